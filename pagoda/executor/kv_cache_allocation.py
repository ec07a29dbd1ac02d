"""The paged KV cache's memory: bytes per token, the default CPU budget, each layer's cache
tensors, and the start-up sizing of a runner's cache (how many blocks each KV-cache group
gets: from the configured memory, the CPU default, or on CUDA a profiled forward).

On CPU every layer of a KV-cache group shares one anonymous mapping, which the kernel
zero-fills page by page on first write: memory is taken as blocks are used, not all at
start (a one-shot generation of the bundled model touches a few blocks of its cache). Huge
pages are declined for it: each (layer, K/V, head) plane would take 2 MiB at its first row.
Backends read whole blocks, and the unwritten rows they mask out must hold finite values:
zeros.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
from typing import Protocol

import numpy as np
import torch

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.executor.attention.kv_quant import (
    SCALE_BYTES,
    QuantizedKVCache,
    bytes_per_token_head,
    code_dtype,
    is_quantized,
    plain_cache_dtype,
)
from pagoda.executor.kv_cache_layout import cdiv, split_kv_blocks, window_blocks_needed

logger = logging.getLogger(__name__)

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
                       kv_cache_dtype: str, planes: int = 2) -> int:
    """K and V (`planes` 1: K only) of one token over all layers and KV heads (`dtype` the
    activations'); an 8-bit cache counts its codes and its scales (kv_quant.py)."""
    if is_quantized(kv_cache_dtype):
        row_bytes = bytes_per_token_head(kv_cache_dtype, head_dim)
    else:
        row_bytes = head_dim * plain_cache_dtype(kv_cache_dtype, dtype).itemsize
    return planes * num_layers * num_kv_heads * row_bytes


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


# ---- sizing: how many blocks each KV-cache group gets -------------------------------------


class SizedRunner(Protocol):
    """What the sizing reads and calls of a runner (model_runner.ModelRunner, which imports
    this module)."""

    cache_config: CacheConfig
    device: torch.device
    block_size: int
    kv_bytes_per_token: int
    kv_cache_windows: list[int | None]
    layer_kv_groups: list[int]
    num_kv_cache_groups: int
    num_blocks: int
    kv_caches: list

    def set_kv_cache_groups(self, max_model_len: int | None = None) -> None: ...
    def initialize_kv_cache(self, per_group: list[int]) -> None: ...
    def same_table_every_group(self, block_table: np.ndarray) -> list[np.ndarray]: ...
    def _forward(self, input_ids: np.ndarray, num_computed: np.ndarray,
                 num_scheduled: np.ndarray, block_tables: list[np.ndarray]) -> torch.Tensor: ...


def determine_num_blocks(runner: SizedRunner, max_model_len: int,
                         scheduler_config: SchedulerConfig) -> int:
    """Blocks that fit the configured memory, but no more than the engine could ever use."""
    cfg = runner.cache_config
    bytes_per_block = runner.kv_bytes_per_token * runner.block_size
    most_useful = -(-max_model_len // runner.block_size) * scheduler_config.max_num_seqs
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    if cfg.kv_cache_memory is not None:
        budget = cfg.kv_cache_memory
    elif runner.device.type == "cuda":
        budget = profile_cuda_kv_budget(runner, scheduler_config)
    else:
        return cpu_default_kv_blocks(-(-max_model_len // runner.block_size), bytes_per_block,
                                     most_useful)
    return max(1, budget // bytes_per_block)


def determine_kv_cache_blocks(runner: SizedRunner, max_model_len: int,
                              scheduler_config: SchedulerConfig) -> list[int]:
    """Blocks of each KV-cache group: determine_num_blocks's budget, shared between the
    groups (kv_cache_layout.split_kv_blocks); a forced num_kv_blocks goes to every group.
    Regroups the runner's layers for `max_model_len` first (set_kv_cache_groups)."""
    runner.set_kv_cache_groups(max_model_len)
    num_blocks = determine_num_blocks(runner, max_model_len, scheduler_config)
    windows = runner.kv_cache_windows
    if windows == [None] or runner.cache_config.num_kv_blocks is not None:
        return [num_blocks] * len(windows)
    window_blocks = window_blocks_needed(
        windows[-1], runner.block_size, scheduler_config.max_num_seqs,
        scheduler_config.max_num_batched_tokens, max_model_len)
    layers_per_group = [runner.layer_kv_groups.count(g) for g in range(len(windows))]
    per_group = split_kv_blocks(num_blocks, windows, layers_per_group, window_blocks,
                                cdiv(max_model_len, runner.block_size)
                                * scheduler_config.max_num_seqs)
    logger.info("KV cache groups: %s", "; ".join(
        f"{'full attention' if w is None else f'sliding window {w}'} ({n} layers): "
        f"{b} blocks" for w, n, b in zip(windows, layers_per_group, per_group)))
    return per_group


def profile_cuda_kv_budget(runner: SizedRunner, scheduler_config: SchedulerConfig) -> int:
    """GPU bytes left for the KV cache after weights and a max-size forward's activations
    (the forward runs over a scratch cache, dropped after)."""
    device = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = scheduler_config.max_num_batched_tokens
    runner.initialize_kv_cache([-(-num_tokens // runner.block_size)] * runner.num_kv_cache_groups)
    blocks = runner.same_table_every_group(np.arange(runner.num_blocks)[None, :])
    with torch.inference_mode():
        runner._forward(np.zeros(num_tokens, dtype=np.int64), np.array([0]),
                        np.array([num_tokens]), blocks)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    runner.kv_caches = []
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(device)
    budget = int(total * runner.cache_config.gpu_memory_utilization) - peak
    if budget <= 0:
        raise ValueError(
            "no GPU memory left for the KV cache; raise --gpu-memory-utilization or lower "
            "--max-num-batched-tokens"
        )
    return budget
