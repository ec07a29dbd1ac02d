"""Tiny random Hugging Face checkpoints, built with transformers in a temp folder."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

COMMON = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}

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
}


def build_checkpoint(arch: str, folder: str, max_shard_size: str | None = None) -> torch.nn.Module:
    """Save a random `arch` model (float32) to `folder`; returns the transformers model."""
    config_class, model_class, extra = ARCHITECTURES[arch]
    config = config_class(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # larger than default init so errors show
            param.normal_(0, 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return model
