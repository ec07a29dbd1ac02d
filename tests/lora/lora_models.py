"""Random PEFT LoRA adapters for the tiny checkpoints (tests/executor/tiny_checkpoints.py),
made by `peft` itself, and transformers + peft's merged model as the reference."""

from __future__ import annotations

import copy

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

ADAPTERS = {
    "all": {"r": 8, "lora_alpha": 16, "target_modules": ALL_TARGETS},
    "qv": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "rslora": {"r": 8, "lora_alpha": 4, "target_modules": ALL_TARGETS, "use_rslora": True},
    "patterns": {"r": 8, "lora_alpha": 16, "target_modules": ALL_TARGETS,
                 "rank_pattern": {"k_proj": 2, "down_proj": 4},
                 "alpha_pattern": {"o_proj": 3, "up_proj": 40}},
}
"""Adapter kinds: every target, q/v only, rsLoRA scaling, per-module ranks and alphas."""


def make_adapter(base: torch.nn.Module, folder: str, kind: str, seed: int) -> torch.nn.Module:
    """Save a random `kind` adapter of `base` (a transformers model, left unchanged) to
    `folder`; returns transformers' model with the adapter merged into its weights."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base),
                           LoraConfig(init_lora_weights=False, **ADAPTERS[kind]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # large enough to change greedy tokens
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    model.save_pretrained(folder)
    return model.merge_and_unload().eval()


def greedy_reference(model, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy tokens (a full forward over the sequence each step)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
