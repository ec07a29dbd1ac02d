"""What a replica is started with: its own module, so that the launcher and both sides of
a replica (replica_main.py, ray_replica.py) import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.config import EngineConfig


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a replica needs to start (pickled into it)."""

    index: int
    config: EngineConfig
    """The engine's config with data_parallel_size 1."""
    num_threads: int
    """Its CPU threads (OMP_NUM_THREADS, unless the server's environment sets one)."""
    parent_pid: int
    log_level: int
    send_tokenizer: bool = False
    """Ship the tokenizer in the ready message (the server's first start needs it)."""
