"""ReplicaSetCore: the engine front-end's core (front_end.py) over N engine replicas, each
an EngineLoop in its own process (replica_main.py), behind a Router (router.py).

- Validation and tokenization stay in the server process (the front-end's input_processor,
  with the tokenizer replica 0 shipped); a replica gets a validated EngineRequest, routed by
  the Router, and answers with Batches of items on its pipe (messages.py).
- Invariant: a request id in `_homes` is counted in the router and in its slot's
  `request_ids` until `_unroute` (ended, aborted, or routed again), which undoes all three.
- A replica that dies (EOF or exit on its pipe): its slot turns RESTARTING, the router
  skips it, its in-flight streams end with ReplicaDiedError (503, or an SSE error event),
  requests it had not yet acknowledged are routed to another replica (nothing of them ran;
  EngineDeadError, a 503, when none is left), and the supervisor (supervisor.py) starts a
  new process for the same index. `is_alive` (/health) holds while any replica is healthy;
  the front-end's `wait_dead` returns only once every slot is given up (the server exits 1).
- All state is touched on the server's event loop only; reader threads post to it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

from pagoda.config import EngineConfig
from pagoda.engine.core.grammar import GrammarCompiler
from pagoda.engine.core.input_processor import EngineRequest
from pagoda.engine.data_parallel.launcher import launch_replica
from pagoda.engine.data_parallel.messages import (
    Abort,
    Add,
    Added,
    Answered,
    BatchItem,
    Error,
    LoRACall,
    Out,
    Snapshot,
    decode_error,
)
from pagoda.engine.data_parallel.metrics import DataParallelMetrics
from pagoda.engine.data_parallel.replica_slot import FAILED, ReplicaSlot
from pagoda.engine.data_parallel.router import NoHealthyReplicaError, Router
from pagoda.engine.data_parallel.snapshots import merge_snapshots
from pagoda.engine.data_parallel.supervisor import Launcher, ReplicaSupervisor
from pagoda.engine.loop.front_end import CoreEvents
from pagoda.engine.loop.request_stream import EngineDeadError
from pagoda.engine.stats.snapshot import EngineSnapshot

logger = logging.getLogger(__name__)


class ReplicaLostBeforeAckError(EngineDeadError):
    """The replica a request was sent to died before it took the request: nothing of it
    ran, so `add` routes it to another replica."""


class ReplicaDiedError(EngineDeadError):
    """The replica running this request died; the request is lost (retry it). The server
    answers 503 (or ends the stream with that error): the others serve a retry."""


class ReplicaSetCore:
    """An EngineCore for the front-end, and the supervisor's ReplicaEvents."""

    def __init__(self, config: EngineConfig, launcher: Launcher = launch_replica) -> None:
        """Start `config.parallel.data_parallel_size` replicas and wait until all are ready
        (slow: each loads the model). Raises ValueError if one fails to start."""
        self.num_replicas = config.parallel.data_parallel_size
        self.metrics: DataParallelMetrics | None = None
        self.dead_error: BaseException | None = None
        self._supervisor = ReplicaSupervisor(config, launcher)
        self.slots = self._supervisor.slots
        self._homes: dict[str, int] = {}
        """Request id -> the replica it is routed to."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: CoreEvents | None = None
        self._snapshot: EngineSnapshot | None = None
        self._calls: dict[tuple[int, int], asyncio.Future] = {}
        """(replica index, call id) -> a LoRACall's answer from that replica."""
        self._call_ids = itertools.count(1)
        self._supervisor.start_all()
        info = self.slots[0].info
        logger.info("%d engine replicas ready (pids %s), %d CPU threads each",
                    self.num_replicas, ", ".join(str(s.info.pid) for s in self.slots),
                    info.num_threads)
        self.tokenizer = info.tokenizer
        self.max_model_len: int = min(s.info.max_model_len for s in self.slots)
        self.vocab_size: int = info.vocab_size
        self.run_info: dict = dict(info.run_info, replicas=self.num_replicas)
        self.model_pooling = info.model_pooling
        self.max_num_seqs: int = info.max_num_seqs
        self.model_files = info.model_files
        self.kv_capacity_tokens: int = info.kv_capacity_tokens
        """Of one replica."""
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                                info.eos_token_ids)
        self.router = Router(self.num_replicas, info.block_size,
                             capacity_blocks=max(info.num_kv_blocks, 1))

    # ---- EngineCore (event loop) -------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, events: CoreEvents) -> None:
        self._loop = loop
        self._events = events
        self._supervisor.watch(loop, self)
        for slot in self.slots:
            self._publish_state(slot)

    @property
    def is_alive(self) -> bool:
        return (self._loop is not None and not self._supervisor.stopping
                and any(slot.healthy for slot in self.slots))

    def dead_message(self) -> str:
        if self._supervisor.stopping:
            return "the engine replicas are shut down"
        if self._loop is None:
            return "the engine replicas are not started"
        return "no engine replica is healthy: " + "; ".join(s.describe() for s in self.slots)

    @property
    def snapshot(self) -> EngineSnapshot:
        """All replicas together (counters cumulative over restarts)."""
        if self._snapshot is None:
            self._snapshot = merge_snapshots([s.cumulative_snapshot() for s in self.slots])
        return self._snapshot

    def queue_capacity(self) -> tuple[int, int]:
        """Over the healthy replicas together."""
        healthy = [slot for slot in self.slots if slot.healthy]
        return (len(healthy) * self.max_num_seqs,
                sum(slot.snapshot.num_waiting_seqs for slot in healthy))

    async def add(self, request: EngineRequest) -> None:
        """Route to a replica and wait until it took the request; a replica that dies before
        taking it is skipped for the next healthy one (EngineDeadError when none is left)."""
        request_id = request.request_id
        while True:  # each pass routes to another replica: a lost one is no longer healthy
            try:
                await self._send_to_a_replica(request)
            except ReplicaLostBeforeAckError as error:
                # Nothing of it ran there: route it again unless it was ended meanwhile (a
                # concurrent abort or cancel_all).
                if request_id not in self._homes:
                    raise EngineDeadError(str(error)) from None
                logger.info("request %s: %s; routing it again", request_id, error)
                self._unroute(request_id)
                continue
            return

    def _send_to_a_replica(self, request: EngineRequest) -> asyncio.Future:
        """Route, count (the module's invariant) and send; the future is set once the
        replica took the request, or fails."""
        request_id, num_seqs = request.request_id, request.params.n
        try:
            lora_int_id = request.lora_request.lora_int_id if request.lora_request else 0
            index = self.router.route(request_id, request.prompt_token_ids, num_seqs,
                                      lora_int_id)
        except NoHealthyReplicaError:
            raise EngineDeadError(self.dead_message()) from None
        slot = self.slots[index]
        self._homes[request_id] = index
        slot.request_ids.add(request_id)
        ack = slot.pending_acks[request_id] = self._loop.create_future()
        slot.send(Add(request))  # if it is gone, its loss fails the ack
        return ack

    async def lora_call(self, method: str, *arguments) -> Any:
        """Run an adapter command on every healthy replica (each engine keeps its own
        adapters): add_lora / remove_lora answer True if any replica did, list_loras the
        union. A replica lost meanwhile is left out; a refusal is raised."""
        call_id = next(self._call_ids)
        waiting = []
        for slot in self.slots:
            if slot.healthy:
                answer = self._loop.create_future()
                self._calls[(slot.index, call_id)] = answer
                if slot.send(LoRACall(method, arguments, call_id)):
                    waiting.append(answer)
                else:
                    del self._calls[(slot.index, call_id)]
        if not waiting:
            raise EngineDeadError(self.dead_message())
        try:
            results = await asyncio.gather(*waiting)
        finally:
            for slot in self.slots:
                self._calls.pop((slot.index, call_id), None)
        answered = [result for result in results if result is not None]
        if method == "list_loras":
            return set().union(*answered)
        return any(answered)

    def abort(self, request_id: str) -> None:
        index = self._homes.get(request_id)
        if index is None:
            return
        self._unroute(request_id)
        slot = self.slots[index]
        if slot.healthy:  # (a replica that died took the request with it)
            slot.send(Abort(request_id))

    def forget(self, request_id: str) -> None:
        if request_id in self._homes:
            self._unroute(request_id)

    async def synchronize(self) -> None:
        """Returns at once: the replicas do not acknowledge aborts, so there is nothing to
        wait for (EngineClient.synchronize)."""

    def _unroute(self, request_id: str) -> None:
        """Forget a request everywhere it is counted (the invariant of this module); an
        add still waiting for it returns (its stream has ended)."""
        index = self._homes.pop(request_id)
        slot = self.slots[index]
        self.router.finish(request_id)
        slot.request_ids.discard(request_id)
        ack = slot.pending_acks.pop(request_id, None)
        if ack is not None and not ack.done():
            ack.set_result(None)
        if self.metrics is not None:
            self.metrics.forget(index, request_id)

    async def shutdown(self, timeout: float) -> None:
        """Stop every replica (Stop; SIGKILL after `timeout`) and end open streams."""
        if self._supervisor.stopping:
            return
        self._events.fail_all(EngineDeadError("the server is shutting down"))
        await self._supervisor.stop(timeout)

    def replica_states(self) -> list[str]:
        return [slot.state for slot in self.slots]

    # ---- replica events (ReplicaEvents; event loop) ------------------------------------------

    def on_batch(self, slot: ReplicaSlot, items: list[BatchItem]) -> None:
        # Latency metrics first: delivering a last output forgets its request's metrics state.
        outputs = [item.output for item in items
                   if isinstance(item, Out) and item.request_id in self._homes]
        if outputs and self.metrics is not None:
            self.metrics.record_step(slot.index, outputs, time.time())
        for item in items:
            if isinstance(item, Out):
                self._events.deliver([(item.request_id, item.output)])
            elif isinstance(item, Added):
                ack = slot.pending_acks.pop(item.request_id, None)
                if ack is not None and not ack.done():
                    ack.set_result(None)
            elif isinstance(item, Error):
                self._fail(slot, item.request_id, decode_error(item.error))
            elif isinstance(item, Answered):
                answer = self._calls.pop((slot.index, item.call_id), None)
                if answer is not None and not answer.done():
                    if item.error is None:
                        answer.set_result(item.result)
                    else:
                        answer.set_exception(decode_error(item.error))
            elif isinstance(item, Snapshot):
                slot.snapshot = item.rebuild()
                self._snapshot = None
                if self.metrics is not None:
                    self.metrics.update(slot.index, slot.cumulative_snapshot(), self.snapshot)

    def _fail(self, slot: ReplicaSlot, request_id: str, error: BaseException) -> None:
        """Refused (its add raises the error) or failed while running (its stream does)."""
        ack = slot.pending_acks.pop(request_id, None)
        if ack is not None and not ack.done():
            ack.set_exception(error)
        else:
            self._events.deliver([(request_id, error)])

    def on_ready(self, slot: ReplicaSlot) -> None:
        self.router.set_healthy(slot.index, True)
        self._publish_state(slot)

    def on_lost(self, slot: ReplicaSlot, how: str) -> None:
        """Fail its requests in flight with ReplicaDiedError; those it had not yet taken
        go to another replica (`add`); keep its counters."""
        self.router.set_healthy(slot.index, False)
        message = f"engine replica {slot.index} died ({how}) while running this request; retry it"
        for request_id in list(slot.request_ids):
            ack = slot.pending_acks.pop(request_id, None)
            if ack is not None and not ack.done():
                ack.set_exception(ReplicaLostBeforeAckError(
                    f"engine replica {slot.index} died ({how}) before it took the request"))
            else:
                self._events.deliver([(request_id, ReplicaDiedError(message))])
        for (index, call_id), answer in list(self._calls.items()):
            if index == slot.index:  # (its engine, and its adapters, are gone)
                del self._calls[(index, call_id)]
                if not answer.done():
                    answer.set_result(None)
        slot.retire_snapshot()
        self._snapshot = None
        self._publish_state(slot)

    def on_restart(self, slot: ReplicaSlot) -> None:
        if self.metrics is not None:
            self.metrics.restarted(slot.index)

    def on_given_up(self, slot: ReplicaSlot) -> None:
        self._publish_state(slot)
        if all(s.state == FAILED for s in self.slots):
            self.dead_error = EngineDeadError(self.dead_message())
            self._events.died()

    def _publish_state(self, slot: ReplicaSlot) -> None:
        if self.metrics is not None:
            self.metrics.set_healthy(slot.index, slot.healthy)
