"""Paged KV-cache allocation with automatic prefix caching. Pure Python: no torch here.

One full-attention KV-cache group's pool; the scheduler talks to the KVCacheManager over
every group's pool (kv_cache_groups.py), which for most models is a list of one of these.

Blocks
    The cache holds `num_blocks` blocks of `block_size` token slots. Each block has a
    reference count (how many running requests use it) and, once full, a content hash.

Free list (O(1) LRU)
    Blocks with ref_count 0 sit in an ordered dict, least recently freed first. Allocation
    takes from the front; a freed block goes to the back. A free block keeps its hash (and
    stays findable by it) until it is taken for new content: lazy eviction. A request frees its
    blocks in reverse order so that the tails of prompts are evicted before their heads.

Prefix hashes
    hash(block i) = xxh3_128(hash(block i - 1), token ids of block i); only full blocks are
    hashed, so equal hashes mean equal whole prefixes. On admission a request takes the
    longest run of cached blocks matching its tokens, but never its last token: that token's
    logits are needed, so at least one token is always computed.

    tokens:   [ b0 full ][ b1 full ][ b2 full ][ b3 partial ]
    hashes:     h0 -------> h1 -------> h2        (none)

    A request that runs with a LoRA adapter chains from its adapter's own root
    (root_hash(lora_int_id); the base model's is ROOT_HASH), so the same tokens under two
    adapters, or under an adapter and the base, never share a block; requests of one
    adapter share as base requests do.

KV tiers (kv_offload_index.py, --kv-offload-memory / --kv-offload-dir)
    With `tiers` set, a cached block taken for new content (lazy eviction) is first saved to
    the tiers under its hash (the save runs before the step's forward overwrites it), unless
    it belongs to a LoRA request (its chain's root is a per-process adapter id). A request
    whose prefix goes on past the pool's hits in the tiers gets blocks for those hits
    (`allocate_loading`), loaded before the step's forward; they are registered as cached
    once the load is known to have succeeded (`cache_computed_blocks`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

from pagoda.engine.core.kv_offload_index import KVOffloadIndex
from pagoda.engine.core.request import Request

ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    """Stable content hash of one full block, chained to its parent's hash."""
    digest = xxhash.xxh3_128()
    digest.update(parent_hash.to_bytes(16, "little"))
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.intdigest()


def root_hash(lora_int_id: int = 0) -> int:
    """The parent hash of a request's first block: ROOT_HASH for the base model, a distinct
    stable value per LoRA adapter (its KV differs: the adapter changes k and v)."""
    if not lora_int_id:
        return ROOT_HASH
    digest = xxhash.xxh3_128()
    digest.update(b"pagoda-lora")
    digest.update(lora_int_id.to_bytes(8, "little"))
    return digest.intdigest()


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    lora: bool = False
    """The hash chains from a LoRA adapter's root: never saved to the KV tiers."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached_blocks: dict[int, KVBlock] = {}
        """Content hash -> block holding it (in use or free but not yet reused)."""
        self.request_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_block_tokens: dict[str, int] = {}
        """Per request: tokens whose blocks are already registered in the cache."""
        # Counters for metrics: prompt tokens looked up in / served from the prefix cache.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.kv_offload: KVOffloadIndex | None = None
        """The KV tiers below this pool (None: off); evicted cached blocks are saved there."""

    # ---- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix: a walk of the free list."""
        return sum(block.block_hash is not None for block in self.free_blocks.values())

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.request_blocks.get(request_id, [])]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------

    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes over every full block of its known tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        while (len(hashes) + 1) * bs <= request.num_tokens:
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else root_hash(request.lora_int_id)
            hashes.append(hash_block_tokens(parent, request.all_token_ids[start : start + bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of a request about to be admitted: (blocks, num tokens).

        Does not take the blocks; `allocate_slots` does. The last token is never a hit."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after request.num_computed_tokens.

        `computed_blocks` are prefix-cache hits for a request being admitted (its
        num_computed_tokens already counts them). Returns the ids of newly allocated blocks,
        or None, changing nothing, when too few blocks are free.
        """
        computed_blocks = computed_blocks or []
        if not self.can_allocate_slots(request, num_new_tokens, computed_blocks):
            return None
        held = self.request_blocks.get(request.request_id, [])
        total_tokens = request.num_computed_tokens + num_new_tokens
        num_new_blocks = self.num_blocks_needed(total_tokens) - len(held) - len(computed_blocks)
        held = self.request_blocks.setdefault(request.request_id, held)
        for block in computed_blocks:
            self._take(block)
            held.append(block)
        new_blocks = [self._pop_free_block() for _ in range(max(num_new_blocks, 0))]
        held.extend(new_blocks)
        if not self.num_cached_block_tokens.get(request.request_id):
            self.num_cached_block_tokens[request.request_id] = len(computed_blocks) * self.block_size
        if self.enable_prefix_caching:
            # Register every block that will be full once this step runs (its KV is written
            # in this step's forward, before any later request in the batch reads it).
            self._cache_full_blocks(request, min(total_tokens, request.num_tokens))
        return [b.block_id for b in new_blocks]

    def can_allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
    ) -> bool:
        """Whether `allocate_slots` with these arguments would succeed (changes nothing)."""
        computed_blocks = computed_blocks or []
        held = self.request_blocks.get(request.request_id, [])
        total_tokens = request.num_computed_tokens + num_new_tokens
        num_new_blocks = self.num_blocks_needed(total_tokens) - len(held) - len(computed_blocks)
        # Hit blocks that sit in the free list stop being free once taken.
        num_hits_free = sum(1 for b in computed_blocks if b.ref_count == 0)
        return max(num_new_blocks, 0) + num_hits_free <= self.num_free_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        self._update_block_hashes(request)
        held = self.request_blocks[request.request_id]
        start = self.num_cached_block_tokens[request.request_id] // self.block_size
        end = num_tokens // self.block_size
        for i in range(start, end):
            block, block_hash = held[i], request.block_hashes[i]
            if block.block_hash is None:
                block.block_hash = block_hash
                block.lora = request.lora_int_id != 0
                # Keep the first holder of a hash: an equal block stays uncached and is plain.
                self.cached_blocks.setdefault(block_hash, block)
        self.num_cached_block_tokens[request.request_id] = max(start, end) * self.block_size

    def _take(self, block: KVBlock) -> None:
        if block.ref_count == 0:
            del self.free_blocks[block.block_id]
        block.ref_count += 1

    def _pop_free_block(self) -> KVBlock:
        _, block = self.free_blocks.popitem(last=False)
        if block.block_hash is not None:
            # Lazy eviction: the block's old content is overwritten now (after the step's
            # saves: the tiers keep it).
            if self.kv_offload is not None and not block.lora:
                self.kv_offload.save_evicted(block.block_hash, block.block_id)
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block

    # ---- KV tiers --------------------------------------------------------------------------

    def get_kv_offload_hits(self, request: Request, num_pool_hit_tokens: int) -> list[int]:
        """Keys of the blocks after the pool's hits that the tiers hold, in order (a run;
        never the block of the request's last token). Empty without tiers, for a LoRA
        request, or without prefix caching."""
        if self.kv_offload is None or not self.enable_prefix_caching or request.lora_int_id:
            return []
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        keys = []
        for block_hash in request.block_hashes[num_pool_hit_tokens // self.block_size:
                                               max_hit_blocks]:
            if block_hash not in self.kv_offload.keys:
                break
            keys.append(block_hash)
        return keys

    def allocate_loading(
        self, request: Request, computed_blocks: list[KVBlock], num_load_blocks: int,
    ) -> list[int] | None:
        """Take the pool's hits and `num_load_blocks` fresh blocks after them, which the
        step's loads fill (registered as cached later, by cache_computed_blocks, once the
        request's num_computed_tokens counts them). None, changing nothing, if too few
        blocks are free. The request holds no blocks yet."""
        assert request.request_id not in self.request_blocks, request
        num_hits_free = sum(1 for b in computed_blocks if b.ref_count == 0)
        if num_load_blocks + num_hits_free > self.num_free_blocks:
            return None
        held = self.request_blocks.setdefault(request.request_id, [])
        for block in computed_blocks:
            self._take(block)
            held.append(block)
        new_blocks = [self._pop_free_block() for _ in range(num_load_blocks)]
        held.extend(new_blocks)
        self.num_cached_block_tokens[request.request_id] = len(computed_blocks) * self.block_size
        return [b.block_id for b in new_blocks]

    def holds_blocks(self, request_id: str) -> bool:
        return bool(self.request_blocks.get(request_id))

    def cached_block_items(self) -> list[tuple[int, int]]:
        """(hash, block id) of every block the prefix cache holds, LoRA ones excepted, most
        recently used first as far as the free list knows (what a shutdown flushes)."""
        free_order = list(reversed(self.free_blocks))
        free = set(free_order)
        in_use = [b for b in self.cached_blocks.values() if b.block_id not in free]
        ordered = in_use + [self.blocks[i] for i in free_order]
        return [(b.block_hash, b.block_id) for b in ordered
                if b.block_hash is not None and not b.lora
                and self.cached_blocks.get(b.block_hash) is b]

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so tails are evicted before heads."""
        blocks = self.request_blocks.pop(request.request_id, [])
        self.num_cached_block_tokens.pop(request.request_id, None)
        for block in reversed(blocks):
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} freed twice"
            if block.ref_count == 0:
                if block.block_hash is None or not self.enable_prefix_caching:
                    block.block_hash = None
                self.free_blocks[block.block_id] = block

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose tokens are all computed (speculative
        decoding: accepted proposals become tokens after their KV was written)."""
        if self.enable_prefix_caching and request.request_id in self.request_blocks:
            self._cache_full_blocks(request, request.num_computed_tokens)

    def rollback_slots(self, request: Request) -> None:
        """Free the blocks past request.num_computed_tokens (speculative decoding: slots
        allocated for proposals that were rejected). They are fresh blocks, unhashed (only
        blocks full of the request's real tokens, all computed, are hashed), and go back to
        the front of the free list, tail first: the held blocks and the free list are then
        as if the slots had never been allocated."""
        held = self.request_blocks.get(request.request_id)
        if not held:
            return
        keep = self.num_blocks_needed(request.num_computed_tokens)
        while len(held) > keep:
            block = held.pop()
            assert block.ref_count == 1 and block.block_hash is None, block
            block.ref_count = 0
            self.free_blocks[block.block_id] = block
            self.free_blocks.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no request holds blocks."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.cached_blocks.clear()
        for block in self.blocks:
            block.block_hash = None
        return True
