"""A pool block's bytes out of, and back into, the model runner's KV caches.

The runner holds one cache a layer (kv_cache_allocation.py), each block on axis 2:

    float   (2, num_kv_heads, num_blocks, block_size, head_dim)   the model's dtype
    8-bit   QuantizedKVCache (kv_quant.py):
              codes   (2, num_kv_heads, num_blocks, block_size, head_dim)  int8 / uint8
              scales  (2, num_kv_heads, num_blocks, block_size)            bfloat16

Each such tensor is a "plane", seen as bytes: (2 * num_kv_heads, num_blocks, row_bytes),
row_bytes = the bytes of one (K or V, head, block) slab (block_size * head_dim elements, or
block_size scales). A block's payload is every plane's (2 * num_kv_heads, row_bytes) slab,
plane after plane in layer order (codes before scales):

    payload = [layer 0: K heads, V heads | (8-bit) their scales] [layer 1: ...] ...

Copies are one gather (index_select over the block axis) and one copy per plane for any
number of blocks; nothing loops over rows or heads in Python.
"""

from __future__ import annotations

import torch

from pagoda.executor.attention.kv_quant import QuantizedKVCache

BLOCK_AXIS = 2


def _planes(kv_caches: list) -> list[tuple[torch.Tensor, str]]:
    """(tensor, what) of every plane, in payload order."""
    planes = []
    for layer, cache in enumerate(kv_caches):
        if isinstance(cache, QuantizedKVCache):
            planes.append((cache.codes, f"layer {layer} codes ({cache.kv_cache_dtype})"))
            planes.append((cache.scales, f"layer {layer} scales"))
        else:
            planes.append((cache, f"layer {layer}"))
    return planes


def _bytes_view(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """tensor (2, H, num_blocks, ...) -> uint8 view (2 * H, num_blocks, row_bytes) of the
    same memory (writes through)."""
    if tensor.dim() < 4 or tensor.shape[0] != 2 or not tensor.is_contiguous():
        raise ValueError(f"KV offload: {what} is not a contiguous (2, heads, blocks, ...) cache: "
                         f"shape {tuple(tensor.shape)}")
    two, heads, blocks = tensor.shape[:3]
    return tensor.view(torch.uint8).view(two * heads, blocks, -1)


class BlockCopier:
    """Copies whole pool blocks between the caches and (n, payload_bytes) uint8 rows."""

    def __init__(self, kv_caches: list) -> None:
        if not kv_caches:
            raise ValueError("KV offload needs the model's KV caches (none were given)")
        planes = _planes(kv_caches)
        self.planes = [_bytes_view(tensor, what) for tensor, what in planes]
        self.num_blocks = min(plane.shape[1] for plane in self.planes)
        self.slab_bytes = [plane.shape[0] * plane.shape[2] for plane in self.planes]
        self.payload_bytes = sum(self.slab_bytes)
        self.device = self.planes[0].device
        self.layout = ";".join(
            f"{what}:{tensor.dtype}:{tuple(s for i, s in enumerate(tensor.shape) if i != BLOCK_AXIS)}"
            for tensor, what in planes)
        """The payload's layout in words (dtypes and every shape but the pool's size): part
        of the fingerprint, so a payload is never read into caches of another layout."""

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise IndexError(f"KV offload: block ids {bad[:8]} outside the pool's "
                             f"{self.num_blocks} blocks")
        return torch.tensor(block_ids, dtype=torch.int64, device=self.device)

    def gather(self, block_ids: list[int], out: torch.Tensor) -> None:
        """out (n, >= payload_bytes) uint8 on CPU: row i's first payload_bytes <- block
        block_ids[i]'s payload."""
        n = len(block_ids)
        if n == 0:
            return
        ids = self._ids(block_ids)
        at = 0
        for plane, size in zip(self.planes, self.slab_bytes):
            slabs = plane.index_select(1, ids)  # (2H, n, row_bytes)
            out[:, at:at + size].view(n, plane.shape[0], plane.shape[2]).copy_(
                slabs.transpose(0, 1))
            at += size

    def scatter(self, block_ids: list[int], rows: torch.Tensor) -> None:
        """rows (n, payload_bytes) uint8 on CPU: block block_ids[i] <- row i's payload."""
        n = len(block_ids)
        if n == 0:
            return
        ids = self._ids(block_ids)
        at = 0
        for plane, size in zip(self.planes, self.slab_bytes):
            slabs = rows[:, at:at + size].view(n, plane.shape[0], plane.shape[2])
            plane.index_copy_(1, ids, slabs.transpose(0, 1).to(self.device))
            at += size
