"""Write GGUF files the way llama.cpp's convert_hf_to_gguf.py does: its tensor names (the
`gguf` package's own name tables), its metadata keys, its changes to the tensors. The one GGUF
writer of the project, with two callers:

- `write_hf_checkpoint`: a Hugging Face folder (config.json + model.safetensors, as the tests'
  tiny_checkpoints.build_checkpoint saves it) converted with the converter's changes (Gemma
  norms stored as 1 + w, llama q/k rows permuted for the interleaved rotary, experts stacked
  into one (experts, out, in) tensor per projection, Phi-3's LongRoPE factors as tensors).
  float32 unless `quant_type` names a type per matrix. The tests' checkpoints of every family.
- `write_random_model` (gguf_random_model.py): random weights with the shapes of a deployed
  model (`Shape`), the tokenizer copied from another GGUF file; benchmarks/synthetic_gguf.py
  is its command line.

Both go through `write_core_metadata` (the keys every decoder writes) and `write_tensors`
(tensor infos first, then the data one tensor at a time: peak memory is one tensor).
transformers cannot write GGUF; this is the converter's logic in small. Not used by serving.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType

# --- the shared core ----------------------------------------------------------------------


def write_core_metadata(writer: gguf.GGUFWriter, *, vocab: int, context: int, hidden: int,
                        layers: int, ffn: int, heads: int, kv_heads: int, rms_eps: float,
                        rope_theta: float) -> None:
    """The keys every decoder-only file carries, whoever writes it."""
    writer.add_vocab_size(vocab)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(rms_eps)
    writer.add_rope_freq_base(rope_theta)


def encoded(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """float32 `values` (..., in) stored as `qtype`: float32, float16, or blocks (uint8
    (..., row bytes)) by the `gguf` package's reference quantizers (legacy types only: it
    raises NotImplementedError for the K-quants)."""
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


TensorSource = tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, Callable[[], np.ndarray]]
"""(GGUF name, float shape (out, in) or (experts, out, in), stored type, the encoded data)"""


def write_tensors(writer: gguf.GGUFWriter, layout: Iterable[TensorSource]) -> None:
    """Header, metadata and tensor infos, then each tensor's data made and written in turn."""
    layout = list(layout)
    for name, dims, qtype, _ in layout:
        block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims)) // block * type_bytes
        writer.add_tensor_info(name, dims, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, _, data in layout:
        writer.write_tensor_data(data())
    writer.close()


# --- random blocks of any type ------------------------------------------------------------

SCALE_OFFSETS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
                 Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
                 Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.IQ1_S: [0], Q.IQ1_M: [], Q.IQ2_XXS: [0],
                 Q.IQ2_XS: [0], Q.IQ2_S: [0], Q.IQ3_XXS: [0], Q.IQ3_S: [0], Q.IQ4_NL: [0],
                 Q.IQ4_XS: [0], Q.TQ1_0: [52], Q.TQ2_0: [64], Q.MXFP4: [], Q.NVFP4: []}
"""byte offsets of each block's float16 d / dmin / m (IQ1_M's scale is spread over four
fields, MXFP4's and NVFP4's are 8-bit floats: random_blocks sets those)"""

KQUANT_LARGEST_CODE = {  # largest |code x sub-block scale| of a K-quant weight
    Q.Q4_K: 15 * 63,
    Q.Q5_K: 31 * 63,
    Q.Q6_K: 32 * 128,
}


def random_blocks(ggml_type, n: int, k: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """(n, row_bytes) uint8: random codes and sub-scales, float16 scales ~ N(0, scale). Random
    bytes with sane scales are real blocks of each type (the K-quants the `gguf` package
    cannot write included)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // block_size, type_size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[ggml_type]:
        scales = (rng.standard_normal(blocks.shape[0]) * scale).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    if ggml_type == Q.IQ1_M:  # its float16 scale: the top nibbles of the 4 uint16 at 48-55
        d = (rng.standard_normal(blocks.shape[0]) * scale).astype(np.float16).view(np.uint16)
        for i in range(4):
            nibble = ((d >> (4 * i)) & 0xF).astype(np.uint8)
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (nibble << 4)
    elif ggml_type == Q.MXFP4:  # an e8m0 scale byte, 2^(e - 127): about `scale`
        center = 127 + int(np.round(np.log2(scale)))
        blocks[:, 0] = rng.integers(center - 3, center + 3, size=blocks.shape[0])
    return blocks.reshape(n, -1)


def quantized(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """float32 `values` (..., in) as `qtype` blocks, uint8 (..., row bytes): quantized by the
    `gguf` package where it can (the legacy types); K-quant blocks (which it cannot write)
    random, with scales that give weights of about the tensor's size. Either way the file's
    weights are whatever its blocks dequantize to; the tests compare runs of the same file."""
    try:
        return gguf.quants.quantize(values, qtype)
    except NotImplementedError:
        rows = int(np.prod(values.shape[:-1]))
        scale = float(np.abs(values).max()) / KQUANT_LARGEST_CODE[qtype]
        blocks = random_blocks(qtype, rows, values.shape[-1], seed=values.size, scale=scale)
        return blocks.reshape(*values.shape[:-1], -1)


# --- a Hugging Face folder ----------------------------------------------------------------

GGUF_ARCH = {  # HF model_type -> (gguf arch name, gguf.MODEL_ARCH)
    "llama": ("llama", gguf.MODEL_ARCH.LLAMA),
    "gemma2": ("gemma2", gguf.MODEL_ARCH.GEMMA2),
    "gemma3_text": ("gemma3", gguf.MODEL_ARCH.GEMMA3),
    "phi3": ("phi3", gguf.MODEL_ARCH.PHI3),
    "qwen2": ("qwen2", gguf.MODEL_ARCH.QWEN2),
    "qwen3": ("qwen3", gguf.MODEL_ARCH.QWEN3),
    "qwen3_moe": ("qwen3moe", gguf.MODEL_ARCH.QWEN3MOE),
    "mixtral": ("llama", gguf.MODEL_ARCH.LLAMA),
}
_EXPERT = re.compile(r"^(model\.layers\.\d+\.\w+\.experts)\.(\d+)\.(\w+)\.weight$")


def permute(weight, num_heads: int):
    """llama.cpp's LlamaModel.permute: each head's halves interleaved."""
    rows = weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def write_hf_checkpoint(folder: str, path: str, quant_type=None) -> None:
    """Convert the Hugging Face folder `folder` to the GGUF file `path`. `quant_type(hf_name)`,
    when given, names the GGUF type to store a matrix in (None: float32): see `quantized`."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    arch, model_arch = GGUF_ARCH[cfg.model_type]
    writer = gguf.GGUFWriter(path, arch)
    write_hf_metadata(writer, cfg)
    name_map = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    state = {k: v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors: list[tuple[str, np.ndarray, gguf.GGMLQuantizationType | None]] = []
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        if (match := _EXPERT.match(name)) is not None:
            prefix, index, proj = match.groups()
            experts.setdefault((prefix, proj), {})[int(index)] = tensor
            continue
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1
        if arch == "llama" and name.endswith("q_proj.weight"):
            tensor = permute(tensor, cfg.num_attention_heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            tensor = permute(tensor, cfg.num_key_value_heads)
        tensors.append((name, tensor.contiguous().numpy(), quant_type and quant_type(name)))
    for (prefix, proj), by_index in experts.items():
        stacked = torch.stack([by_index[i] for i in sorted(by_index)])  # (experts, out, in)
        name = f"{prefix}.{proj}.weight"
        tensors.append((name, stacked.contiguous().numpy(), quant_type and quant_type(name)))
    layout = [hf_tensor(name_map, name, values, qtype) for name, values, qtype in tensors]
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if rope.get("rope_type") == "longrope":
        for name, key in (("rope_factors_long.weight", "long_factor"),
                          ("rope_factors_short.weight", "short_factor")):
            values = np.asarray(rope[key], np.float32)
            layout.append((name, values.shape, Q.F32, lambda values=values: values))
    write_tensors(writer, layout)


def hf_tensor(name_map, hf_name: str, values: np.ndarray,
              qtype: gguf.GGMLQuantizationType | None) -> TensorSource:
    """The GGUF name of the HF tensor `hf_name` and its data, float32 or `qtype` blocks."""
    base, suffix = hf_name.rsplit(".", 1)
    gguf_name = name_map.get_name(base)
    assert gguf_name is not None, f"no GGUF name for {hf_name}"
    if qtype is None:
        return f"{gguf_name}.{suffix}", values.shape, Q.F32, lambda: values
    return f"{gguf_name}.{suffix}", values.shape, qtype, lambda: quantized(values, qtype)


def write_hf_metadata(writer: gguf.GGUFWriter, cfg) -> None:
    """The converter's metadata for the HF config `cfg`: the core keys, the head size, rope
    scaling, experts, soft-capping, sliding windows and Phi-3's partial rotary."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = dict(cfg.rope_parameters)
    rope = rope.get("full_attention", rope)
    write_core_metadata(writer, vocab=cfg.vocab_size, context=cfg.max_position_embeddings,
                        hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
                        ffn=cfg.intermediate_size, heads=cfg.num_attention_heads,
                        kv_heads=cfg.num_key_value_heads, rms_eps=cfg.rms_norm_eps,
                        rope_theta=rope["rope_theta"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":  # as the converter's base.py, and mscale_all_dim as
        # its mistral3.py writes it (yarn_log_multiplier)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add_field in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                               ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
                               ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                               ("mscale_all_dim", writer.add_rope_scaling_yarn_log_mul)):
            if rope.get(key) is not None:
                add_field(rope[key])
    kind = cfg.model_type
    if kind in ("mixtral", "qwen3_moe"):
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if kind == "qwen3_moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if kind == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if kind.startswith("gemma"):
        writer.add_sliding_window(cfg.sliding_window)
    if kind == "phi3":
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            original = rope["original_max_position_embeddings"]
            writer.add_rope_scaling_orig_ctx_len(original)
            scale = cfg.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
