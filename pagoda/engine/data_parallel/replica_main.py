"""What runs inside a replica process: an EngineLoop (engine_loop.py) on the main thread, its
commands read from the pipe, its events written back onto it.

    reader thread:  conn.recv() -> Add / Abort / Stop -> EngineLoop.put
    main thread:    the EngineLoop (the engine was built on this thread too: one OpenMP pool)
                    PipeEvents: everything one loop iteration produced (Added, Out, Error,
                    Snapshot at most every SNAPSHOT_INTERVAL_S) leaves in one Batch message;
                    only this thread writes to the pipe.

SIGINT and SIGTERM are ignored (see run_replica). Exit paths: Stop (code 0); the engine
loop died (a Dead message, code 1); the server's end of the pipe closed (the server is gone:
stop, and a hard exit PARENT_GONE_EXIT_S later if that hangs); the server process died
(PR_SET_PDEATHSIG: SIGKILL from the kernel).

Module imports stay light: the process must set OMP_NUM_THREADS before torch loads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from pagoda.child_process import connect_to_parent, receive_message, send_message
from pagoda.engine.data_parallel.messages import (
    Abort,
    Add,
    Added,
    Answered,
    Batch,
    BatchItem,
    Dead,
    Error,
    Failed,
    LoRACall,
    Out,
    Ready,
    ReplicaInfo,
    ReplicaMessage,
    Snapshot,
    Stop,
    encode_error,
    snapshot_fields,
)
from pagoda.engine.data_parallel.replica_spec import ReplicaSpec
from pagoda.engine.loop.request_stream import Delivery
from pagoda.engine.stats.snapshot import EngineSnapshot
from pagoda.parent_death import die_with_parent

logger = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 0.25
PARENT_GONE_EXIT_S = 10.0


def run_replica(conn: Connection) -> None:
    """The process's entry point (`python -m pagoda.engine.data_parallel.replica_main FD`,
    launcher.py): its ReplicaSpec is the first message on its connection."""
    spec: ReplicaSpec = receive_message(conn)
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
    """Build the engine and serve the server's messages until Stop, the engine's death or
    the server's; returns the exit code. A local replica process's body (run_replica), and
    a Ray actor's (ray_replica.py)."""
    num_threads = _set_threads()
    from pagoda.engine.loop.builder import build_engine
    from pagoda.engine.loop.engine_loop import EngineLoop

    try:
        engine = build_engine(spec.config)
    except Exception as e:
        logger.exception("building the engine failed")
        send_message(conn, Failed(f"{type(e).__name__}: {e}"))
        return 1
    snapshot = engine.snapshot()
    send_message(conn, Ready(ReplicaInfo(
        pid=os.getpid(), max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
        eos_token_ids=list(engine.eos_token_ids),
        max_num_seqs=engine.config.scheduler.max_num_seqs,
        num_kv_blocks=snapshot.num_kv_blocks, block_size=engine.config.cache.block_size,
        kv_capacity_tokens=engine.kv_capacity_tokens, model_files=engine.model_files,
        num_threads=num_threads, run_info=engine.run_info, model_pooling=engine.model_pooling,
        tokenizer=engine.tokenizer if spec.send_tokenizer else None,
    )))
    events = PipeEvents(conn)
    engine_loop = events.engine_loop = EngineLoop(engine, events)
    threading.Thread(target=_read_commands, args=(conn, engine_loop),
                     name="pagoda-dp-reader", daemon=True).start()
    engine_loop.run()
    return 0 if engine_loop.dead_error is None else 1


def _set_threads() -> int:
    import torch

    # OMP_NUM_THREADS is read when torch loads; if a __main__ loaded it earlier, say it again.
    with contextlib.suppress(ValueError):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return torch.get_num_threads()


def _read_commands(conn: Connection, engine_loop) -> None:
    try:
        while True:
            message = receive_message(conn)
            if isinstance(message, LoRACall):
                if not engine_loop.call(message):
                    return  # the loop has ended
                continue
            if not isinstance(message, (Add, Abort, Stop)):
                logger.error("unknown message %r from the server", message)
                continue
            engine_loop.put(message)
            if isinstance(message, Stop):
                return
    except (EOFError, OSError):  # the server is gone: nobody to serve
        engine_loop.put(Stop())
        time.sleep(PARENT_GONE_EXIT_S)
        os._exit(1)  # the orderly stop hung


class PipeEvents:
    """The replica's LoopEvents: what one loop iteration produced leaves in one Batch."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.engine_loop = None
        """Told to stop when the server's end is gone."""
        self._outbox: list[BatchItem] = []
        self._unsent: EngineSnapshot | None = None
        """The last snapshot published, while not yet sent (throttled)."""
        self._next_snapshot_at = 0.0

    def added(self, request_id: str, error: BaseException | None) -> None:
        self._outbox.append(Added(request_id) if error is None
                            else Error(request_id, encode_error(error)))

    def deliver(self, items: Delivery) -> None:
        for request_id, item in items:
            self._outbox.append(Error(request_id, encode_error(item))
                                if isinstance(item, BaseException) else Out(request_id, item))

    def synced(self, token: Any) -> None:
        pass  # (no Sync crosses the pipe)

    def answered(self, call_id: int, result: Any, error: BaseException | None) -> None:
        self._outbox.append(Answered(call_id, result,
                                     None if error is None else encode_error(error)))

    def published(self, snapshot: EngineSnapshot) -> None:
        """The end of a loop iteration: send its items, with the snapshot if one is due."""
        self._unsent = snapshot
        now = time.monotonic()
        if now >= self._next_snapshot_at:
            self._outbox.append(Snapshot(snapshot_fields(snapshot)))
            self._unsent = None
            self._next_snapshot_at = now + SNAPSHOT_INTERVAL_S
        self._flush()

    def idle_timeout(self) -> float | None:
        """Wake an idle loop when its last snapshot is due to be sent."""
        if self._unsent is None:
            return None
        return max(self._next_snapshot_at - time.monotonic(), 0.0)

    def ended(self, dead_error: BaseException | None) -> None:
        self._flush()
        if dead_error is not None:
            self._send(Dead(f"the engine loop died: {type(dead_error).__name__}: {dead_error}"))

    def _flush(self) -> None:
        items, self._outbox = self._outbox, []
        if items:
            self._send(Batch(items))

    def _send(self, message: ReplicaMessage) -> None:
        try:
            send_message(self.conn, message)
        except OSError:  # the server is gone (BrokenPipeError among them)
            if self.engine_loop is not None:
                self.engine_loop.put(Stop())


if __name__ == "__main__":
    run_replica(connect_to_parent())
