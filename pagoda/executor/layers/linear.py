"""Linear layers whose parameters are filled by per-parameter weight loaders.

A fused projection (qkv, gate/up) is one matmul; the checkpoint stores its parts separately,
so the fused weight's loader copies each part into its row range:

    qkv_proj.weight rows:  [0, q) q_proj | [q, q+kv) k_proj | [q+kv, q+2kv) v_proj
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match {tuple(param.shape)}")
    param.data.copy_(loaded)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear a row at a time: row i of the result is what x's row i alone gives, whatever
    the number of rows (a BLAS matmul picks its blocking, and with it each row's summation
    order, by the whole shape). x (..., in) -> (..., out). For --deterministic."""
    rows = x.reshape(-1, x.shape[-1])
    out = x.new_empty(rows.shape[0], weight.shape[0])
    for i in range(rows.shape[0]):
        out[i:i + 1] = F.linear(rows[i:i + 1], weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Module):
    """y = x W^T (+ b). weight (out_features, in_features)."""

    batch_invariant = False
    """Set by executor/batch_invariant.py: rows one at a time (`linear_rows`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        )
        for param in self.parameters():
            param.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return linear_rows(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input fused along the output dim.

    `shard_sizes` maps each part's id (e.g. "q", "k", "v" or 0, 1) to its output size, in order.
    """

    def __init__(self, in_features: int, shard_sizes: dict, bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        for param in self.parameters():
            param.weight_loader = self.load_shard

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        """Copy part `shard_id`; shard_id None: `loaded` is the whole fused tensor, as
        checkpoints that store the projection fused have it (Phi-3)."""
        if shard_id is None:
            default_weight_loader(param, loaded)
            return
        offset, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(
                f"shard {shard_id!r}: weight shape {tuple(loaded.shape)} does not match "
                f"{tuple(target.shape)}"
            )
        target.copy_(loaded)
