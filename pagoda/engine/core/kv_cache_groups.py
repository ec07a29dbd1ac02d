"""KV-cache groups: the block manager the scheduler talks to, over one block pool per group.
Pure Python: no torch here.

Every model's layers fall into KV-cache groups, each with a block pool of its own (own block
ids, own KV tensors in the executor). A model whose layers all attend to the whole sequence
has one group: a list of one full-attention BlockManager (block_manager.py), prefix caching
and all. A model with sliding-window layers (Gemma 2/3 interleave them with global layers;
Mistral, Qwen2/3 or Mixtral may slide on every layer) has up to two:

    group 0  full attention     BlockManager (no prefix caching), grows with the sequence
    group 1  sliding window W   SlidingWindowBlockManager: only the blocks the window reaches

(a model whose every layer slides has the sliding group alone). All groups index a
request's blocks by position the same way, block i = positions [i*bs, (i+1)*bs), so a
request's tables have equal lengths in every group, and block ids always travel as a tuple
with one list per group.

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

Prefix caching is off for models with a sliding group (noted in the log): a cache hit would
need the windowed group's last window of blocks as well, which this manager does not keep.

One scheduling rule still: the scheduler asks `allocate_slots(request, n)`, and the
KVCacheManager answers for all groups at once (all get their blocks, or none does).
"""

from __future__ import annotations

import logging
from collections import deque

from pagoda.engine.core.block_manager import BlockManager
from pagoda.engine.core.kv_offload_index import KVOffloadIndex
from pagoda.engine.core.request import Request

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

    def can_allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: tuple = (),
    ) -> bool:
        assert not computed_blocks, "no prefix caching in a windowed pool"
        return self._num_new_blocks(request, num_new_tokens) <= self.num_free_blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: tuple = (),
    ) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens; None, changing nothing, if too few are free.
        (`computed_blocks`: always empty, a windowed pool has no prefix caching.)"""
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



    def cache_computed_blocks(self, request: Request) -> None:
        """No prefix caching in a windowed pool."""

    def reset_prefix_cache(self) -> bool:
        return self.num_free_blocks == self.num_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return 0  # no prefix caching: free blocks hold nothing worth finding


GroupPool = BlockManager | SlidingWindowBlockManager


class KVCacheManager:
    """The block manager the scheduler and the engine talk to: one pool per KV-cache group,
    in the runner's group order (a full-attention BlockManager, or a SlidingWindowBlockManager
    per window), answering for all of them at once. A model without sliding-window layers
    has a list of one pool; nothing here treats it differently.

    Block ids always come as a tuple with one list per group, all lists of equal length:

        block_ids(r)        ([b0, b1, b2],  [b5, b9, b4])    group 0 full, group 1 windowed
        allocate_slots(r)   ([b3],          [b6])            this step's new blocks
    """

    def __init__(
        self, num_blocks: list[int], block_size: int, windows: list[int | None],
        enable_prefix_caching: bool = True,
    ):
        assert len(num_blocks) == len(windows) >= 1, (num_blocks, windows)
        self.block_size = block_size
        self.windows = list(windows)
        sliding = any(window is not None for window in windows)
        if enable_prefix_caching and sliding:
            logger.info("prefix caching is off: the model has sliding-window layers, whose KV "
                        "blocks out of the window are freed")
        self.enable_prefix_caching = enable_prefix_caching and not sliding
        self.groups: list[GroupPool] = [
            BlockManager(n, block_size, self.enable_prefix_caching) if window is None
            else SlidingWindowBlockManager(n, block_size, window)
            for n, window in zip(num_blocks, windows)
        ]
        self.sliding_groups = [g for g in self.groups if isinstance(g, SlidingWindowBlockManager)]
        """The pools whose out-of-window blocks are freed before each allocation."""
        self.no_hits: tuple[tuple, ...] = tuple(() for _ in self.groups)
        """computed_blocks of a request without prefix-cache hits (nothing is appended)."""
        # Counters for metrics: prompt tokens looked up in / served from the prefix cache.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.kv_offload: KVOffloadIndex | None = None
        """The KV tiers (host memory, disk) below the pool; None: off (attach_kv_offload)."""

    def attach_kv_offload(self, kv_offload: KVOffloadIndex) -> None:
        """Put KV tiers below the pool: a model with one full-attention group only (a
        windowed group's blocks are freed out of the window, and have no prefix hashes)."""
        if self.windows != [None]:
            raise ValueError("the KV tiers (kv_offload_memory, kv_offload_dir) need a model "
                             "whose layers all attend to the whole sequence; this one has "
                             "sliding-window layers")
        self.kv_offload = kv_offload
        self.groups[0].kv_offload = kv_offload

    # ---- queries ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return sum(group.num_blocks for group in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return sum(group.num_free_blocks for group in self.groups)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (a walk of the free lists)."""
        return sum(group.num_cached_free_blocks for group in self.groups)

    @property
    def usage(self) -> float:
        """Fraction of all groups' blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's whole table, one fresh list per group."""
        return tuple(group.block_ids(request_id) for group in self.groups)

    # ---- prefix cache ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list, ...], int]:
        """Longest cached prefix of a request about to be admitted, in every group:
        (one list of hit blocks per group, num tokens); ((), 0) without prefix caching.
        Does not take the blocks; `allocate_slots` does. The last token is never a hit."""
        if not self.enable_prefix_caching:
            return (), 0
        per_group = [group.get_computed_blocks(request) for group in self.groups]
        num_hit_blocks = min(num_tokens for _, num_tokens in per_group) // self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_blocks * self.block_size
        return (tuple(hits[:num_hit_blocks] for hits, _ in per_group),
                num_hit_blocks * self.block_size)

    def get_kv_offload_hits(self, request: Request, num_pool_hit_tokens: int) -> list[int]:
        """Keys of the tier-held blocks right after the pool's hits (a one-group model with
        tiers; else empty): BlockManager.get_kv_offload_hits."""
        if self.kv_offload is None:
            return []
        return self.groups[0].get_kv_offload_hits(request, num_pool_hit_tokens)

    def allocate_loading(
        self, request: Request, computed_blocks: tuple[list, ...], num_load_blocks: int,
    ) -> list[int] | None:
        """Blocks for a request whose next blocks are loaded from the tiers this step (a
        one-group model with tiers): BlockManager.allocate_loading; the new block ids."""
        assert self.kv_offload is not None
        return self.groups[0].allocate_loading(
            request, list(computed_blocks[0]) if computed_blocks else [], num_load_blocks)

    def holds_blocks(self, request_id: str) -> bool:
        return any(group.request_blocks.get(request_id) for group in self.groups)

    def cached_block_items(self) -> list[tuple[int, int]]:
        """(hash, block id) of the prefix cache's blocks (no LoRA ones): what a graceful
        shutdown flushes to the disk tier. Empty without tiers."""
        return self.groups[0].cached_block_items() if self.kv_offload is not None else []

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks (see BlockManager's)."""
        for group in self.groups:
            group.cache_computed_blocks(request)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no request holds blocks."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for group in self.groups:
            group.reset_prefix_cache()  # (succeeds: every block of every group is free)
        return True

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: tuple[list, ...] = (),
    ) -> tuple[list[int], ...] | None:
        """Room for `num_new_tokens` more tokens in every group, after freeing the windowed
        blocks the request no longer needs. `computed_blocks`: get_computed_blocks's hits
        (a request being admitted; () for none). None, allocating nothing, if a group lacks
        blocks; else one list of new block ids per group (empty lists where none was new)."""
        for group in self.sliding_groups:
            group.remove_skipped_blocks(request)
        hits = computed_blocks or self.no_hits
        groups, last = self.groups, len(self.groups) - 1
        # All groups get their blocks, or none does: the others are checked first; the last
        # one's allocate_slots checks itself and changes nothing when it lacks blocks (so a
        # step of a one-group model checks its pool once, as the pool alone would).
        for i in range(last):
            if not groups[i].can_allocate_slots(request, num_new_tokens, hits[i]):
                return None
        last_new_ids = groups[last].allocate_slots(request, num_new_tokens, hits[last])
        if last_new_ids is None:
            return None
        return (*[groups[i].allocate_slots(request, num_new_tokens, hits[i])
                  for i in range(last)], last_new_ids)

    def free(self, request: Request) -> None:
        for group in self.groups:
            group.free(request)

    def rollback_slots(self, request: Request) -> None:
        """Free the blocks past request.num_computed_tokens in every group (speculative
        decoding's rejected proposals)."""
        for group in self.groups:
            group.rollback_slots(request)
