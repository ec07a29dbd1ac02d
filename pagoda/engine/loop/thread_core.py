"""ThreadCore: the engine front-end's core (front_end.py) for one engine in this process: an
EngineLoop (engine_loop.py) on its own thread, its events posted to the event loop.

    event loop (EngineFrontEnd)                  engine thread (the only LLMEngine user)
    add()    --Add-->   EngineLoop queue   -->   add_engine_request -> added -> ack future
    abort()  --Abort-->                    -->   abort_request (frees KV blocks)
    synchronize() --Sync-->                -->   publish, then synced -> its future
    lora_call() --LoRACall-->              -->   add_lora / remove_lora / list_loras
                                                 -> answered -> its future
    front_end.deliver   <-- call_soon_threadsafe <-- step() outputs / errors
    self.snapshot       <-- (attribute swap)     <-- engine.snapshot() after each iteration

The engine thread blocks on the queue while idle and drains it between steps while busy, so
a step never waits for HTTP work and HTTP never waits for a step. When the loop dies of an
error, `is_alive` turns False (/health says 503), every open stream gets EngineDeadError,
and the front-end's `wait_dead()` returns (the server then exits non-zero).

The core keeps its own copy of the tokenizer (the front-end's): Hugging Face fast tokenizers
are not meant to be used from two threads at once, and the engine thread detokenizes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import itertools
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from pagoda.engine.core.input_processor import EngineRequest
from pagoda.engine.loop.engine_loop import EngineLoop
from pagoda.engine.loop.front_end import CoreEvents
from pagoda.engine.loop.loop_commands import Abort, Add, LoRACall, Stop
from pagoda.engine.loop.request_stream import Delivery, EngineDeadError
from pagoda.engine.stats.snapshot import EngineSnapshot


class ThreadCore:
    """An EngineCore for the front-end, and the LoopEvents of its EngineLoop."""

    def __init__(self, engine, metrics=None) -> None:
        """`engine` is an LLMEngine (or anything with its interface); from `start()` on, only
        the engine thread may touch it. `metrics`: an EngineMetrics, or None."""
        self.engine = engine
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.grammar_compiler = getattr(engine, "grammar_compiler", None)  # thread-safe
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size
        self.run_info: dict = getattr(engine, "run_info", {})  # test doubles may have none
        self.model_pooling = getattr(engine, "model_pooling", None)
        self.max_num_seqs: int = engine.config.scheduler.max_num_seqs
        self.engine_loop = EngineLoop(engine, self, metrics)
        self.snapshot: EngineSnapshot = engine.snapshot()
        """The engine's state after the loop's last iteration, published by the engine
        thread (one attribute swap: atomic to read from the event loop)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: CoreEvents | None = None
        self._thread: threading.Thread | None = None
        self._prebuilt: tuple[threading.Thread, threading.Event] | None = None
        self._acks: dict[str, deque[asyncio.Future]] = {}
        """Per request id, the add_request calls waiting for the engine (oldest first: the
        loop answers Adds in order). Event loop only."""
        self._calls: dict[int, asyncio.Future] = {}
        """LoRACalls waiting for their answer, by call id. Event loop only."""
        self._call_ids = itertools.count(1)

    @classmethod
    def build_on_engine_thread(cls, build_engine: Callable[[], object]) -> ThreadCore:
        """Start the engine thread, build the engine there (`build_engine()`), return the
        core around it; `start()` then runs the loop on that same thread. Raises what
        `build_engine` raises.

        Why: OpenMP (torch's CPU threads) keeps one pool of worker threads per thread that
        ran a parallel region. Loading the model on the main thread and stepping on another
        leaves two pools, more OpenMP threads than cores, and libgomp then stops spinning
        between parallel regions: every op pays a futex wake-up, and single-stream decode
        slows markedly (measured in BENCHMARKS.md)."""
        built: concurrent.futures.Future[ThreadCore] = concurrent.futures.Future()
        go = threading.Event()

        def thread_main() -> None:
            try:
                core = cls(build_engine())
            except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
                built.set_exception(e)
                return
            built.set_result(core)
            go.wait()
            core.engine_loop.run()

        # A daemon: a forced exit (second Ctrl+C) must not hang on a step in progress.
        thread = threading.Thread(target=thread_main, name="pagoda-engine", daemon=True)
        thread.start()
        core = built.result()  # raises what the build raised
        core._prebuilt = (thread, go)
        return core

    @property
    def metrics(self):
        return self.engine_loop.metrics

    @metrics.setter
    def metrics(self, metrics) -> None:
        self.engine_loop.metrics = metrics

    @property
    def dead_error(self) -> BaseException | None:
        return self.engine_loop.dead_error

    # ---- EngineCore (event loop) -----------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, events: CoreEvents) -> None:
        self._loop = loop
        self._events = events
        if self._prebuilt is not None:  # the thread that built the engine runs the loop
            self._thread, go = self._prebuilt
            go.set()
            return
        # A daemon: a forced exit (second Ctrl+C) must not hang on a step in progress.
        self._thread = threading.Thread(target=self.engine_loop.run, name="pagoda-engine",
                                        daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    def dead_message(self) -> str:
        if self.dead_error is not None:
            return f"the engine loop died: {type(self.dead_error).__name__}: {self.dead_error}"
        if self._thread is None:
            return "the engine loop is not started"
        return "the engine loop has stopped"

    def queue_capacity(self) -> tuple[int, int]:
        return self.max_num_seqs, self.snapshot.num_waiting_seqs

    async def add(self, request: EngineRequest) -> None:
        ack = self._loop.create_future()
        self._acks.setdefault(request.request_id, deque()).append(ack)
        self.engine_loop.put(Add(request))
        await ack

    def abort(self, request_id: str) -> None:
        self.engine_loop.put(Abort(request_id))

    def forget(self, request_id: str) -> None:
        pass  # (the engine ended it itself)

    async def synchronize(self) -> None:
        """Return once the engine thread has handled every command queued before this call
        and published its snapshot after them. Returns at once when the loop is not running."""
        if self._thread is None:
            return
        ack = asyncio.get_running_loop().create_future()
        if self.engine_loop.sync(ack):
            await ack

    async def lora_call(self, method: str, *arguments) -> Any:
        """Run the engine's add_lora / remove_lora / list_loras on the engine thread, in
        order with the requests added before and after; returns its result, raises its
        refusal (or EngineDeadError once the loop has ended)."""
        if self._thread is None:
            raise EngineDeadError("the engine loop is not started")
        call_id = next(self._call_ids)
        answer = self._calls[call_id] = asyncio.get_running_loop().create_future()
        if not self.engine_loop.call(LoRACall(method, arguments, call_id)):
            del self._calls[call_id]
            raise EngineDeadError(self.dead_message())
        try:
            return await answer
        finally:
            self._calls.pop(call_id, None)

    async def shutdown(self, timeout: float) -> None:
        """Stop the loop (what still runs is aborted, its streams fail) and join the thread."""
        if self._thread is None or not self._thread.is_alive():
            return
        self.engine_loop.put(Stop())
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)

    def _acked(self, request_id: str, error: BaseException | None) -> None:
        acks = self._acks.get(request_id)
        if not acks:
            return
        ack = acks.popleft()
        if not acks:
            del self._acks[request_id]
        _resolve(ack, error)

    # ---- LoopEvents (engine thread) --------------------------------------------------------

    def added(self, request_id: str, error: BaseException | None) -> None:
        self._call_in_loop(self._acked, request_id, error)

    def deliver(self, items: Delivery) -> None:
        self._call_in_loop(self._events.deliver, items)

    def synced(self, token: Any) -> None:
        self._call_in_loop(_resolve, token, None)

    def answered(self, call_id: int, result: Any, error: BaseException | None) -> None:
        self._call_in_loop(self._answer, call_id, result, error)

    def _answer(self, call_id: int, result: Any, error: BaseException | None) -> None:
        answer = self._calls.pop(call_id, None)
        if answer is None or answer.done():
            return  # the caller was cancelled
        if error is None:
            answer.set_result(result)
        else:
            answer.set_exception(error)

    def published(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot

    def idle_timeout(self) -> float | None:
        return None

    def ended(self, dead_error: BaseException | None) -> None:
        self._call_in_loop(self._events.fail_all, EngineDeadError(self.dead_message()))
        if dead_error is not None:
            self._call_in_loop(self._events.died)

    def _call_in_loop(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return  # the caller was cancelled
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
