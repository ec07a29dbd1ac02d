"""The LoRA adapter routes, vLLM's: POST /v1/load_lora_adapter and /v1/unload_lora_adapter
(they need the server's API key; lora_registry.py does the work)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from pagoda.entrypoints.openai.protocol.requests import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from pagoda.entrypoints.openai.routes.common import State, check_admin, parse_body

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(raw_request: Request, state: State) -> Response:
    """vLLM's answer: 200 with a plain-text line; refusals are 400s naming the problem."""
    check_admin(state)
    request = await parse_body(raw_request, LoadLoRAAdapterRequest)
    await state.loras.load(request.lora_name, request.lora_path, request.base_model_name,
                           replace=request.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(raw_request: Request, state: State) -> Response:
    """New requests naming it get 404 at once; running ones finish (the engine then frees
    it)."""
    check_admin(state)
    request = await parse_body(raw_request, UnloadLoRAAdapterRequest)
    await state.loras.remove(request.lora_name, request.lora_int_id)
    return PlainTextResponse(
        f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
