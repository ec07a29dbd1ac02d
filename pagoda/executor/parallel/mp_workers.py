"""Tensor-parallel workers as local processes (the "mp" backend, the default): N processes
`python -m pagoda.executor.parallel.worker_process` (no re-import of the user's script), each
on a socket pair with the engine and with cpus / N threads. They die with the engine's
process (PR_SET_PDEATHSIG, and the end of their socket)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from multiprocessing.connection import Connection

from pagoda.config import EngineConfig
from pagoda.errors import EngineFatalError

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
    threads = max(1, len(os.sched_getaffinity(0)) // world_size)
    environment = {"OMP_NUM_THREADS": str(threads), **os.environ}  # (a user's setting wins)
    processes, connections = [], []
    for rank in range(world_size):
        parent_end, child_end = socket.socketpair()
        process = subprocess.Popen(
            [sys.executable, "-m", "pagoda.executor.parallel.worker_process",
             str(child_end.fileno())],
            pass_fds=[child_end.fileno()], env=environment)
        child_end.close()
        connection = Connection(parent_end.detach())
        send(connection, (config, rank, world_size, init_method,
                          logging.getLogger().getEffectiveLevel()))
        processes.append(process)
        connections.append(connection)
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

    def __init__(self, processes: list[subprocess.Popen], connections: list[Connection]) -> None:
        self.processes, self.connections = processes, connections
        self._finalizer = weakref.finalize(self, _stop_workers, processes, connections)
        atexit.register(self._finalizer)

    def call_all(self, method: str, args: tuple) -> list:
        for rank, connection in enumerate(self.connections):
            try:
                send(connection, (method, args))
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
                if process.poll() is not None:
                    raise EngineFatalError(f"tensor-parallel rank {rank} exited "
                                           f"(exit code {process.returncode})")
                if deadline is not None and time.monotonic() > deadline:
                    raise EngineFatalError(
                        f"tensor-parallel rank {rank} did not answer in {timeout:.0f} s")
            try:
                status, value = receive(connection)
            except (EOFError, OSError):
                raise EngineFatalError(
                    f"tensor-parallel rank {rank} closed its socket (it died)") from None
            if status == "error":
                raise EngineFatalError(f"tensor-parallel rank {rank}: {value}")
            replies.append(value)
        return replies


def _stop_workers(processes: list, connections: list[Connection]) -> None:
    for connection in connections:
        with contextlib.suppress(OSError, ValueError):
            send(connection, None)
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
    for connection in connections:
        connection.close()


def send(connection: Connection, message: object) -> None:
    """Plain pickle over the socket: tensors travel as bytes (multiprocessing's pickler
    would pass their storage as file descriptors, through a channel these processes,
    not started by multiprocessing, cannot open)."""
    connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(connection: Connection) -> object:
    return pickle.loads(connection.recv_bytes())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
