"""Scheduler: aborts, finished ids and every stop condition (eos, stop ids, lengths)."""

from __future__ import annotations

import pytest

from pagoda.engine.core.request import Request, RequestStatus
from tests.engine.scheduler_helpers import (
    EOS,
    TOKEN,
    add,
    assert_all_free,
    batch,
    make_request,
    make_scheduler,
    runner_output,
    step,
    stop_reasons,
)

# ---- finishing: aborts and stop conditions -------------------------------------------------


def test_finish_requests_frees_blocks_and_reports_ids_in_the_next_output():
    sched = make_scheduler(max_num_seqs=1)
    a = make_request("a", 6)
    b = make_request("b", 3)
    add(sched, a, b)
    step(sched)
    assert sched.block_manager.num_free_blocks == 16 - 2
    finished = sched.finish_requests(["a", "b", "nope"], RequestStatus.FINISHED_ABORTED)
    assert finished == [a, b]
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []
    assert_all_free(sched)
    out = sched.schedule()
    assert out.is_empty
    assert out.finished_request_ids == ["a", "b"]
    assert sched.schedule().finished_request_ids == []


def test_a_request_aborted_while_its_step_runs_gets_no_token():
    sched = make_scheduler()
    a = make_request("a", 3)
    b = make_request("b", 3)
    add(sched, a, b)
    out = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, runner_output(out, [TOKEN, TOKEN])) == [(b, TOKEN)]
    assert a.output_token_ids == []
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert b.output_token_ids == [TOKEN]
    nxt = sched.schedule()
    assert batch(nxt) == [("b", 1)]
    assert nxt.finished_request_ids == ["a"]


def test_finished_request_ids_of_natural_stops_are_reported_once():
    sched = make_scheduler()
    add(sched, make_request("a", 3, max_tokens=1), make_request("b", 3, max_tokens=2))
    out, _ = step(sched)
    assert out.finished_request_ids == []
    out, _ = step(sched)
    assert out.finished_request_ids == ["a"]
    assert batch(out) == [("b", 1)]
    out = sched.schedule()
    assert out.finished_request_ids == ["b"]
    assert sched.schedule().finished_request_ids == []


def _generate(request: Request, tokens: list[int], **sched_kwargs) -> Request:
    sched = make_scheduler(**sched_kwargs)
    sched.add_request(request)
    it = iter(tokens)
    for _ in range(len(tokens)):
        step(sched, lambda r: next(it))
        if request.is_finished:
            break
    return request


def test_eos_stops_with_no_stop_reason():
    r = _generate(make_request("r", 3, eos_token_ids=[2, 3]), [5, 3, 5])
    assert r.output_token_ids == [5, 3]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.status.finish_reason == "stop"
    assert stop_reasons[r.request_id] is None


def test_ignore_eos_runs_to_max_tokens():
    r = _generate(make_request("r", 3, max_tokens=3, ignore_eos=True), [EOS] * 5)
    assert r.output_token_ids == [EOS] * 3
    assert r.status == RequestStatus.FINISHED_LENGTH


def test_stop_token_ids_stop_with_the_token_as_stop_reason():
    r = _generate(make_request("r", 3, stop_token_ids=[9, 11]), [5, 11, 5])
    assert r.output_token_ids == [5, 11]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert stop_reasons[r.request_id] == 11


def test_stop_token_ids_apply_even_with_ignore_eos():
    r = _generate(make_request("r", 3, stop_token_ids=[9], ignore_eos=True), [EOS, 9, 5])
    assert r.output_token_ids == [EOS, 9]
    assert stop_reasons[r.request_id] == 9


def test_max_tokens_finishes_with_length():
    r = _generate(make_request("r", 3, max_tokens=3), [5] * 10)
    assert r.output_token_ids == [5] * 3
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.status.finish_reason == "length"


def test_request_max_tokens_overrides_the_sampling_params():
    r = _generate(make_request("r", 3, max_tokens=16, request_max_tokens=2), [5] * 10)
    assert r.output_token_ids == [5, 5]
    assert r.status == RequestStatus.FINISHED_LENGTH


def test_min_tokens_delays_eos_and_stop_token_ids():
    r = _generate(make_request("r", 3, min_tokens=3, stop_token_ids=[9]), [EOS, 9, EOS, 5])
    assert r.output_token_ids == [EOS, 9, EOS]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert stop_reasons[r.request_id] is None
    r = _generate(make_request("r", 3, min_tokens=2, stop_token_ids=[9]), [EOS, 9, 5])
    assert r.output_token_ids == [EOS, 9]
    assert stop_reasons[r.request_id] == 9


@pytest.mark.parametrize("max_tokens", [None, 16])
def test_max_model_len_finishes_with_length(max_tokens):
    # max_tokens None (no cap anywhere) used to raise TypeError comparing an int with None.
    r = _generate(make_request("r", 6, max_tokens=max_tokens), [5] * 10, max_model_len=8)
    assert r.output_token_ids == [5, 5]
    assert r.num_tokens == 8
    assert r.status == RequestStatus.FINISHED_LENGTH
