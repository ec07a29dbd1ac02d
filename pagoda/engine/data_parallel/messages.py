"""What crosses a replica's pipe: typed dataclasses of picklable data, nothing live.

    server -> replica   Add(EngineRequest)   Abort(request_id)   Stop()
                        LoRACall(method, arguments, call_id)        (loop_commands.py)
    replica -> server   Ready(ReplicaInfo)   Failed(message)     Dead(message)
                        Batch([item, ...]) with items
                            Added(request_id)                  the engine took it (the ack)
                            Out(request_id, RequestOutput)
                            Error(request_id, ErrorInfo)       before Added: it was refused
                            Snapshot(fields)                   snapshot_fields(EngineSnapshot)
                            Answered(call_id, result, error)   a LoRACall's answer

Order: a replica sends a request's items in order; a server-side abort may cross items
already sent (the server drops items of requests it no longer tracks).

Errors travel as ErrorInfo (class name, message, and InvalidRequestError's param and code)
and are rebuilt as the class the server's pipeline maps to an HTTP status; an exception
object itself may not pickle (or may drag a traceback of live objects along).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.loop.loop_commands import Abort, Add, LoRACall, Stop
from pagoda.engine.loop.request_stream import EngineDeadError, EngineStepError, QueueFullError
from pagoda.engine.stats.snapshot import EngineSnapshot
from pagoda.errors import InvalidRequestError
from pagoda.outputs import RequestOutput

__all__ = ["Abort", "Add", "Added", "Answered", "Batch", "BatchItem", "Dead", "Error", "ErrorInfo", "Failed",
           "LoRACall", "Out", "Ready", "ReplicaInfo", "ReplicaMessage", "ServerMessage", "Snapshot", "Stop",
           "decode_error", "encode_error", "snapshot_fields"]


@dataclass(frozen=True)
class ReplicaInfo:
    """What a replica reports once its engine is built."""

    pid: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    kv_capacity_tokens: int
    model_files: Any
    """The engine's ModelFiles (path, name)."""
    num_threads: int
    tokenizer: Any = None
    """The engine's tokenizer, sent by the first start of replica 0 only (the server
    process validates and tokenizes with it)."""
    run_info: dict = field(default_factory=dict)
    """The replica's device, CPU, dtypes and kernels (cpu_info.run_info)."""
    model_pooling: Any = None
    """How the model pools embeddings (pooling_params.ModelPooling)."""


@dataclass(frozen=True)
class ErrorInfo:
    kind: str
    message: str
    param: str | None = None
    code: str | None = None


@dataclass(frozen=True)
class Ready:
    """The replica's engine is built: it serves from now on."""

    info: ReplicaInfo


@dataclass(frozen=True)
class Failed:
    """Building the engine failed (the process then exits)."""

    message: str


@dataclass(frozen=True)
class Dead:
    """The engine loop died of an error (the process then exits 1)."""

    message: str


@dataclass(frozen=True)
class Added:
    """The engine took the request (add_request's ack)."""

    request_id: str


@dataclass(frozen=True)
class Out:
    request_id: str
    output: RequestOutput


@dataclass(frozen=True)
class Error:
    """The request failed: refused (before Added), or failed while running."""

    request_id: str
    error: ErrorInfo


@dataclass(frozen=True)
class Snapshot:
    fields: dict[str, Any]
    """snapshot_fields(EngineSnapshot); `EngineSnapshot(**fields)` rebuilds it."""

    def rebuild(self) -> EngineSnapshot:
        return EngineSnapshot(**self.fields)


@dataclass(frozen=True)
class Answered:
    """A LoRACall's answer: its result (error None), or why it failed."""

    call_id: int
    result: Any = None
    error: ErrorInfo | None = None


BatchItem = Added | Out | Error | Snapshot | Answered


@dataclass(frozen=True)
class Batch:
    """Everything a replica produced in one loop iteration, in order."""

    items: list[BatchItem]


ServerMessage = Add | Abort | Stop | LoRACall
"""What the server sends a replica."""
ReplicaMessage = Ready | Failed | Dead | Batch
"""What a replica sends the server."""


_KINDS = {cls.__name__: cls for cls in (EngineDeadError, EngineStepError, QueueFullError)}


def encode_error(error: BaseException) -> ErrorInfo:
    if isinstance(error, InvalidRequestError):
        return ErrorInfo("InvalidRequestError", error.message, error.param, error.code)
    kind = type(error).__name__
    if kind not in _KINDS and isinstance(error, ValueError):
        kind = "ValueError"
    return ErrorInfo(kind, str(error))


def decode_error(info: ErrorInfo) -> BaseException:
    if info.kind == "InvalidRequestError":
        return InvalidRequestError(info.message, info.param, info.code or "invalid_value")
    if info.kind == "ValueError":
        return ValueError(info.message)
    cls = _KINDS.get(info.kind)
    if cls is not None:
        return cls(info.message)
    return EngineStepError(f"the engine failed this request: {info.kind}: {info.message}")


def snapshot_fields(snapshot: EngineSnapshot) -> dict[str, Any]:
    """The snapshot as picklable fields (its mappings are read-only proxies, which do not
    pickle); `EngineSnapshot(**fields)` rebuilds it."""
    fields = {f.name: getattr(snapshot, f.name) for f in dataclasses.fields(snapshot)}
    return {name: dict(value) if isinstance(value, Mapping) else value
            for name, value in fields.items()}
