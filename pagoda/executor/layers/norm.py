"""RMSNorm that can fuse the residual add: norm(x + residual) and return the new residual."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (..., hidden). With `residual`, returns (norm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        # Computed in float32 like the reference implementation, then cast back.
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        normed = self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)
        return normed if residual is None else (normed, residual)
