"""Each GGUF family's own Hugging Face config fields, read from the file's metadata (and a
few small tensors) where llama.cpp's converter wrote them, or set to what llama.cpp's graph
assumes where it wrote nothing (gguf_architectures.py: the families and their names)."""

from __future__ import annotations

GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""llama.cpp scales the 27B's attention by (hidden / heads) ** -0.5, the others' by
head_dim ** -0.5: it knows the 27B by its layer count."""
SIGMOID_GATING = 2
"""`expert_gating_func` of sigmoid routing (llama.cpp's enum; 1 is softmax, its default)."""
DEEPSEEK2_LOG_MULTIPLIER_PER_MSCALE = 0.1
"""The converter writes a deepseek2 file's yarn_log_multiplier as 0.1 * mscale_all_dim
(other families': mscale_all_dim itself)."""


def family_config(family: str, field, kwargs: dict, read_tensor) -> None:
    """Add the family's own config fields to `kwargs` (the common ones are there; a
    "model_type" among them replaces the family's: DeepSeek-V3 in a deepseek2 file).
    `field(key, default)` reads `{arch}.key` metadata; `read_tensor(name)` a small tensor."""
    if family in ("mixtral", "qwen3moe", "olmoe"):
        kwargs["num_experts_per_tok"] = int(field("expert_used_count", 2))
        experts = int(field("expert_count", 0))
        if family == "olmoe":  # llama.cpp's olmoe graph: weights as routed, no clamp unless set
            kwargs["num_experts"], kwargs["norm_topk_prob"] = experts, False
            clamp = field("attention.clamp_kqv", None)
            kwargs["clip_qkv"] = float(clamp) if clamp else None
        elif family == "mixtral":
            kwargs["num_local_experts"] = experts
            kwargs["intermediate_size"] = int(
                field("expert_feed_forward_length", None) or kwargs["intermediate_size"])
        else:
            kwargs["num_experts"] = experts
            kwargs["moe_intermediate_size"] = int(field("expert_feed_forward_length", None)
                                                  or kwargs["intermediate_size"])
            kwargs["norm_topk_prob"] = bool(field("expert_weights_norm", True))
            kwargs["mlp_only_layers"], kwargs["decoder_sparse_step"] = [], 1
    if family in ("granite", "granitemoe"):
        _granite_config(family, field, kwargs)
    elif family == "glm4moe":
        _glm4_moe_config(field, kwargs, read_tensor)
    elif family in ("ernie4_5", "ernie4_5-moe"):
        _ernie_config(family, field, kwargs)
    elif family == "gpt-oss":
        _gpt_oss_config(field, kwargs, read_tensor)
    elif family == "deepseek2":
        _deepseek2_config(field, kwargs)
    elif family == "llama4":
        _llama4_config(field, kwargs)
    elif family in ("phi3", "phimoe"):
        _phi3_config(field, kwargs, read_tensor)
    if family == "phimoe":
        kwargs["num_local_experts"] = int(field("expert_count", 0))
        kwargs["num_experts_per_tok"] = int(field("expert_used_count", 2))
        kwargs["attention_bias"] = read_tensor("blk.0.attn_q.bias") is not None
        kwargs["lm_head_bias"] = read_tensor("output.bias") is not None
    elif family in GEMMA_27B_LAYERS:
        _gemma_config(family, field, kwargs)


def _granite_config(family: str, field, kwargs: dict) -> None:
    head_dim = kwargs.pop("head_dim")  # Granite's config derives it: hidden / heads
    scales = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
              "logits_scaling": "logit_scale", "attention_multiplier": "attention.scale"}
    for name, key in scales.items():
        value = field(key, None)  # absent (or 0): llama.cpp applies no scaling
        kwargs[name] = float(value) if value else (head_dim ** -0.5 if key == "attention.scale"
                                                    else 1.0)
    if family == "granitemoe":
        kwargs["num_local_experts"] = int(field("expert_count", 0))
        kwargs["num_experts_per_tok"] = int(field("expert_used_count", 2))
        kwargs["intermediate_size"] = int(field("expert_feed_forward_length", None)
                                          or kwargs["intermediate_size"])


def _glm4_moe_config(field, kwargs: dict, read_tensor) -> None:
    head_dim = kwargs["head_dim"]
    kwargs["partial_rotary_factor"] = int(field("rope.dimension_count", head_dim)) / head_dim
    _routed_and_shared_experts(field, kwargs, normalized_by_default=True)
    kwargs["n_group"] = kwargs["topk_group"] = 1
    kwargs["num_nextn_predict_layers"] = 0  # (not loaded: GGUFCheckpoint.num_layers)
    kwargs["attention_bias"] = read_tensor("blk.0.attn_q.bias") is not None
    kwargs["use_qk_norm"] = read_tensor("blk.0.attn_q_norm.weight") is not None


def _routed_and_shared_experts(field, kwargs: dict, normalized_by_default: bool) -> None:
    """GLM-4.5's and DeepSeek's MoE fields (mixtral.py: routed_and_shared_experts)."""
    kwargs["n_routed_experts"] = int(field("expert_count", 0))
    kwargs["num_experts_per_tok"] = int(field("expert_used_count", 2))
    kwargs["moe_intermediate_size"] = int(field("expert_feed_forward_length", 0))
    kwargs["n_shared_experts"] = int(field("expert_shared_count", 0))
    kwargs["first_k_dense_replace"] = int(field("leading_dense_block_count", 0))
    kwargs["routed_scaling_factor"] = float(field("expert_weights_scale", 1.0))
    kwargs["norm_topk_prob"] = bool(field("expert_weights_norm", normalized_by_default))


def _deepseek2_config(field, kwargs: dict) -> None:
    """The latent attention's sizes (`key_length` is the cached head: rank + rope; an older
    file without `key_length_mla` has the expanded key's there), MoE as GLM-4.5's, the
    routing's class by the gating function; YaRN's mscale back from the multiplier."""
    rope = int(field("rope.dimension_count", 64))
    key_length = int(field("attention.key_length_mla", None) or kwargs["head_dim"])
    kwargs["qk_rope_head_dim"], kwargs["qk_nope_head_dim"] = rope, key_length - rope
    kwargs["v_head_dim"] = int(field("attention.value_length_mla", None)
                               or field("attention.value_length", None))
    kwargs["kv_lora_rank"] = int(field("attention.kv_lora_rank", 512))
    kwargs["q_lora_rank"] = int(field("attention.q_lora_rank", 0) or 0) or None
    kwargs["head_dim"] = rope  # (what the rotary turns)
    kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # (the file says 1: MQA)
    _routed_and_shared_experts(field, kwargs, normalized_by_default=False)
    groups = int(field("expert_group_count", 1) or 1)
    kwargs["n_group"], kwargs["topk_group"] = groups, int(field("expert_group_used_count",
                                                                groups) or groups)
    kwargs["num_nextn_predict_layers"] = 0
    if int(field("expert_gating_func", 1)) == SIGMOID_GATING:
        kwargs["model_type"], kwargs["architectures"] = "deepseek_v3", ["DeepseekV3ForCausalLM"]
    else:
        kwargs["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    rope_scaling = kwargs.pop("rope_scaling", None)
    if rope_scaling is not None:
        if "mscale_all_dim" in rope_scaling:
            mscale = rope_scaling["mscale_all_dim"] / DEEPSEEK2_LOG_MULTIPLIER_PER_MSCALE
            rope_scaling["mscale"] = rope_scaling["mscale_all_dim"] = mscale
        kwargs["rope_parameters"] = {**rope_scaling, "rope_theta": kwargs["rope_theta"]}


LLAMA4_CHUNK, LLAMA4_NOPE_INTERVAL, LLAMA4_FLOOR_SCALE, LLAMA4_ATTN_SCALE = 8192, 4, 8192, 0.1
"""What llama.cpp's llama4 graph fixes (the file holds none of them): chunks of 8192 on three
layers of four, the fourth NoPE with temperature tuning from floor 8192 and scale 0.1."""
LLAMA4_NO_QK_NORM_EXPERTS = 128
"""Maverick (128 experts) has no q/k norms: llama.cpp tells it by its expert count."""


def _llama4_config(field, kwargs: dict) -> None:
    """Llama 4 text: the dense MLP's size is feed_forward_length, the experts'
    expert_feed_forward_length; a sliding_window of 0 in the file turns chunks (and NoPE
    layers) off, as llama.cpp reads it."""
    experts = int(field("expert_count", 0))
    kwargs["intermediate_size_mlp"] = kwargs["intermediate_size"]
    kwargs["intermediate_size"] = int(field("expert_feed_forward_length", 0)
                                      or kwargs["intermediate_size"])
    kwargs["num_local_experts"] = experts
    kwargs["num_experts_per_tok"] = int(field("expert_used_count", 1))
    kwargs["interleave_moe_layer_step"] = int(field("interleave_moe_layer_step", 1))
    chunk = field("attention.sliding_window", None)
    kwargs.pop("sliding_window", None)
    if chunk is not None and int(chunk) == 0:
        kwargs["attention_chunk_size"] = None
        kwargs["no_rope_layer_interval"] = kwargs["num_hidden_layers"] + 1  # every layer rotary
    else:
        kwargs["attention_chunk_size"] = int(chunk or LLAMA4_CHUNK)
        kwargs["no_rope_layer_interval"] = LLAMA4_NOPE_INTERVAL
    kwargs["floor_scale"], kwargs["attn_scale"] = LLAMA4_FLOOR_SCALE, LLAMA4_ATTN_SCALE
    kwargs["attn_temperature_tuning"] = True
    kwargs["use_qk_norm"] = experts != LLAMA4_NO_QK_NORM_EXPERTS
    kwargs["rotary_rows_in_halves"] = True  # (convert_tensor reordered them: llama4.py)


def _ernie_config(family: str, field, kwargs: dict) -> None:
    kwargs["rotary_rows_in_halves"] = True  # (convert_tensor reordered them: ernie.py)
    if family != "ernie4_5-moe":
        return
    kwargs["moe_num_experts"] = int(field("expert_count", 0))
    kwargs["moe_k"] = int(field("expert_used_count", 2))
    kwargs["moe_intermediate_size"] = int(field("expert_feed_forward_length", 0)
                                          or kwargs["intermediate_size"])
    kwargs["moe_num_shared_experts"] = int(field("expert_shared_count", 0))
    kwargs["moe_layer_start_index"] = int(field("leading_dense_block_count", 0))
    kwargs["moe_layer_interval"] = int(field("interleave_moe_layer_step", 1))
    kwargs["moe_layer_end_index"] = kwargs["num_hidden_layers"] - 1


def _gpt_oss_config(field, kwargs: dict, read_tensor) -> None:
    kwargs["num_local_experts"] = int(field("expert_count", 0))
    kwargs["num_experts_per_tok"] = int(field("expert_used_count", 4))
    kwargs["intermediate_size"] = int(field("expert_feed_forward_length", None)
                                      or kwargs["intermediate_size"])
    kwargs["attention_bias"] = read_tensor("blk.0.attn_q.bias") is not None
    kwargs["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(kwargs["num_hidden_layers"])]
    rope = kwargs.pop("rope_scaling", None)
    if rope is not None:  # gpt-oss's YaRN keeps the blend's ends unrounded
        kwargs["rope_parameters"] = {**rope, "rope_theta": kwargs["rope_theta"],
                                     "truncate": False}


def _phi3_config(field, kwargs: dict, read_tensor) -> None:
    head_dim = kwargs["head_dim"]
    rotary_dims = int(field("rope.dimension_count", head_dim))
    kwargs["partial_rotary_factor"] = rotary_dims / head_dim
    window = field("attention.sliding_window", None)
    kwargs["sliding_window"] = int(window) if window else None
    long_factors = read_tensor("rope_factors_long.weight")
    if long_factors is not None:
        original = int(field("rope.scaling.original_context_length",
                             kwargs["max_position_embeddings"]))
        kwargs["original_max_position_embeddings"] = original
        kwargs["rope_scaling"] = {
            "rope_type": "longrope", "original_max_position_embeddings": original,
            "long_factor": long_factors.tolist(),
            "short_factor": read_tensor("rope_factors_short.weight").tolist(),
        }
        attention_factor = field("rope.scaling.attn_factor", None)
        if attention_factor is not None:
            kwargs["rope_scaling"]["attention_factor"] = float(attention_factor)


def _gemma_config(family: str, field, kwargs: dict) -> None:
    num_layers = kwargs["num_hidden_layers"]
    kwargs["hidden_activation"] = "gelu_pytorch_tanh"
    kwargs["query_pre_attn_scalar"] = (
        kwargs["hidden_size"] // kwargs["num_attention_heads"]
        if num_layers == GEMMA_27B_LAYERS[family] else kwargs["head_dim"])
    final_cap = field("final_logit_softcapping", None)
    if family == "gemma2":
        kwargs["attn_logit_softcapping"] = float(field("attn_logit_softcapping", 50.0))
        kwargs["final_logit_softcapping"] = float(final_cap) if final_cap else 30.0
        window, pattern = int(field("attention.sliding_window", 4096)), 2
    else:
        kwargs["final_logit_softcapping"] = float(final_cap) if final_cap else None
        kwargs["rope_local_base_freq"] = float(field("rope.freq_base_swa", 10000.0))
        window, pattern = int(field("attention.sliding_window", 0) or 0), 6
    stored = field("attention.sliding_window_pattern", None)
    if isinstance(stored, list):  # one flag per layer: True where the layer slides
        sliding = [bool(flag) for flag in stored]
    else:
        pattern = int(stored or pattern)
        sliding = [bool((i + 1) % pattern) for i in range(num_layers)]
    if not window:  # no window in the file: every layer global (llama.cpp's reading)
        sliding, window = [False] * num_layers, 4096
    kwargs["sliding_window"] = window
    kwargs["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
