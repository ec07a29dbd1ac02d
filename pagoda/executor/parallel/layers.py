"""The layers that make a sharded model whole again, each with one collective:

    RowParallelLinear        o_proj, down_proj: each rank multiplies its input columns
                             (its heads, its MLP rows); all-reduce sums the partial outputs
    VocabParallelEmbedding   each rank looks up the ids in its vocabulary rows, zeros the
                             rest; all-reduce
    VocabParallelHead        each rank computes the logits of its vocabulary rows;
                             all-gather puts them side by side, in rank order

The column-parallel layers (qkv, gate/up) need no collective: each rank computes its own
heads and MLP rows from the whole hidden state, which every rank holds.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.executor.parallel.communication import TensorParallelGroup


class RowParallelLinear(nn.Module):
    """`inner`: this rank's columns of the layer (its bias on rank 0 only, so that the sum
    adds it once). (..., in share) -> (..., out), summed over ranks. `columns`: the
    [start, stop) of the whole layer's inputs `inner` takes, of `whole_in_features` (LoRA
    adapters are cut on them: executor/lora/model_lora.py)."""

    def __init__(self, inner: nn.Module, group: TensorParallelGroup,
                 columns: tuple[int, int] | None = None,
                 whole_in_features: int | None = None) -> None:
        super().__init__()
        self.inner, self.group = inner, group
        self.columns, self.whole_in_features = columns, whole_in_features
        self.in_features, self.out_features = inner.in_features, inner.out_features
        self.bias = None  # (inner's: what the fused decode kernel would look for)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """`inner`: the embedding of vocabulary ids [start, start + inner.num_embeddings).
    ids (...) -> (..., hidden), whole after the all-reduce."""

    def __init__(self, inner: nn.Module, start: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner, self.start, self.group = inner, start, group
        self.num_local = inner.num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        rows = self.inner(local.masked_fill(outside, 0))
        rows = rows.masked_fill(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(rows)


class VocabParallelHead(nn.Module):
    """`inner`: the logits head of this rank's vocabulary rows. hidden (n, hidden) ->
    logits (n, vocab_size), every rank's rows gathered in order."""

    def __init__(self, inner: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last_dim(self.inner(hidden))


class ShardedRMSNorm(nn.Module):
    """An RMSNorm whose features are split over the ranks (OLMoE's q and k norms, each over
    all heads): `weight` is this rank's share of the whole norm's weight, and the mean square
    is every rank's sum of squares, all-reduced, over `counted_features`: the widths of all
    ranks' shares (the whole width; times the replication where every KV head is held by
    several ranks, which counts each square as often). (..., share) -> (..., share), the
    whole norm's output at this rank's features (RMSNorm's roundings: float32 statistics,
    half-precision inputs scaled by the weight after the cast)."""

    def __init__(self, weight: torch.Tensor, eps: float, counted_features: int,
                 group: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.eps, self.counted_features, self.group = eps, counted_features, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = self.group.all_reduce(x32.square().sum(dim=-1, keepdim=True))
        normed = x32 * torch.rsqrt(squares / self.counted_features + self.eps)
        if x.dtype == torch.float32:
            return normed * self.weight
        return self.weight * normed.to(x.dtype)
