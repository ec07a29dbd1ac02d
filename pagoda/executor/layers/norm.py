"""The norms, each able to fuse the residual add: norm(x + residual) and return the new
residual. RMSNorm (most families) and LayerNorm with a bias (PhiMoE)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.executor.kernels.ops import RMS_NORM_KERNEL_MAX_ROWS, kernels_available, rms_norm


class RMSNorm(nn.Module):
    batch_invariant = False
    """Set by executor/batch_invariant.py: float32 rows always through the C kernel, which
    normalises each row on its own (torch's may change its reduction with the shape)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (..., hidden). With `residual`, returns (norm(x + residual), x + residual).

        torch's fused kernel replaces the ~ten elementwise ops of the textbook form; small
        float32 CPU batches (decode steps) take Pagoda's C kernel, which also fuses the add
        (at those sizes torch's float32 rms_norm costs mostly its fixed overhead a call).
        Half precision follows the reference implementation's roundings exactly: normalise in
        float32, cast, then scale by the weight in the input dtype."""
        if self.batch_invariant:
            normed, residual = rms_norm(
                x.reshape(-1, x.shape[-1]).contiguous(), self.weight, self.eps,
                None if residual is None else residual.reshape(-1, x.shape[-1]).contiguous())
            normed = normed.view(x.shape)
            return normed if residual is None else (normed, residual.view(x.shape))
        if self._takes_kernel(x, residual):
            normed, residual = rms_norm(x, self.weight, self.eps, residual)
            return normed if residual is None else (normed, residual)
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            normed = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        else:
            normed = self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return normed if residual is None else (normed, residual)

    def _takes_kernel(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Small float32 CPU batches of whole rows (eager only: compiled graphs fuse their
        own) where the kernels run."""
        return (
            x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
            and x.shape[0] <= RMS_NORM_KERNEL_MAX_ROWS and x.is_contiguous()
            and (residual is None or residual.is_contiguous())
            and not torch.compiler.is_compiling() and kernels_available(torch.float32)
        )


class LayerNorm(nn.Module):
    """(x - mean) / std * weight + bias over the last dim, with RMSNorm's residual interface:
    forward(x), or forward(x, residual) -> (norm(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        normed = F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        return normed if residual is None else (normed, residual)
