"""What runs inside a replica process: an AsyncLLMEngine relaying its streams over the pipe.

    reader thread:  conn.recv() --call_soon_threadsafe--> Relay.on_message (event loop)
    event loop:     ADD   -> a task: add_request, post ADDED, post each output (OUT)
                    ABORT -> cancel that task (its `finally` aborts the request)
                    STOP  -> shut the engine down, exit 0
                    every SNAPSHOT_INTERVAL_S: post the engine's snapshot if it changed
    posts are batched: everything posted in one loop iteration leaves in one BATCH message,
    sent from the event loop only (one writer per pipe).

SIGINT and SIGTERM are ignored (see run_replica). Exit paths: STOP (code 0); the engine loop died (DEAD message, code 1); the server's end of
the pipe closed (the server is gone: shut down, and a hard exit PARENT_GONE_EXIT_S later if
that hangs); the server process died (PR_SET_PDEATHSIG: SIGKILL from the kernel).

Module imports stay light: the process must set OMP_NUM_THREADS before torch loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from pagoda.engine.data_parallel.messages import (
    Abort,
    Add,
    Added,
    Batch,
    BatchItem,
    Dead,
    Error,
    Failed,
    Out,
    Ready,
    ReplicaInfo,
    ReplicaMessage,
    ServerMessage,
    Snapshot,
    Stop,
    encode_error,
    snapshot_fields,
)
from pagoda.engine.data_parallel.replica_spec import ReplicaSpec
from pagoda.parent_death import die_with_parent

logger = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 0.25
PARENT_GONE_EXIT_S = 10.0


def run_replica(spec: ReplicaSpec, conn: Connection) -> None:
    """The process's entry point (multiprocessing target)."""
    die_with_parent(signal.SIGKILL, spec.parent_pid)
    # Ctrl+C, and a service manager's SIGTERM, reach the whole process group: the server
    # drains its requests (which needs its replicas) and then stops them itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.num_threads))
    logging.basicConfig(level=spec.log_level,
                        format=f"%(levelname)s replica {spec.index} %(name)s: %(message)s")
    code = 0
    try:
        code = serve_replica(spec, conn)
    finally:
        conn.close()
    sys.exit(code)


def serve_replica(spec: ReplicaSpec, conn: Connection) -> int:
    """Build the engine and serve the server's messages until STOP, the engine's death or
    the server's; returns the exit code. A local replica process's body (run_replica), and
    a Ray actor's (ray_replica.py)."""
    return asyncio.run(_serve(spec, conn))


def _set_threads() -> int:
    import torch

    # OMP_NUM_THREADS is read when torch loads; if a __main__ loaded it earlier, say it again.
    with contextlib.suppress(ValueError):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return torch.get_num_threads()


async def _serve(spec: ReplicaSpec, conn: Connection) -> int:
    num_threads = _set_threads()
    from pagoda.engine.async_engine import AsyncLLMEngine
    from pagoda.engine.builder import build_engine

    try:
        async_engine = AsyncLLMEngine.build_on_engine_thread(lambda: build_engine(spec.config))
    except Exception as e:
        logger.exception("building the engine failed")
        conn.send(Failed(f"{type(e).__name__}: {e}"))
        return 1
    engine = async_engine.engine
    snapshot = engine.snapshot()
    conn.send(Ready(ReplicaInfo(
        pid=os.getpid(), max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
        eos_token_ids=list(engine.eos_token_ids),
        max_num_seqs=engine.config.scheduler.max_num_seqs,
        num_kv_blocks=snapshot.num_kv_blocks, block_size=engine.config.cache.block_size,
        kv_capacity_tokens=engine.kv_capacity_tokens, model_files=engine.model_files,
        num_threads=num_threads,
        tokenizer=async_engine.tokenizer if spec.send_tokenizer else None,
    )))
    async_engine.start()
    relay = Relay(async_engine, conn)
    threading.Thread(target=_read_commands, args=(conn, asyncio.get_running_loop(), relay),
                     name="pagoda-dp-reader", daemon=True).start()
    publisher = asyncio.create_task(relay.publish_snapshots())
    died = asyncio.create_task(async_engine.wait_dead())
    stopping = asyncio.create_task(relay.stopping.wait())
    await asyncio.wait([died, stopping], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if died.done():
        error = died.result()
        relay.post_now(Dead(f"the engine loop died: {type(error).__name__}: {error}"))
        code = 1
    for task in (publisher, died, stopping, *relay.tasks.values()):
        task.cancel()
    await async_engine.shutdown()
    relay.flush()
    return code


def _read_commands(conn: Connection, loop: asyncio.AbstractEventLoop, relay: Relay) -> None:
    try:
        while True:
            message = conn.recv()
            loop.call_soon_threadsafe(relay.on_message, message)
            if isinstance(message, Stop):
                return
    except (EOFError, OSError):  # the server is gone: nobody to serve
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(relay.stopping.set)
        time.sleep(PARENT_GONE_EXIT_S)
        os._exit(1)  # the orderly shutdown hung


class Relay:
    """The event-loop side: one task per request, outputs batched onto the pipe."""

    def __init__(self, engine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.tasks: dict[str, asyncio.Task] = {}
        self.stopping = asyncio.Event()
        self._outbox: list[BatchItem] = []

    def on_message(self, message: ServerMessage) -> None:
        if isinstance(message, Add):
            request = message.request
            self.tasks[request.request_id] = asyncio.create_task(self._run(request))
        elif isinstance(message, Abort):
            task = self.tasks.pop(message.request_id, None)
            if task is not None:
                task.cancel()
        elif isinstance(message, Stop):
            self.stopping.set()
        else:
            logger.error("unknown message %r from the server", message)

    async def _run(self, request) -> None:
        request_id = request.request_id
        try:
            try:
                stream = await self.engine.add_request(request)
            except Exception as e:  # noqa: BLE001 -- the server raises it for the caller
                self.post(Error(request_id, encode_error(e)))
                return
            self.post(Added(request_id))
            try:
                async for output in stream:
                    self.post(Out(request_id, output))
            except Exception as e:  # noqa: BLE001 -- ends the request's stream there
                self.post(Error(request_id, encode_error(e)))
            finally:
                if not stream.finished:  # cancelled: the server aborted it
                    self.engine.abort(request_id)
        finally:
            if self.tasks.get(request_id) is asyncio.current_task():
                del self.tasks[request_id]

    async def publish_snapshots(self) -> None:
        last = None
        while True:
            snapshot = self.engine.snapshot
            if snapshot is not last:
                self.post(Snapshot(snapshot_fields(snapshot)))
                last = snapshot
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)

    def post(self, item: BatchItem) -> None:
        """Queue an item; everything queued in this loop iteration leaves in one message."""
        self._outbox.append(item)
        if len(self._outbox) == 1:
            asyncio.get_running_loop().call_soon(self.flush)

    def post_now(self, message: ReplicaMessage) -> None:
        self.flush()
        self._send(message)

    def flush(self) -> None:
        items, self._outbox = self._outbox, []
        if items:
            self._send(Batch(items))

    def _send(self, message: ReplicaMessage) -> None:
        try:
            self.conn.send(message)
        except OSError:  # the server is gone (BrokenPipeError among them)
            self.stopping.set()
