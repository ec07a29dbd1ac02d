"""What each GGUF architecture means in Hugging Face terms: its config, its tensor names and
the changes llama.cpp's converter (convert_hf_to_gguf.py) made to the tensors.

  llama      Llama, Mistral; with `llama.expert_count` > 0 Mixtral. q/k rows permuted for
             llama.cpp's interleaved rotary (undone here).
  qwen2, qwen3
  qwen3moe   experts stacked in one 3D tensor per projection (ffn_{gate,up,down}_exps),
             split back into experts.{i}; top-k weights renormalised (llama.cpp always does).
  olmoe      as qwen3moe, but top-k weights never renormalised and q/k norms over all
             heads (attn_{q,k}_norm of num_heads * head_dim); clip_qkv from clamp_kqv.
  granite    Llama's layout (q/k permuted), with the four Granite scalars as embedding_scale,
             attention.scale, residual_scale and logit_scale (each absent: no scaling)
  granitemoe as granite, experts stacked like qwen3moe's (the converter split Granite's
             fused input_linear into ffn_gate_exps and ffn_up_exps)
  glm4moe    GLM-4.5: experts as qwen3moe's, a shared expert (ffn_*_shexp), the router's
             correction bias (exp_probs_b), the first leading_dense_block_count layers dense;
             sigmoid routing without expert groups (llama.cpp's graph); no q/k permutation;
             the MTP layers after block_count - nextn_predict_layers are not loaded
  ernie4_5   ERNIE 4.5: Llama's layout; q/k rows in adjacent-pair order, as ERNIE's own
             (the converter does not permute them), reordered here as a llama file's are
             (the config's rotary_rows_in_halves tells the model class not to again)
  ernie4_5-moe  as ernie4_5; experts as qwen3moe's, shared experts (ffn_*_shexp), the
             router's correction bias (exp_probs_b); a MoE layer every
             interleave_moe_layer_step-th from leading_dense_block_count to the last
             (llama.cpp's graph: the file has no end index), top-k weights renormalised
  gpt-oss    experts as qwen3moe's, with biases (ffn_*_exps.bias, stacked (experts, out));
             the router's bias (ffn_gate_inp.bias); sinks (attn_sinks); every other layer
             sliding from the first (llama.cpp's graph); YaRN without truncation (the
             family's, which the file does not say); no q/k permutation
  phimoe     Phi-3.5-MoE: Mixtral's names (experts stacked as qwen3moe's), LayerNorm
             biases (attn_norm, ffn_norm, output_norm .bias), q/k/v/o and output biases,
             LongRoPE as phi3's (its attention factor is the file's: llama.cpp's formula,
             where Hugging Face scales by the config's mscale); sparsemixer routing with the
             family's jitter eps (the file has none; llama.cpp's graph routes by softmax)
  phi3       q/k/v fused (attn_qkv) and gate/up fused (ffn_up), as in the HF checkpoint;
             LongRoPE factors as the tensors rope_factors_{long,short}.
  gemma2     norm weights stored as 1 + w (taken back to w here); softcaps as metadata;
             every other layer sliding from the first; attention scale from the head size
             (hidden / heads for the 27B), the facts llama.cpp hard-codes.
  gemma3     as gemma2, no softcaps, q/k norms, 5 of 6 layers sliding with rope base
             10000 (llama.cpp's fixed values) unless the file says otherwise.
  llama4     Llama 4 text: the MLP is `feed_forward` (dense, or experts as qwen3moe's with a
             shared expert and `router`); q/k rows as Meta's own, adjacent rotary pairs,
             reordered here as ERNIE's are; llama.cpp's fixed chunk (8192), NoPE pattern (every
             4th layer), temperature tuning and q/k norms (not for 128 experts: Maverick)
  deepseek2  DeepSeek-V2/V3: latent attention's projections under their own names, kv_b_proj
             split by the converter into attn_k_b (each head's W_UK transposed) and attn_v_b
             (models/deepseek.py joins them); experts as qwen3moe's, shared experts, the
             correction bias; sigmoid gating (expert_gating_func 2) reads as V3, softmax as
             V2; no q/k permutation (the rotary pairs stay adjacent, as DeepSeek's own).

Each family's config fields from the file's metadata: gguf_family_configs.py.
"""

from __future__ import annotations

import re

import torch

# GGUF general.architecture -> (Hugging Face model_type, architecture class name)
GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
    "granite": ("granite", "GraniteForCausalLM"),
    "granitemoe": ("granitemoe", "GraniteMoeForCausalLM"),
    "glm4moe": ("glm4_moe", "Glm4MoeForCausalLM"),
    "ernie4_5": ("ernie4_5", "Ernie4_5ForCausalLM"),
    "ernie4_5-moe": ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "phimoe": ("phimoe", "PhimoeForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "deepseek2": ("deepseek_v2", "DeepseekV2ForCausalLM"),  # (V3 where routing is sigmoid)
    "llama4": ("llama4_text", "Llama4ForCausalLM"),
}
MIXTRAL = ("mixtral", "MixtralForCausalLM")
"""A `llama` file with experts."""
# Architectures whose q/k rows are in llama.cpp's interleaved-rotary (adjacent pairs) order:
# the converter permuted Llama's and Granite's, ERNIE's are so by design. Reordered to the
# halves Pagoda's rotary takes at load, raw (packed) rows and decoded tensors alike.
PERMUTED_QK_ARCHITECTURES = {"llama", "granite", "granitemoe", "ernie4_5", "ernie4_5-moe",
                             "llama4"}
NORM_PLUS_ONE_ARCHITECTURES = {"gemma2", "gemma3"}
"""The converter stored (1 + w) for every norm weight of these (Gemma's RMSNorm scale)."""
SKIPPED_TENSORS = {"rope_factors_long.weight", "rope_factors_short.weight"}
"""Read into the config (Phi-3 LongRoPE), not weights."""

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",  # (PhiMoE's LayerNorm)
    "output.weight": "lm_head.weight",
    "output.bias": "lm_head.bias",
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
_GEMMA_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_EXPERT_NAMES = {  # {e}: the expert's index
    "qwen3moe": {
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
        "ffn_up_exps": "mlp.experts.{e}.up_proj",
        "ffn_down_exps": "mlp.experts.{e}.down_proj",
    },
    "granitemoe": {
        "ffn_gate_inp": "block_sparse_moe.gate",
        "ffn_gate_exps": "block_sparse_moe.experts.{e}.gate_proj",
        "ffn_up_exps": "block_sparse_moe.experts.{e}.up_proj",
        "ffn_down_exps": "block_sparse_moe.experts.{e}.down_proj",
    },
    "mixtral": {
        "ffn_gate_inp": "block_sparse_moe.gate",
        "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
        "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
        "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
        # older Mixtral files: one tensor per expert, blk.N.ffn_gate.E.weight
        "ffn_gate": "block_sparse_moe.experts.{e}.w1",
        "ffn_up": "block_sparse_moe.experts.{e}.w3",
        "ffn_down": "block_sparse_moe.experts.{e}.w2",
    },
}
_SHARED_EXPERT_NAMES = {
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
LAYER_NAMES = {
    "llama": _LAYER_NAMES,
    "qwen2": _LAYER_NAMES,
    "qwen3": _LAYER_NAMES,
    "qwen3moe": {**_LAYER_NAMES, **_EXPERT_NAMES["qwen3moe"]},
    "olmoe": {**_LAYER_NAMES, **_EXPERT_NAMES["qwen3moe"]},
    "granite": _LAYER_NAMES,
    "glm4moe": {**_LAYER_NAMES, **_EXPERT_NAMES["qwen3moe"], **_SHARED_EXPERT_NAMES,
                "post_attention_norm": "post_attention_layernorm",
                "exp_probs_b": "mlp.gate.e_score_correction_bias!"},
    "ernie4_5": _LAYER_NAMES,
    "ernie4_5-moe": {**_LAYER_NAMES, **_EXPERT_NAMES["qwen3moe"], **_SHARED_EXPERT_NAMES,
                     "exp_probs_b": "mlp.moe_statics.e_score_correction_bias!"},
    "gpt-oss": {**_LAYER_NAMES, **_EXPERT_NAMES["qwen3moe"], "ffn_gate_inp": "mlp.router",
                "post_attention_norm": "post_attention_layernorm",
                "attn_sinks": "self_attn.sinks!"},
    "granitemoe": {**_LAYER_NAMES, **_EXPERT_NAMES["granitemoe"]},
    "mixtral": {**_LAYER_NAMES, **_EXPERT_NAMES["mixtral"]},
    "phi3": {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "phimoe": {**_LAYER_NAMES, **_EXPERT_NAMES["mixtral"]},
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    "llama4": {**_LAYER_NAMES,
               "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj",
               "ffn_down": "feed_forward.down_proj", "ffn_gate_inp": "feed_forward.router",
               "ffn_gate_exps": "feed_forward.experts.{e}.gate_proj",
               "ffn_up_exps": "feed_forward.experts.{e}.up_proj",
               "ffn_down_exps": "feed_forward.experts.{e}.down_proj",
               "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
               "ffn_up_shexp": "feed_forward.shared_expert.up_proj",
               "ffn_down_shexp": "feed_forward.shared_expert.down_proj"},
    "deepseek2": {**_LAYER_NAMES, **_EXPERT_NAMES["qwen3moe"], **_SHARED_EXPERT_NAMES,
                  "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                  "attn_q_b": "self_attn.q_b_proj",
                  "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                  "attn_kv_a_norm": "self_attn.kv_a_layernorm",
                  "attn_kv_b": "self_attn.kv_b_proj",  # (older files: whole)
                  "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
                  "exp_probs_b": "mlp.gate.e_score_correction_bias!"},
}
"""Name table by family (a `llama` file with experts reads as "mixtral")."""
WHOLE_NAME = "!"
"""A target ending in it is the parameter's whole name (the GGUF tensor's `.bias` / `.weight`
suffix is not appended): the router's correction bias, a tensor of its own in HF."""
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)$")
"""blk.{layer}.{part}[.{expert}].{weight|bias}"""


def family_of(architecture: str, num_experts: int) -> str:
    return "mixtral" if architecture == "llama" and num_experts > 0 else architecture


def hf_tensor_names(family: str, gguf_name: str, shape: tuple, num_experts: int) -> list[str] | None:
    """The Hugging Face names a GGUF tensor holds: one, or one per expert for a stacked
    expert tensor (shape (experts, out, in), a bias (experts, out)); None for a name this
    family does not have."""
    if gguf_name in GLOBAL_NAMES:
        return [GLOBAL_NAMES[gguf_name]]
    match = _LAYER_TENSOR.match(gguf_name)
    names = LAYER_NAMES[family]
    if match is None or match.group(2) not in names:
        return None
    layer, part, expert, kind = match.groups()
    target = names[part]
    prefix = f"model.layers.{layer}."
    if target.endswith(WHOLE_NAME):
        return None if expert is not None else [prefix + target.removesuffix(WHOLE_NAME)]
    if "{e}" not in target:
        return None if expert is not None else [f"{prefix}{target}.{kind}"]
    if expert is not None:  # one expert's own tensor
        return [f"{prefix}{target.format(e=expert)}.{kind}"]
    stacked_dims = 2 if kind == "bias" else 3
    if part in ("ffn_gate", "ffn_up", "ffn_down") or len(shape) != stacked_dims or (
            shape[0] != num_experts):
        return None
    return [f"{prefix}{target.format(e=e)}.{kind}" for e in range(num_experts)]


def convert_tensor(architecture: str, name: str, weight: torch.Tensor, cfg) -> torch.Tensor:
    """Undo what llama.cpp's converter did to a tensor (by Hugging Face name)."""
    if architecture in PERMUTED_QK_ARCHITECTURES:
        if ".q_proj." in name:
            return unpermute_rotary(weight, cfg.num_attention_heads)
        if ".k_proj." in name:
            return unpermute_rotary(weight, cfg.num_key_value_heads)
    if architecture in NORM_PLUS_ONE_ARCHITECTURES and name.endswith("norm.weight"):
        return weight - 1
    return weight


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (2, dim/2) interleaved -> halves.

    llama.cpp stores each head's rows as pairs (x0, x_half, x1, x_half+1, ...) so that its
    rotary rotates adjacent elements; Hugging Face rotates the two halves (rotate_half).
    weight: (num_heads * head_dim, ...) for both weights and biases.
    """
    head_dim = weight.shape[0] // num_heads
    rows = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return rows.transpose(1, 2).reshape(weight.shape).contiguous()
