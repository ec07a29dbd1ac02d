"""Which part of the model each tensor-parallel rank holds: pure arithmetic, no torch.

Attention heads go by KV head, so that each rank's query heads attend to KV heads it holds:

    num_kv_heads >= N   the KV heads split into N contiguous runs (as even as can be:
                        3 KV heads over 2 ranks -> 2 + 1), each with its group of query heads
    num_kv_heads <  N   N must be a multiple of num_kv_heads: each KV head is replicated on
                        N / num_kv_heads ranks, which split its query heads between them

MLP rows (intermediate size) and vocabulary rows split into contiguous runs whose bounds are
multiples of `align` (a packed weight's tile of outputs, a quantization block of inputs),
as even as that allows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShare:
    """One rank's heads: query heads [q_start, q_stop), KV heads [kv_start, kv_stop)."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int

    @property
    def num_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start


def head_shares(num_heads: int, num_kv_heads: int, world_size: int) -> list[HeadShare]:
    """Each rank's HeadShare. ValueError where the heads cannot be split over `world_size`."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= world_size:
        return [HeadShare(start * group, stop * group, start, stop)
                for start, stop in even_runs(num_kv_heads, world_size)]
    if world_size % num_kv_heads or num_heads % world_size:
        raise ValueError(
            f"tensor_parallel_size {world_size} does not divide this model's heads: with "
            f"{num_kv_heads} KV heads (fewer than the ranks) it must be a multiple of "
            f"{num_kv_heads} and divide the {num_heads} query heads"
        )
    per_rank = num_heads // world_size
    return [HeadShare(rank * per_rank, (rank + 1) * per_rank,
                      rank * per_rank // group, rank * per_rank // group + 1)
            for rank in range(world_size)]


def even_runs(size: int, world_size: int) -> list[tuple[int, int]]:
    """[start, stop) of each rank: `size` split as evenly as can be, earlier ranks the larger.
    ValueError when a rank would get nothing."""
    if size < world_size:
        raise ValueError(f"{size} cannot be split over {world_size} tensor-parallel ranks")
    base, extra = divmod(size, world_size)
    bounds = [0]
    for rank in range(world_size):
        bounds.append(bounds[-1] + base + (rank < extra))
    return list(itertools.pairwise(bounds))


def aligned_runs(size: int, world_size: int, align: int) -> list[tuple[int, int]]:
    """`size` split into `world_size` runs whose inner bounds are multiples of `align`.
    ValueError where `size` is no multiple of `align` or too small to give every rank some."""
    if size % align:
        raise ValueError(f"a dimension of {size} cannot be split on multiples of {align}")
    return [(start * align, stop * align) for start, stop in even_runs(size // align, world_size)]
