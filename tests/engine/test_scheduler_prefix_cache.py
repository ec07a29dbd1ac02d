"""Prefix caching as the scheduler uses it: cache hits at admission, shared prefixes within a
step, hits kept across a failed admission (no model; see tests/engine/scheduler_helpers.py)."""

from __future__ import annotations

from pagoda.engine.core.request import RequestStatus
from tests.engine.scheduler_helpers import (
    add,
    batch,
    block_tables,
    full_pool,
    make_request,
    make_scheduler,
    new_blocks,
    step,
)


def test_second_request_with_the_same_prompt_starts_from_the_cache():
    sched = make_scheduler()
    prompt = list(range(100, 110))
    a = make_request("a", prompt)
    add(sched, a)
    step(sched)
    b = make_request("b", prompt)
    add(sched, b)
    out, _ = step(sched)
    assert batch(out) == [("a", 1), ("b", 2)]
    assert block_tables(sched, out) == [([0, 1, 2],), ([0, 1, 3],)]
    assert out.new_block_ids == {}  # a needs no block; b is new: its whole table is sent
    assert new_blocks(sched, out) == {"b": ([0, 1, 3],)}
    assert b.num_cached_tokens == 8
    assert a.num_cached_tokens == 0
    assert [blk.ref_count for blk in full_pool(sched).blocks[:4]] == [2, 2, 1, 1]


def test_requests_admitted_in_the_same_step_share_the_prefix():
    # Blocks are registered when allocated: b reads what a writes earlier in the same forward.
    sched = make_scheduler()
    prompt = list(range(100, 110))
    add(sched, make_request("a", prompt), make_request("b", prompt))
    out, _ = step(sched)
    assert batch(out) == [("a", 10), ("b", 2)]
    assert block_tables(sched, out) == [([0, 1, 2],), ([0, 1, 3],)]


def test_a_request_that_did_not_fit_keeps_its_cache_hits_for_the_next_try():
    sched = make_scheduler(num_blocks=5)
    prompt = list(range(100, 109))
    a = make_request("a", prompt, max_tokens=1)
    c = make_request("c", 4, max_tokens=3)
    add(sched, a, c)
    assert block_tables(sched, step(sched)[0]) == [([0, 1, 2],), ([3],)]  # a finishes: free list 4, 2, 1, 0
    b = make_request("b", prompt[:8] + list(range(200, 208)))  # hits blocks 0, 1
    add(sched, b)
    out, _ = step(sched)
    # c's decode took block 4; b needs its 2 hits and 2 new blocks, only 3 are free.
    assert batch(out) == [("c", 1)]
    assert new_blocks(sched, out) == {"c": ([4],)}
    assert b.status == RequestStatus.WAITING
    assert b.num_computed_tokens == 0
    assert [blk.ref_count for blk in full_pool(sched).blocks] == [0, 0, 0, 1, 1]
    assert batch(step(sched)[0]) == [("c", 1)]  # c finishes
    out, _ = step(sched)
    assert batch(out) == [("b", 8)]
    assert block_tables(sched, out) == [([0, 1, 2, 4],)]
    assert b.num_cached_tokens == 8


def test_prompt_logprobs_requests_compute_every_prompt_token():
    sched = make_scheduler()
    prompt = list(range(100, 110))
    add(sched, make_request("a", prompt))
    step(sched)
    b = make_request("b", prompt, prompt_logprobs=1)
    add(sched, b)
    out, _ = step(sched)
    assert batch(out) == [("a", 1), ("b", 10)]
    assert b.num_cached_tokens == 0


def test_prefix_caching_disabled_computes_every_prompt_token():
    sched = make_scheduler(enable_prefix_caching=False)
    prompt = list(range(100, 110))
    add(sched, make_request("a", prompt), make_request("b", prompt))
    out, _ = step(sched)
    assert batch(out) == [("a", 10), ("b", 10)]
    assert block_tables(sched, out) == [([0, 1, 2],), ([3, 4, 5],)]
