"""A child process of the engine (a tensor-parallel worker, a data-parallel replica): how it
is started, how messages cross to it, how the parent watches and ends it, and the share of
the CPUs each gets. One module for both kinds of parallelism; it imports nothing of pagoda,
so the engine and the executor both use it.

    parent: start_child_process(module, ...)  ->  ChildProcess
            `python -m module FD` (no re-import of the user's script, no fork of a process
            that has threads), FD the child's end of a socket pair; the parent keeps only
            its own end, so either side's death reads as EOF on the other's
    child:  connect_to_parent() -> its Connection (from argv)
    both:   send_message / receive_message: plain pickle framed by the Connection

The child should ask for a signal when its parent dies (parent_death.die_with_parent);
PR_SET_PDEATHSIG fires when the parent *thread* that started it ends, so start children
from long-lived threads only.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection


def threads_per_process(num_processes: int) -> int:
    """The CPUs this process may run on (its affinity mask, which taskset and container
    cpusets narrow), shared evenly among `num_processes` (at least one each)."""
    return max(1, len(os.sched_getaffinity(0)) // num_processes)


def send_message(connection: Connection, message: object) -> None:
    """Plain pickle over the connection: tensors travel as bytes (multiprocessing's pickler
    would pass their storage as file descriptors, through a channel these processes, not
    started by multiprocessing, cannot open). A Connection's own `recv` reads it too."""
    connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive_message(connection: Connection) -> object:
    """The next message; EOFError once the other side is gone."""
    return pickle.loads(connection.recv_bytes())


class ChildProcess:
    """A started child and the parent's end of its socket pair."""

    def __init__(self, process: subprocess.Popen, connection: Connection) -> None:
        self.process = process
        self.connection = connection
        self.sentinel: int | None = _pidfd(process.pid)
        """Readable once the child has exited (multiprocessing.connection.wait); None where
        the platform has no pidfd (then the connection's EOF tells)."""
        if self.sentinel is not None:
            weakref.finalize(self, os.close, self.sentinel)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; negative: the signal that ended it."""
        return self.process.poll()

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    def join(self, timeout: float | None = None) -> None:
        """Wait (up to `timeout` seconds) for it to exit; reaps it."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)


PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The folder holding this `pagoda` package (this file is pagoda/child_process.py)."""


def start_child_process(module: str, environment: dict[str, str] | None = None) -> ChildProcess:
    """`python -m module FD` with `environment` added to ours (ours wins: a user's setting
    such as OMP_NUM_THREADS is kept); returns at once. The child imports the same `pagoda`
    as this process, whatever the working directory: its folder leads the child's path."""
    parent_end, child_end = socket.socketpair()
    env = {**(environment or {}), **os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_PARENT, env.get("PYTHONPATH")]))
    with child_end:
        process = subprocess.Popen(
            [sys.executable, "-m", module, str(child_end.fileno())],
            pass_fds=[child_end.fileno()], env=env)
    # (the child's end is closed here: else the parent would never read EOF when it dies)
    return ChildProcess(process, Connection(parent_end.detach()))


def connect_to_parent() -> Connection:
    """In the child: its end of the socket pair (the FD start_child_process passed)."""
    return Connection(int(sys.argv[1]))


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
