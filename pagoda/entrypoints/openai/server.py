"""The OpenAI-compatible HTTP server: a FastAPI app in front of one engine (EngineClient) per
served model (model_registry.py); requests route by their `model` field (none: the first
model), which may also name a LoRA adapter: its base model's engine then runs the request
with the adapter (lora_registry.py).

Routes
    POST /v1/completions, POST /v1/chat/completions   (OpenAI; stream or not)
    POST /v1/embeddings                               (OpenAI; serving/embedding.py)
    GET  /v1/models                                   (OpenAI; plus each model's `state`)
    POST /v1/models/load, POST /v1/models/unload      (Pagoda's; need the server's API key)
    POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter
                                                      (vLLM's; need the API key too;
                                                      adapters: lora_registry.py)
    POST /v1/responses, GET and DELETE /v1/responses/{id}, GET .../{id}/input_items
                                                      (OpenAI's Responses API, on chat:
                                                      responses_api/)
    POST /tokenize, POST /detokenize                  (vLLM's shapes)
    GET  /health   200 while the engine loop runs, 503 once it died (the process then
                   exits with code 1 two seconds later); with --data-parallel-size N, 200
                   while one replica is up (a dead replica is restarted: data_parallel/)
    GET  /version, GET /metrics (Prometheus text, this server's own registry)
    GET  /openapi.json   the OpenAPI document of all of these (openapi.py)
    GET  /   the web page, and GET /v1/engine/stream its live engine view (web/routes.py)

Only /v1 routes need the API key (as in vLLM) and only they are refused while the server
drains for shutdown. Every error is an OpenAI error body (protocol/errors.py). Guards
(serving/guards.py): a request body cap (413), a per-request deadline (408), CORS for the
origins allowed, and HTTPS with a key and certificate. With --record-traffic, a middleware writes one line per
completions/chat request (traffic_recorder.py).

This module assembles the app: the models' registry (each model's handlers), the
middleware, and the routers of routes/ (generation, models, lora, admin); the state it
serves is server_state.py's, built from the flags by api_server.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

import pagoda
from pagoda.engine.loop.protocol import EngineClient
from pagoda.entrypoints.openai.lora_registry import LoRARegistry
from pagoda.entrypoints.openai.model_registry import ModelRegistry, ServedModel
from pagoda.entrypoints.openai.openapi import openapi_document
from pagoda.entrypoints.openai.protocol.errors import OpenAIError, install_error_handlers
from pagoda.entrypoints.openai.routes import admin, generation, lora, models
from pagoda.entrypoints.openai.server_state import ServerState
from pagoda.entrypoints.openai.serving.chat import OpenAIServingChat
from pagoda.entrypoints.openai.serving.completion import OpenAIServingCompletion
from pagoda.entrypoints.openai.serving.embedding import OpenAIServingEmbedding
from pagoda.entrypoints.openai.serving.guards import BodyLimitMiddleware
from pagoda.entrypoints.openai.traffic_recorder import TrafficRecorder, TrafficRecorderMiddleware
from pagoda.entrypoints.tools.parsers import resolve_tool_call_parser
from pagoda.entrypoints.web.routes import add_web_routes

logger = logging.getLogger(__name__)

DEAD_ENGINE_EXIT_DELAY_S = 2.0
"""Seconds between the engine loop's death and the server's exit (health checks see 503)."""

ROUTERS = (generation.router, models.router, lora.router, admin.router)
"""Every API route, by concern (routes/)."""


@dataclass
class RouteHandlers:
    """What the routes call for one served model (made once per model; a request served as
    a LoRA adapter passes the adapter to them: serving_pipeline.ServedAs)."""

    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    embeddings: OpenAIServingEmbedding


class GateMiddleware:
    """API key check and drain refusal for /v1 routes (plain ASGI: streaming-safe)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        error = None
        if self.state.api_key is not None:
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"").decode("latin-1")
            expected = f"Bearer {self.state.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                error = OpenAIError(
                    "Incorrect or missing API key: send the header "
                    "'Authorization: Bearer <key>' with the server's --api-key.",
                    401, "invalid_request_error", None, "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if error is None and self.state.draining:
            error = OpenAIError("The server is shutting down; retry on another instance.",
                                503, "server_error", None, "shutting_down",
                                headers={"Retry-After": "5"})
        if error is not None:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def exit_when_engine_dies(state: ServerState, engine: EngineClient) -> None:
    """vLLM's behaviour: once the engine loop died (its streams have already ended with an
    error event, /health says 503), refuse new work, wait a moment for health checks and
    open responses, then shut down with exit code 1 so that a supervisor restarts us."""
    error = await engine.wait_dead()
    state.draining = True
    state.exit_code = 1
    logger.error("the engine loop died (%s: %s); exiting in %.0f s with code 1",
                 type(error).__name__, error, DEAD_ENGINE_EXIT_DELAY_S)
    await asyncio.sleep(DEAD_ENGINE_EXIT_DELAY_S)
    if state.request_exit is not None:
        state.request_exit()


def build_registry(state: ServerState) -> ModelRegistry:
    """The registry of the state's models, each with its handlers."""
    def make_serving(model: ServedModel) -> RouteHandlers:
        template = state.chat_template or getattr(model.engine.tokenizer, "chat_template", None)
        tool_call_parser = resolve_tool_call_parser(state.tool_call_parser, template)
        serving = RouteHandlers(
            OpenAIServingCompletion(model.engine, model.name),
            OpenAIServingChat(model.engine, model.name, state.chat_template, tool_call_parser,
                              reasoning_parser=state.reasoning_parser),
            OpenAIServingEmbedding(model.engine, model.name))
        for handler in (serving.completions, serving.chat, serving.embeddings):
            handler.request_timeout = state.request_timeout
        for handler in (serving.completions, serving.chat):
            handler.default_max_tokens = state.default_max_tokens
        return serving

    def on_start(model: ServedModel) -> None:
        model.watcher = asyncio.create_task(exit_when_engine_dies(state, model.engine))

    registry = ModelRegistry(make_serving, on_start, state.model_builder,
                             state.max_loaded_models, state.model_load_timeout)
    for model in state.models:
        registry.add(model)
    return registry


def build_app(state: ServerState) -> FastAPI:
    """The app for `state`: its models' registry, the middleware, then the routers."""
    registry = state.registry = build_registry(state)
    loras = state.loras = LoRARegistry(registry, state.lora_allowed_paths)
    for module in state.lora_modules:  # (checked by `pagoda serve` before the engines built)
        try:
            loras.add(module.name, module.path, module.base_model_name)
        except OpenAIError as e:
            raise ValueError(f"--lora-modules {module.name}: {e.message}") from None
    recorder = traffic_recorder(state) if state.record_traffic is not None else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        registry.start()
        yield
        state.draining = True
        await registry.shutdown()
        if recorder is not None:
            await asyncio.to_thread(recorder.close)

    app = FastAPI(title="Pagoda", version=pagoda.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    document = openapi_document(app.title, app.version, state.api_key is not None)
    app.openapi = lambda: document  # FastAPI serves it at openapi_url
    app.state.pagoda = state  # what the routes read (routes/common.py)
    install_error_handlers(app)
    # Outermost last: CORS (answers preflights, which carry no API key), the API-key gate,
    # then the body cap (so bodies are read only for callers who passed the gate), then the
    # traffic recorder (what it records reached the routes).
    if recorder is not None:
        app.add_middleware(TrafficRecorderMiddleware, recorder=recorder)
    app.add_middleware(BodyLimitMiddleware, limit=state.max_request_bytes)
    app.add_middleware(GateMiddleware, state=state)
    if state.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(state.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])
    for router in ROUTERS:  # (flat, not include_router: that nests an included router's
        for route in router.routes:  # routes, and app.routes would no longer list them)
            app.add_api_route(route.path, route.endpoint, methods=list(route.methods))
    add_web_routes(app, lambda: served_engines(registry, loras))
    return app


def served_engines(registry: ModelRegistry, loras: LoRARegistry) -> dict[str, EngineClient]:
    """The engine of every name a request may give: each ready model's, and each adapter's
    base's (the web page's live view of an adapter is its base engine's)."""
    engines = {name: model.engine for name, model in registry.ready.items()}
    for name in loras.adapters:
        adapter = loras.routable(name)
        if adapter is not None:
            engines[name] = registry.ready[adapter.base].engine
    return engines


def traffic_recorder(state: ServerState) -> TrafficRecorder:
    """--record-traffic's recorder; with --record-redact, counting tokens with the tokenizer
    of the model each request names (the default model's if it names none or is gone)."""
    assert state.record_traffic is not None

    def count_tokens_for(name: str | None) -> Callable[[str], int]:
        adapter = state.loras.routable(name) if state.loras else None
        name = adapter.base if adapter is not None else name  # (an adapter's tokenizer)
        model = state.registry.ready.get(name) if state.registry and name else None
        if model is None or model.engine is None:
            model = state.default_model
        tokenizer = model.engine.tokenizer
        return lambda text: len(tokenizer.encode(text, add_special_tokens=False))

    return TrafficRecorder(state.record_traffic,
                           count_tokens_for if state.record_redact else None)
