"""One tensor-parallel rank: its share of the model and the calls the engine sends it. The
same class runs in a local worker process (worker_process.py, the "mp" backend) and as a
Ray actor (ray_workers.py)."""

from __future__ import annotations

import logging

from pagoda.config import EngineConfig

logger = logging.getLogger(__name__)


class TensorParallelWorker:
    """Joins the group and builds rank `rank`'s share on construction (every rank of the
    group at once: joining waits for all); `built` then says what the engine needs."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, init_method: str,
                 device_index: int | None = None) -> None:
        from pagoda.executor.loader.model_loader import resolve_device
        from pagoda.executor.parallel.communication import init_tensor_parallel
        from pagoda.executor.runner_builder import build_runner

        self.rank = rank
        group = init_tensor_parallel(rank, world_size, init_method, resolve_device(config.device),
                                     device_index)
        self.runner, self.built = build_runner(config, group)

    def describe(self):
        """The BuiltRunner (for a caller that reaches the worker by method calls only)."""
        return self.built

    def run(self, method: str, args: tuple) -> object:
        """The runner's `method(*args)`. Rank 0 returns the result; the others return only
        what the engine checks them by (their sampled tokens), or None."""
        result = getattr(self.runner, method)(*args)
        if self.rank == 0:
            return result
        if method == "execute_model":
            return (result.sampled_token_ids, result.num_accepted_tokens)
        return None

    def close(self) -> None:
        from pagoda.executor.parallel.communication import leave_tensor_parallel

        leave_tensor_parallel()
