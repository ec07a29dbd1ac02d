"""The one child-process handle (pagoda/child_process.py) that tensor-parallel workers and
data-parallel replicas share: its framing reads back what it wrote (a Connection's own
recv too), and a started child's liveness, sentinel, kill and exit code agree."""

from __future__ import annotations

import os
import signal
from multiprocessing import Pipe
from multiprocessing.connection import wait

import pagoda
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


def test_a_child_imports_this_pagoda_from_any_working_directory(tmp_path, monkeypatch) -> None:
    """From a folder with no `pagoda` in it, the child still finds this process's package
    (a replica started by `pagoda serve` run elsewhere loads the same code as its server)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "probe.py").write_text(
        "import os, pagoda\n"
        "from pagoda.child_process import connect_to_parent, send_message\n"
        "send_message(connect_to_parent(), (pagoda.__file__, os.environ['PYTHONPATH']))\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # only to find probe.py itself
    child = start_child_process("probe")
    try:
        child_pagoda, child_path = receive_message(child.connection)
        assert child_pagoda == pagoda.__file__
        # (an installed pagoda would be found anyway: the path is what makes it this one)
        package_parent = os.path.dirname(os.path.dirname(pagoda.__file__))
        assert child_path.split(os.pathsep) == [package_parent, str(tmp_path)]
    finally:
        child.join(10)
