"""Scheduler under a random workload: no leaks, same tokens whatever the memory pressure."""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest

from pagoda.engine.core.request import Request, RequestStatus
from pagoda.engine.core.scheduler import Scheduler
from tests.engine.scheduler_helpers import (
    assert_all_free,
    block_tables,
    finish_stopped,
    full_pool,
    make_request,
    make_scheduler,
    runner_output,
)

# ---- everything together: no leaks, same tokens whatever the memory pressure ---------------


def _fake_model(r: Request) -> int:
    # Deterministic in the request's tokens, never EOS (2).
    return (sum(r.all_token_ids) * 31 + r.num_tokens) % 50 + 10


def _workload(seed: int) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, 60) for _ in range(8)]
    requests = []
    for i in range(14):
        if i % 3 == 0:
            prompt = shared[: rng.randint(5, 8)] + [rng.randrange(10, 60) for _ in range(3)]
        else:
            prompt = [rng.randrange(10, 60) for _ in range(rng.randint(1, 15))]
        requests.append(
            make_request(
                f"r{i}", prompt, max_tokens=rng.randint(1, 8),
                priority=rng.randint(0, 3), arrival_time=float(i),
            )
        )
    return requests


def _run_checked(sched: Scheduler, requests: list[Request], abort: Iterable[str] = ()):
    bm = full_pool(sched)
    cfg = sched.config
    pending = list(requests)
    for step_index in range(500):
        # Requests arrive over time, a couple per step.
        for _ in range(2):
            if pending:
                sched.add_request(pending.pop(0))
        if step_index == 6:
            sched.finish_requests(abort, RequestStatus.FINISHED_ABORTED)
        if not sched.has_unfinished_requests() and not pending:
            return
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        scheduled = [sched.requests[request_id] for request_id in out.request_ids]
        assert len(scheduled) <= cfg.max_num_seqs
        assert sched.num_running <= cfg.max_num_seqs
        assert not set(out.preempted_request_ids) & set(out.request_ids)
        tables = block_tables(sched, out)
        for r, n, (table,) in zip(scheduled, out.num_scheduled_tokens, tables):  # one group
            assert n >= 1
            assert r.num_computed_tokens + n <= r.num_tokens
            assert table == bm.block_ids(r.request_id)
            assert len(set(table)) == len(table)
            assert len(table) == bm.num_blocks_needed(r.num_computed_tokens + n)
        holders = [0] * bm.num_blocks
        for r in sched.running:
            for block_id in bm.block_ids(r.request_id):
                holders[block_id] += 1
        assert [b.ref_count for b in bm.blocks] == holders
        assert sorted(bm.free_blocks) == [i for i, h in enumerate(holders) if h == 0]
        sampled = [
            _fake_model(r) if r.num_computed_tokens + n == r.num_tokens else None
            for r, n in zip(scheduled, out.num_scheduled_tokens)
        ]
        finish_stopped(sched, sched.update_from_output(out, runner_output(out, sampled)))
    raise AssertionError("workload did not finish in 500 steps")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_tight_cache_gives_the_same_tokens_and_leaks_nothing(policy, enable_prefix_caching):
    roomy = make_scheduler(
        num_blocks=64, max_num_batched_tokens=64, policy=policy,
        enable_prefix_caching=enable_prefix_caching,
    )
    roomy_requests = _workload(seed=1)
    _run_checked(roomy, roomy_requests)
    assert roomy.num_preemptions == 0

    tight = make_scheduler(
        num_blocks=8, max_num_batched_tokens=6, max_num_seqs=4, max_model_len=32,
        policy=policy, enable_prefix_caching=enable_prefix_caching,
    )
    tight_requests = _workload(seed=1)
    _run_checked(tight, tight_requests)
    assert tight.num_preemptions > 0  # the workload really exercises preemption
    for r_roomy, r_tight in zip(roomy_requests, tight_requests):
        assert r_tight.output_token_ids == r_roomy.output_token_ids
        assert r_tight.num_output_tokens == r_tight.max_tokens
        assert r_tight.status == RequestStatus.FINISHED_LENGTH
    assert_all_free(tight)
    assert_all_free(roomy)
    if enable_prefix_caching:
        assert tight.block_manager.prefix_cache_hits > 0


def test_aborts_in_a_busy_tight_cache_leak_nothing():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=6, max_num_seqs=4)
    requests = _workload(seed=2)
    _run_checked(sched, requests, abort={"r0", "r3", "r5", "r9"})
    aborted = [r.request_id for r in requests if r.status == RequestStatus.FINISHED_ABORTED]
    assert aborted and set(aborted) <= {"r0", "r3", "r5", "r9"}
    assert all(r.is_finished for r in requests)
    assert_all_free(sched)
