"""The local tensor-parallel worker's socket carries typed messages (parallel/messages.py):
they survive the framing, and a worker answers what it cannot do with a Reply naming the
error rather than dying silently."""

from __future__ import annotations

import logging

from pagoda.child_process import receive_message, send_message, start_child_process
from pagoda.config import EngineConfig, ModelConfig
from pagoda.executor.parallel.messages import Call, Reply, Shutdown, WorkerStart

WORKER = "pagoda.executor.parallel.worker_process"


def test_messages_round_trip_through_the_framing() -> None:
    from multiprocessing import Pipe

    a, b = Pipe()
    for message in (Call("execute_model", (1, "x")), Shutdown(), Reply([1, 2]),
                    Reply.failure(ValueError("bad")), WorkerStart(EngineConfig(), 1, 2,
                                                                   "tcp://127.0.0.1:1", 20)):
        send_message(a, message)
        assert receive_message(b) == message
    assert Reply.failure(ValueError("bad")).error == "ValueError: bad"


def test_a_worker_that_cannot_start_replies_with_the_error() -> None:
    child = start_child_process(WORKER)
    try:
        config = EngineConfig(model=ModelConfig(model="/nonexistent/model.gguf"))
        send_message(child.connection, WorkerStart(config, 0, 1, "tcp://127.0.0.1:1",
                                                   logging.WARNING))
        reply = receive_message(child.connection)
        assert isinstance(reply, Reply) and reply.value is None
        assert "nonexistent" in reply.error
        child.join(30)
        assert child.exitcode == 0
    finally:
        child.kill()
        child.join(5)


def test_a_worker_refuses_a_first_message_that_is_not_a_start() -> None:
    child = start_child_process(WORKER)
    try:
        send_message(child.connection, Call("execute_model", ()))
        assert receive_message(child.connection) == Reply(
            error="expected WorkerStart, got Call")
        child.join(30)
        assert child.exitcode == 0
    finally:
        child.kill()
        child.join(5)
