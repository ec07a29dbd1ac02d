"""A data-parallel replica's body without a model: the same EngineLoop the in-process
engine runs, over a fake LLMEngine, with PipeEvents writing typed Batches onto a pipe:
acks, outputs in order, a refusal, an abort, the first snapshot, and Stop."""

from __future__ import annotations

import threading
import time
from multiprocessing import Pipe

from pagoda.engine.core.input_processor import EngineRequest
from pagoda.engine.data_parallel.messages import (
    Abort,
    Add,
    Added,
    Batch,
    Error,
    Out,
    Snapshot,
    Stop,
    decode_error,
)
from pagoda.engine.data_parallel.replica_main import PipeEvents
from pagoda.engine.loop.engine_loop import EngineLoop
from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import SamplingParams
from tests.entrypoints.test_server_async_engine import FakeEngine


class RefusingEngine(FakeEngine):
    def add_engine_request(self, request: EngineRequest) -> None:
        if request.request_id == "bad":
            raise InvalidRequestError("no such thing", "prompt")
        super().add_engine_request(request)


def request(request_id: str, max_tokens: int) -> EngineRequest:
    return EngineRequest(request_id, None, [4], SamplingParams(max_tokens=max_tokens), 1, 0.0)


def test_the_replica_loop_answers_on_its_pipe() -> None:
    server_end, replica_end = Pipe()
    engine = RefusingEngine()
    events = PipeEvents(replica_end)
    engine_loop = events.engine_loop = EngineLoop(engine, events)
    thread = threading.Thread(target=engine_loop.run, daemon=True)
    thread.start()
    items = []

    def receive_until(condition) -> None:
        while not condition():
            assert server_end.poll(5), "no message from the loop"
            message = server_end.recv()
            assert isinstance(message, Batch)
            items.extend(message.items)

    receive_until(lambda: any(isinstance(i, Snapshot) for i in items))  # before any command
    engine_loop.put(Add(request("a", 3)))
    engine_loop.put(Add(request("bad", 3)))
    receive_until(lambda: sum(isinstance(i, Out) and i.output.finished for i in items) == 1)
    assert Added("a") in items
    refused = next(i for i in items if isinstance(i, Error))
    assert refused.request_id == "bad" and isinstance(decode_error(refused.error),
                                                      InvalidRequestError)
    outputs = [i.output for i in items if isinstance(i, Out)]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3]
    engine_loop.put(Add(request("long", 10**9)))
    receive_until(lambda: any(isinstance(i, Out) and i.request_id == "long" for i in items))
    engine_loop.put(Abort("long"))
    engine_loop.put(Stop())
    deadline = time.monotonic() + 5
    while thread.is_alive() and time.monotonic() < deadline:
        while server_end.poll(0.01):  # (read on, as the server does: a full pipe blocks it)
            server_end.recv()
    assert not thread.is_alive() and engine_loop.dead_error is None
    assert engine.aborted == ["long"] and not engine.requests
