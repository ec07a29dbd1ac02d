"""What the routes share: the server's state and model registry as FastAPI dependencies
(build_app set app.state.pagoda), strict body parsing, and the resolution of a request's
`model` (a served model, or a LoRA adapter over one) to the model that serves it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import Response

from pagoda.entrypoints.openai.lora_registry import adapter_not_found
from pagoda.entrypoints.openai.model_registry import (
    ModelRegistry,
    ServedModel,
    release_with_response,
)
from pagoda.entrypoints.openai.protocol.errors import OpenAIError
from pagoda.entrypoints.openai.server_state import ServerState
from pagoda.entrypoints.openai.serving.job import ServedAs


async def server_state(raw_request: Request) -> ServerState:
    return raw_request.app.state.pagoda


async def model_registry(raw_request: Request) -> ModelRegistry:
    registry = raw_request.app.state.pagoda.registry
    assert registry is not None, "build_app sets the registry"
    return registry


State = Annotated[ServerState, Depends(server_state)]
Registry = Annotated[ModelRegistry, Depends(model_registry)]


async def parse_body(raw_request: Request, model: type):
    """Strict JSON -> pydantic; a ValidationError becomes a 400 in the error handler."""
    return model.model_validate_json(await raw_request.body())


Serve = Callable[[ServedModel, ServedAs | None], Awaitable[Response]]
"""(the model, who it serves as: an adapter, or None for the model itself) -> Response."""


async def serve_with_model(state: ServerState, name: str | None, serve: Serve) -> Response:
    """serve(model, served_as) -> Response, with the model held until the response ends. A
    LoRA adapter's name holds its base model and serves as the adapter."""
    registry, adapter = state.registry, state.loras.routable(name)
    if adapter is None:
        model = await registry.acquire(name)
    else:
        try:
            model = await registry.acquire(adapter.base)
        except OpenAIError as e:
            raise adapter_not_found(name, e) from None
    try:
        response = await serve(model, adapter.served_as if adapter is not None else None)
    except BaseException:
        registry.release(model)
        raise
    return release_with_response(response, lambda: registry.release(model))


async def resolve_model(state: ServerState, name: str | None) -> ServedModel:
    """The model a request's `model` names (an adapter: its base model), not held: for the
    routes that run no generation."""
    adapter = state.loras.routable(name)
    if adapter is None:
        return await state.registry.get(name)
    try:
        return await state.registry.get(adapter.base)
    except OpenAIError as e:
        raise adapter_not_found(name, e) from None


def check_admin(state: ServerState) -> None:
    """Loading and unloading (models, adapters) needs the server's API key."""
    if state.api_key is None:
        raise OpenAIError("Loading and unloading models and LoRA adapters needs the server "
                          "to be started with --api-key (they load files of the server's "
                          "machine).",
                          403, "invalid_request_error", None, "admin_disabled")
