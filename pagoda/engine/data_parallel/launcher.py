"""Starting one replica: the seam between the data-parallel engine and where replicas run.

`launch_replica(spec)` returns a ReplicaHandle; the engine uses nothing else of a replica:
its connection (send/recv/poll of picklable messages, messages.py), a sentinel that turns
readable once it is gone, and kill/join. Backend "mp" is a local process started with the
"spawn" context (never fork: the server process has threads, and CUDA or OpenMP state must
not be copied); backend "ray" is a Ray actor on the cluster behind the same handle
(ray_replica.py).

Invariants of an "mp" replica:
- the server holds only its own end of the pipe (the child's end is closed right after the
  start), so a replica's death reads as EOF at once, and the server's death reads as EOF in
  the replica (replica_main.py then exits);
- the replica also asks Linux for SIGKILL when its parent thread dies (PR_SET_PDEATHSIG);
  replicas are therefore started from long-lived threads only (the main thread, the event
  loop's, or the default executor's, which live as long as the loop);
- it is not a daemon process: a replica may start processes of its own (tensor-parallel
  workers); the engine stops it on shutdown, and kills what is left at exit (atexit).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing.connection import Connection
from typing import Protocol

from pagoda.engine.data_parallel.replica_spec import ReplicaSpec


class ReplicaHandle(Protocol):
    """A started replica, as the engine sees it."""

    connection: Connection
    sentinel: int | None
    """Readable once the replica is gone (multiprocessing.connection.wait); None if the
    backend has no such handle (then only the connection's EOF tells)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


class ProcessReplica:
    """An "mp" replica: a spawned multiprocessing.Process and the server's end of its pipe."""

    def __init__(self, process: multiprocessing.Process, connection: Connection) -> None:
        self.process = process
        self.connection = connection
        self.sentinel = process.sentinel

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        self.process.kill()

    def join(self, timeout: float | None = None) -> None:
        self.process.join(timeout)


def launch_replica(spec: ReplicaSpec, backend: str = "mp") -> ReplicaHandle:
    """Start a replica (a local process, or a Ray actor); returns at once (it reports READY
    or FAILED on its pipe)."""
    if backend == "ray":
        from pagoda.engine.data_parallel.ray_replica import launch_ray_replica

        return launch_ray_replica(spec)
    # Imported here: the module the child unpickles must not import torch at the top.
    from pagoda.engine.data_parallel.replica_main import run_replica

    context = multiprocessing.get_context("spawn")
    server_end, replica_end = context.Pipe(duplex=True)
    process = context.Process(target=run_replica, args=(spec, replica_end),
                              name=f"pagoda-dp-replica-{spec.index}", daemon=False)
    process.start()
    replica_end.close()  # else the server would never read EOF when the replica dies
    return ProcessReplica(process, server_end)


def threads_per_replica(num_replicas: int) -> int:
    """The CPUs this process may use, shared evenly (at least one each)."""
    return max(1, len(os.sched_getaffinity(0)) // num_replicas)


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
