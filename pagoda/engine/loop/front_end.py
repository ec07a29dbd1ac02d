"""The engine front-end: what the server uses of an engine (EngineClient, protocol.py), once,
over either core that runs the engine:

    EngineFrontEnd (event loop: streams, queue check, aborts, dead/alive)
        │  add / abort / shutdown                 ↑ deliver / fail_all / died
        ▼                                          │
    EngineCore: ThreadCore (thread_core.py)   an LLMEngine loop on a thread of this process
                ReplicaSetCore (data_parallel/replica_set_core.py)   N replica processes

- Invariant: a request id has a stream in `_streams` (its `num_seqs` counted in
  `num_unfinished_seqs`) from `add_request` until its last output, an error, or `abort`.
- Requests are validated on the event loop (`input_processor`, the one validation step)
  before they reach a core, so a bad request never reaches the engine.
- A stream whose consumer goes away must be aborted by the consumer: `abort(request_id)`,
  or iterate with `generate()`, which does it in `finally`.
- A request ended while its `add_request` still waits for the core (an abort, cancel_all,
  shutdown) still gets its stream back; the stream then ends at once, or raises the error
  that ended it. Only a refusal (or a core that is gone) makes `add_request` raise.
- All of it runs on the event loop given to `start`; a core posts to it from its threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from pagoda.engine.core.input_processor import EngineRequest, InputProcessor
from pagoda.engine.loop.request_stream import (
    Delivery,
    EngineDeadError,
    RequestStream,
    check_capacity,
    generate_outputs,
)
from pagoda.engine.stats.snapshot import EngineSnapshot
from pagoda.errors import InvalidRequestError
from pagoda.lora.request import LoRARequest
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams


class CoreEvents(Protocol):
    """What a core tells the front-end (on the event loop)."""

    def deliver(self, items: Delivery) -> None: ...

    def fail_all(self, error: BaseException) -> None: ...

    def died(self) -> None: ...


class EngineCore(Protocol):
    """Where the engine runs, as the front-end sees it."""

    tokenizer: Any
    """The core's tokenizer, for the front-end's own use (validation, templates)."""
    grammar_compiler: Any
    max_model_len: int
    vocab_size: int
    run_info: dict
    """The device, CPU, dtypes and kernels the model runs with (cpu_info.run_info)."""
    model_pooling: Any
    """How the model pools embeddings (pooling_params.ModelPooling; None: no embeddings)."""
    metrics: Any
    """The core's metrics (EngineMetrics or DataParallelMetrics), set before `start`."""
    dead_error: BaseException | None

    def start(self, loop: asyncio.AbstractEventLoop, events: CoreEvents) -> None: ...

    @property
    def is_alive(self) -> bool: ...

    def dead_message(self) -> str: ...

    @property
    def snapshot(self) -> EngineSnapshot: ...

    def queue_capacity(self) -> tuple[int, int]:
        """(sequences that run at once, sequences the engine reported waiting)."""

    async def add(self, request: EngineRequest) -> None:
        """Hand a request over; returns once the engine took it, raises if it refused it
        (or is gone). A request the front-end ended meanwhile returns at once."""

    def abort(self, request_id: str) -> None:
        """Abort in the engine; a no-op for unknown ids."""

    def forget(self, request_id: str) -> None:
        """The request ended (last output or error delivered): drop its bookkeeping."""

    async def synchronize(self) -> None:
        """Return once the engine has handled every command sent before this call (see
        EngineFrontEnd.synchronize); at once where the engine does not acknowledge them."""

    async def shutdown(self, timeout: float) -> None:
        """Stop the engine; `events.fail_all` ends the streams still open."""

    async def lora_call(self, method: str, *arguments) -> Any:
        """Run the engine's `method` (loop_commands.LORA_METHODS) with `arguments`, in order
        with the requests added around it; its result, or its refusal raised."""


class EngineFrontEnd:
    def __init__(self, core: EngineCore, *, max_queue: int | None = None) -> None:
        """`max_queue`: most sequences allowed to wait for a batch slot; a request that
        would go over raises QueueFullError (None: no limit)."""
        self.core = core
        self.max_queue = max_queue
        self.tokenizer = core.tokenizer
        self.max_model_len: int = core.max_model_len
        self.vocab_size: int = core.vocab_size
        self.run_info: dict = core.run_info
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size,
                                              self.max_model_len, core.grammar_compiler,
                                              getattr(core, "model_pooling", None))
        self._streams: dict[str, RequestStream] = {}
        self.num_unfinished_seqs = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._died: asyncio.Event | None = None
        """Set once the core died of an error (not on shutdown)."""

    @property
    def metrics(self):
        return self.core.metrics

    @metrics.setter
    def metrics(self, metrics) -> None:
        """Set before `start` (the server names the model once the engine is built)."""
        self.core.metrics = metrics

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the core; call from the event loop that will consume the streams."""
        if self._loop is not None:
            raise RuntimeError("the engine is already started")
        self._loop = asyncio.get_running_loop()
        self._died = asyncio.Event()
        self.core.start(self._loop, self)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop that consumes the streams (set by `start`)."""
        return self._loop

    @property
    def is_alive(self) -> bool:
        return self._loop is not None and self.core.is_alive

    @property
    def dead_error(self) -> BaseException | None:
        return self.core.dead_error

    async def wait_dead(self) -> BaseException:
        """Return (with the error) once the core has died; call after `start`, from its
        event loop. A normal shutdown never returns it."""
        await self._died.wait()
        return self.core.dead_error

    def dead_message(self) -> str:
        return self.core.dead_message()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core: open streams end with EngineDeadError."""
        await self.core.shutdown(timeout)

    @property
    def snapshot(self) -> EngineSnapshot:
        """The engine's state after its last step (all replicas together)."""
        return self.core.snapshot

    # ---- requests --------------------------------------------------------------------------

    async def add_request(self, request: EngineRequest) -> RequestStream:
        """Hand a validated request (from `input_processor.process`) to the engine; returns
        its stream once the engine accepted it. Raises QueueFullError, EngineDeadError, or
        InvalidRequestError (an id already in use, or refused by the engine)."""
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
        try:
            await self.core.add(request)
        except BaseException:
            # Refused, or our caller was cancelled while waiting (then the engine may still
            # add it: abort, which is a no-op for an unknown id).
            self.abort(request_id)
            raise
        return stream

    def check_queue(self, num_seqs: int = 1) -> None:
        """Raise QueueFullError if `num_seqs` more sequences would overflow the waiting queue
        (request_stream.check_capacity, over what the core runs at once)."""
        if self.max_queue is None:
            return
        num_running_slots, num_waiting_seqs = self.core.queue_capacity()
        check_capacity(self.num_unfinished_seqs, num_seqs, num_running_slots,
                       num_waiting_seqs, self.max_queue)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; a no-op for finished or unknown ids."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self.num_unfinished_seqs -= stream.num_seqs
            stream.finished = True
            stream.put(None)  # wakes a consumer still waiting on it
        self.core.abort(request_id)

    async def synchronize(self) -> None:
        """Return once the engine has handled every command queued before this call and
        published its snapshot after them: after `abort(request_id)`, the engine holds
        nothing of that request (no sequence running or waiting, no KV block) and
        `self.snapshot` and the metrics gauges say so. Waits for the step in progress, if
        any. Returns at once when the engine loop is not running, and always with the data
        parallel core (its replicas do not acknowledge aborts)."""
        await self.core.synchronize()

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ------------------------

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Make an adapter known to the engine ahead of its requests; False if it was known.
        Raises InvalidRequestError with LoRA off or for an id another adapter holds."""
        return await self.core.lora_call("add_lora", lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Remove an adapter: requests naming it from now on are refused (InvalidRequestError
        naming it), those in flight finish, then the engine frees its weights. False for an
        adapter the engine does not know."""
        return await self.core.lora_call("remove_lora", lora_int_id)

    async def list_loras(self) -> set[int]:
        """The lora_int_ids the engine knows (added or named by a request) and not removed."""
        return await self.core.lora_call("list_loras")

    def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Validate, add_request and iterate; aborts the request if the consumer stops early.
        Raises InvalidRequestError for a bad request."""
        return generate_outputs(self, request_id, prompt, params, priority, lora_request)

    def cancel_all(self, reason: str) -> None:
        """Abort every open request; their streams raise EngineDeadError(reason). For a
        shutdown whose grace period ran out: handlers end their responses cleanly."""
        request_ids = list(self._streams)
        for request_id in request_ids:
            self.core.abort(request_id)
        self.deliver([(request_id, EngineDeadError(reason)) for request_id in request_ids])

    # ---- CoreEvents (event loop) -----------------------------------------------------------

    def deliver(self, items: Delivery) -> None:
        """Route outputs and errors to their streams; an error or a finished output ends
        the request (items of requests no longer open are dropped: aborted meanwhile)."""
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if isinstance(item, BaseException) or item.finished:
                del self._streams[request_id]
                self.num_unfinished_seqs -= stream.num_seqs
                self.core.forget(request_id)
            stream.put(item)

    def fail_all(self, error: BaseException) -> None:
        self.deliver([(request_id, error) for request_id in list(self._streams)])

    def died(self) -> None:
        self._died.set()
