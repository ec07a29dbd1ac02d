"""The one child-process handle (pagoda/child_process.py) that tensor-parallel workers and
data-parallel replicas share: its framing reads back what it wrote (a Connection's own
recv too), and a started child's liveness, sentinel, kill and exit code agree."""

from __future__ import annotations

import os
import signal
from multiprocessing import Pipe
from multiprocessing.connection import wait

from pagoda.child_process import (
    receive_message,
    send_message,
    start_child_process,
    threads_per_process,
)


def test_the_cpu_share_is_even_and_at_least_one() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert threads_per_process(1) == cpus
    assert threads_per_process(cpus * 4) == 1


def test_messages_cross_a_connection() -> None:
    a, b = Pipe()
    send_message(a, {"x": [1, 2]})
    assert receive_message(b) == {"x": [1, 2]}
    send_message(a, ("ok", 3))
    assert b.recv() == ("ok", 3)  # (plain pickle: a Connection reads it as its own)


def test_a_child_is_watched_and_killed() -> None:
    # A TP worker process waits for its first message: a child that stays up until killed.
    child = start_child_process("pagoda.executor.parallel.worker_process")
    try:
        assert child.is_alive() and child.exitcode is None and child.pid > 0
        if child.sentinel is not None:
            assert wait([child.sentinel], timeout=0.1) == []
        child.kill()
        child.join(10)
        assert not child.is_alive() and child.exitcode == -signal.SIGKILL
        if child.sentinel is not None:
            assert wait([child.sentinel], timeout=5) == [child.sentinel]
        assert wait([child.connection], timeout=5) == [child.connection]  # its end: EOF
    finally:
        child.kill()
        child.join(5)
