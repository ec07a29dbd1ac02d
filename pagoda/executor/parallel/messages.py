"""What crosses a local tensor-parallel worker's socket (mp_workers.py <-> worker_process.py),
as typed messages in pagoda/child_process.py's framing.

    engine -> worker   WorkerStart once; then a Call per step or method; Shutdown at the end
    worker -> engine   a Reply to WorkerStart (value: its BuiltRunner), then one per Call

A Reply carries either a value or an error (the worker's exception as "Type: message"; the
exception object itself may not pickle). The worker also ends when the socket closes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.config import EngineConfig


@dataclass(frozen=True)
class WorkerStart:
    config: EngineConfig
    rank: int
    world_size: int
    init_method: str  # torch.distributed's rendezvous, tcp://host:port
    log_level: int


@dataclass(frozen=True)
class Call:
    """Run TensorParallelWorker.run(method, *args) and reply with its result."""

    method: str
    args: tuple


@dataclass(frozen=True)
class Shutdown:
    """Close the worker and exit."""


@dataclass(frozen=True)
class Reply:
    value: Any = None
    error: str | None = None  # set: the request failed, "ExceptionType: message"

    @classmethod
    def failure(cls, error: BaseException) -> Reply:
        return cls(error=f"{type(error).__name__}: {error}")
