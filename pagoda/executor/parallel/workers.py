"""Tensor parallelism over local processes (the "mp" backend): N worker processes, one per
rank, each holding its share of the model; the engine's process holds none and drives them.

    engine process                                  worker r (r = 0 .. N-1)
    --------------                                  -----------------------
    start_tensor_parallel_runner                    init_tensor_parallel (gloo / NCCL)
      start N workers, each with cpus/N threads     build_runner(config, group): load the
      wait for each one's BuiltRunner   <-------      whole model, keep rank r's share, KV cache
    TensorParallelRunner.execute_model(step)        loop: receive (method, args)
      send the step to every worker     ------->      run it (collectives keep ranks in step)
      rank 0's output back; the others' sampled <--   reply (rank 0: the output; others: their
      tokens compared with it                         sampled tokens, to catch a divergence)

Every rank samples from the gathered logits with the same generator state, so all ranks'
batch records stay equal without sending tokens back down. A worker that dies, fails to
start, or samples otherwise than rank 0 ends the runner: EngineFatalError, and the engine
stops. Workers are `python -m pagoda.executor.parallel.worker_process` processes (no
re-import of the user's script), each on a socket pair with the engine; they die with the
engine's process (PR_SET_PDEATHSIG, and the end of their socket).
"""

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


def start_tensor_parallel_runner(config: EngineConfig):
    """Spawn the workers for `config` (tensor_parallel_size of them) and wait until each has
    built its share. Returns (TensorParallelRunner, rank 0's BuiltRunner). ValueError for a
    model tensor parallelism cannot split, or any worker's start-up error."""
    from pagoda.executor.loader.model_files import resolve_model_files
    from pagoda.executor.loader.model_loader import open_checkpoint
    from pagoda.executor.models.registry import resolve_model_class
    from pagoda.executor.parallel.sharding import check_shardable

    world_size = config.parallel.tensor_parallel_size
    hf_config = open_checkpoint(resolve_model_files(config.model.model)).hf_config
    check_shardable(resolve_model_class(hf_config), hf_config, world_size)  # fail before spawning
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
    runner = TensorParallelRunner(processes, connections)
    try:
        built = runner.wait_all(timeout=START_TIMEOUT)
    except EngineFatalError as error:
        runner.shutdown()
        raise ValueError(f"tensor-parallel start-up failed: {error}") from None
    logger.info("tensor parallelism: %d worker processes, %d threads each", world_size, threads)
    return runner, built[0]


class TensorParallelRunner:
    """The engine's runner under tensor parallelism: what a ModelRunner offers the engine
    (execute_model, prompt_logits), run by every worker; rank 0's result returned."""

    def __init__(self, processes: list, connections: list[Connection]) -> None:
        self.processes, self.connections = processes, connections
        self.broken: str | None = None
        """Why the workers can no longer run steps; None while they can."""
        self._finalizer = weakref.finalize(self, _stop_workers, processes, connections)
        atexit.register(self._finalizer)

    def execute_model(self, scheduler_output):
        outputs = self._call("execute_model", scheduler_output)
        first = outputs[0]
        for rank, sampled in enumerate(outputs[1:], start=1):
            if sampled != (first.sampled_token_ids, first.num_accepted_tokens):
                self._break(f"rank {rank} sampled other tokens than rank 0: the ranks "
                            "are out of step")
        return first

    def prompt_logits(self, prompts: list[list[int]]):
        return self._call("prompt_logits", prompts)[0]

    def shutdown(self) -> None:
        """Stop the workers (waits for them briefly, then kills). Idempotent."""
        self.broken = self.broken or "the runner was shut down"
        self._finalizer()

    def wait_all(self, timeout: float | None = None) -> list:
        """Each worker's next reply, rank order; EngineFatalError if one failed or died."""
        deadline = None if timeout is None else time.monotonic() + timeout
        replies = []
        for rank, (process, connection) in enumerate(zip(self.processes, self.connections)):
            while not connection.poll(POLL_INTERVAL):
                if process.poll() is not None:
                    self._break(f"tensor-parallel rank {rank} exited "
                                f"(exit code {process.returncode})")
                if deadline is not None and time.monotonic() > deadline:
                    self._break(f"tensor-parallel rank {rank} did not answer in {timeout:.0f} s")
            try:
                status, value = receive(connection)
            except (EOFError, OSError):
                self._break(f"tensor-parallel rank {rank} closed its pipe (it died)")
            if status == "error":
                self._break(f"tensor-parallel rank {rank}: {value}")
            replies.append(value)
        return replies

    def _call(self, method: str, *args) -> list:
        if self.broken is not None:
            raise EngineFatalError(self.broken)
        for rank, connection in enumerate(self.connections):
            try:
                send(connection, (method, args))
            except (BrokenPipeError, OSError):
                self._break(f"tensor-parallel rank {rank} is gone")
        return self.wait_all()

    def _break(self, why: str):
        self.broken = why
        self._finalizer()
        raise EngineFatalError(why)


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
