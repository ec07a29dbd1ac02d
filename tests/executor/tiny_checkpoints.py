"""Tiny random Hugging Face checkpoints, built with transformers in a temp folder."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

import torch
from transformers import (
    AutoTokenizer,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Ernie4_5_MoeConfig,
    Ernie4_5_MoeForCausalLM,
    Ernie4_5Config,
    Ernie4_5ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PhimoeConfig,
    PhimoeForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

COMMON = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}

DEEPSEEK = {"num_hidden_layers": 3, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 16, "v_head_dim": 24, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 32,
            "first_k_dense_replace": 1, "tie_word_embeddings": False}

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": False}),
    "llama3.1-rope": (
        LlamaConfig, LlamaForCausalLM,
        {"tie_word_embeddings": True, "rope_theta": 500000.0, "max_position_embeddings": 256,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    ),
    "smollm-tied": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True, "rope_theta": 100000.0}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32, "tie_word_embeddings": False}),
    # Windows of 8 (Gemma) and 16 (Phi-3, Mixtral) tokens: the test prompts cross them.
    # Soft-caps low enough to bend the tiny model's scores and logits.
    "gemma2": (
        Gemma2Config, Gemma2ForCausalLM,
        {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 8,
         "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
         "final_logit_softcapping": 3.0},
    ),
    "gemma3": (
        Gemma3TextConfig, Gemma3ForCausalLM,
        {"head_dim": 32, "num_hidden_layers": 3, "sliding_window": 8,
         "sliding_window_pattern": 2, "query_pre_attn_scalar": 24,
         "rope_local_base_freq": 100.0, "rope_theta": 10000.0,
         "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "phi3": (
        Phi3Config, Phi3ForCausalLM,
        {"sliding_window": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    # LongRoPE with partial rotary (Phi-3.5 / Phi-4-mini's settings); the prompts stay within
    # original_max_position_embeddings, where Hugging Face takes the short factors.
    "phi3-longrope": (
        Phi3Config, Phi3ForCausalLM,
        {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
         "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5,
         "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                          "long_factor": [2.0, 4.0, 8.0, 16.0]}},
    ),
    "mixtral": (
        MixtralConfig, MixtralForCausalLM,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16},
    ),
    # Layer 1 dense (mlp_only_layers); top-k weights not renormalised (norm_topk_prob False).
    "qwen3-moe": (
        Qwen3MoeConfig, Qwen3MoeForCausalLM,
        {"head_dim": 32, "num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "mlp_only_layers": [1], "norm_topk_prob": False},
    ),
    # ERNIE 4.5: pairwise rotary; MoE layers 1 and 3 of 4 (start 1, interval 2) with a shared
    # expert and a correction bias (set below: not zero).
    "ernie4.5": (Ernie4_5Config, Ernie4_5ForCausalLM, {"head_dim": 32}),
    "ernie4.5-moe": (
        Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM,
        {"head_dim": 32, "num_hidden_layers": 4, "num_experts": 4, "moe_k": 2,
         "moe_intermediate_size": 32, "moe_num_shared_experts": 1, "moe_layer_start_index": 1,
         "moe_layer_interval": 2, "moe_layer_end_index": 3, "tie_word_embeddings": False},
    ),
    # GLM-4.5: 8 experts in 4 groups (2 kept), a shared expert, layer 0 dense, q/k norms,
    # half the head rotated, a correction bias set below (not zero) so that it steers choices.
    "glm4-moe": (
        Glm4MoeConfig, Glm4MoeForCausalLM,
        {"head_dim": 32, "num_hidden_layers": 3, "n_routed_experts": 8, "num_experts_per_tok": 2,
         "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
         "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
         "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5,
         "tie_word_embeddings": False},
    ),
    # gpt-oss: sliding (window 8) and global layers, sinks, YaRN from a 64-token original
    # context; a swiglu_limit low enough to clamp the tiny model's gate and up.
    "gpt-oss": (
        GptOssConfig, GptOssForCausalLM,
        {"head_dim": 16, "num_hidden_layers": 3, "intermediate_size": 32,
         "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
         "swiglu_limit": 1.0,
         "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                             "original_max_position_embeddings": 64}},
    ),
        # Granite's four scalars away from 1, so that each one's place shows.
    "granite": (
        GraniteConfig, GraniteForCausalLM,
        {"embedding_multiplier": 6.0, "attention_multiplier": 0.05, "residual_multiplier": 0.3,
         "logits_scaling": 4.0, "tie_word_embeddings": True},
    ),
    "granite-moe": (
        GraniteMoeConfig, GraniteMoeForCausalLM,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
         "embedding_multiplier": 6.0, "attention_multiplier": 0.05, "residual_multiplier": 0.3,
         "logits_scaling": 4.0, "tie_word_embeddings": False},
    ),
    # PhiMoE: LayerNorms, biases (attention, logits head), sparsemixer routing with a jitter
    # eps wide enough to keep several experts in each softmax; LongRoPE with its mscale.
    "phimoe": (
        PhimoeConfig, PhimoeForCausalLM,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
         "sliding_window": 16, "attention_bias": True, "lm_head_bias": True,
         "router_jitter_noise": 0.5, "original_max_position_embeddings": 64,
         "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                             "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0],
                             "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0],
                             "short_mscale": 1.25, "long_mscale": 1.25,
                             "original_max_position_embeddings": 64}},
    ),
    # DeepSeek: latent attention (a 32-feature latent, 16 rotary and 16 plain query/key
    # features a head, values of 24); layer 0 dense; 8 experts in 4 groups, 2 groups kept.
    # V2 as V2-Lite (no query latent), group-limited softmax routing (one group kept: its two
    # experts are the choice, where the best two overall might not be), 2 shared experts; V3
    # with a query latent, sigmoid routing with its correction bias (set below), YaRN with
    # mscale_all_dim from a 64-token original context.
    "deepseek-v2": (
        DeepseekV2Config, DeepseekV2ForCausalLM,
        {**DEEPSEEK, "q_lora_rank": None, "topk_method": "group_limited_greedy",
         "topk_group": 1, "routed_scaling_factor": 1.5, "n_shared_experts": 2},
    ),
    "deepseek-v3": (
        DeepseekV3Config, DeepseekV3ForCausalLM,
        {**DEEPSEEK, "q_lora_rank": 32, "routed_scaling_factor": 2.5,
         "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                             "original_max_position_embeddings": 64, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}},
    ),
    # Llama 4: rotary layers 0 and 2 (chunked attention in chunks of 8, q/k norms), NoPE
    # layers 1 and 3 (whole context, temperature tuned from position 3 on: floor_scale 4);
    # MoE on layers 1 and 3 (2 of 4 experts, a shared one), dense MLPs of 96 elsewhere. Heads
    # of 32: the C attention kernel takes the NoPE layers, the chunked ones the torch path.
    "llama4": (
        Llama4TextConfig, Llama4ForCausalLM,
        {"num_hidden_layers": 4, "head_dim": 32, "intermediate_size": 32,
         "intermediate_size_mlp": 96, "num_local_experts": 4, "num_experts_per_tok": 2,
         "interleave_moe_layer_step": 2, "no_rope_layer_interval": 2,
         "attention_chunk_size": 8, "floor_scale": 4, "attn_scale": 0.1, "use_qk_norm": True,
         "tie_word_embeddings": False},
    ),
        # q/k norms over all heads at once, clip_qkv low enough to clamp the tiny model's q/k/v.
    "olmoe": (
        OlmoeConfig, OlmoeForCausalLM,
        {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
         "clip_qkv": 1.5, "tie_word_embeddings": False},
    ),
}


def build_checkpoint(
    arch: str, folder: str, max_shard_size: str | None = None, **overrides
) -> torch.nn.Module:
    """Save a random `arch` model (float32) to `folder`, config fields `overrides` changed;
    returns the transformers model."""
    config_class, model_class, extra = ARCHITECTURES[arch]
    config = config_class(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # larger than default init so errors show
            param.normal_(0, 0.2)
        for name, buffer in model.named_buffers():  # a routing input, not a parameter
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return model


def bundled_tokenizer():
    """The bundled model's tokenizer, as transformers reads it from the GGUF file: a fresh
    object each call, loaded from the files of the first call's (transformers converts a
    GGUF vocabulary in ~3 s; about 25 fixtures of the suite ask for this one)."""
    return AutoTokenizer.from_pretrained(_bundled_tokenizer_files())


@functools.lru_cache(maxsize=1)
def _bundled_tokenizer_files() -> str:
    from pagoda.executor.loader.model_files import bundled_model_path

    folder, name = os.path.split(bundled_model_path())
    saved = tempfile.mkdtemp(prefix="pagoda-bundled-tokenizer-")
    atexit.register(shutil.rmtree, saved, True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(saved)
    return saved


def build_checkpoint_with_bundled_tokenizer(folder: str, arch: str = "llama", **overrides) -> str:
    """A tiny random `arch` model in `folder` that speaks the bundled model's tokenizer (its
    vocabulary and special tokens; the tokenizer files saved beside it); returns `folder`."""
    tokenizer = bundled_tokenizer()
    build_checkpoint(arch, folder, vocab_size=len(tokenizer), max_position_embeddings=2048,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     **overrides)
    tokenizer.save_pretrained(folder)
    return folder
