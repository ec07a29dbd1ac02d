"""Starting one replica: the seam between the data-parallel engine and where replicas run.

`launch_replica(spec)` returns a ReplicaHandle; the engine uses nothing else of a replica:
its connection (typed messages, messages.py, framed by child_process.send_message), a
sentinel that turns readable once it is gone, and kill/join. Backend "mp" is a local child
process (pagoda/child_process.py: `python -m pagoda.engine.data_parallel.replica_main FD`,
the ReplicaSpec its first message; never a fork: the server process has threads, and CUDA
or OpenMP state must not be copied); backend "ray" is a Ray actor on the cluster behind the
same handle (ray_replica.py).

Invariants of an "mp" replica:
- the server holds only its own end of the socket pair, so a replica's death reads as EOF
  at once, and the server's death reads as EOF in the replica (replica_main.py then exits);
- the replica also asks Linux for SIGKILL when its parent thread dies (PR_SET_PDEATHSIG);
  replicas are therefore started from long-lived threads only (the main thread, the event
  loop's, or the default executor's, which live as long as the loop);
- the engine stops it on shutdown, and kills what is left at exit (atexit).
"""

from __future__ import annotations

import signal
from multiprocessing.connection import Connection
from typing import Protocol

from pagoda.child_process import send_message, start_child_process
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


def launch_replica(spec: ReplicaSpec, backend: str = "mp") -> ReplicaHandle:
    """Start a replica (a local process, or a Ray actor); returns at once (it reports READY
    or FAILED on its pipe)."""
    if backend == "ray":
        from pagoda.engine.data_parallel.ray_replica import launch_ray_replica

        return launch_ray_replica(spec)
    replica = start_child_process("pagoda.engine.data_parallel.replica_main",
                                  {"OMP_NUM_THREADS": str(spec.num_threads)})
    send_message(replica.connection, spec)
    return replica


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
