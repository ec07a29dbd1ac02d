"""The paged KV cache's memory: bytes per token, the default CPU budget, and each layer's
cache tensors.

On CPU every layer of a KV-cache group shares one anonymous mapping, which the kernel
zero-fills page by page on first write: memory is taken as blocks are used, not all at
start (a one-shot generation of the bundled model touches a few blocks of its cache). Huge
pages are declined for it: each (layer, K/V, head) plane would take 2 MiB at its first row.
Backends read whole blocks, and the unwritten rows they mask out must hold finite values:
zeros.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

from pagoda.executor.attention.kv_quant import (
    SCALE_BYTES,
    QuantizedKVCache,
    bytes_per_token_head,
    code_dtype,
    is_quantized,
    plain_cache_dtype,
)

CPU_KV_CACHE_FRACTION = 0.2
"""Most of the available RAM the KV cache takes on CPU when no size is given."""
CPU_KV_CACHE_DEFAULT_BYTES = 256 << 20
"""Default CPU KV cache when no size is given (at least one max_model_len sequence fits):
the bundled model then holds ~5.7K tokens in float32 (~11K in bf16), room for 16 streams
of 256 tokens, and runs in well under 1 GB; --kv-cache-memory sets more for large batches."""


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_default_kv_blocks(one_sequence: int, bytes_per_block: int, most_useful: int) -> int:
    """Blocks of a CPU KV cache given no size: CPU_KV_CACHE_DEFAULT_BYTES (but at least
    `one_sequence`, the blocks of one max_model_len sequence), at most CPU_KV_CACHE_FRACTION
    of the available RAM and `most_useful` (what the engine could ever hold)."""
    default = max(one_sequence, CPU_KV_CACHE_DEFAULT_BYTES // bytes_per_block)
    ram_share = int(available_memory_bytes() * CPU_KV_CACHE_FRACTION) // bytes_per_block
    return max(1, min(default, ram_share, most_useful))



def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       kv_cache_dtype: str) -> int:
    """K and V of one token over all layers and KV heads (`dtype` the activations'); an
    8-bit cache counts its codes and its scales (kv_quant.py)."""
    if is_quantized(kv_cache_dtype):
        row_bytes = bytes_per_token_head(kv_cache_dtype, head_dim)
    else:
        row_bytes = head_dim * plain_cache_dtype(kv_cache_dtype, dtype).itemsize
    return 2 * num_layers * num_kv_heads * row_bytes


def allocate_kv_caches(shape: tuple, num_layers: int, dtype: torch.dtype, device: torch.device,
                       kv_cache_dtype: str) -> list:
    """`num_layers` zeroed paged caches of the backend's `shape` (one KV-cache group's):
    tensors of `dtype` (the activations') or of the 16-bit `kv_cache_dtype`, or
    QuantizedKVCache for an 8-bit one (CPU)."""
    if num_layers == 0:
        return []
    if is_quantized(kv_cache_dtype):
        return _quantized_kv_caches(shape, num_layers, kv_cache_dtype)
    dtype = plain_cache_dtype(kv_cache_dtype, dtype)
    if device.type == "cpu":
        element_size = torch.empty(0, dtype=dtype).element_size()
        buffer = torch.frombuffer(_lazy_zeros(num_layers * math.prod(shape) * element_size),
                                  dtype=dtype)  # keeps the mapping alive
        return list(buffer.view(num_layers, *shape).unbind(0))
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def _lazy_zeros(num_bytes: int) -> mmap.mmap:
    mapping = mmap.mmap(-1, num_bytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return mapping


def _quantized_kv_caches(shape: tuple, num_layers: int, kv_cache_dtype: str) -> list[QuantizedKVCache]:
    """One QuantizedKVCache a layer, all in one lazily zero-filled mapping as the float
    cache is: every layer's codes, then every layer's scales (bfloat16, 2-byte aligned)."""
    scale_shape = shape[:-1]
    code_bytes = num_layers * math.prod(shape)
    num_scales = num_layers * math.prod(scale_shape)
    scales_at = code_bytes + code_bytes % SCALE_BYTES
    mapping = _lazy_zeros(scales_at + SCALE_BYTES * num_scales)
    codes = torch.frombuffer(mapping, dtype=code_dtype(kv_cache_dtype), count=code_bytes)
    scales = torch.frombuffer(mapping, dtype=torch.bfloat16, count=num_scales, offset=scales_at)
    return [QuantizedKVCache(layer_codes, layer_scales, kv_cache_dtype)
            for layer_codes, layer_scales in zip(
                codes.view(num_layers, *shape).unbind(0),
                scales.view(num_layers, *scale_shape).unbind(0))]
