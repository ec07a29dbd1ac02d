"""What a KV tier entry is valid for (the runner's fingerprint string; record.py digests it
with the payload layout): entries are never reused across another model file, dtype, KV
dtype, block size, cache shape or tensor-parallel share."""

from __future__ import annotations

import os

import torch

KV_OFFLOAD_LAYOUT_VERSION = "pagoda-paged-kv-1"
"""Bumped whenever the cache's block layout changes: older tier entries are then ignored."""


def kv_offload_fingerprint(
    model_path: str, dtype: torch.dtype, kv_cache_dtype: str, block_size: int,
    num_layers: int, num_kv_heads: int, head_dim: int, tp_rank: int, tp_size: int,
) -> str:
    """What a KV tier entry is valid for: the model's file(s) by path, size and mtime (a
    Hugging Face folder: each of its weight files), the dtypes, the block size, the cache's
    shape and the tensor-parallel share."""
    path = os.path.abspath(model_path)
    files = [path]
    if os.path.isdir(path):
        files = sorted(os.path.join(path, name) for name in os.listdir(path)
                       if name.endswith((".safetensors", ".bin", ".json", ".gguf")))
    stamps = []
    for name in files:
        stat = os.stat(name)
        stamps.append(f"{name}:{stat.st_size}:{stat.st_mtime_ns}")
    return "\n".join([
        *stamps, f"dtype={dtype}", f"kv_cache_dtype={kv_cache_dtype}",
        f"block_size={block_size}", f"layers={num_layers}", f"kv_heads={num_kv_heads}",
        f"head_dim={head_dim}", f"tp={tp_rank}/{tp_size}", KV_OFFLOAD_LAYOUT_VERSION])
