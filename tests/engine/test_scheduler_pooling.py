"""Pooling (embedding) requests in the scheduler and the lifecycle, without a model: the same
one rule (computed catches up with the prompt, chunked under the budget, batched with
generation), nothing sampled, finished by the lifecycle in the step its vector comes back,
blocks freed at once; mean and CLS take no prefix-cache hits, last-token may; a preempted
pooling request starts over and is re-sent whole with its params."""

from __future__ import annotations

import pytest

from pagoda.engine.core.input_processor import InputProcessor
from pagoda.engine.core.lifecycle import RequestLifecycle
from pagoda.engine.core.request import Request, RequestStatus
from pagoda.engine.core.scheduler import Scheduler
from pagoda.errors import InvalidRequestError
from pagoda.pooling_params import ModelPooling, PoolingParams
from pagoda.step_data import ModelRunnerOutput
from tests.engine.scheduler_helpers import (
    BS,
    TOKEN,
    add,
    assert_all_free,
    batch,
    block_tables,
    full_pool,
    make_request,
    make_scheduler,
    runner_output,
)

VECTOR = [0.6, 0.8]


def pooling_request(request_id: str, prompt: int | list[int], pooling: str = "last") -> Request:
    request = make_request(request_id, prompt, max_tokens=None, request_max_tokens=0)
    request.pooling_params = PoolingParams(pooling=pooling, normalize=True)
    return request


def step_with_pooling(sched: Scheduler):
    """One simulated step as the engine runs it: the runner samples for generation requests
    that reach their end and returns a vector for pooling requests that complete their
    prompt (never a token); the lifecycle's rule then finishes those at once."""
    out = sched.schedule()
    block_tables(sched, out)
    sampled, pooled = [], []
    for request_id, num in zip(out.request_ids, out.num_scheduled_tokens):
        request = sched.requests[request_id]
        reaches_end = request.num_computed_tokens + num == request.num_tokens
        if request.pooling_params is not None:
            sampled.append(None)
            if reaches_end:
                pooled.append(request_id)
        else:
            sampled.append(TOKEN if reaches_end else None)
    new_tokens = sched.update_from_output(out, runner_output(out, sampled))
    assert all(r.pooling_params is None for r, _ in new_tokens), "a pooling request sampled"
    for request, _ in new_tokens:
        if request.num_output_tokens >= request.max_tokens:
            sched.finish_requests([request.request_id], RequestStatus.FINISHED_LENGTH)
    finished = sched.finish_requests(pooled, RequestStatus.FINISHED_STOPPED)
    return out, finished


def test_a_pooling_request_is_prefill_only_chunked_and_freed_in_its_last_step():
    sched = make_scheduler(max_num_batched_tokens=4)
    request = pooling_request("e", 10)
    add(sched, request)
    steps = []
    while sched.has_unfinished_requests():
        out, finished = step_with_pooling(sched)
        steps.append((batch(out), [r.request_id for r in finished],
                      full_pool(sched).num_free_blocks))
    # Chunks of 4, 4, 2: exactly the prompt, no decode step; its 3 blocks free in the step
    # that completes it.
    assert steps == [([("e", 4)], [], 15), ([("e", 4)], [], 14), ([("e", 2)], ["e"], 16)]
    assert request.num_computed_tokens == 10 and request.output_token_ids == []
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert sched.schedule().finished_request_ids == ["e"]  # the runner drops its state
    assert_all_free(sched)


def test_pooling_and_generation_share_steps_and_the_budget():
    sched = make_scheduler(max_num_batched_tokens=6)
    generation = make_request("g", 5, max_tokens=3)
    embedding = pooling_request("e", 9, pooling="mean")
    add(sched, generation, embedding)
    batches = []
    while sched.has_unfinished_requests():
        batches.append(batch(step_with_pooling(sched)[0]))
    assert batches == [
        [("g", 5), ("e", 1)],  # the budget left after g's prompt goes to e's first chunk
        [("g", 1), ("e", 5)],
        [("g", 1), ("e", 3)],  # both done: g's third token, e's prompt
    ]
    assert generation.output_token_ids == [TOKEN] * 3
    assert_all_free(sched)


def test_the_first_schedule_sends_the_pooling_params_and_a_preempted_request_starts_over():
    # 5 blocks: g holds 3, e's second chunk needs a third, so the latest arrival (e,
    # mid-prefill) is preempted.
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=8)
    generation = make_request("g", 8, max_tokens=4)
    embedding = pooling_request("e", 12, pooling="cls")
    add(sched, generation, embedding)
    out, _ = step_with_pooling(sched)
    assert batch(out) == [("g", 8)]
    out, _ = step_with_pooling(sched)
    assert batch(out) == [("g", 1), ("e", 7)]
    [new] = out.new_requests
    assert new.request_id == "e" and new.pooling_params == embedding.pooling_params
    out, _ = step_with_pooling(sched)
    assert out.preempted_request_ids == ["e"]
    assert embedding.num_computed_tokens == 0 and embedding.status == RequestStatus.PREEMPTED
    while sched.has_unfinished_requests():
        out, _ = step_with_pooling(sched)
        for new in out.new_requests:  # back whole, from position 0, params again
            assert (new.request_id, new.num_computed_tokens) == ("e", 0)
            assert new.pooling_params.pooling == "cls"
    assert embedding.status == RequestStatus.FINISHED_STOPPED
    assert_all_free(sched)


@pytest.mark.parametrize(("pooling", "cached"), [("last", 2 * BS), ("mean", 0), ("cls", 0)])
def test_only_last_token_pooling_takes_prefix_cache_hits(pooling, cached):
    sched = make_scheduler()
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    add(sched, make_request("g", prompt, max_tokens=1))
    step_with_pooling(sched)  # g computed (and cached) the prompt's blocks
    embedding = pooling_request("e", prompt, pooling)
    add(sched, embedding)
    out, finished = step_with_pooling(sched)
    assert batch(out) == [("e", len(prompt) - cached)]
    assert embedding.num_cached_tokens == cached
    assert finished == [embedding]
    assert_all_free(sched)


def test_the_lifecycle_ends_a_pooling_request_with_its_vector(bundled_tokenizer):
    model = ModelPooling(pooling="mean", normalize=True, hidden_size=2)
    processor = InputProcessor(bundled_tokenizer, len(bundled_tokenizer), 64, None, model)
    lifecycle = RequestLifecycle(bundled_tokenizer, [2], 64)
    engine_request = processor.process_pooling("e", "Hello there", PoolingParams())
    assert engine_request.pooling == PoolingParams(pooling="mean", normalize=True)
    assert engine_request.max_tokens == 0
    [sequence] = lifecycle.add_request(engine_request)
    assert sequence.pooling_params is engine_request.pooling
    assert sequence.can_use_prefix_cache is False
    # A partial chunk: nothing comes back, nothing ends.
    assert lifecycle.process_step([], ModelRunnerOutput(["e"], [None]), now=1.0) == []
    assert lifecycle.make_outputs() == []
    finished = lifecycle.process_step(
        [], ModelRunnerOutput(["e"], [None], pooled={"e": VECTOR}), now=2.0)
    assert finished == [("e", RequestStatus.FINISHED_STOPPED)]
    [output] = lifecycle.make_outputs()
    assert output.finished and output.embedding == VECTOR
    assert output.prompt_token_ids == engine_request.prompt_token_ids
    assert output.outputs[0].finish_reason == "stop" and output.outputs[0].token_ids == []
    assert not lifecycle.has_request("e")
    # A vector for a request aborted meanwhile is dropped.
    [sequence] = lifecycle.add_request(processor.process_pooling("f", [5, 6], PoolingParams()))
    lifecycle.abort("f")
    assert lifecycle.process_step(
        [], ModelRunnerOutput(["f"], [None], pooled={"f": VECTOR}), now=3.0) == []


def test_pooling_validation_names_the_field(bundled_tokenizer):
    vocab = len(bundled_tokenizer)
    plain = ModelPooling(hidden_size=64)
    listed = ModelPooling(hidden_size=64, matryoshka=True, matryoshka_dimensions=(16, 32))
    free = ModelPooling(hidden_size=64, matryoshka=True)

    def process(model, prompt, params=None, max_model_len=8):
        processor = InputProcessor(bundled_tokenizer, vocab, max_model_len, None, model)
        return processor.process_pooling("r", prompt, params or PoolingParams())

    def refused(param, *args, **kwargs) -> str:
        with pytest.raises(InvalidRequestError) as error:
            process(*args, **kwargs)
        assert error.value.param == param
        return error.value.message

    assert "Matryoshka" in refused("dimensions", plain, [1, 2], PoolingParams(dimensions=8))
    assert "[16, 32]" in refused("dimensions", listed, [1, 2], PoolingParams(dimensions=8))
    assert "64" in refused("dimensions", free, [1, 2], PoolingParams(dimensions=65))
    assert process(free, [1, 2], PoolingParams(dimensions=8)).pooling.dimensions == 8
    assert process(listed, [1, 2], PoolingParams(dimensions=32)).pooling.dimensions == 32
    assert process(free, [1, 2], PoolingParams(dimensions=64)).pooling.dimensions is None
    # The whole context may be prompt (no room for output is needed), not one token more.
    assert len(process(plain, list(range(1, 9))).prompt_token_ids) == 8
    assert "maximum context length is 8" in refused("input", plain, list(range(1, 10)))
    assert "out of range" in refused("input", plain, [vocab])
    assert "empty" in refused("input", plain, [])
    assert "not available" in refused("input", None, [1])
    with pytest.raises(InvalidRequestError) as error:
        PoolingParams(dimensions=0)
    assert error.value.param == "dimensions"
    with pytest.raises(InvalidRequestError) as error:
        PoolingParams(pooling="max")
    assert error.value.param == "pooling"
