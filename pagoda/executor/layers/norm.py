"""RMSNorm that can fuse the residual add: norm(x + residual) and return the new residual."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (..., hidden). With `residual`, returns (norm(x + residual), x + residual).

        torch's fused kernel replaces the ~ten elementwise ops of the textbook form. Half
        precision follows the reference implementation's roundings exactly: normalise in
        float32, cast, then scale by the weight in the input dtype."""
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            normed = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        else:
            normed = self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return normed if residual is None else (normed, residual)
