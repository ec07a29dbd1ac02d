"""A pool block's bytes out of, and back into, the model runner's KV caches.

The runner holds one cache a layer (kv_cache_allocation.py), each block on axis 2:

    float   (2, num_kv_heads, num_blocks, block_size, head_dim)   the model's dtype, or the
            16-bit --kv-cache-dtype (float16 / bfloat16) under float32 activations; (1, ...)
            where the values are the keys (DeepSeek's latent attention), 8-bit ones alike
    8-bit   QuantizedKVCache (kv_quant.py):
              codes   (2, num_kv_heads, num_blocks, block_size, head_dim)  int8 / uint8
              scales  (2, num_kv_heads, num_blocks, block_size)            bfloat16

Each such tensor is a "plane", seen as words (UNITS): (2 * num_kv_heads, num_blocks, row
words), a row = one (K or V, head, block) slab (block_size * head_dim elements, or
block_size scales). A block's payload is every plane's (2 * num_kv_heads, row_bytes) slab,
plane after plane in layer order (codes before scales):

    payload = [layer 0: K heads, V heads | (8-bit) their scales] [layer 1: ...] ...

Copies are one gather (index_select over the block axis) and one copy per plane, or one
index_copy_, for any number of blocks; nothing loops over blocks, rows or heads in Python.
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


UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
"""Copies move words of the widest unit that every row and offset allows (torch copies
uint8 one byte at a time; int64 is ~5x faster for these gathers and scatters)."""


def _check(tensor: torch.Tensor, what: str) -> None:
    if tensor.dim() < 4 or tensor.shape[0] not in (1, 2) or not tensor.is_contiguous():
        raise ValueError(f"KV offload: {what} is not a contiguous (2 or 1, heads, blocks, ...) cache: "
                         f"shape {tuple(tensor.shape)}")


def _shape_but_blocks(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape[:BLOCK_AXIS] + tensor.shape[BLOCK_AXIS + 1:])


def _word_view(tensor: torch.Tensor, unit: int) -> torch.Tensor:
    """tensor (2, H, num_blocks, ...) -> (2 * H, num_blocks, row_bytes / unit) view of the
    same memory in UNITS[unit] (writes through)."""
    planes, heads, blocks = tensor.shape[:3]
    return tensor.view(torch.uint8).view(planes * heads, blocks, -1).view(UNITS[unit])


class BlockCopier:
    """Copies whole pool blocks between the caches and rows of a uint8 buffer (n, stride)
    whose payloads start at column `start` (start and stride multiples of `unit`)."""

    def __init__(self, kv_caches: list) -> None:
        if not kv_caches:
            raise ValueError("KV offload needs the model's KV caches (none were given)")
        planes = _planes(kv_caches)
        for tensor, what in planes:
            _check(tensor, what)
        row_bytes = [tensor[0, 0, 0].numel() * tensor.element_size() for tensor, _ in planes]
        slab_bytes = [tensor.shape[0] * tensor.shape[1] * rb
                      for (tensor, _), rb in zip(planes, row_bytes)]
        self.payload_bytes = sum(slab_bytes)
        starts = [sum(slab_bytes[:i]) for i in range(len(slab_bytes))]
        alignment = [*row_bytes, *starts] + [tensor.data_ptr() for tensor, _ in planes]
        self.unit = next(u for u in UNITS if all(x % u == 0 for x in alignment))
        self.planes = [_word_view(tensor, self.unit) for tensor, _ in planes]
        self.slabs = [(start // self.unit, size // self.unit)
                      for start, size in zip(starts, slab_bytes)]
        self.num_blocks = min(plane.shape[1] for plane in self.planes)
        self.device = self.planes[0].device
        self.layout = ";".join(f"{what}:{tensor.dtype}:{_shape_but_blocks(tensor)}"
                                for tensor, what in planes)
        """The payload's layout in words (dtypes and every shape but the pool's size): part
        of the fingerprint, so a payload is never read into caches of another layout."""

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise IndexError(f"KV offload: block ids {bad[:8]} outside the pool's "
                             f"{self.num_blocks} blocks")
        return torch.tensor(block_ids, dtype=torch.int64, device=self.device)

    def _words(self, rows: torch.Tensor, start: int) -> tuple[torch.Tensor, int]:
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.stride(1) != 1 or (
                rows.stride(0) % self.unit or start % self.unit or rows.data_ptr() % self.unit):
            raise ValueError(f"KV offload: rows must be uint8 (n, stride) with stride and start "
                             f"multiples of {self.unit}")
        n = rows.shape[0]
        return rows.view(UNITS[self.unit]).view(n, -1), start // self.unit

    def gather(self, block_ids: list[int], rows: torch.Tensor, start: int) -> None:
        """rows (n, stride) uint8 on CPU: row i's payload (from column `start`) <- block
        block_ids[i]'s. One index_select a plane for all the blocks."""
        n = len(block_ids)
        if n == 0:
            return
        ids = self._ids(block_ids)
        words, first = self._words(rows, start)
        for plane, (at, size) in zip(self.planes, self.slabs):
            out = words[:, first + at:first + at + size].view(n, plane.shape[0], plane.shape[2])
            out.copy_(plane.index_select(1, ids).transpose(0, 1))

    def scatter(self, block_ids: list[int], rows: torch.Tensor, start: int) -> None:
        """rows (n, stride) uint8 on CPU: block block_ids[i] <- row i's payload (from column
        `start`). One index_copy_ a plane for all the blocks."""
        n = len(block_ids)
        if n == 0:
            return
        ids = self._ids(block_ids)
        words, first = self._words(rows, start)
        for plane, (at, size) in zip(self.planes, self.slabs):
            slabs = words[:, first + at:first + at + size].view(n, plane.shape[0], plane.shape[2])
            plane.transpose(0, 1).index_copy_(0, ids, slabs.to(self.device))
