"""A tensor-parallel rank's view of its group: rank, size, and the two collectives the
parallel layers need, over torch.distributed (gloo on CPU, NCCL on CUDA).

Every rank of a group runs the same forward, so each collective is met by all ranks in the
same order; a rank that dies breaks its peers' next collective (gloo sees the closed
connection) instead of leaving them waiting.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a rank waits in a collective for its peers (a long prefill on a slow rank)."""


@dataclass
class TensorParallelGroup:
    rank: int
    world_size: int
    device_index: int = 0
    """This rank's CUDA device (cuda:rank for local workers; cuda:0 for a Ray actor, which
    sees only the GPU Ray gave it)."""
    last_dim_sizes: tuple[int, ...] = ()
    """Each rank's width of the gathered dimension (the vocabulary rows it holds); set by
    the sharding."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        dist.all_reduce(tensor)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """(..., n_r) on rank r -> (..., sum of n_r) on every rank, rank order; the parts may
        differ in size (an uneven vocabulary split)."""
        sizes = self.last_dim_sizes
        parts = [tensor.new_empty(*tensor.shape[:-1], size) for size in sizes]
        if len(set(sizes)) == 1:
            dist.all_gather(parts, tensor.contiguous())
        else:  # gloo's all_gather needs equal shapes: pad to the largest, then trim
            widest = max(sizes)
            padded = tensor.new_zeros(*tensor.shape[:-1], widest)
            padded[..., : tensor.shape[-1]] = tensor
            gathered = [tensor.new_empty(*tensor.shape[:-1], widest) for _ in sizes]
            dist.all_gather(gathered, padded)
            parts = [g[..., :size] for g, size in zip(gathered, sizes)]
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, value: object = None) -> object:
        """Rank 0's `value` (any picklable object) on every rank."""
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: torch.device,
                         device_index: int | None = None) -> TensorParallelGroup:
    """Join the group (`init_method`: tcp://host:port of the rendezvous): gloo on CPU, NCCL
    on CUDA (each rank on its own device: cuda:`device_index`, by default cuda:rank)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_index = rank if device_index is None else device_index
    if backend == "nccl":
        torch.cuda.set_device(device_index)
    if "//127.0.0.1:" in init_method:  # all ranks on this machine: talk over loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    logger.info("tensor-parallel rank %d of %d joined (%s)", rank, world_size, backend)
    return TensorParallelGroup(rank, world_size, device_index)


def leave_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
