"""Small KV caches built the way the model runner builds them (kv_cache_allocation.py), with
random bytes in every block, and a worker over them."""

from __future__ import annotations

import torch

from pagoda.executor.attention.kv_quant import QuantizedKVCache
from pagoda.executor.attention.torch_backend import TorchAttentionBackend
from pagoda.executor.kv_cache_allocation import allocate_kv_caches
from pagoda.executor.kv_offload import KVOffloadConfig, KVOffloadWorker

NUM_LAYERS, NUM_KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = 3, 2, 8, 4, 16
FINGERPRINT = "model.gguf|123|456|float32|auto|bs4|layers3|kv2|hd16|tp0/1|layout1"


def make_caches(dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto", seed: int = 0,
                block_size: int = BLOCK_SIZE, kv_planes: int = 2) -> list:
    """The runner's per-layer caches (the backends' shape, the runner's allocation), every
    byte random; `kv_planes` 1: keys only (latent attention). (The CPU kernel backend takes
    the torch backend's kv_cache_shape.)"""
    shape = TorchAttentionBackend(block_size, torch.device("cpu")).kv_cache_shape(
        NUM_BLOCKS, NUM_KV_HEADS, HEAD_DIM, kv_planes)
    caches = allocate_kv_caches(shape, NUM_LAYERS, dtype, torch.device("cpu"), kv_cache_dtype)
    generator = torch.Generator().manual_seed(seed)
    for plane in planes(caches):
        raw = plane.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return caches


def planes(caches: list) -> list[torch.Tensor]:
    out = []
    for cache in caches:
        out += [cache.codes, cache.scales] if isinstance(cache, QuantizedKVCache) else [cache]
    return out


def block_bytes(caches: list, block_id: int) -> list[torch.Tensor]:
    """Every plane's bytes of one block (compared bit for bit, NaN patterns included)."""
    return [plane[:, :, block_id].contiguous().view(torch.uint8).clone()
            for plane in planes(caches)]


def same_block(caches_a: list, block_a: int, caches_b: list, block_b: int) -> bool:
    return all(torch.equal(a, b) for a, b in zip(block_bytes(caches_a, block_a),
                                                 block_bytes(caches_b, block_b)))


def worker(caches: list, host_records: float = 0, disk_dir=None, disk_records: float = 0,
           fingerprint: str = FINGERPRINT) -> KVOffloadWorker:
    """A worker whose tiers hold that many records (fractions allowed) of these caches."""
    probe = KVOffloadWorker(caches, KVOffloadConfig(0), fingerprint)
    size = probe.record_bytes
    return KVOffloadWorker(caches, KVOffloadConfig(
        int(host_records * size), None if disk_dir is None else str(disk_dir),
        int(disk_records * size)), fingerprint)
