"""ServerState: what one server serves and how (built by api_server.build_server_state from
the flags, or by a test), and what build_app adds to it while it serves (the registries,
draining, the exit code). The routes read it from their app (routes/common.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.entrypoints.openai.model_registry import (
    DEFAULT_MODEL_LOAD_TIMEOUT_S,
    ModelBuilder,
    ModelRegistry,
    ServedModel,
)
from pagoda.entrypoints.openai.responses_api.store import ResponseStore
from pagoda.entrypoints.openai.serving.guards import DEFAULT_MAX_REQUEST_BYTES
from pagoda.lora.lora_modules import LoRAModule

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from pagoda.entrypoints.openai.lora_registry import LoRARegistry


@dataclass
class ServerState:
    models: list[ServedModel]
    """The models loaded at start (--model, once or more); the first is the default for
    requests that name none. Models loaded and unloaded later live in `registry` only."""
    lora_modules: tuple[LoRAModule, ...] = ()
    """Adapters served from the start (--lora-modules)."""
    lora_allowed_paths: tuple[str, ...] = ()
    """Directories POST /v1/load_lora_adapter may read (--lora-allowed-paths); none: off."""
    loras: LoRARegistry | None = None
    """The served LoRA adapters (built by build_app)."""
    model_builder: ModelBuilder | None = None
    """Builds a model for POST /v1/models/load; None: loading at run time is off."""
    max_loaded_models: int | None = None
    model_load_timeout: float = DEFAULT_MODEL_LOAD_TIMEOUT_S
    server_registry: CollectorRegistry | None = None
    """Metrics of the server process itself (/metrics adds each model's)."""
    registry: ModelRegistry | None = None
    """The served models (built by build_app)."""
    api_key: str | None = None
    chat_template: str | None = None
    tool_call_parser: str = "hermes"
    """The parser of "auto" tool calls (--tool-call-parser; "auto": each model's from its
    chat template, tools/parsers/auto.py)."""
    reasoning_parser: str | None = None
    """Splits a reasoning model's thinking into reasoning_content (--reasoning-parser:
    qwen3, deepseek_r1, or auto: per model, from its chat template); None: off."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Larger request bodies get 413 (--max-request-bytes)."""
    request_timeout: float | None = None
    """Seconds a generation may run before it is stopped with 408 (--request-timeout)."""
    default_max_tokens: int | None = None
    """The output cap of a request that gives none (--max-tokens-default); None: up to the
    context."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins allowed by CORS (--allowed-origins; "*" for any); none: no CORS."""
    draining: bool = False
    """Set when shutdown begins: new /v1 requests get 503, in-flight ones finish."""
    exit_code: int = 0
    """The process's exit code: 1 once the engine loop died (a supervisor restarts it)."""
    request_exit: Callable[[], None] | None = None
    """Asks the HTTP server to shut down (set by uvicorn_server.run_server)."""
    record_traffic: str | None = None
    """Write one traffic entry per completions/chat request to this file (--record-traffic)."""
    record_redact: bool = False
    """Record placeholders of the same token counts instead of text (--record-redact)."""
    responses_store: ResponseStore = field(default_factory=ResponseStore)
    """Responses made with `store: true`, for all models (--responses-store-size, -ttl)."""

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("a server serves at least one model")

    @property
    def default_model(self) -> ServedModel:
        """The first model given at start (requests that name no model get it)."""
        return self.models[0]
