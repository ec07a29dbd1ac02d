"""EngineClient: what the server, the web view and the model registry use of an engine, as
one declared interface (vLLM's engine/loop/protocol.py idea). One front-end implements it
(front_end.py, EngineFrontEnd), built as the in-process AsyncLLMEngine (async_engine.py) or
the data-parallel DataParallelEngine (data_parallel/engine.py);
tests/engine/test_engine_protocol.py checks that both have every member with the same
signature.

Request flow through it: `input_processor.process(...)` validates and tokenizes on the
event loop, `check_queue` refuses when full, `add_request` returns the RequestStream the
response reads, `abort` ends one early, `snapshot` is the engine's state for /metrics,
/health and the web view."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from pagoda.engine.core.input_processor import EngineRequest, InputProcessor
from pagoda.engine.loop.request_stream import RequestStream
from pagoda.engine.stats.snapshot import EngineSnapshot
from pagoda.lora.request import LoRARequest
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Any
    """The front-end's own tokenizer (detokenizing, chat templates)."""
    input_processor: InputProcessor
    """The one validation step of a request, on the event loop."""
    max_model_len: int
    vocab_size: int
    run_info: dict
    """The device, CPU, dtypes and kernels the model runs with (cpu_info.run_info)."""

    def start(self) -> None:
        """Start the engine loop (replicas), from the event loop's thread."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the engine answers on, once started."""

    @property
    def is_alive(self) -> bool:
        """False once the engine loop died (the server then exits non-zero)."""

    @property
    def snapshot(self) -> EngineSnapshot:
        """The engine's state after its last step."""

    async def wait_dead(self) -> BaseException:
        """Returns the error the engine loop died of."""

    def dead_message(self) -> str:
        """Why the engine is dead, for a 503 body."""

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine: requests in flight fail, the loop (replicas) end."""

    async def add_request(self, request: EngineRequest) -> RequestStream:
        """Hand a validated request to the engine; its outputs arrive on the stream."""

    def check_queue(self, num_seqs: int = 1) -> None:
        """Raise QueueFullError where `num_seqs` more sequences would exceed --max-queue."""

    def abort(self, request_id: str) -> None:
        """End a request early (its stream ends; its blocks are freed)."""

    async def synchronize(self) -> None:
        """Return once the engine has handled every command sent before this call (an abort:
        nothing of the request is left, and the snapshot says so); at once where the engine
        does not acknowledge commands (the data-parallel replicas)."""

    def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                 priority: int = 0,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Validate, add and iterate in one call; aborts the request if the consumer stops
        early (tests and scripts)."""

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Make an adapter known ahead of its requests; False if it was known already."""

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Refuse new requests of an adapter; free it once its requests have finished.
        False for an unknown adapter."""

    async def list_loras(self) -> set[int]:
        """The lora_int_ids of the adapters the engine knows."""

    def cancel_all(self, reason: str) -> None:
        """Fail every request in flight with `reason` (shutdown, a model unloaded)."""
