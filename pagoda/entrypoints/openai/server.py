"""The OpenAI-compatible HTTP server: a FastAPI app in front of one engine (EngineClient) per
served model (model_registry.py); requests route by their `model` field (none: the first
model), which may also name a LoRA adapter: its base model's engine then runs the request
with the adapter (lora_registry.py).

Routes
    POST /v1/completions, POST /v1/chat/completions   (OpenAI; stream or not)
    POST /v1/embeddings                               (OpenAI; serving_embedding.py)
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
drains for shutdown. Every error is an OpenAI error body (see errors.py). Guards (guards.py):
a request body cap (413), a per-request deadline (408), CORS for the origins allowed, and
HTTPS with a key and certificate. With --record-traffic, a middleware writes one line per
completions/chat request (traffic_recorder.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

import pagoda
from pagoda.engine.loop.protocol import EngineClient
from pagoda.engine.stats.metrics import EngineMetrics
from pagoda.entrypoints.openai.embedding_protocol import EmbeddingRequest
from pagoda.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    install_error_handlers,
    server_error,
)
from pagoda.entrypoints.openai.guards import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from pagoda.entrypoints.openai.lora_registry import LoRARegistry, adapter_not_found
from pagoda.entrypoints.openai.merged_metrics import MergedRegistries
from pagoda.entrypoints.openai.model_registry import (
    DEFAULT_MODEL_LOAD_TIMEOUT_S,
    ModelBuilder,
    ModelRegistry,
    ServedModel,
    release_with_response,
)
from pagoda.entrypoints.openai.openapi import openapi_document
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    LoadModelRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    UnloadModelRequest,
)
from pagoda.entrypoints.openai.responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ModelRunInfo,
    TokenizeResponse,
    VersionResponse,
)
from pagoda.entrypoints.openai.responses_api import serving as responses_api
from pagoda.entrypoints.openai.responses_api.protocol import ResponsesRequest
from pagoda.entrypoints.openai.responses_api.store import ResponseStore
from pagoda.entrypoints.openai.serving_chat import OpenAIServingChat
from pagoda.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagoda.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagoda.entrypoints.openai.traffic_recorder import TrafficRecorder, TrafficRecorderMiddleware
from pagoda.entrypoints.tools.parsers import resolve_tool_call_parser
from pagoda.entrypoints.web.routes import add_web_routes
from pagoda.lora.lora_modules import LoRAModule

logger = logging.getLogger(__name__)

DEAD_ENGINE_EXIT_DELAY_S = 2.0
"""Seconds between the engine loop's death and the server's exit (health checks see 503)."""


@dataclass
class RouteHandlers:
    """What the routes call for one served model."""

    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    embeddings: OpenAIServingEmbedding


@dataclass
class ServerState:
    engine: EngineClient
    """The first model's (the default for requests that name none)."""
    metrics: EngineMetrics | None
    model_name: str
    model_root: str
    more_models: list[ServedModel] = field(default_factory=list)
    """Further models loaded at start (--model given more than once)."""
    model_lora: Any = None
    """The first model's LoRAConfig (ServedModel.lora); None: no adapters over it."""
    model_hf_config: Any = None
    """The first model's Hugging Face config (ServedModel.hf_config)."""
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
    allowed_origins: tuple[str, ...] = ()
    """Browser origins allowed by CORS (--allowed-origins; "*" for any); none: no CORS."""
    draining: bool = False
    """Set when shutdown begins: new /v1 requests get 503, in-flight ones finish."""
    created: int = 0
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


async def parse_body(raw_request: Request, model: type):
    """Strict JSON -> pydantic; a ValidationError becomes a 400 in the error handler."""
    return model.model_validate_json(await raw_request.body())


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


def model_card(model: ServedModel, state: str) -> ModelCard:
    return ModelCard(id=model.name, created=model.created, root=model.root, state=state,
                     max_model_len=model.engine.max_model_len if model.engine else None)


def build_registry(state: ServerState) -> ModelRegistry:
    def make_serving(model: ServedModel) -> RouteHandlers:
        template = state.chat_template or getattr(model.engine.tokenizer, "chat_template", None)
        tool_call_parser = resolve_tool_call_parser(state.tool_call_parser, template)
        serving = RouteHandlers(
            OpenAIServingCompletion(model.engine, model.name),
            OpenAIServingChat(model.engine, model.name, state.chat_template, tool_call_parser,
                              reasoning_parser=state.reasoning_parser),
            OpenAIServingEmbedding(model.engine, model.name))
        serving.completions.request_timeout = state.request_timeout
        serving.chat.request_timeout = state.request_timeout
        serving.embeddings.request_timeout = state.request_timeout
        return serving

    def on_start(model: ServedModel) -> None:
        model.watcher = asyncio.create_task(exit_when_engine_dies(state, model.engine))

    registry = ModelRegistry(make_serving, on_start, state.model_builder,
                             state.max_loaded_models, state.model_load_timeout)
    registry.add(ServedModel(state.model_name, state.engine, state.model_root, state.metrics,
                             created=state.created, lora=state.model_lora,
                             hf_config=state.model_hf_config))
    for model in state.more_models:
        registry.add(model)
    return registry


def build_app(state: ServerState) -> FastAPI:
    """The app for `state`: its models' registry, the middleware, then the routes below."""
    state.created = state.created or int(time.time())
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
    app.state.pagoda = state  # what the routes read (server_state, model_registry)
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
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=[method])
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
        engine = model.engine if model is not None and model.engine is not None else state.engine
        tokenizer = engine.tokenizer
        return lambda text: len(tokenizer.encode(text, add_special_tokens=False))

    return TrafficRecorder(state.record_traffic,
                           count_tokens_for if state.record_redact else None)


# The routes (the ROUTES table at the end lists them). Each reads the server's state from its
# app: build_app set app.state.pagoda, and the State and Registry dependencies read it.

async def server_state(raw_request: Request) -> ServerState:
    return raw_request.app.state.pagoda


async def model_registry(raw_request: Request) -> ModelRegistry:
    registry = raw_request.app.state.pagoda.registry
    assert registry is not None, "build_app sets the registry"
    return registry


State = Annotated[ServerState, Depends(server_state)]
Registry = Annotated[ModelRegistry, Depends(model_registry)]


async def serve_with_model(state: ServerState, name: str | None, serve) -> Response:
    """serve(RouteHandlers) -> Response, with the model held until the response ends. A
    LoRA adapter's name holds its base model and serves with the adapter's handlers."""
    registry, adapter = state.registry, state.loras.routable(name)
    if adapter is None:
        model = await registry.acquire(name)
    else:
        try:
            model = await registry.acquire(adapter.base)
        except OpenAIError as e:
            raise adapter_not_found(name, e) from None
    try:
        response = await serve(model.serving if adapter is None else adapter.handlers(model))
    except BaseException:
        registry.release(model)
        raise
    return release_with_response(response, lambda: registry.release(model))


async def resolve_model(state: ServerState, name: str | None) -> tuple[ServedModel, Any]:
    """The model a request's `model` names, and its handlers (an adapter: its base model
    and the adapter's handlers), not held: for the routes that run no generation."""
    adapter = state.loras.routable(name)
    if adapter is None:
        model = await state.registry.get(name)
        return model, model.serving
    try:
        model = await state.registry.get(adapter.base)
    except OpenAIError as e:
        raise adapter_not_found(name, e) from None
    return model, adapter.handlers(model)


def check_admin(state: ServerState) -> None:
    if state.api_key is None:
        raise OpenAIError("Loading and unloading models and LoRA adapters needs the server "
                          "to be started with --api-key (they load files of the server's "
                          "machine).",
                          403, "invalid_request_error", None, "admin_disabled")


async def create_completion(raw_request: Request, state: State) -> Response:
    request = await parse_body(raw_request, CompletionRequest)
    return await serve_with_model(
        state, request.model,
        lambda serving: serving.completions.serve(request, raw_request))


async def create_chat_completion(raw_request: Request, state: State) -> Response:
    request = await parse_body(raw_request, ChatCompletionRequest)
    return await serve_with_model(
        state, request.model, lambda serving: serving.chat.serve(request, raw_request))


async def create_response(raw_request: Request, state: State) -> Response:
    request = await parse_body(raw_request, ResponsesRequest)
    return await serve_with_model(
        state, request.model, lambda serving: responses_api.OpenAIServingResponses(
            serving.chat, state.responses_store).create(request, raw_request))


async def retrieve_response(response_id: str, state: State) -> JSONResponse:
    return responses_api.retrieve(state.responses_store, response_id)


async def delete_response(response_id: str, state: State) -> JSONResponse:
    return responses_api.delete(state.responses_store, response_id)


async def list_response_input_items(response_id: str, raw_request: Request,
                                    state: State) -> JSONResponse:
    return responses_api.list_input_items(state.responses_store, response_id,
                                          raw_request.query_params)


async def create_embedding(raw_request: Request, state: State) -> Response:
    request = await parse_body(raw_request, EmbeddingRequest)
    return await serve_with_model(
        state, request.model, lambda serving: serving.embeddings.serve(request, raw_request))


async def list_models(state: State, registry: Registry) -> JSONResponse:
    cards = [model_card(model, "ready") for model in registry.ready.values()]
    cards += [ModelCard(id=name, state="loading") for name in registry.loading
              if name not in registry.ready]
    cards += [model_card(model, "draining") for model in registry.draining
              if model.engine is not None]
    cards += state.loras.cards()
    return JSONResponse(ModelList(data=cards).model_dump())


async def load_model(raw_request: Request, state: State, registry: Registry) -> JSONResponse:
    check_admin(state)
    request = await parse_body(raw_request, LoadModelRequest)
    if request.model in state.loras.adapters:
        raise bad_request(f"`{request.model}` is the name of a LoRA adapter; give the model "
                          "another name", param="model", code="model_name_taken")
    path = request.path
    if path is None:
        loaded = registry.ready.get(request.model)
        if loaded is None:
            raise bad_request(f"`{request.model}` is not loaded: give `path`, the model "
                              "file or folder to load", param="path")
        path = loaded.root
    model = await registry.load(request.model, path, dict(request.options or {}))
    return JSONResponse(model_card(model, "ready").model_dump())


async def unload_model(raw_request: Request, state: State, registry: Registry) -> JSONResponse:
    check_admin(state)
    request = await parse_body(raw_request, UnloadModelRequest)
    model = registry.ready.get(request.model)
    card = model_card(model, "unloaded") if model is not None else None
    await registry.unload(request.model)
    return JSONResponse(card.model_dump())


async def load_lora_adapter(raw_request: Request, state: State) -> Response:
    """vLLM's answer: 200 with a plain-text line; refusals are 400s naming the problem."""
    check_admin(state)
    request = await parse_body(raw_request, LoadLoRAAdapterRequest)
    await state.loras.load(request.lora_name, request.lora_path, request.base_model_name,
                           replace=request.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")


async def unload_lora_adapter(raw_request: Request, state: State) -> Response:
    """New requests naming it get 404 at once; running ones finish (the engine then frees
    it)."""
    check_admin(state)
    request = await parse_body(raw_request, UnloadLoRAAdapterRequest)
    await state.loras.remove(request.lora_name, request.lora_int_id)
    return PlainTextResponse(
        f"Success: LoRA adapter '{request.lora_name}' removed successfully.")


async def tokenize(raw_request: Request, state: State) -> JSONResponse:
    request = await parse_body(raw_request, TokenizeRequest)
    model, serving = await resolve_model(state, request.model)
    chat, engine = serving.chat, model.engine
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("give exactly one of `prompt` and `messages`", param="prompt")
    if request.messages is not None:
        text = chat.render_prompt(request.messages, request.chat_template,
                                  request.add_generation_prompt is not False,
                                  template_kwargs=request.template_kwargs())
        # As for chat requests: the template placed the special tokens already.
        add_special_tokens = request.add_special_tokens is True
    else:
        text = request.prompt
        add_special_tokens = request.add_special_tokens is not False
    tokens = chat.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    token_strs = None
    if request.return_token_strs:
        token_strs = chat.tokenizer.convert_ids_to_tokens(tokens)
    return JSONResponse(TokenizeResponse(
        count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens,
        token_strs=token_strs,
    ).model_dump())


async def detokenize(raw_request: Request, state: State) -> JSONResponse:
    request = await parse_body(raw_request, DetokenizeRequest)
    model, _ = await resolve_model(state, request.model)
    vocab_size = model.engine.vocab_size
    for token_id in request.tokens:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"tokens: token id {token_id} is out of range; ids must be "
                              f"in [0, {vocab_size})", param="tokens")
    return JSONResponse(DetokenizeResponse(prompt=model.serving.chat.tokenizer.decode(
        request.tokens)).model_dump())


async def health(registry: Registry) -> Response:
    for model in registry.all_models():
        if model.engine is not None and not model.engine.is_alive:
            raise server_error(f"model {model.name}: {model.engine.dead_message()}", 503)
    return Response(status_code=200)


async def version(registry: Registry) -> JSONResponse:
    models = [ModelRunInfo(id=name, run=model.engine.run_info)
              for name, model in registry.ready.items() if model.engine is not None]
    return JSONResponse(VersionResponse(version=pagoda.__version__, models=models).model_dump())


def metrics_page(state: ServerState) -> MergedRegistries:
    """The server process's registry and each served model's, as one collector (read at
    each scrape: models come and go); GET /metrics and a Ray Serve replica's own metrics
    port (deploy/replica_metrics.py) serve it."""
    def registries() -> list[CollectorRegistry]:
        own = [state.server_registry] if state.server_registry is not None else []
        models = state.registry.all_models() if state.registry is not None else ()
        return own + [model.metrics.registry for model in models if model.metrics is not None]

    return MergedRegistries(registries)


async def metrics(state: State) -> Response:
    """The server process's registry and each served model's, as one page."""
    return Response(generate_latest(metrics_page(state)), media_type=CONTENT_TYPE_LATEST)


ROUTES: tuple[tuple[str, str, Callable[..., Awaitable[Response]]], ...] = (
    ("POST", "/v1/completions", create_completion),
    ("POST", "/v1/chat/completions", create_chat_completion),
    ("POST", "/v1/responses", create_response),
    ("GET", "/v1/responses/{response_id}", retrieve_response),
    ("DELETE", "/v1/responses/{response_id}", delete_response),
    ("GET", "/v1/responses/{response_id}/input_items", list_response_input_items),
    ("POST", "/v1/embeddings", create_embedding),
    ("GET", "/v1/models", list_models),
    ("POST", "/v1/models/load", load_model),
    ("POST", "/v1/models/unload", unload_model),
    ("POST", "/v1/load_lora_adapter", load_lora_adapter),
    ("POST", "/v1/unload_lora_adapter", unload_lora_adapter),
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
    ("GET", "/health", health),
    ("GET", "/version", version),
    ("GET", "/metrics", metrics),
)
"""(method, path, handler) of every API route. A table rather than an APIRouter: FastAPI's
include_router nests an included router's routes, and app.routes (which the OpenAPI test
walks) would no longer list them."""
