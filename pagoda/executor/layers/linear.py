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


class Linear(nn.Module):
    """y = x W^T (+ b). weight (out_features, in_features)."""

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
