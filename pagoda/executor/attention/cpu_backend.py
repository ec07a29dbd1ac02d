"""Attention on CPUs with Pagoda's C kernels: decodes read the paged cache in place.

Same cache layout, metadata and prefill path as the torch backend (torch_backend.py); the
decode group runs `paged_decode_attention` (pagoda/executor/kernels/cpu_kernels.c): one
pass per (sequence, KV head) over its blocks, float32 scores and softmax, no gathered copy
of the keys and values and no per-op dispatch. `select_backend` picks it where the kernel
takes the model's shapes.
"""

from __future__ import annotations

import torch

from pagoda.executor.attention.backend import AttentionBackend
from pagoda.executor.attention.torch_backend import AttentionGroup, TorchAttentionBackend
from pagoda.executor.kernels.ops import decode_attention_supported, paged_decode_attention


class CpuKernelAttentionBackend(TorchAttentionBackend):
    name = "cpu-kernel"

    def decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, group: AttentionGroup, scale: float
    ) -> torch.Tensor:
        return paged_decode_attention(query, kv_cache, group.block_tables, group.seq_lens, scale,
                                      self.sliding_window)


def select_backend(
    block_size: int, device: torch.device, dtype: torch.dtype, num_heads: int,
    num_kv_heads: int, head_dim: int, sliding_window: int | None,
) -> AttentionBackend:
    """The C-kernel backend on CPU where it takes these shapes, else the torch backend."""
    if device.type == "cpu" and decode_attention_supported(dtype, num_heads, num_kv_heads, head_dim):
        return CpuKernelAttentionBackend(block_size, device, sliding_window)
    return TorchAttentionBackend(block_size, device, sliding_window)
