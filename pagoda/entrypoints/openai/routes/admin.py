"""The operator's routes: GET /health (200 while every engine loop runs, 503 naming the
dead one), GET /version (Pagoda's and each model's run info), GET /metrics (Prometheus
text: the server process's registry and each served model's, as one page)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

import pagoda
from pagoda.entrypoints.openai.merged_metrics import MergedRegistries
from pagoda.entrypoints.openai.protocol.errors import server_error
from pagoda.entrypoints.openai.protocol.responses import ModelRunInfo, VersionResponse
from pagoda.entrypoints.openai.routes.common import Registry, State
from pagoda.entrypoints.openai.server_state import ServerState

router = APIRouter()


@router.get("/health")
async def health(registry: Registry) -> Response:
    for model in registry.all_models():
        if model.engine is not None and not model.engine.is_alive:
            raise server_error(f"model {model.name}: {model.engine.dead_message()}", 503)
    return Response(status_code=200)


@router.get("/version")
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


@router.get("/metrics")
async def metrics(state: State) -> Response:
    """The server process's registry and each served model's, as one page."""
    return Response(generate_latest(metrics_page(state)), media_type=CONTENT_TYPE_LATEST)
