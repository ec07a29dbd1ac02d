"""AsyncLLMEngine against a fake LLMEngine (no model): streams, aborts, contained failures,
a dead loop, and the waiting-queue limit. Fast; the real engine is covered by the server
tests."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from pagoda.engine.core.input_processor import EngineRequest
from pagoda.engine.loop.async_engine import AsyncLLMEngine
from pagoda.engine.loop.llm_engine import BatchFailedError
from pagoda.engine.loop.request_stream import EngineDeadError, EngineStepError, QueueFullError
from pagoda.engine.stats.snapshot import EngineSnapshot
from pagoda.errors import InvalidRequestError
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams

POISON = 666
"""A prompt token that makes the fake engine's step raise while that request is running."""


class FakeEngine:
    """The LLMEngine black box, faked: each request emits its prompt's first token
    `max_tokens` times, one per step; the snapshot says who runs. (Steps are instant: a
    request meant to outlive a test asks for 10**9 tokens.)"""

    def __init__(self, max_num_seqs: int = 8) -> None:
        self.tokenizer = object()
        self.max_model_len = 100
        self.vocab_size = 1000
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=max_num_seqs))
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()
        self.die = False
        self.step_gate = threading.Event()
        self.step_gate.set()

    def add_engine_request(self, request: EngineRequest) -> None:
        self.thread_ids.add(threading.get_ident())
        self.requests[request.request_id] = {
            "prompt": request.prompt_token_ids, "params": request.params, "tokens": []
        }

    def abort_request(self, request_ids):
        self.thread_ids.add(threading.get_ident())
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            if self.requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def has_unfinished_requests(self):
        if self.die:
            raise RuntimeError("bookkeeping bug")
        return bool(self.requests)

    def snapshot(self) -> EngineSnapshot:
        running = tuple(self.requests)
        return EngineSnapshot(running_request_ids=running, num_running_seqs=len(running))

    def take_failed_requests(self) -> dict[str, str]:
        return {}  # no request fails on its own here

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.step_gate.wait()
        if any(r["prompt"][0] == POISON for r in self.requests.values()):
            batch = list(self.requests)
            self.abort_request(batch)
            raise BatchFailedError(batch, RuntimeError("kernel exploded"))
        outputs = []
        for request_id, r in list(self.requests.items()):
            r["tokens"].append(r["prompt"][0])
            done = len(r["tokens"]) >= r["params"].max_tokens
            completion = CompletionOutput(
                index=0, text="x" * len(r["tokens"]), token_ids=list(r["tokens"]),
                delta_text="x", delta_token_ids=[r["prompt"][0]],
                finish_reason="length" if done else None,
            )
            outputs.append(RequestOutput(request_id, None, r["prompt"], [completion], done))
            if done:
                del self.requests[request_id]
        return outputs


async def add(engine: AsyncLLMEngine, request_id: str, prompt: list[int], params: SamplingParams):
    """Validate on the event loop, then hand over: what the server does."""
    return await engine.add_request(engine.input_processor.process(request_id, prompt, params))


async def collect(engine: AsyncLLMEngine, request_id: str, prompt: list[int], max_tokens: int):
    return [o async for o in engine.generate(request_id, prompt, SamplingParams(max_tokens=max_tokens))]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_streams_are_separate_and_the_engine_runs_on_its_own_thread():
    fake = FakeEngine()

    async def main():
        engine = AsyncLLMEngine(fake)
        engine.start()
        results = await asyncio.gather(*(collect(engine, f"r{i}", [i + 1], 3 + i) for i in range(5)))
        await engine.shutdown()
        return results

    results = run(main())
    for i, outputs in enumerate(results):
        assert len(outputs) == 3 + i
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == [i + 1] * (3 + i)
        assert not any(o.finished for o in outputs[:-1])
    assert fake.thread_ids and threading.get_ident() not in fake.thread_ids


def test_an_engine_built_on_the_engine_thread_is_stepped_on_that_thread():
    """build_on_engine_thread: the thread that built the engine (and so owns torch's
    OpenMP pool) runs every step; a failing build raises in the caller."""
    built_on: list[int] = []

    def build():
        built_on.append(threading.get_ident())
        return FakeEngine()

    async def main():
        engine = AsyncLLMEngine.build_on_engine_thread(build, max_queue=5)
        assert engine.max_queue == 5 and not engine.is_alive  # built, loop not yet started
        engine.start()
        outputs = await collect(engine, "r", [7], 3)
        await engine.shutdown()
        return engine, outputs

    engine, outputs = run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == [7, 7, 7]
    assert built_on and built_on[0] != threading.get_ident()
    assert engine.engine.thread_ids == set(built_on)

    def broken():
        raise ValueError("no such model file")

    with pytest.raises(ValueError, match="no such model file"):
        AsyncLLMEngine.build_on_engine_thread(broken)


def test_bad_request_is_refused_and_the_loop_keeps_serving():
    fake = FakeEngine()

    async def main():
        engine = AsyncLLMEngine(fake)
        engine.start()
        with pytest.raises(InvalidRequestError, match="prompt is empty") as refused:
            await add(engine, "bad", [], SamplingParams())
        assert refused.value.param == "prompt"
        with pytest.raises(InvalidRequestError, match="out of range"):
            await add(engine, "bad", [1000], SamplingParams())
        assert engine.num_unfinished_seqs == 0 and not fake.requests
        outputs = await collect(engine, "good", [5], 2)
        await engine.shutdown()
        return outputs

    assert run(main())[-1].finished


def test_failing_step_fails_only_its_batch():
    fake = FakeEngine()

    async def main():
        engine = AsyncLLMEngine(fake)
        engine.start()
        fake.step_gate.clear()  # hold the first step until we listen
        poisoned = await add(engine, "poisoned", [POISON], SamplingParams(max_tokens=5))
        fake.step_gate.set()
        with pytest.raises(EngineStepError, match="kernel exploded"):
            async for _ in poisoned:
                pass
        assert "poisoned" in fake.aborted
        assert engine.is_alive
        outputs = await collect(engine, "after", [7], 3)  # the loop still serves
        await engine.shutdown()
        return outputs

    assert run(main())[-1].finished


def test_abort_reaches_the_engine():
    fake = FakeEngine()

    async def main():
        engine = AsyncLLMEngine(fake)
        engine.start()
        gen = engine.generate("long", [3], SamplingParams(max_tokens=10**9))
        await gen.__anext__()
        await gen.aclose()  # the consumer goes away: generate() aborts in `finally`
        for _ in range(100):
            if "long" in fake.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.num_unfinished_seqs == 0
        await engine.shutdown()

    run(main())
    assert fake.aborted == ["long"] and not fake.requests


def test_abort_ends_an_iteration_in_progress():
    fake = FakeEngine()

    async def main():
        engine = AsyncLLMEngine(fake)
        engine.start()
        stream = await add(engine, "r", [3], SamplingParams(max_tokens=10**9))
        received = []

        async def consume():
            async for output in stream:
                received.append(output)

        consumer = asyncio.create_task(consume())
        while not received:
            await asyncio.sleep(0.01)
        engine.abort("r")
        await asyncio.wait_for(consumer, timeout=5)
        await engine.shutdown()
        return received

    assert not run(main())[-1].finished


def test_dead_loop_fails_streams_and_reports_not_alive():
    fake = FakeEngine()

    async def main():
        engine = AsyncLLMEngine(fake)
        engine.start()
        stream = await add(engine, "r", [1], SamplingParams(max_tokens=10**9))
        fake.die = True
        with pytest.raises(EngineDeadError, match="bookkeeping bug"):
            async for _ in stream:
                pass
        assert not engine.is_alive
        with pytest.raises(EngineDeadError):
            await add(engine, "late", [1], SamplingParams())

    run(main())


def test_queue_limit_counts_sequences_beyond_the_batch():
    fake = FakeEngine(max_num_seqs=1)

    async def main():
        engine = AsyncLLMEngine(fake, max_queue=1)
        engine.start()
        long = SamplingParams(max_tokens=10**9)
        await add(engine, "a", [1], long)  # runs
        await add(engine, "b", [1], long)  # waits: 1 sequence queued, the limit
        with pytest.raises(QueueFullError, match="at most 1"):
            await add(engine, "c", [1], long)
        with pytest.raises(QueueFullError):
            engine.check_queue(1)
        engine.abort("a")
        engine.abort("b")
        engine.check_queue(2)  # room again: one runs, one waits
        await engine.shutdown()

    run(main())


def test_cancel_all_fails_open_streams():
    fake = FakeEngine()

    async def main():
        engine = AsyncLLMEngine(fake)
        engine.start()
        streams = [await add(engine, f"r{i}", [1], SamplingParams(max_tokens=10**9))
                   for i in range(3)]
        engine.cancel_all("shutting down")
        for stream in streams:
            with pytest.raises(EngineDeadError, match="shutting down"):
                async for _ in stream:
                    pass
        assert engine.num_unfinished_seqs == 0
        for _ in range(100):
            if not fake.requests:
                break
            await asyncio.sleep(0.01)
        assert engine.is_alive  # cancelling requests is not stopping the loop
        await engine.shutdown()

    run(main())
    assert sorted(fake.aborted) == ["r0", "r1", "r2"]
