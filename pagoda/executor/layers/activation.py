"""Activations over fused projections: x (..., 2 * d) holding [gate | up] -> act(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.executor.kernels.ops import silu_and_mul


class SiluAndMul(nn.Module):
    """x (..., 2 * d) holding [gate | up] -> silu(gate) * up, (..., d)."""

    batch_invariant = False
    """Set by executor/batch_invariant.py: float32 rows through the C kernel (ops.silu_and_mul)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            rows = silu_and_mul(x.reshape(-1, x.shape[-1]).contiguous())
            return rows.view(*x.shape[:-1], rows.shape[-1])
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """x (..., 2 * d) holding [gate | up] -> gelu_tanh(gate) * up, (..., d): GeGLU (Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class ClampedSwigluAndMul(nn.Module):
    """gpt-oss's gated activation: x (..., 2 * d) holding [gate | up] ->
    (up + 1) * g * sigmoid(alpha * g), (..., d), with g = min(gate, limit) and up clamped to
    [-limit, limit]."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * (gate * torch.sigmoid(gate * self.alpha))


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
