"""The engine's runner under tensor parallelism: what a ModelRunner offers the engine
(execute_model, prompt_logits), run by every rank of a worker group; rank 0's result back.

    engine process                                  worker r (r = 0 .. N-1)
    --------------                                  -----------------------
    start_tensor_parallel_runner                    TensorParallelWorker (worker.py):
      start N workers (mp_workers.py: local          join the group (gloo / NCCL), load the
      processes; ray_workers.py: Ray actors)         whole model, keep rank r's share, KV cache
      wait for each one's BuiltRunner   <-------
    TensorParallelRunner.execute_model(step)
      send the step to every worker     ------->    run it (collectives keep ranks in step)
      rank 0's output back; the others' sampled <-- reply (rank 0: the output; others: their
      tokens compared with it                       sampled tokens, to catch a divergence)

Every rank samples from the gathered logits with the same generator state, so all ranks'
batch records stay equal without sending tokens back down. A worker that dies, fails, or
samples otherwise than rank 0 ends the runner: EngineFatalError, and the engine stops.
"""

from __future__ import annotations

import logging
from typing import Protocol

from pagoda.config import EngineConfig
from pagoda.errors import EngineFatalError

logger = logging.getLogger(__name__)


class WorkerGroup(Protocol):
    """The ranks' transport: one backend's way to reach its workers."""

    def call_all(self, method: str, args: tuple) -> list:
        """Every worker's TensorParallelWorker.run(method, args), rank order; raises
        EngineFatalError if a worker failed or is gone."""

    def stop(self) -> None:
        """End the workers; idempotent."""


def start_tensor_parallel_runner(config: EngineConfig):
    """Start `config`'s tensor_parallel_size workers on its backend and wait until each has
    built its share. Returns (TensorParallelRunner, rank 0's BuiltRunner). ValueError for a
    model tensor parallelism cannot split (before any worker starts), or a worker's
    start-up error."""
    from pagoda.executor.loader.model_files import resolve_model_files
    from pagoda.executor.loader.model_loader import open_checkpoint
    from pagoda.executor.models.registry import resolve_model_class
    from pagoda.executor.parallel.sharding import check_shardable

    hf_config = open_checkpoint(resolve_model_files(config.model.model)).hf_config
    check_shardable(resolve_model_class(hf_config), hf_config,
                    config.parallel.tensor_parallel_size)
    if config.parallel.distributed_executor_backend == "ray":
        from pagoda.executor.parallel.ray_workers import start_ray_workers as start
    else:
        from pagoda.executor.parallel.mp_workers import start_local_workers as start
    workers, built = start_with_a_free_rendezvous(start, config)
    return TensorParallelRunner(workers), built[0]


RENDEZVOUS_ATTEMPTS = 3
"""Start-ups tried while the rendezvous port is lost to another process: a backend picks a
free port, and rank 0 listens on it a moment later (EADDRINUSE if something took it)."""


def start_with_a_free_rendezvous(start, config: EngineConfig):
    """`start(config)`, again (each time on a newly picked port) when rank 0 could not
    listen on the port picked for the group's rendezvous."""
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        try:
            return start(config)
        except ValueError as error:
            if "EADDRINUSE" not in str(error) or attempt == RENDEZVOUS_ATTEMPTS:
                raise
            logger.warning("tensor-parallel start-up, attempt %d: the rendezvous port was "
                           "taken meanwhile; starting again on another", attempt)


class TensorParallelRunner:
    def __init__(self, workers: WorkerGroup) -> None:
        self.workers = workers
        self.broken: str | None = None
        """Why the workers can no longer run steps; None while they can."""

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
        """Stop the workers. Idempotent."""
        self.broken = self.broken or "the runner was shut down"
        self.workers.stop()

    def _call(self, method: str, *args) -> list:
        if self.broken is not None:
            raise EngineFatalError(self.broken)
        try:
            return self.workers.call_all(method, args)
        except EngineFatalError as error:
            self._break(str(error))

    def _break(self, why: str):
        self.broken = why
        self.workers.stop()
        raise EngineFatalError(why)
