"""AsyncLLMEngine against a fake LLMEngine (no model): streams, aborts, contained failures,
a dead loop, and the waiting-queue limit. Fast; the real engine is covered by the server
tests."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.engine.request_stream import EngineDeadError, EngineStepError, QueueFullError
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams

POISON = 666
"""A prompt token that makes the fake engine's step raise while that request is running."""


class FakeEngine:
    """Each request emits its prompt's first token `max_tokens` times, one per step."""

    def __init__(self, max_num_seqs: int = 8) -> None:
        self.tokenizer = object()
        self.max_model_len = 100
        self.vocab_size = 1000
        self.kv_capacity_tokens = 1600
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=max_num_seqs))
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()
        self.die = False
        self.step_gate = threading.Event()
        self.step_gate.set()
        self.scheduler = SimpleNamespace(num_running=0, num_waiting=0, running=[])
        self.output_processor = SimpleNamespace(child_ids=lambda rid: [rid] if rid in self.requests else [])

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0):
        self.thread_ids.add(threading.get_ident())
        if not prompt:
            raise ValueError("prompt is empty; give at least one token")
        self.requests[request_id] = {"prompt": prompt, "params": params, "tokens": []}
        self._sync()

    def abort_request(self, request_ids):
        self.thread_ids.add(threading.get_ident())
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            if self.requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)
        self._sync()

    def has_unfinished_requests(self):
        if self.die:
            raise RuntimeError("bookkeeping bug")
        return bool(self.requests)

    def _sync(self):
        self.scheduler.num_running = len(self.requests)
        self.scheduler.running = [SimpleNamespace(request_id=r) for r in self.requests]

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.step_gate.wait()
        if any(r["prompt"][0] == POISON for r in self.requests.values()):
            raise RuntimeError("kernel exploded")
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
        self._sync()
        return outputs


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
        with pytest.raises(ValueError, match="prompt is empty"):
            await engine.add_request("bad", [], SamplingParams())
        assert engine.num_unfinished_seqs == 0
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
        poisoned = await engine.add_request("poisoned", [POISON], SamplingParams(max_tokens=5))
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
        gen = engine.generate("long", [3], SamplingParams(max_tokens=10_000))
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
        stream = await engine.add_request("r", [3], SamplingParams(max_tokens=10_000))
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
        stream = await engine.add_request("r", [1], SamplingParams(max_tokens=10_000))
        fake.die = True
        with pytest.raises(EngineDeadError, match="bookkeeping bug"):
            async for _ in stream:
                pass
        assert not engine.is_alive
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", [1], SamplingParams())

    run(main())


def test_queue_limit_counts_sequences_beyond_the_batch():
    fake = FakeEngine(max_num_seqs=1)

    async def main():
        engine = AsyncLLMEngine(fake, max_queue=1)
        engine.start()
        long = SamplingParams(max_tokens=10_000)
        await engine.add_request("a", [1], long)  # runs
        await engine.add_request("b", [1], long)  # waits: 1 sequence queued, the limit
        with pytest.raises(QueueFullError, match="at most 1"):
            await engine.add_request("c", [1], long)
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
        streams = [await engine.add_request(f"r{i}", [1], SamplingParams(max_tokens=10_000))
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
