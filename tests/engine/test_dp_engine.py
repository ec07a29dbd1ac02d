"""DataParallelEngine without a model: each "replica" is a thread speaking the pipe protocol
(messages.py) behind a fake launcher. Routing, acks, outputs, a replica's death (its
streams fail, the other's go on, it restarts and rejoins), failed starts given up, and the
per-replica metrics."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from multiprocessing import Pipe

import pytest

from pagoda.config import EngineConfig
from pagoda.engine.data_parallel import supervisor
from pagoda.engine.data_parallel.engine import DataParallelEngine, ReplicaDiedError
from pagoda.engine.data_parallel.messages import (
    Abort,
    Add,
    Added,
    Answered,
    Batch,
    ErrorInfo,
    Failed,
    LoRACall,
    Out,
    Ready,
    ReplicaInfo,
    Snapshot,
    Stop,
    snapshot_fields,
)
from pagoda.engine.data_parallel.metrics import DataParallelMetrics
from pagoda.engine.loop.request_stream import EngineDeadError
from pagoda.engine.stats.snapshot import EngineSnapshot
from pagoda.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagoda.sampling_params import SamplingParams

_pids = itertools.count(1000)


class FakeReplica:
    """A replica on a thread: acks each ADD with one output (unless `hold_adds`: it keeps
    them unanswered), finishes a request when the test says so; `kill()` closes its pipe
    end (what the server sees of a SIGKILL)."""

    def __init__(self, spec, tokenizer, fail_start: bool = False,
                 ready: threading.Event | None = None) -> None:
        """`ready`: wait for it before reporting READY (a slow start)."""
        self.server_end, self.conn = Pipe()
        self.spec = spec
        self.sentinel = None
        self.pid = next(_pids)
        self.exitcode: int | None = None
        self.requests: dict[str, list[int]] = {}
        self.hold_adds = False
        self.loras: set[int] = set()
        """Adapter ids its "engine" knows (LoRACalls answered as LLMEngine's)."""
        self._lock = threading.Lock()
        self._killed = threading.Event()
        self._stopped = threading.Event()
        self.connection = self.server_end
        info = ReplicaInfo(self.pid, 2048, 49152, [2], 8, 64, 16, 1024, None, 1,
                           tokenizer if spec.send_tokenizer else None)
        self._thread = threading.Thread(target=self._run, args=(info, fail_start, ready),
                                        daemon=True)
        self._thread.start()

    def _send(self, message) -> None:
        with self._lock:
            self.conn.send(message)

    def _run(self, info: ReplicaInfo, fail_start: bool, ready: threading.Event | None) -> None:
        if ready is not None:
            ready.wait()
        self._send(Failed("ValueError: no such model") if fail_start else Ready(info))
        while not fail_start and not self._killed.is_set():
            if not self.conn.poll(0.01):
                continue
            message = self.conn.recv()
            if isinstance(message, Add):
                request = message.request
                self.requests[request.request_id] = request.prompt_token_ids
                if self.hold_adds:
                    continue
                self._send(Batch([Added(request.request_id),
                                  Out(request.request_id, self.output(request.request_id,
                                                                      False))]))
            elif isinstance(message, LoRACall):
                self._send(Batch([self.answer(message)]))
            elif isinstance(message, Abort):
                self.requests.pop(message.request_id, None)
            elif isinstance(message, Stop):
                break
        self.exitcode = -9 if self._killed.is_set() else (1 if fail_start else 0)
        self.conn.close()
        self._stopped.set()

    def output(self, request_id: str, finished: bool) -> RequestOutput:
        return RequestOutput(request_id, None, self.requests[request_id], [CompletionOutput(
            0, "x", [5], finish_reason="stop" if finished else None, delta_token_ids=[5])],
            finished=finished, metrics=RequestMetrics(arrival_time=time.time() - 1,
                                                      first_token_time=time.time()))

    def answer(self, call: LoRACall) -> Answered:
        if call.method == "list_loras":
            return Answered(call.call_id, set(self.loras))
        lora_id = getattr(call.arguments[0], "lora_int_id", call.arguments[0])
        if lora_id == 99:
            return Answered(call.call_id, None, ErrorInfo(
                "InvalidRequestError", "lora_int_id 99 is already adapter 'x'", "lora_request"))
        known = lora_id in self.loras
        if call.method == "add_lora":
            self.loras.add(lora_id)
            return Answered(call.call_id, not known)
        self.loras.discard(lora_id)
        return Answered(call.call_id, known)

    def finish(self, request_id: str) -> None:
        self._send(Batch([Out(request_id, self.output(request_id, True)),
                          Snapshot(snapshot_fields(EngineSnapshot(
                              num_generation_tokens=2, num_kv_blocks=64)))]))

    def kill(self) -> None:
        self._killed.set()

    def is_alive(self) -> bool:
        return not self._stopped.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._stopped.wait(timeout)


@pytest.fixture
def launched(bundled_tokenizer):
    """(launcher, {index: [FakeReplica, ...]}, settings): settings["fail_restarts"] makes
    later starts fail, settings["restarted"] holds their READY until set."""
    replicas: dict[int, list[FakeReplica]] = {}
    settings = {"fail_restarts": False, "restarted": threading.Event()}
    settings["restarted"].set()

    def launch(spec, backend: str) -> FakeReplica:
        assert backend == "mp" and spec.config.parallel.data_parallel_size == 1
        fail = settings["fail_restarts"] and spec.index in replicas
        replica = FakeReplica(spec, bundled_tokenizer, fail_start=fail,
                              ready=settings["restarted"] if spec.index in replicas else None)
        replicas.setdefault(spec.index, []).append(replica)
        return replica

    return launch, replicas, settings


def make_engine(launch, num_replicas: int = 2) -> DataParallelEngine:
    config = EngineConfig.from_kwargs(data_parallel_size=num_replicas)
    engine = DataParallelEngine(config, launcher=launch)
    engine.metrics = DataParallelMetrics("m", num_replicas)
    return engine


async def until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def request(engine: DataParallelEngine, request_id: str, prompt: list[int]):
    return engine.input_processor.process(request_id, prompt, SamplingParams(max_tokens=4))


def sample(engine: DataParallelEngine, name: str, replica: str | None = None) -> float:
    labels = {"model_name": "m"} if replica is None else {"model_name": "m", "replica": replica}
    for family in engine.metrics.registry.collect():
        for s in family.samples:
            if s.name == "pagoda:" + name and s.labels == labels:
                return s.value
    raise KeyError(name)


def test_a_dead_replica_fails_its_own_streams_and_restarts(launched):
    launch, replicas, settings = launched
    engine = make_engine(launch)
    settings["restarted"].clear()
    assert engine.tokenizer is not None and engine.max_model_len == 2048

    async def scenario() -> None:
        engine.start()
        a = await engine.add_request(request(engine, "a", [1, 2, 3]))
        b = await engine.add_request(request(engine, "b", [4, 5, 6]))
        home = {rid: i for i, rs in replicas.items() for rid in rs[-1].requests}
        assert sorted(home.values()) == [0, 1]  # least loaded: one each
        assert (await a.__anext__()).outputs[0].text == "x"
        await b.__anext__()
        replicas[home["a"]][-1].kill()
        with pytest.raises(ReplicaDiedError, match=f"replica {home['a']} died"):
            await asyncio.wait_for(a.__anext__(), 5)
        assert engine.is_alive  # the other one serves
        assert engine.replica_states()[home["a"]] == "starting"
        await engine.add_request(request(engine, "c", [7]))
        assert "c" in replicas[home["b"]][-1].requests  # the router skips the dead one
        assert sample(engine, "dp_replica_healthy", str(home["a"])) == 0
        settings["restarted"].set()
        replicas[home["b"]][-1].finish("b")
        assert (await b.__anext__()).finished
        # the dead one was started again (a new "process" of the same index) and rejoins
        await until(lambda: engine.replica_states() == ["healthy", "healthy"])
        assert len(replicas[home["a"]]) == 2
        assert sample(engine, "dp_replica_restarts_total", str(home["a"])) == 1
        await until(lambda: sample(engine, "generation_tokens_total", str(home["b"])) == 2)
        assert sample(engine, "generation_tokens_total") == 2  # totals
        # one first token each (b's last output is not counted again): b, c there; a, b, c
        # in all; one finished request (b)
        assert sample(engine, "time_to_first_token_seconds_count", str(home["b"])) == 2
        assert sample(engine, "time_to_first_token_seconds_count") == 3
        assert sample(engine, "e2e_request_latency_seconds_count", str(home["b"])) == 1
        assert sample(engine, "e2e_request_latency_seconds_count") == 1
        d = await engine.add_request(request(engine, "d", [8]))  # to the idle, new one
        assert "d" in replicas[home["a"]][-1].requests
        engine.abort("c")
        await until(lambda: "c" not in replicas[home["b"]][-1].requests)
        assert engine.num_unfinished_seqs == 1
        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in d:
                pass
        assert not engine.is_alive
        assert all(not r.is_alive() for rs in replicas.values() for r in rs)

    asyncio.run(scenario())


def test_a_request_whose_replica_dies_before_taking_it_goes_to_another(launched):
    launch, replicas, settings = launched
    engine = make_engine(launch)
    settings["restarted"].clear()  # the dead one stays down meanwhile

    async def scenario() -> None:
        engine.start()
        await until(lambda: engine.replica_states() == ["healthy", "healthy"])
        for index in (0, 1):
            replicas[index][-1].hold_adds = True
        adding = asyncio.ensure_future(engine.add_request(request(engine, "a", [1, 2])))
        await until(lambda: any("a" in replicas[i][-1].requests for i in (0, 1)))
        first = next(i for i in (0, 1) if "a" in replicas[i][-1].requests)
        other = 1 - first
        replicas[other][-1].hold_adds = False
        assert not adding.done()  # not taken yet
        replicas[first][-1].kill()
        stream = await asyncio.wait_for(adding, 5)  # taken by the other, no error
        assert "a" in replicas[other][-1].requests
        assert (await stream.__anext__()).outputs[0].text == "x"
        assert engine.num_unfinished_seqs == 1
        assert engine.router.load(first) == 0
        replicas[other][-1].finish("a")
        assert (await stream.__anext__()).finished
        assert engine.num_unfinished_seqs == 0
        # With no replica left to take it, the request fails with a 503's error.
        replicas[other][-1].hold_adds = True
        adding = asyncio.ensure_future(engine.add_request(request(engine, "b", [3])))
        await until(lambda: "b" in replicas[other][-1].requests)
        replicas[other][-1].kill()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(adding, 5)
        assert engine.num_unfinished_seqs == 0
        settings["restarted"].set()
        await engine.shutdown()

    asyncio.run(scenario())


def test_replicas_that_keep_failing_to_start_are_given_up(launched, monkeypatch):
    launch, replicas, settings = launched
    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_S", 0.01)
    engine = make_engine(launch)

    async def scenario() -> None:
        engine.start()
        settings["fail_restarts"] = True
        pending = await engine.add_request(request(engine, "a", [1]))
        for index in (0, 1):
            replicas[index][-1].kill()
        error = await asyncio.wait_for(engine.wait_dead(), 10)
        assert isinstance(error, EngineDeadError) and "no such model" in str(error)
        assert engine.replica_states() == ["failed", "failed"] and not engine.is_alive
        assert all(len(replicas[i]) == 1 + supervisor.MAX_START_FAILURES for i in (0, 1))
        assert not (await pending.__anext__()).finished  # sent before the replica died
        with pytest.raises(ReplicaDiedError):
            await pending.__anext__()
        with pytest.raises(EngineDeadError):
            await engine.add_request(request(engine, "b", [1]))
        await engine.shutdown()

    asyncio.run(scenario())


def test_a_replica_that_fails_to_start_fails_the_start_up(launched):
    launch, replicas, settings = launched
    replicas[1] = []  # (a "restart" for index 1: it fails)
    settings["fail_restarts"] = True
    with pytest.raises(ValueError, match="replica 1 failed to start: ValueError: no such model"):
        make_engine(launch)
    assert not any(r.is_alive() for r in replicas[0] + replicas[1])


def test_adapter_commands_go_to_every_healthy_replica(launched):
    from pagoda.errors import InvalidRequestError
    from pagoda.lora.request import LoRARequest

    launch, replicas, settings = launched
    engine = make_engine(launch)
    settings["restarted"].clear()

    async def scenario() -> None:
        engine.start()
        assert await engine.add_lora(LoRARequest("a", 1, "/a")) is True
        assert all(rs[-1].loras == {1} for rs in replicas.values())
        replicas[0][-1].loras.add(2)  # (as if a request of adapter 2 had gone to replica 0)
        assert await engine.list_loras() == {1, 2}
        assert await engine.remove_lora(2) is True  # one replica knew it
        assert await engine.remove_lora(2) is False
        with pytest.raises(InvalidRequestError, match="already adapter"):
            await engine.add_lora(LoRARequest("b", 99, "/b"))
        replicas[1][-1].kill()
        await until(lambda: engine.replica_states()[1] != "healthy")
        assert await engine.list_loras() == {1}  # from the healthy one
        settings["restarted"].set()
        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            await engine.list_loras()

    asyncio.run(scenario())
