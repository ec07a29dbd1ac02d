"""What an engine loop is told (engine_loop.py): plain, picklable data, so the same commands
reach a loop on a thread of this process (thread_core.py) or in a replica process over its
pipe (data_parallel/messages.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.engine.core.input_processor import EngineRequest


@dataclass(frozen=True)
class Add:
    """Add a validated request; the loop answers `added(request_id, error)`."""

    request: EngineRequest


@dataclass(frozen=True)
class Abort:
    """Abort a request (a no-op for ids the engine does not hold)."""

    request_id: str


@dataclass(frozen=True)
class Stop:
    """End the loop: what is still running is aborted, the engine shut down."""


@dataclass(frozen=True)
class Sync:
    """Answered (`synced(token)`) once every command before it is handled and the snapshot
    after them published. In-process only: `token` is whatever the caller waits on."""

    token: Any


LORA_METHODS = ("add_lora", "remove_lora", "list_loras")
"""The engine methods a LoRACall may name (LLMEngine's, as vLLM's LLMEngine)."""


@dataclass(frozen=True)
class LoRACall:
    """Call the engine's `method` (one of LORA_METHODS) with `arguments` (a LoRARequest, a
    lora_int_id, or nothing); the loop answers `answered(call_id, result, error)`. Ordered
    with Adds: a request added after a remove_lora is refused."""

    method: str
    arguments: tuple = ()
    call_id: int = 0
