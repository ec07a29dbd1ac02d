"""The OpenAI-compatible HTTP server: a FastAPI app in front of one AsyncLLMEngine.

Routes
    POST /v1/completions, POST /v1/chat/completions   (OpenAI; stream or not)
    GET  /v1/models                                   (OpenAI)
    POST /tokenize, POST /detokenize                  (vLLM's shapes)
    GET  /health   200 while the engine loop runs, 503 once it died (the process then
                   exits with code 1 two seconds later)
    GET  /version, GET /metrics (Prometheus text, this server's own registry)
    GET  /openapi.json   the OpenAPI document of all of these (openapi.py)

Only /v1 routes need the API key (as in vLLM) and only they are refused while the server
drains for shutdown. Every error is an OpenAI error body (see errors.py). Guards (guards.py):
a request body cap (413), a per-request deadline (408), CORS for the origins allowed, and
HTTPS with a key and certificate.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

import pagoda
from pagoda.engine.async_engine import AsyncLLMEngine
from pagoda.engine.metrics import EngineMetrics
from pagoda.entrypoints.openai.errors import (
    OpenAIError,
    bad_request,
    install_error_handlers,
    server_error,
)
from pagoda.entrypoints.openai.guards import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from pagoda.entrypoints.openai.openapi import openapi_document
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from pagoda.entrypoints.openai.serving_chat import OpenAIServingChat
from pagoda.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagoda.entrypoints.web.routes import add_web_routes

logger = logging.getLogger(__name__)

DEAD_ENGINE_EXIT_DELAY_S = 2.0
"""Seconds between the engine loop's death and the server's exit (health checks see 503)."""


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    metrics: EngineMetrics
    model_name: str
    model_root: str
    api_key: str | None = None
    chat_template: str | None = None
    tool_call_parser: str = "hermes"
    """The parser of "auto" tool calls (--tool-call-parser)."""
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
    """Asks the HTTP server to shut down (set by run_server)."""


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


async def exit_when_engine_dies(state: ServerState) -> None:
    """vLLM's behaviour: once the engine loop died (its streams have already ended with an
    error event, /health says 503), refuse new work, wait a moment for health checks and
    open responses, then shut down with exit code 1 so that a supervisor restarts us."""
    error = await state.engine.wait_dead()
    state.draining = True
    state.exit_code = 1
    logger.error("the engine loop died (%s: %s); exiting in %.0f s with code 1",
                 type(error).__name__, error, DEAD_ENGINE_EXIT_DELAY_S)
    await asyncio.sleep(DEAD_ENGINE_EXIT_DELAY_S)
    if state.request_exit is not None:
        state.request_exit()


def build_app(state: ServerState) -> FastAPI:
    engine = state.engine
    state.created = state.created or int(time.time())
    completions = OpenAIServingCompletion(engine, state.model_name)
    chat = OpenAIServingChat(engine, state.model_name, state.chat_template,
                             state.tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        watch = asyncio.create_task(exit_when_engine_dies(state))
        yield
        watch.cancel()
        state.draining = True
        await engine.shutdown()

    app = FastAPI(title="Pagoda", version=pagoda.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    document = openapi_document(app.title, app.version, state.api_key is not None)
    app.openapi = lambda: document  # FastAPI serves it at openapi_url
    app.state.pagoda = state
    install_error_handlers(app)
    completions.request_timeout = chat.request_timeout = state.request_timeout
    # Outermost last: CORS (answers preflights, which carry no API key), the API-key gate,
    # then the body cap (so bodies are read only for callers who passed the gate).
    app.add_middleware(BodyLimitMiddleware, limit=state.max_request_bytes)
    app.add_middleware(GateMiddleware, state=state)
    if state.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(state.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])

    @app.post("/v1/completions")
    async def create_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, CompletionRequest)
        return await completions.serve(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ChatCompletionRequest)
        return await chat.serve(request, raw_request)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        card = ModelCard(id=state.model_name, created=state.created, root=state.model_root,
                         max_model_len=engine.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/tokenize")
    async def tokenize(raw_request: Request) -> JSONResponse:
        request = await parse_body(raw_request, TokenizeRequest)
        chat.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("give exactly one of `prompt` and `messages`", param="prompt")
        if request.messages is not None:
            text = chat.render_prompt(request.messages, request.chat_template,
                                      request.add_generation_prompt is not False)
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

    @app.post("/detokenize")
    async def detokenize(raw_request: Request) -> JSONResponse:
        request = await parse_body(raw_request, DetokenizeRequest)
        chat.check_model(request.model)
        for token_id in request.tokens:
            if not 0 <= token_id < engine.vocab_size:
                raise bad_request(f"tokens: token id {token_id} is out of range; ids must be "
                                  f"in [0, {engine.vocab_size})", param="tokens")
        return JSONResponse(DetokenizeResponse(prompt=chat.tokenizer.decode(request.tokens))
                            .model_dump())

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            raise server_error(engine.dead_message(), 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse(VersionResponse(version=pagoda.__version__).model_dump())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_web_routes(app, lambda: {state.model_name: engine})
    return app


class PagodaUvicornServer(uvicorn.Server):
    """uvicorn's server, except for the signal-initiated shutdown:
    - the app is marked as draining (new /v1 requests: 503) and uvicorn stops accepting;
    - requests still running `shutdown_timeout` seconds later are aborted by us, so their
      responses end with an error body or SSE error event rather than a cancelled task
      (uvicorn's own cancellation, a few seconds later, is only a fallback);
    - it ends normally (exit code 0): uvicorn itself re-raises the signal once done."""

    CANCEL_MARGIN_S = 5.0

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self.pagoda_state = state
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame) -> None:
        engine = self.pagoda_state.engine
        if not self.should_exit:
            logger.info("received %s: finishing in-flight requests (for up to %ss)",
                        signal.Signals(sig).name, self.shutdown_timeout)
            loop = engine.loop
            if loop is not None and not loop.is_closed():
                reason = (f"the server shut down before this request finished (it waited "
                          f"{self.shutdown_timeout}s)")
                loop.call_soon_threadsafe(
                    loop.call_later, self.shutdown_timeout, engine.cancel_all, reason
                )
        self.pagoda_state.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run_server(
    app: FastAPI, state: ServerState, host: str, port: int, shutdown_timeout: float,
    access_log: bool = True, ssl_keyfile: str | None = None, ssl_certfile: str | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT, then drain for up to `shutdown_timeout` seconds; HTTPS
    when a key and certificate are given. Returns the exit code: 0, or 1 when the engine
    loop died."""
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", access_log=access_log,
        timeout_graceful_shutdown=shutdown_timeout + PagodaUvicornServer.CANCEL_MARGIN_S,
        lifespan="on", ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile,
    )
    server = PagodaUvicornServer(config, state, shutdown_timeout)
    state.request_exit = lambda: setattr(server, "should_exit", True)
    server.run()
    return state.exit_code
