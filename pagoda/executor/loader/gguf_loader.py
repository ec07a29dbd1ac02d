"""Read a GGUF file (llama.cpp's format) through the `gguf` package, llama.cpp's own reader.

The file is memory-mapped; each tensor is dequantized on its own, so peak memory stays near
the final weight size. Model config comes from the metadata and is returned as the matching
Hugging Face config object, so the model code reads one kind of config whatever the source.
Tensor names are translated to Hugging Face names, and llama.cpp's rotary permutation of the
q/k projections (applied by its converter for the `llama` architecture) is undone.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from pagoda.executor.loader.gguf_dequant import SUPPORTED_GGUF_TYPES, dequantize_tensor
from pagoda.executor.loader.model_files import ModelLoadError

logger = logging.getLogger(__name__)

# GGUF general.architecture -> (Hugging Face model_type, architecture class name)
GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# Architectures whose q/k weights llama.cpp's converter permuted for its interleaved rotary.
PERMUTED_QK_ARCHITECTURES = {"llama"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freq_factors",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFCheckpoint:
    """A memory-mapped GGUF file: its metadata as a HF config and its tensors by HF name."""

    def __init__(self, path: str) -> None:
        # Imported here: the gguf package is only needed for GGUF checkpoints.
        from gguf import GGUFReader

        self.path = path
        try:
            self.reader = GGUFReader(path, "r")
        except Exception as e:  # noqa: BLE001 -- the reader raises many kinds on a damaged file
            raise ModelLoadError(
                f"{path}: truncated or damaged GGUF file ({type(e).__name__}: {e})"
            ) from None
        self.architecture = str(self._field("general.architecture", required=True))
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"{path}: unsupported GGUF architecture {self.architecture!r}; "
                f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
            )
        self.hf_config = self._build_hf_config()
        # The tokenizer's arrays, parsed into one numpy view per entry (~400 MB of objects for
        # a 49K vocabulary): the tokenizer is built from the file separately, nothing here
        # reads them again.
        for key in [k for k in self.reader.fields if k.startswith("tokenizer.ggml.")]:
            if len(self.reader.fields[key].data) > 1:
                del self.reader.fields[key]

    def _field(self, key: str, default=None, required: bool = False):
        field = self.reader.fields.get(key)
        if field is None:
            if required:
                raise ModelLoadError(f"{self.path}: GGUF metadata lacks {key!r}")
            return default
        return field.contents()

    def _build_hf_config(self) -> PretrainedConfig:
        arch = self.architecture
        model_type, class_name = GGUF_ARCHITECTURES[arch]
        tensor_names = {t.name for t in self.reader.tensors}
        tokens = self._field("tokenizer.ggml.tokens")
        vocab_size = self._field(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
        if vocab_size is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata gives no vocabulary size")
        num_heads = int(self._field(f"{arch}.attention.head_count", required=True))
        hidden_size = int(self._field(f"{arch}.embedding_length", required=True))
        kwargs = {
            "architectures": [class_name],
            "vocab_size": int(vocab_size),
            "hidden_size": hidden_size,
            "intermediate_size": int(self._field(f"{arch}.feed_forward_length", required=True)),
            "num_hidden_layers": int(self._field(f"{arch}.block_count", required=True)),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(self._field(f"{arch}.attention.head_count_kv", num_heads)),
            "head_dim": int(self._field(f"{arch}.attention.key_length", hidden_size // num_heads)),
            "max_position_embeddings": int(self._field(f"{arch}.context_length", 2048)),
            "rms_norm_eps": float(self._field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._field(f"{arch}.rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
        }
        scaling_type = self._field(f"{arch}.rope.scaling.type")
        if scaling_type == "linear":
            factor = float(self._field(f"{arch}.rope.scaling.factor", 1.0))
            kwargs["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        elif scaling_type not in (None, "none"):
            raise ModelLoadError(
                f"{self.path}: rope scaling {scaling_type!r} is not supported (linear, or llama3 "
                "through rope_freqs, are)"
            )
        sliding_window = self._field(f"{arch}.attention.sliding_window")
        if sliding_window:
            kwargs["sliding_window"] = int(sliding_window)
        if arch == "qwen2":
            kwargs["attention_bias"] = True  # informational: Qwen2 always has qkv bias
        return AutoConfig.for_model(model_type, **kwargs)

    @property
    def weight_bytes(self) -> int:
        return sum(int(t.n_bytes) for t in self.reader.tensors)

    def layer_weight_type(self) -> str:
        """The GGUF type most of the decoder layers' matrices have (e.g. "Q4_1")."""
        types = Counter(t.tensor_type.name for t in self.reader.tensors
                        if t.name.startswith("blk.") and len(t.shape) == 2)
        return types.most_common(1)[0][0] if types else "none"

    def tensor_names(self) -> list[str]:
        """The Hugging Face names iter_weights yields, in its order."""
        return [self._hf_name(tensor.name) for tensor in self.reader.tensors]

    def iter_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (Hugging Face name, dequantized tensor in `dtype`) one tensor at a time."""
        cfg = self.hf_config
        for tensor in tqdm(self.reader.tensors, desc="Loading weights", unit="tensor", disable=None):
            name = self._hf_name(tensor.name)
            if tensor.tensor_type not in SUPPORTED_GGUF_TYPES:
                raise ModelLoadError(
                    f"{self.path}: tensor {tensor.name} has quant type {tensor.tensor_type.name}, "
                    f"supported: {', '.join(sorted(t.name for t in SUPPORTED_GGUF_TYPES))}"
                )
            # GGUF lists dims fastest-first; torch wants them slowest-first.
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            weight = dequantize_tensor(np.asarray(tensor.data), tensor.tensor_type, shape, dtype)
            if self.architecture in PERMUTED_QK_ARCHITECTURES:
                if ".q_proj." in name:
                    weight = _unpermute_rotary(weight, cfg.num_attention_heads)
                elif ".k_proj." in name:
                    weight = _unpermute_rotary(weight, cfg.num_key_value_heads)
            yield name, weight

    def _hf_name(self, gguf_name: str) -> str:
        if gguf_name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[gguf_name]
        match = _LAYER_TENSOR.match(gguf_name)
        if match is None or match.group(2) not in _LAYER_NAMES:
            raise ModelLoadError(f"{self.path}: unexpected tensor {gguf_name!r} in GGUF file")
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (2, dim/2) interleaved -> halves.

    llama.cpp stores each head's rows as pairs (x0, x_half, x1, x_half+1, ...) so that its
    rotary rotates adjacent elements; Hugging Face rotates the two halves (rotate_half).
    weight: (num_heads * head_dim, ...) for both weights and biases.
    """
    head_dim = weight.shape[0] // num_heads
    rows = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return rows.transpose(1, 2).reshape(weight.shape).contiguous()
