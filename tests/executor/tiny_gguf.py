"""Write a tiny transformers model as a GGUF file the way llama.cpp's convert_hf_to_gguf.py
does: its tensor names (the `gguf` package's own name tables), its metadata keys, and its
changes to the tensors (Gemma norms stored as 1 + w, llama q/k rows permuted for the
interleaved rotary, experts stacked into one (experts, out, in) tensor per projection, Phi-3's
LongRoPE factors as tensors). All tensors float32, so the file holds the model's exact
weights. transformers cannot write GGUF; this is the converter's logic in small."""

from __future__ import annotations

import math
import os
import re

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

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


def permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: each head's halves interleaved."""
    rows = weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def write_gguf(folder: str, path: str, quant_type=None) -> None:
    """Convert the Hugging Face folder `folder` (config.json + model.safetensors, as
    tiny_checkpoints.build_checkpoint saves it) to the GGUF file `path`. `quant_type(hf_name)`,
    when given, names the GGUF type to store a matrix in (None: float32): see `quantized`."""
    cfg = AutoConfig.from_pretrained(folder)
    arch, model_arch = GGUF_ARCH[cfg.model_type]
    writer = gguf.GGUFWriter(path, arch)
    write_metadata(writer, cfg)
    name_map = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    state = {k: v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
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
        add(writer, name_map, name, tensor, quant_type and quant_type(name))
    for (prefix, proj), by_index in experts.items():
        stacked = torch.stack([by_index[i] for i in sorted(by_index)])  # (experts, out, in)
        name = f"{prefix}.{proj}.weight"
        add(writer, name_map, name, stacked, quant_type and quant_type(name))
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if rope.get("rope_type") == "longrope":
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add(writer: gguf.GGUFWriter, name_map, hf_name: str, tensor: torch.Tensor,
        qtype: gguf.GGMLQuantizationType | None = None) -> None:
    base, suffix = hf_name.rsplit(".", 1)
    gguf_name = name_map.get_name(base)
    assert gguf_name is not None, f"no GGUF name for {hf_name}"
    if qtype is None:
        writer.add_tensor(f"{gguf_name}.{suffix}", tensor.contiguous().numpy())
    else:
        writer.add_tensor(f"{gguf_name}.{suffix}", quantized(tensor, qtype), raw_dtype=qtype)


def quantized(tensor: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """`tensor` (..., in) as `qtype` blocks, uint8 (..., row bytes): quantized by the `gguf`
    package where it can (the legacy types); K-quant blocks (which it cannot write) random,
    with scales that give weights of about the tensor's size. Either way the file's weights
    are whatever its blocks dequantize to, and the tests compare runs of the same file."""
    from tests.executor.test_gguf_packed import random_blocks

    values = tensor.contiguous().numpy()
    try:
        return gguf.quants.quantize(values, qtype)
    except NotImplementedError:
        rows = int(np.prod(values.shape[:-1]))
        scale = float(np.abs(values).max()) / KQUANT_LARGEST_CODE[qtype]
        blocks = random_blocks(qtype, rows, values.shape[-1], seed=values.size, scale=scale)
        return blocks.reshape(*values.shape[:-1], -1)


KQUANT_LARGEST_CODE = {  # largest |code x sub-block scale| of a K-quant weight
    gguf.GGMLQuantizationType.Q4_K: 15 * 63,
    gguf.GGMLQuantizationType.Q5_K: 31 * 63,
    gguf.GGMLQuantizationType.Q6_K: 32 * 128,
}


def write_metadata(writer: gguf.GGUFWriter, cfg) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = dict(cfg.rope_parameters)
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope["rope_theta"])
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
