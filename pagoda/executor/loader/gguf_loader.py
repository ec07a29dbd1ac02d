"""Read a GGUF file (llama.cpp's format) through the `gguf` package, llama.cpp's own reader.

The file is memory-mapped; each tensor is dequantized on its own, so peak memory stays near
the final weight size. Model config comes from the metadata and is returned as the matching
Hugging Face config object, so the model code reads one kind of config whatever the source.
Tensor names are translated to Hugging Face names, and what llama.cpp's converter changed is
undone (the q/k rotary permutation of `llama`, Gemma's 1 + w norms): gguf_architectures.py
holds each architecture's table.
"""

from __future__ import annotations

import logging
import mmap
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from pagoda.executor.loader.gguf_architectures import (
    GGUF_ARCHITECTURES,
    MIXTRAL,
    SKIPPED_TENSORS,
    convert_tensor,
    family_of,
    hf_tensor_names,
)
from pagoda.executor.loader.gguf_dequant import (
    SUPPORTED_GGUF_TYPES,
    dequantize_tensor,
    owned_bytes,
)
from pagoda.executor.loader.gguf_family_configs import family_config
from pagoda.executor.loader.gguf_reader import CompactGGUFReader, array_length
from pagoda.executor.loader.model_files import ModelLoadError

logger = logging.getLogger(__name__)

FLOAT_GGUF_TYPES = frozenset({"F32", "F16", "BF16"})


@dataclass
class RawGGUFTensor:
    """One weight as the file stores it, not decoded: `data` (rows, row_bytes) uint8 (rows
    in the model's order: converter permutations undone), of `ggml_type`, standing for a
    (rows, in_features) `shape` matrix."""

    data: torch.Tensor
    ggml_type: object
    shape: tuple[int, int]


class GGUFCheckpoint:
    """A memory-mapped GGUF file: its metadata as a HF config and its tensors by HF name."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.reader = CompactGGUFReader(path, "r")
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
        self.num_experts = int(self._field(f"{self.architecture}.expert_count", 0) or 0)
        self.family = family_of(self.architecture, self.num_experts)
        self.num_layers = int(self._field(f"{self.architecture}.block_count", required=True)) - \
            int(self._field(f"{self.architecture}.nextn_predict_layers", 0) or 0)
        """The decoder layers run: block_count less the next-token-prediction (MTP) layers
        that GLM-4.5 and DeepSeek files store after them (not loaded)."""
        self.pooling_type = self._field(f"{self.architecture}.pooling_type")
        """llama.cpp's embedding pooling (0 none, 1 mean, 2 cls, 3 last), or None."""
        self.hf_config = self._build_hf_config()

    def _field(self, key: str, default=None, required: bool = False):
        field = self.reader.fields.get(key)
        if field is None:
            if required:
                raise ModelLoadError(f"{self.path}: GGUF metadata lacks {key!r}")
            return default
        return field.contents()

    def _build_hf_config(self) -> PretrainedConfig:
        arch = self.architecture
        model_type, class_name = MIXTRAL if self.family == "mixtral" else GGUF_ARCHITECTURES[arch]
        tensor_names = {t.name for t in self.reader.tensors}
        vocab_size = self._field(f"{arch}.vocab_size") or array_length(
            self.reader, "tokenizer.ggml.tokens")
        if vocab_size is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata gives no vocabulary size")
        num_heads = int(self._field(f"{arch}.attention.head_count", required=True))
        hidden_size = int(self._field(f"{arch}.embedding_length", required=True))
        kwargs = {
            "architectures": [class_name],
            "vocab_size": int(vocab_size),
            "hidden_size": hidden_size,
            # MoE files may give only the experts' size
            "intermediate_size": int(self._field(f"{arch}.feed_forward_length") or self._field(
                f"{arch}.expert_feed_forward_length", required=True)),
            "num_hidden_layers": self.num_layers,
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
        rope_scaling = self._rope_scaling(kwargs["max_position_embeddings"])
        if rope_scaling is not None:
            kwargs["rope_scaling"] = rope_scaling
        sliding_window = self._field(f"{arch}.attention.sliding_window")
        if sliding_window:
            kwargs["sliding_window"] = int(sliding_window)
        if arch == "qwen2":
            kwargs["attention_bias"] = True  # informational: Qwen2 always has qkv bias
        family_config(self.family, lambda key, default=None: self._field(f"{arch}.{key}", default),
                      kwargs, self._small_tensor)
        return AutoConfig.for_model(kwargs.pop("model_type", model_type), **kwargs)

    def _rope_scaling(self, context_length: int) -> dict | None:
        """`<arch>.rope.scaling.*` as the Hugging Face rope_scaling dict llama.cpp's converter
        wrote them from (its base.py: type, factor, original_context_length, and for yarn the
        yarn_* fields the config had), or None. YaRN's yarn_attn_factor is the config's
        attention_factor; yarn_log_multiplier, mscale_all_dim with mscale 1 (llama.cpp's
        reading for all but DeepSeek); yarn_ext_factor (the config's extrapolation_factor)
        is ignored, as transformers ignores it. llama.cpp itself reads yarn_beta_* and
        yarn_attn_factor only for a few architectures (not llama, qwen2/3): files written by
        the converter from a config with non-default values run differently there."""
        arch = self.architecture

        def field(key: str, default=None):
            return self._field(f"{arch}.rope.scaling.{key}", default)

        scaling_type = field("type")
        if scaling_type in (None, "none") or (scaling_type == "longrope"
                                              and self.family in ("phi3", "phimoe")):
            return None  # Phi-3's LongRoPE: its factor tensors, read by family_config
        factor = field("factor")
        if scaling_type == "linear":
            return {"rope_type": "linear", "factor": float(factor or 1.0)}
        if scaling_type != "yarn":
            raise ModelLoadError(
                f"{self.path}: rope scaling {scaling_type!r} is not supported (linear, yarn, or "
                "llama3 through rope_freqs, are)"
            )
        if not factor:
            raise ModelLoadError(f"{self.path}: yarn rope scaling without "
                                 f"{arch}.rope.scaling.factor")
        scaling = {"rope_type": "yarn", "factor": float(factor),
                   "original_max_position_embeddings": int(
                       field("original_context_length", context_length))}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_attn_factor", "attention_factor")):
            value = field(key)
            if value is not None:
                scaling[name] = float(value)
        log_multiplier = field("yarn_log_multiplier")
        if log_multiplier:
            scaling["mscale"], scaling["mscale_all_dim"] = 1.0, float(log_multiplier)
        return scaling

    def _small_tensor(self, name: str) -> torch.Tensor | None:
        """A float tensor read whole (metadata kept as a tensor: LongRoPE factors)."""
        for tensor in self.reader.tensors:
            if tensor.name == name:
                shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
                return dequantize_tensor(np.asarray(tensor.data), tensor.tensor_type, shape,
                                         torch.float32)
        return None

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
        return [name for tensor in self._weight_tensors() for name in self._hf_names(tensor)]

    def _weight_tensors(self) -> list:
        """The tensors loaded: not the SKIPPED_TENSORS, not the MTP layers' (blk.{i} with
        i >= num_layers)."""
        return [t for t in self.reader.tensors if t.name not in SKIPPED_TENSORS
                and not (t.name.startswith("blk.")
                         and int(t.name.split(".", 2)[1]) >= self.num_layers)]

    def quantized_matrices(self) -> dict[str, tuple[object, tuple[int, int]]]:
        """Hugging Face name -> (GGUF type, (rows, in_features)) of every matrix the file
        holds quantized (not F32/F16/BF16); a stacked expert tensor gives one per expert."""
        matrices = {}
        for tensor in self._weight_tensors():
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            if tensor.tensor_type.name in FLOAT_GGUF_TYPES or len(shape) not in (2, 3):
                continue
            for name in self._hf_names(tensor):
                matrices[name] = (tensor.tensor_type, shape[-2:])
        return matrices

    def iter_weights(
        self, dtype: torch.dtype, raw_names: frozenset[str] = frozenset(),
    ) -> Iterator[tuple[str, torch.Tensor | RawGGUFTensor]]:
        """Yield (Hugging Face name, dequantized tensor in `dtype`) one tensor at a time (a
        stacked expert tensor as one tensor per expert); names in `raw_names` (all of a
        stacked tensor's or none) come as RawGGUFTensor, not decoded (the tensor's bytes copied
        out of the mapping, so that nothing keeps the file's pages resident)."""
        cfg = self.hf_config
        tensors = self._weight_tensors()
        for tensor in tqdm(tensors, desc="Loading weights", unit="tensor", disable=None):
            names = self._hf_names(tensor)
            if tensor.tensor_type not in SUPPORTED_GGUF_TYPES:
                raise ModelLoadError(
                    f"{self.path}: tensor {tensor.name} has quant type {tensor.tensor_type.name}, "
                    f"supported: {', '.join(sorted(t.name for t in SUPPORTED_GGUF_TYPES))}"
                )
            # GGUF lists dims fastest-first; torch wants them slowest-first.
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            if names[0] in raw_names:
                row_bytes = int(tensor.n_bytes) // int(np.prod(shape[:-1]))
                rows = owned_bytes(np.asarray(tensor.data)).view(len(names), -1, row_bytes)
                parts = rows.unbind(0)
                for name, part in zip(names, parts):
                    raw = convert_tensor(self.architecture, name, part, cfg)
                    yield name, RawGGUFTensor(raw, tensor.tensor_type, shape[-2:])
                self._release_pages(tensor)
                continue
            weight = dequantize_tensor(np.asarray(tensor.data), tensor.tensor_type, shape, dtype)
            parts = weight.unbind(0) if len(names) > 1 else (weight,)
            for name, part in zip(names, parts):
                yield name, convert_tensor(self.architecture, name, part, cfg)
            self._release_pages(tensor)

    def _release_pages(self, tensor) -> None:
        """Drops `tensor`'s file pages from this process's resident set once it is loaded, so
        that loading's peak memory is the loaded model plus one tensor, not plus the file.
        Safe whatever still views those bytes: the mapping is read-only, so a later read faults
        the pages in again from the file (or the OS page cache, where they stay)."""
        mapping = getattr(self.reader.data, "_mmap", None)
        if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = int(tensor.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _hf_names(self, tensor) -> list[str]:
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        names = hf_tensor_names(self.family, tensor.name, shape, self.num_experts)
        if names is None:
            raise ModelLoadError(f"{self.path}: unexpected tensor {tensor.name!r} in GGUF file")
        return names
