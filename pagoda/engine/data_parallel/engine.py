"""DataParallelEngine: the engine front-end (front_end.py: streams, queue check, aborts, dead
and alive, the EngineClient the server uses) over N engine replicas in their own processes
(replica_set_core.py: router, pipes, supervisor)."""

from __future__ import annotations

from pagoda.config import EngineConfig
from pagoda.engine.data_parallel.launcher import launch_replica
from pagoda.engine.data_parallel.metrics import DataParallelMetrics
from pagoda.engine.data_parallel.replica_set_core import (
    ReplicaDiedError,
    ReplicaLostBeforeAckError,
    ReplicaSetCore,
)
from pagoda.engine.data_parallel.supervisor import Launcher
from pagoda.engine.loop.front_end import EngineFrontEnd

__all__ = ["DataParallelEngine", "ReplicaDiedError", "ReplicaLostBeforeAckError"]


class DataParallelEngine(EngineFrontEnd):
    def __init__(self, config: EngineConfig, *, max_queue: int | None = None,
                 metrics: DataParallelMetrics | None = None,
                 launcher: Launcher = launch_replica) -> None:
        """Start `config.parallel.data_parallel_size` replicas and wait until all are ready
        (slow: each loads the model). Raises ValueError if one fails to start. `metrics`
        may also be set later, before `start` (the server names the model once the engine
        is built)."""
        core = ReplicaSetCore(config, launcher)
        core.metrics = metrics
        super().__init__(core, max_queue=max_queue)
        self.num_replicas = core.num_replicas
        self.model_files = core.model_files
        self.kv_capacity_tokens: int = core.kv_capacity_tokens
        """Of one replica."""
        self.router = core.router

    def replica_states(self) -> list[str]:
        return self.core.replica_states()
