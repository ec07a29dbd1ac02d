"""The server's view of one replica index, across the processes that fill it.

    STARTING ──READY──> HEALTHY ──lost──> RESTARTING ──(relaunch)──> STARTING ...
        │                                     ^
        └──lost (a failed start)──────────────┘   MAX_START_FAILURES in a row: FAILED

Each process that fills the slot is one incarnation; its reader thread tags every message
with the incarnation, so nothing a dead process sent can touch its successor's state.
Only the event loop changes a slot (the reader thread posts to it); `read_replica` runs on
its own thread and joins the process before it reports the loss, so the exit code is known
and the event loop never waits on a process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from pagoda.child_process import receive_message, send_message
from pagoda.engine.data_parallel.launcher import ReplicaHandle
from pagoda.engine.data_parallel.messages import ReplicaInfo, ReplicaMessage, ServerMessage
from pagoda.engine.data_parallel.snapshots import counters_only, merge_snapshots
from pagoda.engine.stats.snapshot import EngineSnapshot

logger = logging.getLogger(__name__)

STARTING, HEALTHY, RESTARTING, FAILED, STOPPED = (
    "starting", "healthy", "restarting", "failed", "stopped")
MAX_START_FAILURES = 3
"""Starts in a row that fail (the process died before READY) before a slot is given up."""
LOST_JOIN_TIMEOUT_S = 5.0


@dataclass
class ReplicaSlot:
    index: int
    state: str = STARTING
    handle: ReplicaHandle | None = None
    incarnation: int = 0
    info: ReplicaInfo | None = None
    """What its current (or last) process reported when ready."""
    request_ids: set[str] = field(default_factory=set)
    """Requests routed to it and not ended (their acks may be pending)."""
    pending_acks: dict[str, asyncio.Future] = field(default_factory=dict)
    snapshot: EngineSnapshot = field(default_factory=EngineSnapshot)
    """The current incarnation's last snapshot."""
    retired: EngineSnapshot = field(default_factory=EngineSnapshot)
    """Counters of its dead incarnations (gauges zero)."""
    num_restarts: int = 0
    num_start_failures: int = 0
    """Failed starts in a row (reset by READY)."""
    last_error: str | None = None

    @property
    def healthy(self) -> bool:
        return self.state == HEALTHY

    def cumulative_snapshot(self) -> EngineSnapshot:
        """Gauges of the current incarnation, counters of all of them."""
        return merge_snapshots([self.retired, self.snapshot])

    def retire_snapshot(self) -> None:
        """Its process is gone: keep its counters, drop its gauges."""
        self.retired = merge_snapshots([self.retired, counters_only(self.snapshot)])
        self.snapshot = EngineSnapshot()

    def send(self, message: ServerMessage) -> bool:
        """Send to the current process; False if it is gone (its loss is then on the way
        through the reader thread)."""
        if self.handle is None:
            return False
        try:
            send_message(self.handle.connection, message)
            return True
        except OSError:
            return False

    def describe(self) -> str:
        text = f"replica {self.index} {self.state}"
        return f"{text} ({self.last_error})" if self.last_error else text


def read_replica(
    handle: ReplicaHandle, incarnation: int,
    post: Callable[[int, ReplicaMessage | None, int | None], None],
) -> None:
    """Thread body: post(incarnation, message, None) per message, then, once the process is
    gone (EOF, or its sentinel), post(incarnation, None, exitcode) exactly once."""
    conn = handle.connection
    waitables = [conn] if handle.sentinel is None else [conn, handle.sentinel]
    try:
        while True:
            ready = wait(waitables)
            if conn in ready:
                post(incarnation, receive_message(conn), None)
            else:  # only the sentinel: gone without closing the pipe (a child holds it)
                break
    except (EOFError, OSError):
        pass
    handle.join(LOST_JOIN_TIMEOUT_S)
    if handle.is_alive():  # closed its pipe but hangs: it cannot serve any more
        logger.error("replica process %s closed its pipe but did not exit: killing it", handle.pid)
        handle.kill()
        handle.join()
    post(incarnation, None, handle.exitcode)
