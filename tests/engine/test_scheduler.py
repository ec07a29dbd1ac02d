"""Scheduler unit tests without a model: the engine loop is simulated.

Each simulated step is schedule -> "forward" -> update_from_output, where a request that
reaches its last token this step gets a sampled token and a partial prefill chunk gets None.
Tiny caches (block_size 4, a handful of blocks) make block ids and preemptions exact.
"""

from __future__ import annotations

import pytest

from pagoda.engine.core.request import Request, RequestStatus
from tests.engine.scheduler_helpers import (
    TOKEN,
    add,
    assert_all_free,
    batch,
    block_tables,
    make_request,
    make_scheduler,
    new_blocks,
    run_to_completion,
    runner_output,
    step,
)

# ---- token budget, chunked prefill, batch composition --------------------------------------


def test_chunked_prefill_splits_a_prompt_under_the_budget():
    sched = make_scheduler(max_num_batched_tokens=4)
    r = make_request("r", 10, max_tokens=3)
    add(sched, r)
    expected = [
        ([("r", 4)], [0], [0], 4, []),
        ([("r", 4)], [1], [0, 1], 8, []),
        ([("r", 2)], [2], [0, 1, 2], 10, [TOKEN]),
        ([("r", 1)], [], [0, 1, 2], 11, [TOKEN, TOKEN]),
    ]
    for scheduled, new_block_ids, block_table, computed, outputs in expected:
        out, new_tokens = step(sched)
        assert batch(out) == scheduled
        assert new_blocks(sched, out) == ({"r": (new_block_ids,)} if new_block_ids else {})
        assert block_tables(sched, out) == [(block_table,)]  # one group
        assert r.num_computed_tokens == computed
        assert r.output_token_ids == outputs
        assert new_tokens == ([(r, TOKEN)] if outputs else [])
        assert r.status == RequestStatus.RUNNING
    out, new_tokens = step(sched)
    assert batch(out) == [("r", 1)]
    assert new_tokens == [(r, TOKEN)]
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [TOKEN] * 3
    out = sched.schedule()
    assert out.is_empty
    assert out.finished_request_ids == ["r"]
    assert_all_free(sched)


def test_partial_chunk_samples_nothing_even_if_given_a_token():
    # The engine passes None for partial chunks; update_from_output must only advance them.
    sched = make_scheduler(max_num_batched_tokens=4)
    r = make_request("r", 6)
    add(sched, r)
    out = sched.schedule()
    assert sched.update_from_output(out, runner_output(out, [None])) == []
    assert (r.num_computed_tokens, r.num_tokens, r.output_token_ids) == (4, 6, [])
    out = sched.schedule()
    assert out.num_scheduled_tokens == [2]
    assert sched.update_from_output(out, runner_output(out, [5])) == [(r, 5)]
    assert (r.num_computed_tokens, r.num_tokens, r.output_token_ids) == (6, 7, [5])


def test_running_decodes_come_first_then_new_prefills_fill_the_budget():
    sched = make_scheduler(max_num_batched_tokens=6)
    a = make_request("a", 4, max_tokens=5)
    b = make_request("b", 10, max_tokens=5)
    add(sched, a, b)
    assert batch(step(sched)[0]) == [("a", 4), ("b", 2)]
    assert batch(step(sched)[0]) == [("a", 1), ("b", 5)]
    out, new_tokens = step(sched)
    assert batch(out) == [("a", 1), ("b", 3)]
    assert [(r.request_id, t) for r, t in new_tokens] == [("a", TOKEN), ("b", TOKEN)]
    c = make_request("c", 8)
    add(sched, c)
    out, _ = step(sched)
    assert batch(out) == [("a", 1), ("b", 1), ("c", 4)]
    assert out.total_num_scheduled_tokens == 6
    assert batch(step(sched)[0]) == [("a", 1), ("b", 1), ("c", 4)]


def test_budget_used_up_by_running_requests_admits_nobody():
    sched = make_scheduler(max_num_batched_tokens=4)
    a = make_request("a", 12)
    add(sched, a)
    step(sched)
    b = make_request("b", 1)
    add(sched, b)
    assert batch(step(sched)[0]) == [("a", 4)]
    assert b.status == RequestStatus.WAITING
    assert batch(step(sched)[0]) == [("a", 4)]
    assert batch(step(sched)[0]) == [("a", 1), ("b", 1)]


def test_without_chunked_prefill_a_prompt_waits_for_room_for_all_of_it():
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a = make_request("a", 6)
    b = make_request("b", 6)
    add(sched, a, b)
    assert batch(step(sched)[0]) == [("a", 6)]
    assert b.status == RequestStatus.WAITING
    assert batch(step(sched)[0]) == [("a", 1), ("b", 6)]


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    a = make_request("a", 3, max_tokens=1)
    b = make_request("b", 3, max_tokens=3)
    c = make_request("c", 3, max_tokens=1)
    add(sched, a, b, c)
    out, _ = step(sched)
    assert batch(out) == [("a", 3), ("b", 3)]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert c.status == RequestStatus.WAITING
    out, _ = step(sched)  # a finished, so c takes its seat
    assert batch(out) == [("b", 1), ("c", 3)]
    assert out.finished_request_ids == ["a"]
    assert sched.num_running == 1  # c finished after its one token
    assert batch(step(sched)[0]) == [("b", 1)]
    assert_all_free(sched)


def test_max_num_seqs_one_runs_requests_one_by_one():
    sched = make_scheduler(max_num_seqs=1)
    add(sched, *(make_request(rid, 2, max_tokens=2) for rid in "abc"))
    assert run_to_completion(sched) == [
        [("a", 2)], [("a", 1)], [("b", 2)], [("b", 1)], [("c", 2)], [("c", 1)],
    ]


# ---- ordering policies ---------------------------------------------------------------------


def _admission_order(policy: str, specs: list[tuple[str, int, float]]) -> list[str]:
    sched = make_scheduler(max_num_seqs=1, policy=policy)
    for rid, priority, arrival in specs:
        add(sched, make_request(rid, 2, max_tokens=1, priority=priority, arrival_time=arrival))
    order = []
    for scheduled in run_to_completion(sched):
        order += [rid for rid, _ in scheduled]
    return order


def test_fcfs_admits_in_queue_order_whatever_the_priority():
    specs = [("a", 5, 1.0), ("b", 0, 2.0), ("c", 1, 3.0)]
    assert _admission_order("fcfs", specs) == ["a", "b", "c"]


def test_priority_policy_admits_lowest_value_first_then_earliest_arrival():
    specs = [("a", 5, 1.0), ("b", 0, 4.0), ("c", 1, 2.0), ("d", 0, 3.0)]
    assert _admission_order("priority", specs) == ["d", "b", "c", "a"]


def test_priority_policy_orders_admissions_within_one_step():
    sched = make_scheduler(max_num_batched_tokens=8, policy="priority")
    add(
        sched,
        make_request("a", 4, priority=2),
        make_request("b", 4, priority=0),
        make_request("c", 4, priority=1),
    )
    out, _ = step(sched)
    assert batch(out) == [("b", 4), ("c", 4)]
    assert [r.request_id for r in sched.waiting] == ["a"]
    # Running requests keep their admission order; a is admitted behind them.
    assert batch(step(sched)[0]) == [("b", 1), ("c", 1), ("a", 4)]


# ---- preemption ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "running_order", "victim", "after"),
    [
        # fcfs: the latest arrival (c) goes, whatever its priority.
        ("fcfs", ["a", "b", "c"], "c", [("a", 1), ("b", 1)]),
        # priority: the largest priority value (b) goes, although c arrived later.
        ("priority", ["a", "c", "b"], "b", [("a", 1), ("c", 1)]),
    ],
)
def test_preemption_victim_and_its_state(policy, running_order, victim, after):
    sched = make_scheduler(num_blocks=6, policy=policy)
    a = make_request("a", 7, priority=0, arrival_time=1.0)
    b = make_request("b", 7, priority=5, arrival_time=2.0)
    c = make_request("c", 7, priority=1, arrival_time=3.0)
    add(sched, a, b, c)
    out, _ = step(sched)
    assert [rid for rid, _ in batch(out)] == running_order
    assert block_tables(sched, out) == [([0, 1],), ([2, 3],), ([4, 5],)]
    out, _ = step(sched)  # 8 tokens each: the last token still fits in block 1
    assert out.preempted_request_ids == []
    assert sched.block_manager.num_free_blocks == 0
    # 9 tokens each: every request needs a third block and none is free.
    out, _ = step(sched)
    assert out.preempted_request_ids == [victim]
    assert batch(out) == after
    # The victim's blocks were [4, 5], freed tail first, then handed out in that order.
    assert new_blocks(sched, out) == {after[0][0]: ([5],), after[1][0]: ([4],)}
    v = {"a": a, "b": b, "c": c}[victim]
    assert v.status == RequestStatus.PREEMPTED
    assert v.num_computed_tokens == 0
    assert v.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert v.output_token_ids == [TOKEN, TOKEN]  # generated tokens are kept
    assert v not in sched.running
    assert list(sched.waiting) == [v]
    assert sched.requests[victim] is v
    assert sched.block_manager.block_ids(victim) == ([],)
    assert sched.block_manager.num_free_blocks == 0


def test_preempted_request_goes_to_the_front_and_nobody_is_admitted_that_step():
    # Priority policy, prefix caching off, so that the recompute is the whole request.
    sched = make_scheduler(num_blocks=4, policy="priority", enable_prefix_caching=False)
    a = make_request("a", 7, max_tokens=3, priority=0)
    b = make_request("b", 7, max_tokens=4, priority=1)
    add(sched, a, b)

    def sample(r: Request) -> int:
        return 10 + r.num_tokens  # depends on the position only: recompute gives the same

    assert batch(step(sched, sample)[0]) == [("a", 7), ("b", 7)]
    assert batch(step(sched, sample)[0]) == [("a", 1), ("b", 1)]
    c = make_request("c", 2, max_tokens=1, priority=0)
    add(sched, c)
    out, _ = step(sched, sample)
    assert out.preempted_request_ids == ["b"]
    assert batch(out) == [("a", 1)]
    # c would fit (budget and a free block), but a step that preempted admits nobody.
    assert a.status == RequestStatus.FINISHED_LENGTH  # a's 3 blocks were freed after the step
    assert sched.block_manager.num_free_blocks == 4
    assert c.status == RequestStatus.WAITING
    assert list(sched.waiting) == [b, c]
    # Next step: c (priority 0) before b (priority 1); b is recomputed from token 0.
    out, _ = step(sched, sample)
    assert batch(out) == [("c", 2), ("b", 9)]
    assert out.finished_request_ids == ["a"]
    assert out.preempted_request_ids == []
    assert b.status == RequestStatus.RUNNING
    assert b.num_cached_tokens == 0
    assert b.output_token_ids == [17, 18, 19]
    out, _ = step(sched, sample)
    assert batch(out) == [("b", 1)]
    assert out.finished_request_ids == ["c"]
    assert b.output_token_ids == [17, 18, 19, 20]
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert b.num_preemptions == 1
    assert sched.schedule().finished_request_ids == ["b"]
    assert_all_free(sched)


def test_fcfs_preempted_request_waits_in_front_of_later_arrivals():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    a = make_request("a", 7, max_tokens=4)
    b = make_request("b", 7, max_tokens=3)
    add(sched, a, b)
    step(sched)
    step(sched)
    c = make_request("c", 1, max_tokens=1)
    add(sched, c)
    out, _ = step(sched)
    assert out.preempted_request_ids == ["b"]
    assert list(sched.waiting) == [b, c]
    # b (9 tokens, 3 blocks) does not fit in the one free block, and c may not jump it.
    out, _ = step(sched)
    assert batch(out) == [("a", 1)]
    assert out.preempted_request_ids == []
    assert c.status == RequestStatus.WAITING
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert batch(step(sched)[0]) == [("b", 9), ("c", 1)]
    assert b.output_token_ids == [TOKEN] * 3  # the third one came from the recompute
    assert b.status == c.status == RequestStatus.FINISHED_LENGTH
    assert sched.schedule().finished_request_ids == ["b", "c"]
    assert_all_free(sched)


def test_preempted_request_reuses_its_cached_blocks_when_they_survive():
    sched = make_scheduler(num_blocks=4)
    a = make_request("a", 7, max_tokens=3)
    b = make_request("b", 7, max_tokens=4)
    add(sched, a, b)
    step(sched)
    step(sched)
    out, _ = step(sched)
    assert out.preempted_request_ids == ["b"]
    assert new_blocks(sched, out) == {"a": ([3],)}  # b's tail block: its hash is gone now
    assert a.status == RequestStatus.FINISHED_LENGTH
    out, _ = step(sched)
    # b's head block 2 is still cached: 4 of its 9 tokens are hits, 5 are recomputed.
    assert batch(out) == [("b", 5)]
    assert block_tables(sched, out) == [([2, 3, 1],)]
    assert out.new_requests[0].num_computed_tokens == 4  # resumed: sent whole, as new
    assert new_blocks(sched, out) == {"b": ([2, 3, 1],)}
    assert b.num_computed_tokens == 9
    # Queries count each admission's tokens (7 + 7, then b's 9 again); hits b's 4.
    bm = sched.block_manager
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (23, 4)
    run_to_completion(sched)
    assert b.output_token_ids == [TOKEN] * 4
    assert_all_free(sched)


def test_a_request_that_cannot_grow_preempts_itself_not_an_already_scheduled_one():
    sched = make_scheduler(num_blocks=4, policy="priority")
    a = make_request("a", 5, priority=9, arrival_time=1.0)
    add(sched, a)
    step(sched)  # a alone: blocks [0, 1]
    b = make_request("b", 7, priority=0, arrival_time=2.0)
    add(sched, b)
    assert batch(step(sched)[0]) == [("a", 1), ("b", 7)]  # b: blocks [2, 3]
    assert batch(step(sched)[0]) == [("a", 1), ("b", 1)]
    # Now a's 8th token still fits its 2 blocks, b's 9th needs a third and none is free.
    # a has the worse priority, but it is already scheduled this step: b preempts itself.
    out, _ = step(sched)
    assert batch(out) == [("a", 1)]
    assert out.preempted_request_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED
    assert sched.block_manager.num_free_blocks == 2
    assert a.status == RequestStatus.RUNNING


def test_abort_a_preempted_request():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    a = make_request("a", 7)
    b = make_request("b", 7)
    add(sched, a, b)
    step(sched)
    step(sched)
    assert step(sched)[0].preempted_request_ids == ["b"]
    assert sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED) == [b]
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert not sched.waiting
    assert "b" not in sched.requests
    assert sched.schedule().finished_request_ids == ["b"]


# ---- admission checks ----------------------------------------------------------------------


def test_a_prompt_of_exactly_max_model_len_samples_one_token():
    # (Longer prompts never get here: the engine's input processor refuses them.)
    sched = make_scheduler(max_model_len=13)
    # A prompt of exactly max_model_len fits: one token is sampled, then length stops it.
    r = make_request("r", 13)
    sched.add_request(r)
    run_to_completion(sched)
    assert r.output_token_ids == [TOKEN]
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert_all_free(sched)
