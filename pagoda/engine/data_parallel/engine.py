"""DataParallelEngine: N engine replicas behind the interface the server uses of an
AsyncLLMEngine (input_processor, check_queue, add_request -> RequestStream, abort, generate,
snapshot, is_alive, wait_dead, cancel_all, shutdown, tokenizer, max_model_len, vocab_size).

- Validation and tokenization stay in the server process (`input_processor`, with the
  tokenizer replica 0 shipped); a replica gets a validated EngineRequest, routed by the
  Router (router.py), and answers with RequestOutputs on its pipe.
- Invariant: a request id in `_streams` is counted in the router and in its slot's
  `request_ids` until `_end` (finished, failed or aborted), which undoes all three.
- A replica that dies (EOF or exit on its pipe): its slot turns RESTARTING, the router
  skips it, its in-flight streams end with ReplicaDiedError (503, or an SSE error event),
  requests it had not yet acknowledged are routed to another replica (nothing of them ran;
  EngineDeadError, a 503, when none is left), and the supervisor (supervisor.py) starts a
  new process for the same index. `is_alive` (/health) holds while any replica is healthy;
  `wait_dead` returns only once every slot is given up (the server then exits 1).
- All state is touched on the server's event loop only; reader threads post to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from pagoda.config import EngineConfig
from pagoda.engine.data_parallel.launcher import launch_replica
from pagoda.engine.data_parallel.messages import (
    Abort,
    Add,
    Added,
    BatchItem,
    Error,
    Out,
    Snapshot,
    decode_error,
)
from pagoda.engine.data_parallel.metrics import DataParallelMetrics
from pagoda.engine.data_parallel.replica_slot import FAILED, ReplicaSlot
from pagoda.engine.data_parallel.router import NoHealthyReplicaError, Router
from pagoda.engine.data_parallel.snapshots import merge_snapshots
from pagoda.engine.data_parallel.supervisor import Launcher, ReplicaSupervisor
from pagoda.engine.grammar import GrammarCompiler
from pagoda.engine.input_processor import EngineRequest, InputProcessor
from pagoda.engine.request_stream import (
    EngineDeadError,
    RequestStream,
    check_capacity,
    generate_outputs,
)
from pagoda.engine.snapshot import EngineSnapshot
from pagoda.errors import InvalidRequestError
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ReplicaLostBeforeAckError(EngineDeadError):
    """The replica a request was sent to died before it took the request: nothing of it
    ran, so add_request routes it to another replica."""


class ReplicaDiedError(EngineDeadError):
    """The replica running this request died; the request is lost (retry it). The server
    answers 503 (or ends the stream with that error): the others serve a retry."""


class DataParallelEngine:
    def __init__(self, config: EngineConfig, *, max_queue: int | None = None,
                 metrics: DataParallelMetrics | None = None,
                 launcher: Launcher = launch_replica) -> None:
        """Start `config.parallel.data_parallel_size` replicas and wait until all are ready
        (slow: each loads the model). Raises ValueError if one fails to start."""
        self.num_replicas = config.parallel.data_parallel_size
        self.max_queue = max_queue
        self.metrics = metrics
        """Set before `start` (the server names the model once the engine is built)."""
        self._supervisor = ReplicaSupervisor(config, launcher)
        self._slots = self._supervisor.slots
        self._streams: dict[str, tuple[RequestStream, int]] = {}
        self.num_unfinished_seqs = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._died: asyncio.Event | None = None
        self.dead_error: BaseException | None = None
        self._snapshot: EngineSnapshot | None = None
        self._supervisor.start_all()
        info = self._slots[0].info
        logger.info("%d engine replicas ready (pids %s), %d CPU threads each",
                    self.num_replicas, ", ".join(str(s.info.pid) for s in self._slots),
                    info.num_threads)
        self.tokenizer = info.tokenizer
        self.max_model_len: int = min(s.info.max_model_len for s in self._slots)
        self.vocab_size: int = info.vocab_size
        self.max_num_seqs: int = info.max_num_seqs
        self.model_files = info.model_files
        self.kv_capacity_tokens: int = info.kv_capacity_tokens
        """Of one replica."""
        grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, info.eos_token_ids)
        grammar_compiler.warm_up()
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size,
                                              self.max_model_len, grammar_compiler)
        self.router = Router(self.num_replicas, info.block_size,
                             capacity_blocks=max(info.num_kv_blocks, 1))

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start relaying; call from the event loop that will consume the streams."""
        if self._loop is not None:
            raise RuntimeError("the data-parallel engine is already started")
        self._loop = asyncio.get_running_loop()
        self._died = asyncio.Event()
        self._supervisor.watch(self._loop, self)
        for slot in self._slots:
            self._publish_state(slot)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    @property
    def is_alive(self) -> bool:
        return (self._loop is not None and not self._supervisor.stopping
                and any(slot.healthy for slot in self._slots))

    async def wait_dead(self) -> BaseException:
        await self._died.wait()
        return self.dead_error

    def dead_message(self) -> str:
        if self._supervisor.stopping:
            return "the engine replicas are shut down"
        if self._loop is None:
            return "the engine replicas are not started"
        return "no engine replica is healthy: " + "; ".join(s.describe() for s in self._slots)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every replica (STOP; SIGKILL after `timeout`) and end open streams."""
        if self._supervisor.stopping:
            return
        self._fail_streams(list(self._streams), EngineDeadError("the server is shutting down"))
        await self._supervisor.stop(timeout)

    # ---- requests (event loop) ---------------------------------------------------------------

    async def add_request(self, request: EngineRequest) -> RequestStream:
        """Route a validated request to a replica; returns its stream once the replica took
        it (a replica that dies before taking it is skipped for the next healthy one).
        Raises QueueFullError, EngineDeadError (no healthy replica), or InvalidRequestError
        (an id in use, or refused there)."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_message())
        request_id = request.request_id
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.check_queue(request.params.n)
        while True:  # each pass routes to another replica: a lost one is no longer healthy
            stream, ack = self._send_to_a_replica(request)
            try:
                await ack
            except ReplicaLostBeforeAckError as error:
                # Nothing of it ran there: route it again if it still has a stream (a
                # concurrent abort or cancel_all ends it).
                if request_id not in self._streams:
                    raise EngineDeadError(str(error)) from None
                logger.info("request %s: %s; routing it again", request_id, error)
                self._end(request_id)
                continue
            except BaseException:
                self.abort(request_id)
                raise
            return stream

    def _send_to_a_replica(self, request: EngineRequest) -> tuple[RequestStream, asyncio.Future]:
        """Route, count (the module's invariant) and send; the future is set once the
        replica took the request, or fails."""
        request_id, num_seqs = request.request_id, request.params.n
        try:
            index = self.router.route(request_id, request.prompt_token_ids, num_seqs)
        except NoHealthyReplicaError:
            raise EngineDeadError(self.dead_message()) from None
        slot = self._slots[index]
        stream = RequestStream(request_id, num_seqs)
        self._streams[request_id] = (stream, index)
        slot.request_ids.add(request_id)
        self.num_unfinished_seqs += num_seqs
        ack = slot.pending_acks[request_id] = self._loop.create_future()
        slot.send(Add(request))  # if it is gone, its loss fails the ack
        return stream, ack

    def check_queue(self, num_seqs: int = 1) -> None:
        """As AsyncLLMEngine.check_queue, over the healthy replicas together."""
        if self.max_queue is None:
            return
        healthy = [slot for slot in self._slots if slot.healthy]
        check_capacity(self.num_unfinished_seqs, num_seqs, len(healthy) * self.max_num_seqs,
                       sum(slot.snapshot.num_waiting_seqs for slot in healthy), self.max_queue)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; a no-op for finished or unknown ids."""
        entry = self._streams.get(request_id)
        if entry is None:
            return
        stream, index = entry
        self._end(request_id)
        stream.finished = True
        stream.put(None)  # wakes a consumer still waiting on it
        slot = self._slots[index]
        if slot.healthy:  # (a replica that died took the request with it)
            slot.send(Abort(request_id))

    def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                 priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Validate, add_request and iterate; aborts the request if the consumer stops early."""
        return generate_outputs(self, request_id, prompt, params, priority)

    def cancel_all(self, reason: str) -> None:
        """Abort every open request; their streams raise EngineDeadError(reason)."""
        for request_id, (_, index) in list(self._streams.items()):
            self._slots[index].send(Abort(request_id))
        self._fail_streams(list(self._streams), EngineDeadError(reason))

    @property
    def snapshot(self) -> EngineSnapshot:
        """All replicas together (counters cumulative over restarts)."""
        if self._snapshot is None:
            self._snapshot = merge_snapshots([s.cumulative_snapshot() for s in self._slots])
        return self._snapshot

    def replica_states(self) -> list[str]:
        return [slot.state for slot in self._slots]

    # ---- streams -----------------------------------------------------------------------------

    def _end(self, request_id: str) -> None:
        """Forget a request everywhere it is counted (the invariant of this module)."""
        stream, index = self._streams.pop(request_id)
        slot = self._slots[index]
        self.num_unfinished_seqs -= stream.num_seqs
        self.router.finish(request_id)
        slot.request_ids.discard(request_id)
        ack = slot.pending_acks.pop(request_id, None)
        if ack is not None and not ack.done():
            ack.cancel()
        if self.metrics is not None:
            self.metrics.forget(index, request_id)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return  # aborted meanwhile
        stream = entry[0]
        if isinstance(item, BaseException) or item.finished:
            self._end(request_id)
        stream.put(item)

    def _fail_streams(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            entry = self._streams.get(request_id)
            if entry is None:
                continue
            ack = self._slots[entry[1]].pending_acks.pop(request_id, None)
            if ack is not None and not ack.done():
                ack.set_exception(error)  # add_request raises it (and aborts)
            else:
                self._deliver(request_id, error)

    # ---- replica events (ReplicaEvents; event loop) ------------------------------------------

    def on_batch(self, slot: ReplicaSlot, items: list[BatchItem]) -> None:
        # Latency metrics first: delivering a last output forgets its request's metrics state.
        outputs = [item.output for item in items
                   if isinstance(item, Out) and item.request_id in self._streams]
        if outputs and self.metrics is not None:
            self.metrics.record_step(slot.index, outputs, time.time())
        for item in items:
            if isinstance(item, Out):
                self._deliver(item.request_id, item.output)
            elif isinstance(item, Added):
                ack = slot.pending_acks.pop(item.request_id, None)
                if ack is not None and not ack.done():
                    ack.set_result(None)
            elif isinstance(item, Error):
                error = decode_error(item.error)
                ack = slot.pending_acks.pop(item.request_id, None)
                if ack is not None and not ack.done():
                    ack.set_exception(error)
                else:
                    self._deliver(item.request_id, error)
            elif isinstance(item, Snapshot):
                slot.snapshot = item.rebuild()
                self._snapshot = None
                if self.metrics is not None:
                    self.metrics.update(slot.index, slot.cumulative_snapshot(), self.snapshot)

    def on_ready(self, slot: ReplicaSlot) -> None:
        self.router.set_healthy(slot.index, True)
        self._publish_state(slot)

    def on_lost(self, slot: ReplicaSlot, how: str) -> None:
        """Fail its requests in flight with ReplicaDiedError; those it had not yet taken
        go to another replica (add_request); keep its counters."""
        self.router.set_healthy(slot.index, False)
        message = f"engine replica {slot.index} died ({how}) while running this request; retry it"
        for request_id in list(slot.request_ids):
            ack = slot.pending_acks.pop(request_id, None)
            if ack is not None and not ack.done():
                ack.set_exception(ReplicaLostBeforeAckError(
                    f"engine replica {slot.index} died ({how}) before it took the request"))
            else:
                self._deliver(request_id, ReplicaDiedError(message))
        slot.retire_snapshot()
        self._snapshot = None
        self._publish_state(slot)

    def on_restart(self, slot: ReplicaSlot) -> None:
        if self.metrics is not None:
            self.metrics.restarted(slot.index)

    def on_given_up(self, slot: ReplicaSlot) -> None:
        self._publish_state(slot)
        if all(s.state == FAILED for s in self._slots):
            self.dead_error = EngineDeadError(self.dead_message())
            self._died.set()

    def _publish_state(self, slot: ReplicaSlot) -> None:
        if self.metrics is not None:
            self.metrics.set_healthy(slot.index, slot.healthy)
