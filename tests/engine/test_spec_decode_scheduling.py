"""Speculative decoding on the scheduling side, without a model: proposals are scheduled
after a request's last token within the budget and the request's limits, accepted ones
become output, and rejected ones roll back their KV slots so that the block manager (held
blocks, free list, prefix-cache hashes) ends exactly as a run without speculation."""

from __future__ import annotations

import random

import pytest

from pagoda.step_data import ModelRunnerOutput
from tests.engine.scheduler_helpers import BS, add, full_pool, make_request, make_scheduler


def _decode_ready(sched, request):
    """Run the request's prefill (one step): it sampled its first token."""
    out = sched.schedule()
    assert out.request_ids == [request.request_id]
    sched.update_from_output(out, ModelRunnerOutput(list(out.request_ids), [11]))
    return out


def test_proposals_are_scheduled_after_the_last_token_and_capped():
    sched = make_scheduler(max_num_batched_tokens=64, max_model_len=64)
    request = make_request("a", 5, max_tokens=4)
    add(sched, request)
    _decode_ready(sched, request)
    request.spec_token_ids = [21, 22, 23, 24, 25]
    out = sched.schedule()
    # max_tokens 4, one token out: at most 2 proposals (the step emits up to one more)
    assert out.spec_token_ids == {"a": [21, 22]}
    assert out.num_scheduled_tokens == [3]


def test_the_budget_cuts_proposals_before_it_cuts_requests():
    sched = make_scheduler(max_num_batched_tokens=3, max_model_len=64)
    request = make_request("a", 5, max_tokens=30)
    add(sched, request)
    sched.config = type(sched.config)(max_num_batched_tokens=64)
    _decode_ready(sched, request)
    sched.config = type(sched.config)(max_num_batched_tokens=3)
    request.spec_token_ids = [21, 22, 23, 24]
    out = sched.schedule()
    assert out.spec_token_ids == {"a": [21, 22]} and out.num_scheduled_tokens == [3]


def test_no_proposals_past_max_model_len():
    sched = make_scheduler(max_num_batched_tokens=64, max_model_len=9)
    request = make_request("a", 5, max_tokens=None)
    add(sched, request)
    _decode_ready(sched, request)  # 6 tokens: positions up to 8 may be computed
    request.spec_token_ids = [21, 22, 23, 24, 25]
    assert sched.schedule().spec_token_ids == {"a": [21, 22, 23]}


def test_accepted_proposals_become_output_and_rejected_ones_are_rolled_back():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=64)
    request = make_request("a", 7, max_tokens=30)  # prompt 7 + 1 token = 8 = two full blocks
    add(sched, request)
    _decode_ready(sched, request)
    request.spec_token_ids = [21, 22, 23, 24, 25, 26]
    out = sched.schedule()  # positions 7..13: blocks 2 and 3 are new
    assert len(full_pool(sched).block_ids("a")) == 4
    new_tokens = sched.update_from_output(out, ModelRunnerOutput(
        ["a"], [99], num_accepted_tokens={"a": 1}, spec_token_ids={"a": [31]}))
    assert [t for _, t in new_tokens] == [21, 99]
    assert request.output_token_ids == [11, 21, 99]
    assert request.num_computed_tokens == 9  # the prompt, 11 and 21; 99 is next
    assert len(full_pool(sched).block_ids("a")) == 3  # ceil(9 / 4): block 3 rolled back
    assert request.spec_token_ids == [31]


def test_preemption_drops_proposals():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    a, b = make_request("a", 6, max_tokens=30), make_request("b", 6, max_tokens=30)
    add(sched, a, b)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(list(out.request_ids), [11, 12]))
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3], [4, 5, 6]
    out = sched.schedule()  # 2 x 10 tokens need 6 blocks: b is preempted
    assert out.preempted_request_ids == ["b"]
    assert b.spec_token_ids == [] and b.request_id not in out.spec_token_ids


def _run(sched, requests, accept_plan, proposals_per_step):
    """Drive `requests` to their end. Each step every request proposes
    proposals_per_step tokens (when asked) and accept_plan(request, n) tells how many
    the "verifier" accepts; the target's token is 7 + position, so with or without
    speculation every request gets the same tokens. Returns the block manager's states
    (held blocks per request, number free) after each step's update, keyed by the
    requests' token counts, and the final output."""
    states = []
    add(sched, *requests)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sampled, accepted, proposals = [], {}, {}
        for request_id, n in zip(out.request_ids, out.num_scheduled_tokens):
            request = sched.requests[request_id]
            spec = out.spec_token_ids.get(request_id, [])
            if request.num_computed_tokens + n < request.num_tokens + len(spec):
                sampled.append(None)
                continue
            num_accepted = accept_plan(request, len(spec))
            accepted[request_id] = num_accepted
            position = request.num_tokens + num_accepted
            sampled.append(7 + position)
            nxt = position + 1
            proposals[request_id] = [
                7 + nxt + i if i < 2 else 1 for i in range(proposals_per_step)]
        sched.update_from_output(out, ModelRunnerOutput(
            list(out.request_ids), sampled, num_accepted_tokens=accepted,
            spec_token_ids=proposals if proposals_per_step else {}))
        for request_id in list(out.request_ids):
            request = sched.requests.get(request_id)
            if request is not None and request.num_output_tokens >= request.max_tokens:
                sched.finish_requests([request_id], type(request.status).FINISHED_LENGTH)
        bm = full_pool(sched)
        states.append({r.request_id: (r.num_computed_tokens, len(bm.block_ids(r.request_id)))
                       for r in requests if r.request_id in sched.requests})
    return states


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_accept_reject_leaves_the_block_manager_as_without_speculation(seed):
    """Proposals 2 right then wrong; the verifier accepts a random prefix of the right
    ones. Afterwards: every block free, the same hashes cached, and at every step each
    request holds exactly the blocks its computed tokens need."""
    rng = random.Random(seed)

    def build():
        shared = list(range(500, 500 + 2 * BS))  # a shared prompt prefix: prefix caching
        requests = [make_request(f"r{i}", shared + [600 + i] * (3 + i), max_tokens=12 + i)
                    for i in range(3)]
        return make_scheduler(num_blocks=40, max_num_batched_tokens=64, max_model_len=64), requests

    plain, plain_requests = build()
    _run(plain, plain_requests, lambda r, n: 0, proposals_per_step=0)
    spec, spec_requests = build()
    states = _run(spec, spec_requests, lambda r, n: rng.randint(0, min(n, 2)),
                  proposals_per_step=4)
    for step_state in states:
        for num_computed, num_blocks in step_state.values():
            assert num_blocks == -(-num_computed // BS)
    expected_cached = set()
    for a, b in zip(plain_requests, spec_requests):
        assert a.output_token_ids == b.output_token_ids
        assert b.block_hashes == a.block_hashes[: len(b.block_hashes)]
        # cached: the full blocks of computed tokens (a request that ends emitting several
        # tokens at once leaves its last ones uncomputed, where the plain run computed them)
        expected_cached.update(a.block_hashes[: b.num_computed_tokens // BS])
    plain_bm, spec_bm = full_pool(plain), full_pool(spec)
    assert spec_bm.num_free_blocks == spec_bm.num_blocks  # nothing leaked
    assert set(spec_bm.cached_blocks) == expected_cached
    assert expected_cached <= set(plain_bm.cached_blocks)
    assert all(b.ref_count == 0 for b in spec_bm.blocks)
    for block_hash, block in spec_bm.cached_blocks.items():
        assert block.block_hash == block_hash


def test_rollback_restores_the_free_list_order():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=64)
    request = make_request("a", 3, max_tokens=30)
    add(sched, request)
    _decode_ready(sched, request)
    free_before = list(full_pool(sched).free_blocks)
    request.spec_token_ids = [21] * 9
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a"], [99], num_accepted_tokens={"a": 0}))
    assert list(full_pool(sched).free_blocks) == free_before
