"""The engine loop behind asyncio queues: one thread owns the LLMEngine, each request a stream.

    event loop thread (HTTP handlers)              engine thread (the only LLMEngine user)
    ---------------------------------              ---------------------------------------
    add_request() --_Add--> commands (SimpleQueue) --> engine.add_engine_request -> ack
    abort()       --_Abort-->                      --> engine.abort_request (frees KV blocks)
    synchronize() --_Sync--> (after those before it)  --> publish the snapshot -> ack
    RequestStream.queue <-- loop.call_soon_threadsafe <-- engine.step() outputs / errors
    self.snapshot       <-- (attribute swap)         <-- engine.snapshot() after each step

- The engine thread blocks on the command queue while idle and drains it between steps
  while busy, so a step never waits for HTTP work and HTTP never waits for a step.
- Requests are validated on the event loop (`input_processor`, the one validation step)
  before they are queued, so a bad request never reaches the engine thread.
- Failures are contained: a `step()` that raises fails the requests that were in its
  batch (the engine has aborted them: BatchFailedError), and the loop keeps serving. Only an error in the loop's
  own bookkeeping kills the thread; then `is_alive` turns False (/health says 503), every
  open stream gets `EngineDeadError`, and `wait_dead()` returns (the server then exits
  non-zero so that a supervisor restarts it).
- A stream whose consumer goes away (client disconnect, cancelled task) must be aborted by
  the consumer: `abort(request_id)`, or iterate with `generate()`, which does it in `finally`.

The frontend keeps its own copy of the tokenizer (`self.tokenizer`): Hugging Face fast
tokenizers are not meant to be used from two threads at once, and the engine thread
detokenizes continuously.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pagoda.engine.input_processor import EngineRequest, InputProcessor
from pagoda.engine.llm_engine import BatchFailedError
from pagoda.engine.metrics import EngineMetrics
from pagoda.engine.request_stream import (
    EngineDeadError,
    EngineStepError,
    RequestStream,
    check_capacity,
    generate_outputs,
)
from pagoda.engine.snapshot import EngineSnapshot
from pagoda.errors import EngineFatalError, InvalidRequestError
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request: EngineRequest
    ack: asyncio.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Sync:
    ack: asyncio.Future


@dataclass
class _Stop:
    done: threading.Event = field(default_factory=threading.Event)


class AsyncLLMEngine:
    def __init__(
        self,
        engine,
        metrics: EngineMetrics | None = None,
        max_queue: int | None = None,
    ) -> None:
        """`engine` is an LLMEngine (or anything with its interface); from `start()` on, only
        the engine thread may touch it. `max_queue`: most sequences allowed to wait for a
        batch slot; a request that would go over raises QueueFullError (None: no limit)."""
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size
        self.input_processor = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len,
            getattr(engine, "grammar_compiler", None),  # thread-safe, shared
        )
        self.max_num_seqs: int = engine.config.scheduler.max_num_seqs
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._prebuilt: tuple[threading.Thread, threading.Event] | None = None
        self.dead_error: BaseException | None = None
        self._died: asyncio.Event | None = None
        """Set on the event loop when the engine loop dies of an error (not on shutdown)."""
        # Event-loop side: open streams and the sequences they stand for.
        self._streams: dict[str, RequestStream] = {}
        self.num_unfinished_seqs = 0
        self._sync_lock = threading.Lock()
        self._syncs_answered = True
        """Whether a _Sync put now will be answered (False once the engine loop has ended)."""
        self.snapshot: EngineSnapshot = engine.snapshot()
        """The engine's state after its last step, published by the engine thread (one
        attribute swap: atomic to read from the event loop)."""

    @classmethod
    def build_on_engine_thread(cls, build_engine: Callable[[], object], **kwargs) -> AsyncLLMEngine:
        """Start the engine thread, build the engine there (`build_engine()`), return the
        AsyncLLMEngine around it (`kwargs` as for the constructor); `start()` then runs the
        loop on that same thread. Raises what `build_engine` raises.

        Why: OpenMP (torch's CPU threads) keeps one pool of worker threads per thread that
        ran a parallel region. Loading the model on the main thread and stepping on another
        leaves two pools, more OpenMP threads than cores, and libgomp then stops spinning
        between parallel regions: every op pays a futex wake-up, and single-stream decode
        slows by half (BENCHMARKS.md section 10)."""
        built: concurrent.futures.Future[AsyncLLMEngine] = concurrent.futures.Future()
        go = threading.Event()

        def thread_main() -> None:
            try:
                async_engine = cls(build_engine(), **kwargs)
            except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
                built.set_exception(e)
                return
            built.set_result(async_engine)
            go.wait()
            async_engine._run()

        # A daemon: a forced exit (second Ctrl+C) must not hang on a step in progress.
        thread = threading.Thread(target=thread_main, name="pagoda-engine", daemon=True)
        thread.start()
        async_engine = built.result()  # raises what the build raised
        async_engine._prebuilt = (thread, go)
        return async_engine

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the streams."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._loop = asyncio.get_running_loop()
        self._died = asyncio.Event()
        if self._prebuilt is not None:  # the thread that built the engine runs the loop
            self._thread, go = self._prebuilt
            go.set()
            return
        # A daemon: a forced exit (second Ctrl+C) must not hang on a step in progress.
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop that consumes the streams (set by `start`)."""
        return self._loop

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    async def wait_dead(self) -> BaseException:
        """Return (with the error) once the engine loop has died of an error; call after
        `start`, from its event loop. A normal shutdown never returns it."""
        await self._died.wait()
        return self.dead_error

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is still running and stop the engine thread."""
        if self._thread is None or not self._thread.is_alive():
            return
        stop = _Stop()
        self._commands.put(stop)
        await asyncio.get_running_loop().run_in_executor(None, stop.done.wait, timeout)
        self._thread.join(timeout=1.0)

    # ---- requests (event loop thread) ------------------------------------------------------

    async def add_request(self, request: EngineRequest) -> RequestStream:
        """Hand a validated request (from `input_processor.process`) to the engine; returns
        its stream once the engine accepted it. Raises QueueFullError, EngineDeadError, or
        InvalidRequestError for a request id already in use."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_message())
        request_id = request.request_id
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        num_seqs = request.params.n
        self.check_queue(num_seqs)
        stream = RequestStream(request_id, num_seqs)
        self._streams[request_id] = stream
        self.num_unfinished_seqs += num_seqs
        ack = asyncio.get_running_loop().create_future()
        self._commands.put(_Add(request, ack))
        try:
            await ack
        except BaseException:
            # Rejected by the engine, or our caller was cancelled while waiting (then the
            # engine may still add it: abort, which is a no-op for an unknown id).
            self.abort(request_id)
            raise
        return stream

    def check_queue(self, num_seqs: int = 1) -> None:
        """Raise QueueFullError if `num_seqs` more sequences would overflow the waiting queue.

        Waiting = the sequences beyond the batch's `max_num_seqs` (known here at once), or,
        when the engine reported a queue after its last step (KV-cache pressure), that queue
        plus the newcomers (first come, first served: they queue behind it)."""
        if self.max_queue is None:
            return
        check_capacity(self.num_unfinished_seqs, num_seqs, self.max_num_seqs,
                       self.snapshot.num_waiting_seqs, self.max_queue)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; a no-op for finished or unknown ids."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self.num_unfinished_seqs -= stream.num_seqs
            stream.finished = True
            stream.put(None)  # wakes a consumer still waiting on it
        self._commands.put(_Abort(request_id))

    async def synchronize(self) -> None:
        """Return once the engine thread has handled every command queued before this call
        and published its snapshot after them: after `abort(request_id)`, the engine holds
        nothing of that request (no sequence running or waiting, no KV block) and
        `self.snapshot` and the metrics gauges say so. Waits for the step in progress, if any.
        Returns at once when the engine loop is not running."""
        with self._sync_lock:
            if self._thread is None or not self._syncs_answered:
                return
            ack = asyncio.get_running_loop().create_future()
            self._commands.put(_Sync(ack))
        await ack

    def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Validate, add_request and iterate; aborts the request if the consumer stops early.
        Raises InvalidRequestError for a bad request."""
        return generate_outputs(self, request_id, prompt, params, priority)

    def cancel_all(self, reason: str) -> None:
        """Abort every open request; their streams raise EngineDeadError(reason). For a
        shutdown whose grace period ran out: handlers end their responses cleanly."""
        request_ids = list(self._streams)
        for request_id in request_ids:
            self._commands.put(_Abort(request_id))
        self._deliver([(request_id, EngineDeadError(reason)) for request_id in request_ids])

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Event loop side of call_soon_threadsafe: route outputs and errors to streams."""
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.put(item)
            if isinstance(item, BaseException) or item.finished:
                del self._streams[request_id]
                self.num_unfinished_seqs -= stream.num_seqs

    def _fail_all(self, error: BaseException) -> None:
        self._deliver([(request_id, error) for request_id in list(self._streams)])

    def dead_message(self) -> str:
        if self.dead_error is not None:
            return f"the engine loop died: {type(self.dead_error).__name__}: {self.dead_error}"
        if self._thread is None:
            return "the engine loop is not started"
        return "the engine loop has stopped"

    # ---- the engine thread -----------------------------------------------------------------

    def _call_in_loop(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    def _run(self) -> None:
        stop: _Stop | None = None
        try:
            while stop is None:
                stop = self._process_commands(block=not self.engine.has_unfinished_requests())
                if stop is None and self.engine.has_unfinished_requests():
                    self._step()
                self._publish()
        except BaseException as e:  # our own bug: make it visible, fail everyone
            logger.exception("the engine loop died")
            self.dead_error = e
        finally:
            self._abort_all_in_engine()
            if hasattr(self.engine, "shutdown"):  # (test doubles may have none)
                self.engine.shutdown()
            self._call_in_loop(self._fail_all, EngineDeadError(self.dead_message()))
            self._publish()
            self._answer_syncs_left()
            if self.dead_error is not None:
                self._call_in_loop(self._died.set)
            if stop is not None:
                stop.done.set()

    def _process_commands(self, block: bool) -> _Stop | None:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for i, command in enumerate(commands):
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_id)
            elif isinstance(command, _Sync):
                self._publish()  # what came before it, visible before it is answered
                self._call_in_loop(_resolve, command.ack, None)
            elif isinstance(command, _Stop):
                for later in commands[i + 1:]:
                    if isinstance(later, _Add):
                        self._call_in_loop(_resolve, later.ack, EngineDeadError("shutting down"))
                    elif isinstance(later, _Sync):  # (answered after the loop's last publish)
                        self._commands.put(later)
                return command
        return None

    def _answer_syncs_left(self) -> None:
        """The loop has ended (its last snapshot published): answer every _Sync queued, and
        any later one at once (`synchronize` then puts none)."""
        with self._sync_lock:
            self._syncs_answered = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Sync):
                self._call_in_loop(_resolve, command.ack, None)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_engine_request(command.request)
        except Exception as e:
            if not isinstance(e, ValueError):
                logger.exception("add_request(%s) failed", command.request.request_id)
            self._call_in_loop(_resolve, command.ack, e)
            return
        self._call_in_loop(_resolve, command.ack, None)

    def _abort(self, request_id: str) -> None:
        """Abort in the engine (a no-op for ids it does not hold)."""
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
            failed = list(snapshot.running_request_ids) or list(self._streams)
            for request_id in failed:
                self._abort(request_id)
            self._fail_requests(failed, e)
            return
        now = time.time()
        failed = self.engine.take_failed_requests()
        if failed:  # their own fault: an error for them alone, not an "abort" output
            outputs = [o for o in outputs if o.request_id not in failed]
            self._fail_requests_alone(failed)
        if outputs:
            self._call_in_loop(self._deliver, [(o.request_id, o) for o in outputs])
        if self.metrics is not None:
            try:
                self.metrics.record_step(outputs, now)
            except Exception:
                logger.exception("recording metrics failed")

    def _fail_requests(self, request_ids: list[str], error: BaseException) -> None:
        """A step raised: fail the streams of the requests of its batch (already aborted)."""
        logger.error(
            "engine step failed (%s: %s); failing %d request(s): %s", type(error).__name__,
            error, len(request_ids), ", ".join(request_ids), exc_info=error,
        )
        message = f"the engine failed while running this request: {type(error).__name__}: {error}"
        if self.metrics is not None:
            for request_id in request_ids:
                self.metrics.forget(request_id)
        self._call_in_loop(self._deliver, [(rid, EngineStepError(message)) for rid in request_ids])

    def _fail_requests_alone(self, failed: dict[str, str]) -> None:
        """Requests the engine stopped for a fault of their own (the rest of the batch went on)."""
        for request_id, reason in failed.items():
            logger.error("request %s failed: %s", request_id, reason)
            if self.metrics is not None:
                self.metrics.forget(request_id)
        self._call_in_loop(self._deliver, [(rid, EngineStepError(f"the engine failed this "
                                                                 f"request: {reason}"))
                                           for rid, reason in failed.items()])

    def _abort_all_in_engine(self) -> None:
        snapshot = self.engine.snapshot()
        for request_id in snapshot.running_request_ids + snapshot.waiting_request_ids:
            self._abort(request_id)

    def _publish(self) -> None:
        try:
            self.snapshot = snapshot = self.engine.snapshot()
            if self.metrics is not None:
                self.metrics.update(snapshot)
        except Exception:
            logger.exception("publishing engine stats failed")


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return  # the caller was cancelled
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
