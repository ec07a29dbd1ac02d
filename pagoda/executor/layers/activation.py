"""Activations over fused projections: x (..., 2 * d) holding [gate | up] -> act(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x (..., 2 * d) holding [gate | up] -> silu(gate) * up, (..., d)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """x (..., 2 * d) holding [gate | up] -> gelu_tanh(gate) * up, (..., d): GeGLU (Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS = {
    "silu": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
    "gelu_tanh": GeluTanhAndMul,
}
"""Hugging Face `hidden_act` / `hidden_activation` name -> gated activation."""


def gated_activation(name: str) -> nn.Module:
    if name not in GATED_ACTIVATIONS:
        raise ValueError(
            f"hidden activation {name!r} is not supported ({', '.join(GATED_ACTIVATIONS)} are)")
    return GATED_ACTIVATIONS[name]()
