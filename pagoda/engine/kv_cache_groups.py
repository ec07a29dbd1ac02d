"""KV-cache groups for models with sliding-window layers. Pure Python: no torch here.

A model whose layers all attend to the whole sequence has one group and uses the plain
BlockManager (block_manager.py), prefix caching and all; nothing here is involved. A model
with sliding-window layers (Gemma 2/3 interleave them with global layers; Mistral, Qwen2/3 or
Mixtral may slide on every layer) splits its layers into up to two groups, each with a
block pool of its own (own block ids, own KV tensors in the executor):

    group 0  full attention     BlockManager (no prefix caching), grows with the sequence
    group 1  sliding window W   SlidingWindowBlockManager: only the blocks the window reaches

(a model whose every layer slides has the sliding group alone). Both groups index a
request's blocks by position the same way, block i = positions [i*bs, (i+1)*bs), so a
request's tables have equal lengths in every group.

Freeing out-of-window blocks. Before a request's next tokens are scheduled, its earliest new
token sits at position p0 = num_computed_tokens and attends keys j with p0 - j < W, i.e.
j >= p0 - W + 1 (later tokens reach even less far back). A windowed block all of whose
positions are older is never read again, so it goes back to the pool; the request's table
keeps a placeholder in its place:

    positions   0 ....... p0-W+1 ........ p0 ....... p0+n-1
    blocks    [ None | None | b7 | b3 | b9 | b12 ]
                freed         in the window   this step's new tokens

The runner's table keeps the freed block's old id there (or NULL_BLOCK_ID for a request sent
after the freeing): attention masks every key outside the window, so whatever another
request has since written there is never used (cache values are always finite).

Prefix caching is off for such models (noted in the log): a cache hit would need the
windowed group's last window of blocks as well, which this manager does not keep.

One scheduling rule still: the scheduler asks `allocate_slots(request, n)`, and the
HybridBlockManager answers for all groups at once (all get their blocks, or none does).
"""

from __future__ import annotations

import logging
from collections import deque

from pagoda.engine.block_manager import BlockManager
from pagoda.engine.request import Request

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0
"""What a freed (out-of-window) position of a windowed table is sent as: any valid id does,
since attention never uses keys outside the window."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SlidingWindowBlockManager:
    """One sliding-window group's pool: blocks are allocated as the sequence grows and freed
    once they fall out of the window. No prefix caching, so free blocks carry no content
    worth keeping and the free list is a plain queue."""

    def __init__(self, num_blocks: int, block_size: int, sliding_window: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.request_blocks: dict[str, list[int | None]] = {}
        """Per request, one entry per block position; None where the block was freed.
        Invariant: the None entries are a prefix of the list."""

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_held_blocks(self, request_id: str) -> int:
        return sum(b is not None for b in self.request_blocks.get(request_id, []))

    def block_ids(self, request_id: str) -> list[int]:
        return [NULL_BLOCK_ID if b is None else b for b in self.request_blocks.get(request_id, [])]

    def remove_skipped_blocks(self, request: Request) -> None:
        """Free the request's blocks that lie wholly before its window (see the module
        docstring). Safe whenever called: num_computed_tokens only grows while blocks are
        held (preemption frees them all)."""
        held = self.request_blocks.get(request.request_id)
        if not held:
            return
        first_needed = max(0, request.num_computed_tokens - self.sliding_window + 1)
        num_skipped = min(first_needed // self.block_size, len(held))
        for i in range(num_skipped - 1, -1, -1):
            if held[i] is None:
                break  # the None entries are a prefix: everything before is freed already
            self.free_block_ids.append(held[i])
            held[i] = None

    def _num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        total_tokens = request.num_computed_tokens + num_new_tokens
        return max(cdiv(total_tokens, self.block_size)
                   - len(self.request_blocks.get(request.request_id, [])), 0)

    def can_allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        return self._num_new_blocks(request, num_new_tokens) <= self.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens; None, changing nothing, if too few are free."""
        num_new_blocks = self._num_new_blocks(request, num_new_tokens)
        if num_new_blocks > self.num_free_blocks:
            return None
        new_ids = [self.free_block_ids.popleft() for _ in range(num_new_blocks)]
        self.request_blocks.setdefault(request.request_id, []).extend(new_ids)
        return new_ids

    def free(self, request: Request) -> None:
        for block_id in reversed(self.request_blocks.pop(request.request_id, [])):
            if block_id is not None:
                self.free_block_ids.append(block_id)

    def rollback_slots(self, request: Request) -> None:
        """Free the blocks past request.num_computed_tokens, back to the front of the pool
        (as BlockManager.rollback_slots)."""
        held = self.request_blocks.get(request.request_id)
        if not held:
            return
        keep = cdiv(request.num_computed_tokens, self.block_size)
        while len(held) > keep:
            block_id = held.pop()
            if block_id is not None:
                self.free_block_ids.appendleft(block_id)


class HybridBlockManager:
    """The block manager of a model with sliding-window layers: one pool per KV-cache group
    (a full-attention BlockManager without prefix caching, and/or a SlidingWindowBlockManager),
    answering the scheduler's questions for all of them. Same interface as BlockManager where
    the scheduler and the engine use it; block ids come as a tuple with one list per group."""

    def __init__(self, num_blocks: list[int], block_size: int, windows: list[int | None]):
        assert len(num_blocks) == len(windows) and any(w is not None for w in windows), windows
        self.block_size = block_size
        self.windows = list(windows)
        self.groups: list[BlockManager | SlidingWindowBlockManager] = [
            BlockManager(n, block_size, enable_prefix_caching=False) if window is None
            else SlidingWindowBlockManager(n, block_size, window)
            for n, window in zip(num_blocks, windows)
        ]
        self.enable_prefix_caching = False
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- queries ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return sum(group.num_blocks for group in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return sum(group.num_free_blocks for group in self.groups)

    @property
    def usage(self) -> float:
        """Fraction of all groups' blocks held by requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(group.block_ids(request_id) for group in self.groups)

    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        return [], 0  # no prefix caching (see the module docstring)

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list | None = None,
    ) -> tuple[list[int], ...] | None:
        """Room for `num_new_tokens` more tokens in every group, after freeing the windowed
        blocks the request no longer needs. None, allocating nothing, if a group lacks
        blocks. Else one list of new block ids per group, or () when no group got any (so
        that the scheduler's `if new_block_ids:` skips it, as a single group's [] would)."""
        assert not computed_blocks, "no prefix caching with sliding-window groups"
        for group in self.groups:
            if isinstance(group, SlidingWindowBlockManager):
                group.remove_skipped_blocks(request)
        if not all(group.can_allocate_slots(request, num_new_tokens) for group in self.groups):
            return None
        new_block_ids = tuple(group.allocate_slots(request, num_new_tokens)
                              for group in self.groups)
        return new_block_ids if any(new_block_ids) else ()

    def free(self, request: Request) -> None:
        for group in self.groups:
            group.free(request)

    def cache_computed_blocks(self, request: Request) -> None:
        """No prefix caching here."""

    def rollback_slots(self, request: Request) -> None:
        for group in self.groups:
            group.rollback_slots(request)

    def reset_prefix_cache(self) -> bool:
        return self.num_free_blocks == self.num_blocks


def make_block_manager(
    num_blocks: int | list[int], block_size: int, enable_prefix_caching: bool,
    kv_cache_windows: list[int | None] | None,
) -> BlockManager | HybridBlockManager:
    """The plain BlockManager for models without sliding-window layers (one group), else a
    HybridBlockManager with a pool per group (pagoda/engine/kv_cache_groups.py)."""
    if not kv_cache_windows or all(window is None for window in kv_cache_windows):
        return BlockManager(num_blocks if isinstance(num_blocks, int) else num_blocks[0],
                            block_size, enable_prefix_caching)
    if enable_prefix_caching:
        logger.info("prefix caching is off: the model has sliding-window layers, whose KV "
                    "blocks out of the window are freed")
    counts = [num_blocks] * len(kv_cache_windows) if isinstance(num_blocks, int) else num_blocks
    return HybridBlockManager(list(counts), block_size, list(kv_cache_windows))
