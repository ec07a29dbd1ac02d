"""The replicas' processes: start them all, watch them, restart one that dies, stop them all.

The supervisor owns the ReplicaSlots' process side (handle, incarnation, state); what a
replica's loss means for requests is the engine's (engine.py), told through ReplicaEvents.

    start_all()   blocking, before the event loop serves: launch every replica, wait for
                  each READY (a FAILED or a death raises ValueError: nothing is served)
    watch(loop)   one reader thread per process from then on (replica_slot.read_replica)
    lost          -> events.on_lost, then restart at once (a replica that was healthy) or
                  after RESTART_BACKOFF_S * 2^k (k-th failed start in a row); after
                  MAX_START_FAILURES failed starts in a row the slot is FAILED for good
    stop()        STOP to each, SIGKILL after the timeout (replicas ignore SIGTERM)

No replica outlives the server: stop() on shutdown, kill_all() at interpreter exit and on a
failed start, and in the replica itself PR_SET_PDEATHSIG and pipe EOF (replica_main.py).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Protocol

from pagoda.child_process import receive_message, threads_per_process
from pagoda.config import EngineConfig
from pagoda.engine.data_parallel.launcher import (
    ReplicaHandle,
    ReplicaSpec,
    describe_exit,
    launch_replica,
)
from pagoda.engine.data_parallel.messages import (
    Batch,
    BatchItem,
    Dead,
    Failed,
    Ready,
    ReplicaInfo,
    ReplicaMessage,
    Stop,
)
from pagoda.engine.data_parallel.replica_slot import (
    FAILED as SLOT_FAILED,
)
from pagoda.engine.data_parallel.replica_slot import (
    HEALTHY,
    MAX_START_FAILURES,
    RESTARTING,
    STARTING,
    STOPPED,
    ReplicaSlot,
    read_replica,
)

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = 1.0
"""Delay before restarting after a failed start (doubled each time); a crash of a healthy
replica restarts it at once."""

Launcher = Callable[[ReplicaSpec, str], ReplicaHandle]


class ReplicaEvents(Protocol):
    """What the engine does about a replica (all called on the event loop)."""

    def on_batch(self, slot: ReplicaSlot, items: list[BatchItem]) -> None: ...

    def on_ready(self, slot: ReplicaSlot) -> None: ...

    def on_lost(self, slot: ReplicaSlot, how: str) -> None:
        """Its process is gone (state already RESTARTING): fail its requests."""

    def on_restart(self, slot: ReplicaSlot) -> None: ...

    def on_given_up(self, slot: ReplicaSlot) -> None: ...


class ReplicaSupervisor:
    def __init__(self, config: EngineConfig, launcher: Launcher = launch_replica) -> None:
        parallel = config.parallel
        self.backend = parallel.distributed_executor_backend
        self.replica_config = dataclasses.replace(
            config, parallel=dataclasses.replace(parallel, data_parallel_size=1))
        self.num_threads = threads_per_process(parallel.data_parallel_size)
        self.slots = [ReplicaSlot(i) for i in range(parallel.data_parallel_size)]
        self._launcher = launcher
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: ReplicaEvents | None = None
        self.stopping = False
        atexit.register(self.kill_all)

    # ---- start-up (blocking) -----------------------------------------------------------------

    def start_all(self) -> list[ReplicaInfo]:
        """Launch every replica (they load in parallel) and wait for all to be ready; raises
        ValueError (after killing the others) if one fails."""
        try:
            for slot in self.slots:
                self._launch(slot, send_tokenizer=slot.index == 0)
            for slot in self.slots:
                slot.info = self._wait_ready(slot)
                slot.state = HEALTHY
        except BaseException:
            self.kill_all()
            raise
        return [slot.info for slot in self.slots]

    def _launch(self, slot: ReplicaSlot, send_tokenizer: bool = False) -> None:
        spec = ReplicaSpec(slot.index, self.replica_config, self.num_threads, os.getpid(),
                           logging.getLogger("pagoda").getEffectiveLevel(), send_tokenizer)
        slot.handle = self._launcher(spec, self.backend)
        slot.incarnation += 1
        slot.state = STARTING

    @staticmethod
    def _wait_ready(slot: ReplicaSlot) -> ReplicaInfo:
        handle = slot.handle
        conn = handle.connection
        waitables = [conn] if handle.sentinel is None else [conn, handle.sentinel]
        while True:
            ready = wait(waitables)
            message = None
            if conn in ready:
                try:
                    message = receive_message(conn)
                except EOFError:
                    pass
            if isinstance(message, Ready):
                return message.info
            failure = message.message if isinstance(message, Failed) else None
            if failure is not None:
                raise ValueError(f"engine replica {slot.index} failed to start: {failure}")
            if message is None:
                handle.join(5.0)
                raise ValueError(f"engine replica {slot.index} died while starting "
                                 f"({describe_exit(handle.exitcode)}); see its log above")

    # ---- watching (event loop) ---------------------------------------------------------------

    def watch(self, loop: asyncio.AbstractEventLoop, events: ReplicaEvents) -> None:
        self._loop = loop
        self._events = events
        for slot in self.slots:
            self._start_reader(slot)

    def _start_reader(self, slot: ReplicaSlot) -> None:
        index = slot.index

        def post(incarnation: int, message: ReplicaMessage | None, exitcode: int | None) -> None:
            try:
                self._loop.call_soon_threadsafe(self._on_event, index, incarnation, message,
                                                exitcode)
            except RuntimeError:
                pass  # the event loop is closed: nobody is listening any more

        threading.Thread(target=read_replica, args=(slot.handle, slot.incarnation, post),
                         name=f"pagoda-dp-reader-{index}", daemon=True).start()

    def _on_event(self, index: int, incarnation: int, message: ReplicaMessage | None,
                  exitcode: int | None) -> None:
        slot = self.slots[index]
        if incarnation != slot.incarnation:
            return  # from a process that was replaced
        if message is None:
            self._on_lost(slot, exitcode)
        elif isinstance(message, Batch):
            self._events.on_batch(slot, message.items)
        elif isinstance(message, Ready):
            slot.info = message.info
            slot.state = HEALTHY
            slot.num_start_failures = 0
            slot.last_error = None
            logger.info("engine replica %d is back (pid %d)", index, slot.info.pid)
            self._events.on_ready(slot)
        elif isinstance(message, (Failed, Dead)):
            slot.last_error = message.message
            logger.error("engine replica %d: %s", index, message.message)

    def _on_lost(self, slot: ReplicaSlot, exitcode: int | None) -> None:
        slot.handle = None
        if self.stopping:
            return
        how = describe_exit(exitcode)
        was_starting = slot.state == STARTING
        slot.state = RESTARTING
        slot.last_error = slot.last_error or f"its process ended: {how}"
        logger.error("engine replica %d died (%s); failing its %d request(s)", slot.index, how,
                     len(slot.request_ids))
        self._events.on_lost(slot, how)
        if was_starting:
            slot.num_start_failures += 1
        if slot.num_start_failures >= MAX_START_FAILURES:
            slot.state = SLOT_FAILED
            logger.error("engine replica %d failed to start %d times in a row: giving it up",
                         slot.index, MAX_START_FAILURES)
            self._events.on_given_up(slot)
            return
        delay = RESTART_BACKOFF_S * 2 ** (slot.num_start_failures - 1) if was_starting else 0.0
        logger.info("restarting engine replica %d in %.0f s", slot.index, delay)
        self._loop.call_later(delay, self._restart, slot)

    def _restart(self, slot: ReplicaSlot) -> None:
        if self.stopping:
            return
        slot.num_restarts += 1
        try:
            self._launch(slot)
        except Exception as e:
            logger.exception("restarting engine replica %d failed", slot.index)
            slot.last_error = f"{type(e).__name__}: {e}"
            slot.state = STARTING
            self._on_lost(slot, None)
            return
        logger.info("engine replica %d restarting (pid %s)", slot.index, slot.handle.pid)
        self._events.on_restart(slot)
        self._start_reader(slot)

    # ---- stopping ----------------------------------------------------------------------------

    async def stop(self, timeout: float) -> None:
        self.stopping = True
        for slot in self.slots:
            if slot.state == STARTING and slot.handle is not None:
                slot.handle.kill()  # still loading: it would read STOP only once built
            slot.send(Stop())
            slot.state = STOPPED
        await asyncio.get_running_loop().run_in_executor(None, self._join_all, timeout)
        atexit.unregister(self.kill_all)

    def _join_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        handles = [slot.handle for slot in self.slots if slot.handle is not None]
        for handle in handles:
            handle.join(max(deadline - time.monotonic(), 0.0))
        for handle in handles:
            if handle.is_alive():  # (replicas ignore SIGTERM: replica_main.py)
                logger.warning("replica process %s did not stop in %.0fs: killing it",
                               handle.pid, timeout)
                handle.kill()
                handle.join()

    def kill_all(self) -> None:
        """Last resort (a failed start, interpreter exit)."""
        for slot in self.slots:
            if slot.handle is not None and slot.handle.is_alive():
                slot.handle.kill()
                slot.handle.join(5.0)
