"""The engine loop: the one owner of an LLMEngine, driven by commands (loop_commands.py),
reporting to LoopEvents. It runs on the engine thread of this process (thread_core.py) or
on a data-parallel replica's main thread (data_parallel/replica_main.py); both run this same
loop, only their events differ (asyncio callbacks, or messages on a pipe).

    put(command) (any thread) --> SimpleQueue --> run() (the engine thread):
        idle: block on the queue; busy: drain it between steps
        Add   -> engine.add_engine_request -> events.added(request_id, error or None)
        Abort -> engine.abort_request (frees KV blocks)
        Sync  -> publish, then events.synced(token)
        LoRACall -> engine.add_lora / remove_lora / list_loras -> events.answered(call_id, ...)
        Stop  -> later Adds refused, the loop ends
        step  -> events.deliver([(request_id, RequestOutput | error), ...])
        at the start and after each iteration: events.published(engine.snapshot())

- Failures are contained: a `step()` that raises fails the requests of its batch (the engine
  has aborted them: BatchFailedError) and the loop keeps serving. Only an error in the
  loop's own bookkeeping (or an EngineFatalError) ends it: `dead_error` is set.
- At its end (Stop or death) the loop aborts whatever the engine still holds, shuts the
  engine down, publishes, tells `events.ended(dead_error)`, and answers every Sync left.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Protocol

from pagoda.engine.loop.llm_engine import BatchFailedError
from pagoda.engine.loop.loop_commands import LORA_METHODS, Abort, Add, LoRACall, Stop, Sync
from pagoda.engine.loop.request_stream import Delivery, EngineDeadError, EngineStepError
from pagoda.engine.stats.snapshot import EngineSnapshot
from pagoda.errors import EngineFatalError

logger = logging.getLogger(__name__)

class LoopEvents(Protocol):
    """What the loop reports; every call comes from the loop's thread."""

    def added(self, request_id: str, error: BaseException | None) -> None:
        """The engine took the request (error None), or refused it."""

    def deliver(self, items: Delivery) -> None: ...

    def synced(self, token: Any) -> None: ...

    def answered(self, call_id: int, result: Any, error: BaseException | None) -> None:
        """A LoRACall's result (error None), or why it failed."""

    def published(self, snapshot: EngineSnapshot) -> None:
        """The engine's state after an iteration (the last call of each iteration)."""

    def idle_timeout(self) -> float | None:
        """How long an idle loop may block on its queue (None: until a command comes)."""

    def ended(self, dead_error: BaseException | None) -> None:
        """The loop is over (dead_error None: it was stopped)."""


class EngineLoop:
    def __init__(self, engine, events: LoopEvents, metrics=None) -> None:
        """`engine` is an LLMEngine (or anything with its interface); from `run()` on only the
        loop's thread touches it. `metrics` (EngineMetrics or None) may be set until `run`."""
        self.engine = engine
        self.events = events
        self.metrics = metrics
        self.dead_error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._request_ids: set[str] = set()
        """Requests the engine took and has not ended (the loop's own record)."""
        self._sync_lock = threading.Lock()
        self._syncs_answered = True
        """Whether a Sync put now will be answered (False once the loop has ended)."""

    def put(self, command: Add | Abort | Stop | LoRACall) -> None:
        """Queue a command (any thread)."""
        self._commands.put(command)

    def sync(self, token: Any) -> bool:
        """Queue a Sync; False (nothing queued) once the loop has ended."""
        with self._sync_lock:
            if not self._syncs_answered:
                return False
            self._commands.put(Sync(token))
            return True

    def call(self, call: LoRACall) -> bool:
        """Queue an adapter command (answered as a Sync is); False (nothing queued) once
        the loop has ended."""
        with self._sync_lock:
            if not self._syncs_answered:
                return False
            self._commands.put(call)
            return True

    # ---- the loop's thread -----------------------------------------------------------------

    def run(self) -> None:
        stopped = False
        try:
            self._publish()  # the state before any command (a replica's first snapshot)
            while not stopped:
                stopped = self._process_commands(block=not self.engine.has_unfinished_requests())
                if not stopped and self.engine.has_unfinished_requests():
                    self._step()
                self._publish()
        except BaseException as e:  # our own bug: make it visible, fail everyone
            logger.exception("the engine loop died")
            self.dead_error = e
        finally:
            self._abort_all_in_engine()
            if hasattr(self.engine, "shutdown"):  # (test doubles may have none)
                self.engine.shutdown()
            self._publish()
            self.events.ended(self.dead_error)
            self._answer_syncs_left()

    def _process_commands(self, block: bool) -> bool:
        """Handle what is queued (wait for one first if `block`); True on Stop."""
        commands = []
        if block:
            try:
                commands.append(self._commands.get(timeout=self.events.idle_timeout()))
            except queue.Empty:
                pass
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for i, command in enumerate(commands):
            if isinstance(command, Add):
                self._add(command.request)
            elif isinstance(command, Abort):
                self._abort(command.request_id)
            elif isinstance(command, Sync):
                self._publish()  # what came before it, visible before it is answered
                self.events.synced(command.token)
            elif isinstance(command, LoRACall):
                self._lora_call(command)
            elif isinstance(command, Stop):
                for later in commands[i + 1:]:
                    if isinstance(later, Add):
                        self.events.added(later.request.request_id,
                                          EngineDeadError("shutting down"))
                    elif isinstance(later, LoRACall):
                        self.events.answered(later.call_id, None,
                                             EngineDeadError("shutting down"))
                    elif isinstance(later, Sync):  # (answered after the loop's last publish)
                        self._commands.put(later)
                return True
        return False

    def _answer_syncs_left(self) -> None:
        """The loop has ended (its last snapshot published): answer every Sync queued (and
        refuse every Add); `sync` queues none from now on."""
        with self._sync_lock:
            self._syncs_answered = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Sync):
                self.events.synced(command.token)
            elif isinstance(command, Add):
                self.events.added(command.request.request_id,
                                  EngineDeadError("the engine loop has stopped"))
            elif isinstance(command, LoRACall):
                self.events.answered(command.call_id, None,
                                     EngineDeadError("the engine loop has stopped"))

    def _add(self, request) -> None:
        try:
            self.engine.add_engine_request(request)
        except Exception as e:
            if not isinstance(e, ValueError):
                logger.exception("add_request(%s) failed", request.request_id)
            self.events.added(request.request_id, e)
            return
        self._request_ids.add(request.request_id)
        self.events.added(request.request_id, None)

    def _lora_call(self, call: LoRACall) -> None:
        """Run an adapter command on the engine and answer it (a refusal, a ValueError, is
        the answer's error; so is anything else it raised, logged)."""
        if call.method not in LORA_METHODS:
            self.events.answered(call.call_id, None,
                                 ValueError(f"unknown engine command {call.method!r}"))
            return
        try:
            result = getattr(self.engine, call.method)(*call.arguments)
        except Exception as e:  # answered to the caller
            if not isinstance(e, ValueError):
                logger.exception("%s failed", call.method)
            self.events.answered(call.call_id, None, e)
            return
        self.events.answered(call.call_id, result, None)

    def _abort(self, request_id: str) -> None:
        """Abort in the engine (a no-op for ids it does not hold)."""
        self._request_ids.discard(request_id)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("abort_request(%s) failed", request_id)
        if self.metrics is not None:
            self.metrics.forget(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except BatchFailedError as e:  # the engine aborted that batch; keep serving
            self._fail_requests(e.request_ids, e.__cause__ or e)
            if isinstance(e.__cause__, EngineFatalError):
                raise e.__cause__ from None  # (workers gone: the loop ends, /health says so)
            return
        except Exception as e:  # noqa: BLE001 - outside the forward: fail what runs
            snapshot = self.engine.snapshot()
            failed = list(snapshot.running_request_ids) or list(self._request_ids)
            for request_id in failed:
                self._abort(request_id)
            self._fail_requests(failed, e)
            return
        now = time.time()
        failed = self.engine.take_failed_requests()
        if failed:  # their own fault: an error for them alone, not an "abort" output
            outputs = [o for o in outputs if o.request_id not in failed]
            self._fail_requests_alone(failed)
        for output in outputs:
            if output.finished:
                self._request_ids.discard(output.request_id)
        if outputs:
            self.events.deliver([(o.request_id, o) for o in outputs])
        if self.metrics is not None:
            try:
                self.metrics.record_step(outputs, now)
            except Exception:
                logger.exception("recording metrics failed")

    def _fail_requests(self, request_ids: list[str], error: BaseException) -> None:
        """A step raised: fail the requests of its batch (already aborted)."""
        logger.error(
            "engine step failed (%s: %s); failing %d request(s): %s", type(error).__name__,
            error, len(request_ids), ", ".join(request_ids), exc_info=error,
        )
        message = f"the engine failed while running this request: {type(error).__name__}: {error}"
        self._forget(request_ids)
        self.events.deliver([(rid, EngineStepError(message)) for rid in request_ids])

    def _fail_requests_alone(self, failed: dict[str, str]) -> None:
        """Requests the engine stopped for a fault of their own (the rest of the batch went on)."""
        for request_id, reason in failed.items():
            logger.error("request %s failed: %s", request_id, reason)
        self._forget(list(failed))
        self.events.deliver([(rid, EngineStepError(f"the engine failed this request: {reason}"))
                             for rid, reason in failed.items()])

    def _forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._request_ids.discard(request_id)
            if self.metrics is not None:
                self.metrics.forget(request_id)

    def _abort_all_in_engine(self) -> None:
        snapshot = self.engine.snapshot()
        for request_id in snapshot.running_request_ids + snapshot.waiting_request_ids:
            self._abort(request_id)

    def _publish(self) -> None:
        try:
            snapshot = self.engine.snapshot()
            if self.metrics is not None:
                self.metrics.update(snapshot)
            self.events.published(snapshot)
        except Exception:
            logger.exception("publishing engine stats failed")
