"""Random PEFT LoRA adapters for tests, made by `peft` itself over a tiny random checkpoint
(tests/executor/tiny_checkpoints.py): LoraConfig(init_lora_weights=False) so that B is
non-zero and the adapter changes the model's output."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from tests.executor.tiny_checkpoints import ARCHITECTURES, COMMON

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(arch: str = "llama", **overrides) -> torch.nn.Module:
    """The tiny random `arch` model build_checkpoint saves (same seed, same weights)."""
    config_class, model_class, extra = ARCHITECTURES[arch]
    torch.manual_seed(0)
    model = model_class(config_class(**{**COMMON, **extra, **overrides})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    return model


def make_adapter(folder: str, base: torch.nn.Module, seed: int = 1, **lora) -> torch.nn.Module:
    """Save a random LoRA adapter over `base` (a fresh model: peft wraps it in place) to
    `folder`; `lora` overrides LoraConfig's fields (default r=8, lora_alpha=16, all seven
    targets). Returns the PeftModel."""
    config = LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": ALL_TARGETS,
                           "init_lora_weights": False, **lora})
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():  # B of about the base weights' size, so that the delta shows
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    return model
