"""Attention on CPUs with Pagoda's C kernel: decode tokens read the paged cache in place.

Same cache layout, metadata and prefill path as the torch backend (torch_backend.py); the
decode group runs `paged_attention` (pagoda/executor/kernels/csrc/: avx512_bf16.c for bf16,
attention_f32.c for float32 on any CPU): one task per
(sequence, KV head) over its blocks, scores and softmax in float32, no gathered copy of the
keys and values and no per-op dispatch. In a decode-only step the same call also writes the
step's keys and values into the cache: one call a layer. `select_backend` picks it where the
kernel takes the model's shapes.

The bf16 kernel takes prefill tokens too (each against its own causal prefix), and is both
faster than the padded, masked scaled_dot_product_attention there and closer to float32
attention. Prefills stay on the torch path all the same: the switch lowered the bundled
model's top-1 agreement with float32 (tests/executor/test_fidelity.py) below the project's
bar, by flipping near-tied positions (measured in BENCHMARKS.md).

Batch-invariant (`--deterministic`, executor/batch_invariant.py): every token of the step,
prefill or decode, is one query of the same kernel call against its own causal prefix
(`KernelTokenGroup`), so a token's attention is computed alike whatever else the step holds,
however its prompt was chunked and whether its prefix came from the cache.

With an 8-bit KV cache (kv_quant.py) the float32 kernel reads codes and scales in place and
quantizes the decode step's keys and values as it writes them; prefills quantize through
the torch path's write_kv_cache, bit for bit the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda.executor.attention.backend import AttentionBackend, AttentionMetadata
from pagoda.executor.attention.kv_quant import is_quantized
from pagoda.executor.attention.torch_backend import (
    AttentionGroup,
    TorchAttentionBackend,
    write_kv_cache,
)
from pagoda.executor.kernels.ops import paged_attention, paged_attention_supported


@dataclass
class KernelDecodeGroup(AttentionGroup):
    """A decode group with what the kernel reads, built once per step (not per layer)."""

    block_tables: torch.Tensor
    """(num_seqs, max_blocks) int64"""
    query_seq: torch.Tensor
    """(num_seqs,) int64: 0 .. num_seqs - 1, query token i is the group's sequence i"""
    seq_lens: torch.Tensor
    """(num_seqs,) int64: keys each sequence's query token attends"""


@dataclass
class KernelTokenGroup:
    """Every token of a step as a query of the kernel (batch-invariant mode)."""

    block_tables: torch.Tensor
    """(num_seqs, max_blocks) int64"""
    query_seq: torch.Tensor
    """(num_tokens,) int64: the sequence of each token"""
    key_lens: torch.Tensor
    """(num_tokens,) int64: keys each token attends, its position + 1"""


class CpuKernelAttentionBackend(TorchAttentionBackend):
    name = "cpu-kernel"

    def __init__(self, block_size: int, device: torch.device, sliding_window: int | None = None,
                 batch_invariant: bool = False):
        super().__init__(block_size, device, sliding_window)
        self.batch_invariant = batch_invariant

    def prepare(
        self, metadata: AttentionMetadata, query_lens: np.ndarray, block_tables: np.ndarray
    ) -> list[AttentionGroup] | list[KernelTokenGroup]:
        if not self.batch_invariant:
            return super().prepare(metadata, query_lens, block_tables)
        return [KernelTokenGroup(
            block_tables=torch.from_numpy(np.ascontiguousarray(block_tables, dtype=np.int64)),
            query_seq=torch.from_numpy(np.repeat(np.arange(len(query_lens)), query_lens)),
            key_lens=metadata.positions.to(torch.int64) + 1,
        )]

    def _group(
        self,
        metadata: AttentionMetadata,
        query_lens: np.ndarray,
        block_tables: np.ndarray,
        members: np.ndarray,
    ) -> AttentionGroup:
        group = super()._group(metadata, query_lens, block_tables, members)
        if group.max_query_len > 1:
            return group
        return KernelDecodeGroup(
            **vars(group),
            block_tables=torch.from_numpy(np.ascontiguousarray(block_tables[members], dtype=np.int64)),
            query_seq=torch.arange(len(members)),
            seq_lens=torch.from_numpy(metadata.seq_lens[members].astype(np.int64)),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        chunk: int | None = None,
    ) -> torch.Tensor:
        """A decode-only step is one kernel call that also writes the step's K/V; anything
        else goes the torch backend's way (cache write, then a call per group). The kernel
        has no soft-capping, no sinks and no chunks: layers with them (Gemma 2, gpt-oss,
        Llama 4's local layers) take the torch path throughout."""
        window = self.sliding_window if window is None else window
        groups = metadata.backend_data
        explicit = softcap is not None or sinks is not None or chunk is not None
        if self.batch_invariant:
            if explicit:
                raise ValueError("batch-invariant attention has no soft-capping, no sinks and "
                                 "no chunks")
            write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
            group = groups[0]
            return paged_attention(query, kv_cache, group.block_tables, group.query_seq,
                                   group.key_lens, scale, window)
        if not explicit and len(groups) == 1 and isinstance(groups[0], KernelDecodeGroup) and (
                groups[0].query_token_index is None):
            group = groups[0]
            return paged_attention(query, kv_cache, group.block_tables, group.query_seq,
                                   group.seq_lens, scale, window,
                                   new_keys=(key, value, metadata.slot_mapping))
        return super().forward(query, key, value, kv_cache, metadata, scale,
                               window=window, softcap=softcap, sinks=sinks, chunk=chunk)

    def decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, group: KernelDecodeGroup, scale: float,
        window: int | None = None, softcap: float | None = None,
        sinks: torch.Tensor | None = None, chunk: int | None = None,
    ) -> torch.Tensor:
        if softcap is not None or sinks is not None or chunk is not None:
            return super().decode(query, kv_cache, group, scale, window, softcap, sinks, chunk)
        return paged_attention(query, kv_cache, group.block_tables, group.query_seq,
                               group.seq_lens, scale, window)


def select_backend(
    block_size: int, device: torch.device, dtype: torch.dtype, num_heads: int,
    num_kv_heads: int, head_dim: int, sliding_window: int | None, kv_cache_dtype: str = "auto",
    batch_invariant: bool = False, values_in_keys: bool = False,
) -> AttentionBackend:
    """The C-kernel backend on CPU where it takes these shapes, else the torch backend. An
    8-bit KV cache has a kernel for float32 activations only (attention_f32.c): with bf16
    ones it takes the torch backend, which dequantizes the gathered tiles.
    `batch_invariant`: the kernel backend in that mode, or ValueError where it cannot run.
    `values_in_keys` (a keys-only cache, which the kernel does not read): the torch backend."""
    if batch_invariant:
        if device.type != "cpu" or values_in_keys or not paged_attention_supported(
                dtype, num_heads, num_kv_heads, head_dim):
            raise ValueError(
                f"--deterministic needs Pagoda's C attention kernel, which does not take "
                f"{dtype} on {device} with {num_heads} heads / {num_kv_heads} KV heads of "
                f"{head_dim}{' in a keys-only (latent) cache' if values_in_keys else ''}")
        return CpuKernelAttentionBackend(block_size, device, sliding_window, batch_invariant=True)
    if values_in_keys or is_quantized(kv_cache_dtype) and dtype != torch.float32:
        return TorchAttentionBackend(block_size, device, sliding_window)
    if device.type == "cpu" and paged_attention_supported(dtype, num_heads, num_kv_heads, head_dim):
        return CpuKernelAttentionBackend(block_size, device, sliding_window)
    return TorchAttentionBackend(block_size, device, sliding_window)
