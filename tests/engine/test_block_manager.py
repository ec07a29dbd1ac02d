"""Block manager unit tests: exact block ids, ref counts, prefix hits, LRU (hashes: test_block_hashing.py).

Tiny caches (block_size 4, a handful of blocks), no model, no torch. Free-list order matters
in every test: a fresh manager hands out 0, 1, 2, ...; freed blocks go to the back, tail first.
"""

from __future__ import annotations

import pytest

from pagoda.engine.core.block_manager import BlockManager
from tests.engine.block_manager_helpers import (
    BS,
    PROMPT_A,
    admit,
    finish_step,
    make_request,
    ref_counts,
)

# ---- allocation ----------------------------------------------------------------------------


def test_blocks_handed_out_in_free_list_order_with_ref_count_one():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", PROMPT_A)
    assert admit(bm, a) == [0, 1, 2]
    b = make_request("b", [1, 2, 3, 4, 5])
    assert admit(bm, b) == [3, 4]
    assert bm.block_ids("a") == [0, 1, 2]
    assert bm.block_ids("b") == [3, 4]
    assert ref_counts(bm) == [1, 1, 1, 1, 1, 0, 0, 0]
    assert bm.num_free_blocks == 3
    assert list(bm.free_blocks) == [5, 6, 7]
    assert bm.block_ids("unknown") == []


def test_decode_takes_a_new_block_only_when_the_last_one_is_full():
    bm = BlockManager(num_blocks=4, block_size=BS)
    r = make_request("r", [1, 2, 3])
    assert admit(bm, r) == [0]
    finish_step(r, 3, sampled=4)  # 4 tokens, 3 computed: token 4 still fits in block 0
    assert bm.allocate_slots(r, 1) == []
    finish_step(r, 1, sampled=5)  # 5 tokens, 4 computed: token 5 needs block 1
    assert bm.allocate_slots(r, 1) == [1]
    finish_step(r, 1, sampled=6)
    assert bm.allocate_slots(r, 1) == []
    assert bm.block_ids("r") == [0, 1]
    assert bm.num_free_blocks == 2


def test_num_blocks_needed_rounds_up():
    bm = BlockManager(num_blocks=2, block_size=BS)
    assert [bm.num_blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_num_blocks_must_be_positive():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=BS)


def test_allocate_returns_none_and_changes_nothing_when_out_of_blocks():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    assert admit(bm, a) == [0, 1]
    cached_before = dict(bm.cached_blocks)
    b = make_request("b", [7, 8, 9, 10, 11, 12, 13, 14, 15])  # needs 3 blocks, 1 free
    assert bm.allocate_slots(b, b.num_tokens) is None
    assert bm.num_free_blocks == 1
    assert list(bm.free_blocks) == [2]
    assert ref_counts(bm) == [1, 1, 0]
    assert bm.block_ids("b") == []
    assert "b" not in bm.request_blocks
    assert "b" not in bm.num_cached_block_tokens
    assert bm.cached_blocks == cached_before
    assert all(block.block_hash is None for block in bm.blocks[1:])
    # Exactly enough still works afterwards.
    c = make_request("c", [7, 8, 9])
    assert bm.allocate_slots(c, 3) == [2]
    assert bm.num_free_blocks == 0


def test_allocate_with_free_cache_hits_counts_the_hits_against_the_free_list():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(bm, a) == [0, 1, 2]
    bm.free(a)
    assert list(bm.free_blocks) == [3, 2, 1, 0]
    x = make_request("x", [50, 51, 52, 53, 54, 55, 56, 57])
    assert admit(bm, x) == [3, 2]  # evicts a's partial tail block 2 (and unused 3)
    assert list(bm.free_blocks) == [1, 0]
    # b hits a's blocks 0 and 1 (free), then needs 2 more: 2 hits + 2 new > 2 free.
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 60, 61, 62, 63, 64])
    hits, num_hit_tokens = bm.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert num_hit_tokens == 8
    b.num_computed_tokens = num_hit_tokens
    assert bm.allocate_slots(b, b.num_tokens - num_hit_tokens, hits) is None
    assert list(bm.free_blocks) == [1, 0]
    assert ref_counts(bm) == [0, 0, 1, 1]
    assert "b" not in bm.request_blocks
    assert bm.cached_blocks[b.block_hashes[0]] is bm.blocks[0]
    assert bm.cached_blocks[b.block_hashes[1]] is bm.blocks[1]


def test_usage_counts_only_held_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS)
    assert bm.usage == 0.0
    a = make_request("a", [1, 2, 3, 4])
    admit(bm, a)
    assert bm.usage == pytest.approx(0.25)
    b = make_request("b", [5, 6, 7, 8, 9])
    admit(bm, b)
    assert bm.usage == pytest.approx(0.75)
    bm.free(a)
    bm.free(b)
    # Blocks a and b filled stay cached, but free cached blocks count as free.
    assert bm.cached_blocks
    assert bm.usage == 0.0


# ---- prefix cache hits ---------------------------------------------------------------------


def test_second_request_with_same_prompt_shares_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", PROMPT_A)
    admit(bm, a)
    b = make_request("b", PROMPT_A)
    hits, num_hit_tokens = bm.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert num_hit_tokens == 8
    b.num_computed_tokens = 8
    assert bm.allocate_slots(b, 2, hits) == [3]
    assert bm.block_ids("b") == [0, 1, 3]
    assert ref_counts(bm)[:4] == [2, 2, 1, 1]
    assert bm.num_free_blocks == 4
    bm.free(a)
    assert ref_counts(bm)[:4] == [1, 1, 0, 1]
    assert list(bm.free_blocks) == [4, 5, 6, 7, 2]  # shared blocks stay held by b
    bm.free(b)
    assert ref_counts(bm) == [0] * 8
    assert list(bm.free_blocks) == [4, 5, 6, 7, 2, 3, 1, 0]


def test_last_prompt_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # exactly two full blocks
    a = make_request("a", prompt)
    admit(bm, a)
    assert len(bm.cached_blocks) == 2
    b = make_request("b", prompt)
    hits, num_hit_tokens = bm.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0]
    assert num_hit_tokens == 4
    b.num_computed_tokens = 4
    # Block 1 is a hit too in content, but b recomputes its last token into a new block.
    assert bm.allocate_slots(b, 4, hits) == [2]
    assert bm.block_ids("b") == [0, 2]
    # b's block 2 holds the same content as block 1: the first holder stays the cached one.
    assert bm.cached_blocks[b.block_hashes[1]] is bm.blocks[1]


def test_a_one_block_prompt_gets_no_hit():
    bm = BlockManager(num_blocks=4, block_size=BS)
    admit(bm, make_request("a", [1, 2, 3, 4]))
    assert bm.get_computed_blocks(make_request("b", [1, 2, 3, 4])) == ([], 0)


def test_hits_stop_at_the_first_miss():
    bm = BlockManager(num_blocks=8, block_size=BS)
    admit(bm, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]))
    # Block 1 differs; block 2 has a's tokens but a different parent, so no hit either.
    b = make_request("b", [1, 2, 3, 4, 0, 6, 7, 8, 9, 10, 11, 12, 13])
    hits, num_hit_tokens = bm.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0]
    assert num_hit_tokens == 4


def test_hits_are_a_contiguous_run_from_the_first_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", PROMPT_A)
    admit(bm, a)
    bm.free(a)
    del bm.cached_blocks[a.block_hashes[0]]  # as if block 0 had been evicted
    assert a.block_hashes[1] in bm.cached_blocks
    assert bm.get_computed_blocks(make_request("b", PROMPT_A)) == ([], 0)


def test_prefix_cache_counters_count_prompt_tokens():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", PROMPT_A)
    admit(bm, a)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10, 0)
    b = make_request("b", PROMPT_A)
    admit(bm, b)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (20, 8)
    c = make_request("c", PROMPT_A[:4] + [0, 0, 0, 0, 0])
    admit(bm, c)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (29, 12)


def test_prefix_caching_disabled_gives_no_hits_and_no_hashes():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", PROMPT_A)
    assert admit(bm, a) == [0, 1, 2]
    assert bm.cached_blocks == {}
    assert all(block.block_hash is None for block in bm.blocks)
    b = make_request("b", PROMPT_A)
    assert bm.get_computed_blocks(b) == ([], 0)
    b.num_computed_tokens = 0
    assert bm.allocate_slots(b, 10) == [3, 4, 5]
    bm.free(a)
    c = make_request("c", PROMPT_A)
    assert bm.get_computed_blocks(c) == ([], 0)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)


# ---- lazy eviction and LRU order -----------------------------------------------------------


def test_freed_blocks_keep_their_hash_and_can_be_hit_again():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", PROMPT_A)
    admit(bm, a)
    hashes = list(a.block_hashes)
    bm.free(a)
    assert bm.num_free_blocks == 8
    assert ref_counts(bm) == [0] * 8
    assert [bm.blocks[0].block_hash, bm.blocks[1].block_hash] == hashes
    assert bm.cached_blocks == {hashes[0]: bm.blocks[0], hashes[1]: bm.blocks[1]}
    assert list(bm.free_blocks) == [3, 4, 5, 6, 7, 2, 1, 0]
    b = make_request("b", PROMPT_A)
    assert admit(bm, b) == [3]
    assert bm.block_ids("b") == [0, 1, 3]
    assert b.num_computed_tokens == 8
    assert ref_counts(bm)[:4] == [1, 1, 0, 1]
    assert list(bm.free_blocks) == [4, 5, 6, 7, 2]


def test_free_order_evicts_tails_first_and_reused_block_loses_its_hash():
    bm = BlockManager(num_blocks=3, block_size=BS)
    prompt = list(range(1, 13))  # three full blocks
    a = make_request("a", prompt)
    assert admit(bm, a) == [0, 1, 2]
    old_tail_hash = bm.blocks[2].block_hash
    assert old_tail_hash == a.block_hashes[2]
    bm.free(a)
    assert list(bm.free_blocks) == [2, 1, 0]  # reverse order: the tail is evicted first
    c = make_request("c", [90, 91, 92, 93])
    assert admit(bm, c) == [2]  # takes a's tail block
    assert bm.blocks[2].block_hash == c.block_hashes[0] != old_tail_hash
    assert old_tail_hash not in bm.cached_blocks
    assert bm.cached_blocks[c.block_hashes[0]] is bm.blocks[2]
    bm.free(c)
    # A longer prompt with a's 12 tokens as prefix could hit 3 blocks; the tail is gone.
    b = make_request("b", prompt + [13])
    hits, num_hit_tokens = bm.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert num_hit_tokens == 8


def test_free_list_is_lru_across_requests():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    b = make_request("b", [9, 10, 11, 12, 13, 14, 15, 16])
    assert admit(bm, a) == [0, 1]
    assert admit(bm, b) == [2, 3]
    bm.free(b)
    bm.free(a)
    assert list(bm.free_blocks) == [4, 5, 3, 2, 1, 0]
    c = make_request("c", [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32])
    assert admit(bm, c) == [4, 5, 3, 2]  # never-used blocks first, then b's (freed first)
    assert b.block_hashes[0] not in bm.cached_blocks
    assert b.block_hashes[1] not in bm.cached_blocks
    assert bm.cached_blocks[a.block_hashes[0]] is bm.blocks[0]
    assert bm.cached_blocks[a.block_hashes[1]] is bm.blocks[1]


def test_hit_on_a_free_block_refreshes_its_lru_position():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert admit(bm, a) == [0, 1]
    bm.free(a)
    assert list(bm.free_blocks) == [2, 3, 1, 0]
    b = make_request("b", [1, 2, 3, 4, 6])
    assert admit(bm, b) == [2]  # hits block 0
    bm.free(b)
    assert list(bm.free_blocks) == [3, 1, 2, 0]  # block 0 is now the most recently freed


def test_reset_prefix_cache_only_when_nothing_is_held():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    assert bm.reset_prefix_cache() is False
    assert bm.cached_blocks
    bm.free(a)
    assert bm.reset_prefix_cache() is True
    assert bm.cached_blocks == {}
    assert all(block.block_hash is None for block in bm.blocks)
    assert bm.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([], 0)
