"""Tensor-parallel workers as local processes (the "mp" backend, the default): N child
processes (pagoda/child_process.py) `python -m pagoda.executor.parallel.worker_process`,
each on a socket pair with the engine and with cpus / N threads. They die with the engine's
process (PR_SET_PDEATHSIG, and the end of their socket)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import socket
import time
import weakref
from multiprocessing.connection import Connection

from pagoda.child_process import (
    ChildProcess,
    receive_message,
    send_message,
    start_child_process,
    threads_per_process,
)
from pagoda.config import EngineConfig
from pagoda.errors import EngineFatalError
from pagoda.executor.parallel.messages import Call, Reply, Shutdown, WorkerStart

logger = logging.getLogger(__name__)

START_TIMEOUT = 1800.0
"""Seconds a worker may take to load its share (a large model from a slow disk)."""
POLL_INTERVAL = 0.5
"""Seconds between checks that the workers still live while waiting for their replies."""


def start_local_workers(config: EngineConfig) -> tuple[LocalWorkers, list]:
    """Start the processes and wait for each one's BuiltRunner (rank order). ValueError
    with the worker's message if one fails to start."""
    world_size = config.parallel.tensor_parallel_size
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    threads = threads_per_process(world_size)
    processes, connections = [], []
    for rank in range(world_size):
        process = start_child_process("pagoda.executor.parallel.worker_process",
                                      {"OMP_NUM_THREADS": str(threads)})
        send_message(process.connection, WorkerStart(
            config, rank, world_size, init_method, logging.getLogger().getEffectiveLevel()))
        processes.append(process)
        connections.append(process.connection)
    workers = LocalWorkers(processes, connections)
    try:
        built = workers.wait_all(timeout=START_TIMEOUT)
    except EngineFatalError as error:
        workers.stop()
        raise ValueError(f"tensor-parallel start-up failed: {error}") from None
    logger.info("tensor parallelism: %d worker processes, %d threads each", world_size, threads)
    return workers, built


class LocalWorkers:
    """The worker processes and their sockets (a WorkerGroup, tp_runner.py)."""

    def __init__(self, processes: list[ChildProcess], connections: list[Connection]) -> None:
        self.processes, self.connections = processes, connections
        self._finalizer = weakref.finalize(self, _stop_workers, processes, connections)
        atexit.register(self._finalizer)

    def call_all(self, method: str, args: tuple) -> list:
        for rank, connection in enumerate(self.connections):
            try:
                send_message(connection, Call(method, args))
            except OSError:
                raise EngineFatalError(f"tensor-parallel rank {rank} is gone") from None
        return self.wait_all()

    def stop(self) -> None:
        self._finalizer()

    def wait_all(self, timeout: float | None = None) -> list:
        """Each worker's next reply, rank order; EngineFatalError if one failed or died."""
        deadline = None if timeout is None else time.monotonic() + timeout
        replies = []
        for rank, (process, connection) in enumerate(zip(self.processes, self.connections)):
            while not connection.poll(POLL_INTERVAL):
                if process.exitcode is not None:
                    raise EngineFatalError(f"tensor-parallel rank {rank} exited "
                                           f"(exit code {process.exitcode})")
                if deadline is not None and time.monotonic() > deadline:
                    raise EngineFatalError(
                        f"tensor-parallel rank {rank} did not answer in {timeout:.0f} s")
            try:
                reply: Reply = receive_message(connection)
            except (EOFError, OSError):
                raise EngineFatalError(
                    f"tensor-parallel rank {rank} closed its socket (it died)") from None
            if reply.error is not None:
                raise EngineFatalError(f"tensor-parallel rank {rank}: {reply.error}")
            replies.append(reply.value)
        return replies


def _stop_workers(processes: list[ChildProcess], connections: list[Connection]) -> None:
    for connection in connections:
        with contextlib.suppress(OSError, ValueError):
            send_message(connection, Shutdown())
    for process in processes:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join(5)
    for connection in connections:
        connection.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
