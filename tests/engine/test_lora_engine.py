"""LoRA adapters through the engine, without a model: a real LLMEngine over a runner that
only records what it is sent. The add-request path takes `lora_request=` (refused with LoRA
off), the runner receives each request's adapter (n > 1 children too), the engine commands
add_lora / remove_lora / list_loras (directly, through the async engine, on a replica's
pipe, and across data-parallel replicas), removed_lora_ids once the last request of a
removed adapter has finished, and vLLM's pagoda:lora_requests_info gauge."""

from __future__ import annotations

import asyncio
import threading
from multiprocessing import Pipe

import pytest
from prometheus_client import generate_latest

from pagoda.config import EngineConfig
from pagoda.engine.data_parallel.messages import Answered, Batch, LoRACall, Stop, decode_error
from pagoda.engine.data_parallel.replica_main import PipeEvents
from pagoda.engine.loop.async_engine import AsyncLLMEngine
from pagoda.engine.loop.engine_loop import EngineLoop
from pagoda.engine.loop.llm_engine import LLMEngine
from pagoda.engine.stats.metrics import EngineMetrics
from pagoda.engine.stats.snapshot import EngineSnapshot
from pagoda.errors import InvalidRequestError
from pagoda.lora.request import LoRARequest
from pagoda.pooling_params import ModelPooling, PoolingParams
from pagoda.sampling_params import SamplingParams
from pagoda.step_data import ModelRunnerOutput, SchedulerOutput
from tests.thinking_tokenizer import thinking_tokenizer

A = LoRARequest("alpha", 1, "/adapters/alpha")
B = LoRARequest("beta", 2, "/adapters/beta")
C = LoRARequest("gamma", 3, "/adapters/gamma")
TOKEN = 70  # what the fake model samples


class RecordingRunner:
    """Samples TOKEN for each request that reaches its end (a pooled vector for a pooling
    one); records every SchedulerOutput and each request's adapter."""

    def __init__(self) -> None:
        self.outputs: list[SchedulerOutput] = []
        self.adapters: dict[str, LoRARequest | None] = {}
        self.pooling: set[str] = set()
        self.lengths: dict[str, int] = {}
        self.permits: threading.Semaphore | None = None
        """When set, each step waits for a permit (a test paces the engine thread)."""

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.permits is not None:
            assert self.permits.acquire(timeout=10), "the test gave no permit"
        self.outputs.append(out)
        for new in out.new_requests:
            self.adapters[new.request_id] = new.lora_request
            self.lengths[new.request_id] = new.num_computed_tokens
            if new.pooling_params is not None:
                self.pooling.add(new.request_id)
        sampled, pooled = [], {}
        for request_id, num in zip(out.request_ids, out.num_scheduled_tokens):
            self.lengths[request_id] = self.lengths.get(request_id, 0) + num
            if request_id in self.pooling:
                pooled[request_id] = [1.0]
                sampled.append(None)
            else:
                sampled.append(TOKEN)
        return ModelRunnerOutput(list(out.request_ids), sampled, pooled=pooled)

    @property
    def removed(self) -> list[int]:
        return [i for out in self.outputs for i in out.removed_lora_ids]


def make_engine(enable_lora: bool = True, max_loras: int = 2,
                max_num_batched_tokens: int = 512) -> LLMEngine:
    config = EngineConfig.from_kwargs(enable_lora=enable_lora, max_loras=max_loras,
                                      max_num_batched_tokens=max_num_batched_tokens)
    tokenizer = thinking_tokenizer()
    return LLMEngine(config, RecordingRunner(), tokenizer, [tokenizer.eos_token_id],
                     max_model_len=128, num_blocks=[64], vocab_size=len(tokenizer),
                     model_pooling=ModelPooling())


def run(engine: LLMEngine, max_steps: int = 200) -> dict[str, list[list[int]]]:
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = [c.token_ids for c in output.outputs]
    raise AssertionError("the engine did not finish")


def params(max_tokens: int = 3, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_with_lora_off_a_request_naming_an_adapter_is_refused():
    engine = make_engine(enable_lora=False)
    with pytest.raises(InvalidRequestError, match="--enable-lora") as refused:
        engine.add_request("r", "hello", params(), lora_request=A)
    assert refused.value.param == "lora_request"
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        engine.add_lora(A)
    with pytest.raises(InvalidRequestError, match="must be a LoRARequest"):
        engine.add_request("r", "hello", params(), lora_request="alpha")
    engine.add_request("base", "hello", params())  # the base model serves as ever
    assert run(engine) == {"base": [[TOKEN] * 3]}
    assert engine.snapshot().max_lora == 0


def test_the_runner_gets_each_requests_adapter_children_included():
    engine = make_engine()
    engine.add_request("a", "one prompt", params(), lora_request=A)
    engine.add_request("pair", "two answers", params(n=2, temperature=1.0, seed=1),
                       lora_request=B)
    engine.add_request("base", "no adapter", params())
    engine.add_request("vector", "embed me", PoolingParams(), lora_request=A)
    finished = run(engine)
    assert set(finished) == {"a", "pair", "base", "vector"}
    assert finished["pair"] == [[TOKEN] * 3, [TOKEN] * 3]
    runner = engine.runner
    assert runner.adapters == {"a": A, "0_pair": B, "1_pair": B, "base": None, "vector": A}
    assert engine.list_loras() == {1, 2}


def test_an_id_is_one_adapter():
    engine = make_engine()
    assert engine.add_lora(A) and not engine.add_lora(A)
    other = LoRARequest("other", 1, "/adapters/other")
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 is already adapter 'alpha'"):
        engine.add_request("r", "hi", params(), lora_request=other)
    with pytest.raises(InvalidRequestError, match="already adapter"):
        engine.add_lora(other)
    assert engine.list_loras() == {1}


def test_remove_lora_refuses_new_requests_and_frees_it_after_the_last_one():
    engine = make_engine()
    engine.add_request("long", "a prompt", params(max_tokens=8), lora_request=A)
    engine.add_request("short", "a prompt", params(max_tokens=2), lora_request=A)
    engine.add_request("other", "a prompt", params(max_tokens=2), lora_request=B)
    engine.step()
    assert engine.remove_lora(1) and not engine.remove_lora(1) and not engine.remove_lora(7)
    assert engine.list_loras() == {2}
    with pytest.raises(InvalidRequestError, match="'alpha' .lora_int_id 1. is being removed"):
        engine.add_request("late", "a prompt", params(), lora_request=A)
    runner = engine.runner
    while engine.has_unfinished_requests() and not runner.removed:
        assert runner.removed == []
        engine.step()
    # the step that announces it is the one that drops the adapter's last request
    last = next(out for out in runner.outputs if out.removed_lora_ids)
    assert last.removed_lora_ids == [1] and "long" in last.finished_request_ids
    assert not engine.has_unfinished_requests()
    engine.step()
    assert runner.removed == [1]  # once
    # the id may serve again: its weights load anew
    engine.add_request("again", "a prompt", params(), lora_request=A)
    assert "again" in run(engine)


def test_removing_an_idle_adapter_takes_one_empty_step():
    engine = make_engine()
    engine.add_lora(C)
    assert not engine.has_unfinished_requests()
    assert engine.remove_lora(3)
    assert engine.has_unfinished_requests()  # an engine loop steps once more ...
    assert engine.step() == []
    assert engine.runner.outputs[-1].is_empty and engine.runner.removed == [3]
    assert not engine.has_unfinished_requests()  # ... and is idle again


def test_no_step_runs_more_than_max_loras_adapters():
    engine = make_engine(max_loras=2)
    adapters = [A, B, C, None]
    for i in range(12):
        engine.add_request(f"r{i}", f"prompt {i}", params(max_tokens=2 + i % 3),
                           lora_request=adapters[i % 4])
    run(engine)
    runner = engine.runner
    for out in runner.outputs:
        ids = {runner.adapters[r].lora_int_id for r in out.request_ids if runner.adapters[r]}
        assert len(ids) <= 2
    assert len({a for a in runner.adapters.values() if a}) == 3  # all three ran


def test_replicas_snapshots_merge_their_adapters():
    from pagoda.engine.data_parallel.snapshots import merge_snapshots

    merged = merge_snapshots([
        EngineSnapshot(running_lora_adapters=("alpha", "beta"), max_lora=2),
        EngineSnapshot(running_lora_adapters=("beta", "gamma"),
                       waiting_lora_adapters=("alpha",), max_lora=2)])
    assert merged.running_lora_adapters == ("alpha", "beta", "gamma")
    assert merged.waiting_lora_adapters == ("alpha",) and merged.max_lora == 2


def test_the_snapshot_and_the_lora_requests_info_gauge():
    engine = make_engine(max_loras=1)
    engine.add_request("a", "x", params(max_tokens=2), lora_request=A)
    engine.add_request("b", "y", params(max_tokens=2), lora_request=B)
    engine.add_request("base", "z", params(max_tokens=2))
    engine.step()
    snapshot = engine.snapshot()
    assert snapshot.running_lora_adapters == ("alpha",)
    assert snapshot.waiting_lora_adapters == ("beta",)
    assert snapshot.max_lora == 1
    metrics = EngineMetrics("m")
    metrics.update(snapshot)
    labels = {"model_name": "m", "running_lora_adapters": "alpha",
              "waiting_lora_adapters": "beta", "max_lora": "1"}
    first = metrics.registry.get_sample_value("pagoda:lora_requests_info", labels)
    assert first is not None and first > 1e9  # the time of the update
    run(engine)
    metrics.update(engine.snapshot())
    exported = generate_latest(metrics.registry).decode()
    assert exported.count("pagoda:lora_requests_info{") == 1  # the old label set is gone
    assert metrics.registry.get_sample_value("pagoda:lora_requests_info", {
        "model_name": "m", "running_lora_adapters": "", "waiting_lora_adapters": "",
        "max_lora": "1"}) >= first
    # with LoRA off the gauge has no sample
    off = EngineMetrics("m")
    off.update(EngineSnapshot())
    assert "pagoda:lora_requests_info{" not in generate_latest(off.registry).decode()


def test_the_async_engine_runs_the_adapter_commands_in_order_with_requests():
    """The engine thread takes one step per permit the test gives, so the order of steps,
    commands and adds is fixed: commands are handled between steps."""

    async def main():
        llm_engine = make_engine()
        runner = llm_engine.runner
        runner.permits = threading.Semaphore(0)
        engine = AsyncLLMEngine(llm_engine)
        engine.start()

        async def with_steps(coroutine, steps: int = 1):
            task = asyncio.ensure_future(coroutine)
            await asyncio.sleep(0.05)
            runner.permits.release(steps)
            return await task

        try:
            assert await engine.add_lora(A) is True  # (idle: no step needed)
            assert await engine.list_loras() == {1}
            stream = await engine.add_request(
                engine.input_processor.process("long", "hi", params(max_tokens=50),
                                               lora_request=A))
            runner.permits.release()
            first = await stream.__anext__()
            assert not first.finished and runner.adapters["long"] == A
            assert await with_steps(engine.remove_lora(1)) is True
            late = engine.input_processor.process("late", "hi", params(), lora_request=A)
            with pytest.raises(InvalidRequestError, match="'alpha' .lora_int_id 1. is being"):
                await with_steps(engine.add_request(late))
            assert await with_steps(engine.list_loras()) == set()
            assert runner.removed == []  # "long" still runs with it
            engine.abort("long")
            runner.permits.release(1000)
            await engine.synchronize()
            for _ in range(100):
                if runner.removed:
                    break
                await asyncio.sleep(0.01)
            assert runner.removed == [1]
        finally:
            runner.permits.release(1000)
            await engine.shutdown()
        with pytest.raises(Exception, match="stopped"):
            await engine.list_loras()

    asyncio.run(main())


def test_a_replica_loop_answers_adapter_commands_on_its_pipe():
    server_end, replica_end = Pipe()
    engine = make_engine()
    events = PipeEvents(replica_end)
    engine_loop = events.engine_loop = EngineLoop(engine, events)
    thread = threading.Thread(target=engine_loop.run, daemon=True)
    thread.start()
    answers = {}
    assert engine_loop.call(LoRACall("add_lora", (A,), 1))
    assert engine_loop.call(LoRACall("list_loras", (), 2))
    assert engine_loop.call(LoRACall("remove_lora", (1,), 3))
    assert engine_loop.call(LoRACall("add_lora", (LoRARequest("x", 1, "/x"),), 4))
    assert engine_loop.call(LoRACall("shutdown", (), 5))
    while len(answers) < 5:
        assert server_end.poll(5), "no answer from the loop"
        message = server_end.recv()
        assert isinstance(message, Batch)
        answers |= {i.call_id: i for i in message.items if isinstance(i, Answered)}
    assert [answers[i].result for i in (1, 2, 3)] == [True, {1}, True]
    assert isinstance(decode_error(answers[4].error), InvalidRequestError)
    assert "being removed" in answers[4].error.message
    assert "unknown engine command" in answers[5].error.message
    engine_loop.put(Stop())
    thread.join(5)
    assert not thread.is_alive()
    assert not engine_loop.call(LoRACall("list_loras", (), 6))  # the loop has ended


def test_a_request_and_the_commands_cross_a_replica_pipe_with_their_adapter():
    from pagoda.engine.core.input_processor import EngineRequest
    from pagoda.engine.data_parallel.messages import Add, snapshot_fields

    request = EngineRequest("r", None, [5, 6], params(), 3, 0.0, lora_request=A)
    server_end, replica_end = Pipe()
    server_end.send(Add(request))
    server_end.send(LoRACall("remove_lora", (1,), 7))
    assert replica_end.recv().request.lora_request == A
    assert replica_end.recv() == LoRACall("remove_lora", (1,), 7)
    snapshot = EngineSnapshot(running_lora_adapters=("alpha",), max_lora=2)
    replica_end.send(Batch([Answered(7, {1, 2})]))
    replica_end.send(snapshot_fields(snapshot))
    assert server_end.recv() == Batch([Answered(7, {1, 2})])
    assert EngineSnapshot(**server_end.recv()).running_lora_adapters == ("alpha",)
