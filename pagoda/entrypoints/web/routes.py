"""The web page's routes.

    GET /                   the page (static/index.html): chat playground + live engine view
    GET /static/...         its CSS and JS (shipped in the package, nothing fetched elsewhere)
    GET /v1/engine/stream   server-sent events, one JSON `data:` event per tick
                            (engine_view.py), `?model=NAME&interval=SECONDS`

The page and its assets are public; the stream is under /v1, so the server's API key gate
covers it (the page sends the key as a Bearer header, hence fetch rather than EventSource).
Ticks read the engine's published snapshot only, at most 1/MIN_INTERVAL_S a second per open
stream: an open page adds no work to the engine's steps.

A stream ends after MAX_STREAM_S (the page reconnects at once): an open page must not hold
a draining server's shutdown for longer than that, since uvicorn waits for open responses.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from pagoda.engine.loop.protocol import EngineClient
from pagoda.entrypoints.openai.protocol.errors import bad_request, model_not_found, server_error
from pagoda.entrypoints.openai.serving.streaming import EventStreamResponse, sse, sse_error
from pagoda.entrypoints.web.engine_view import EngineView

STATIC_DIR = Path(__file__).parent / "static"
DEFAULT_INTERVAL_S = 0.25
MIN_INTERVAL_S = 0.1
MAX_INTERVAL_S = 5.0
MAX_STREAM_S = 15.0


def parse_interval(interval: str | None) -> float:
    """Seconds between ticks, clamped to [MIN_INTERVAL_S, MAX_INTERVAL_S]."""
    if interval is None:
        return DEFAULT_INTERVAL_S
    try:
        seconds = float(interval)
    except ValueError:
        seconds = float("nan")
    if math.isnan(seconds):
        raise bad_request(f"interval: a number of seconds, got {interval!r}.", param="interval",
                          code="invalid_value")
    return min(max(seconds, MIN_INTERVAL_S), MAX_INTERVAL_S)


def resolve_model(engines: Mapping[str, EngineClient], model: str | None) -> str:
    """The served name the stream is for: `model`, or the only one loaded when absent."""
    if model is None:
        if len(engines) == 1:
            return next(iter(engines))
        raise bad_request(f"Name the model: ?model= one of {sorted(engines)}.", param="model",
                          code="missing_model")
    if model not in engines:
        raise model_not_found(model)
    return model


async def engine_events(
    engines: Callable[[], Mapping[str, EngineClient]], model: str, interval: float,
    max_seconds: float | None = None,
) -> AsyncIterator[str]:
    """The stream's events: one per `interval` from now, until `max_seconds` (default
    MAX_STREAM_S) passed, the model is unloaded or its engine died (those two end with an
    error event)."""
    view = EngineView(model)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (MAX_STREAM_S if max_seconds is None else max_seconds)
    while True:
        engine = engines().get(model)
        if engine is None:
            yield sse_error(model_not_found(model))
            return
        if not engine.is_alive:
            yield sse_error(server_error("The engine loop died; the server is restarting."))
            return
        yield sse(json.dumps(view.tick(engine.snapshot), separators=(",", ":")))
        if loop.time() + interval > deadline:
            return
        await asyncio.sleep(interval)


def add_web_routes(app: FastAPI, engines: Callable[[], Mapping[str, EngineClient]]) -> None:
    """Adds GET / (the page), its static files and the live view's stream; `engines()` gives
    the loaded models' engines by served name, at call time (models come and go)."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/engine/stream", include_in_schema=False)
    async def engine_stream(model: str | None = None,
                            interval: str | None = None) -> EventStreamResponse:
        seconds = parse_interval(interval)
        name = resolve_model(engines(), model)
        events = engine_events(engines, name, seconds)
        return EventStreamResponse(events, on_close=lambda: None)
