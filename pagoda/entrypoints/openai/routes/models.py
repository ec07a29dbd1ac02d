"""The model routes: GET /v1/models (OpenAI's list, plus each model's `state` and the
routable LoRA adapters), POST /v1/models/load and /v1/models/unload (Pagoda's; they need
the server's API key: model_registry.py does the work)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pagoda.entrypoints.openai.model_registry import ServedModel
from pagoda.entrypoints.openai.protocol.errors import bad_request
from pagoda.entrypoints.openai.protocol.requests import LoadModelRequest, UnloadModelRequest
from pagoda.entrypoints.openai.protocol.responses import ModelCard, ModelList
from pagoda.entrypoints.openai.routes.common import Registry, State, check_admin, parse_body

router = APIRouter()


def model_card(model: ServedModel, state: str) -> ModelCard:
    return ModelCard(id=model.name, created=model.created, root=model.root, state=state,
                     max_model_len=model.engine.max_model_len if model.engine else None)


@router.get("/v1/models")
async def list_models(state: State, registry: Registry) -> JSONResponse:
    cards = [model_card(model, "ready") for model in registry.ready.values()]
    cards += [ModelCard(id=name, state="loading") for name in registry.loading
              if name not in registry.ready]
    cards += [model_card(model, "draining") for model in registry.draining
              if model.engine is not None]
    cards += state.loras.cards()
    return JSONResponse(ModelList(data=cards).model_dump())


@router.post("/v1/models/load")
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


@router.post("/v1/models/unload")
async def unload_model(raw_request: Request, state: State, registry: Registry) -> JSONResponse:
    check_admin(state)
    request = await parse_body(raw_request, UnloadModelRequest)
    model = registry.ready.get(request.model)
    card = model_card(model, "unloaded") if model is not None else None
    await registry.unload(request.model)
    return JSONResponse(card.model_dump())
