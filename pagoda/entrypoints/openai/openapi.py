"""/openapi.json: the server's OpenAPI 3.1 document, written from one table of operations.

The routes parse their bodies themselves (strict pydantic, errors as OpenAI error bodies), so
FastAPI cannot see what they take; OPERATIONS says it for each route: the request model,
what a success returns, and every error status it can answer with. Request schemas are the
models' validation schemas (unknown fields refused: `additionalProperties: false`; the
hand-checked fields described by json_shapes.py), responses their serialization schemas.
tests/entrypoints/test_openapi.py checks the table against the app's routes and fuzzes a
live server against the document with schemathesis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pagoda.entrypoints.openai.protocol.embedding import EmbeddingRequest, EmbeddingResponse
from pagoda.entrypoints.openai.protocol.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    LoadModelRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    UnloadModelRequest,
)
from pagoda.entrypoints.openai.protocol.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from pagoda.entrypoints.openai.responses_api.objects import (
    DeletedResponse,
    InputItemList,
    Response,
    ResponseStreamEvent,
)
from pagoda.entrypoints.openai.responses_api.protocol import ResponsesRequest

REF_TEMPLATE = "#/components/schemas/{model}"

ERROR_MEANINGS = {
    400: "Invalid request: bad JSON, a wrong type, an unknown field or a value out of range "
         "(LoRA routes: a bad adapter, a name taken or unknown, a path outside "
         "--lora-allowed-paths, or LoRA off).",
    401: "Missing or wrong API key (when the server has one).",
    403: "Loading and unloading models and LoRA adapters is off: the server has no "
         "--api-key.",
    404: "The request names a model this server does not serve (or a stored response it "
         "does not hold).",
    408: "The request ran past the server's --request-timeout.",
    409: "The model is already being loaded, or is the only one loaded (unload).",
    413: "The request body is larger than the server's --max-request-bytes.",
    500: "The engine failed while running this request (the server goes on).",
    503: "The server is at capacity (--max-queue), shutting down, or its engine died.",
}


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    request: type[BaseModel] | None
    """The JSON body's model (None: no body)."""
    response: type[BaseModel] | str | None
    """A success's JSON body model, a plain-text media type, or None for an empty body."""
    errors: tuple[int, ...] = ()
    """Every error status (the body is always an ErrorResponse)."""
    chunk: type[BaseModel] | None = None
    """With `"stream": true` the success is a text/event-stream of these chunks (None: the
    operation does not stream)."""
    query: tuple[dict, ...] = ()
    """Query parameters (OpenAPI parameter objects); path parameters (`{name}` in `path`)
    are added by themselves, as strings."""


GENERATION_ERRORS = (400, 401, 404, 408, 413, 500, 503)
OPERATIONS = (
    Operation("post", "/v1/completions", "Create a completion (OpenAI)", CompletionRequest,
              CompletionResponse, GENERATION_ERRORS, chunk=CompletionResponse),
    Operation("post", "/v1/chat/completions", "Create a chat completion (OpenAI)",
              ChatCompletionRequest, ChatCompletionResponse, GENERATION_ERRORS,
              chunk=ChatCompletionChunk),
    Operation("post", "/v1/responses", "Create a response (OpenAI Responses API)",
              ResponsesRequest, Response, GENERATION_ERRORS, chunk=ResponseStreamEvent),
    Operation("get", "/v1/responses/{response_id}", "A stored response (OpenAI)", None,
              Response, (401, 404, 503)),
    Operation("delete", "/v1/responses/{response_id}", "Delete a stored response (OpenAI)",
              None, DeletedResponse, (401, 404, 503)),
    Operation("get", "/v1/responses/{response_id}/input_items",
              "The input items of a stored response (OpenAI)", None, InputItemList,
              (400, 401, 404, 503), query=(
                  {"name": "limit", "in": "query", "required": False,
                   "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                  {"name": "order", "in": "query", "required": False,
                   "schema": {"enum": ["asc", "desc"]}},
                  {"name": "after", "in": "query", "required": False,
                   "schema": {"type": "string"}},
              )),
    Operation("post", "/v1/embeddings", "Create embeddings (OpenAI)", EmbeddingRequest,
              EmbeddingResponse, GENERATION_ERRORS),
    Operation("get", "/v1/models", "List the served models (OpenAI)", None, ModelList,
              (401, 503)),
    Operation("post", "/v1/models/load", "Load (or reload) a model while serving (Pagoda)",
              LoadModelRequest, ModelCard, (400, 401, 403, 409, 413, 503)),
    Operation("post", "/v1/models/unload", "Unload a model once its requests end (Pagoda)",
              UnloadModelRequest, ModelCard, (400, 401, 403, 404, 409, 413, 503)),
    Operation("post", "/v1/load_lora_adapter", "Load a LoRA adapter while serving (vLLM)",
              LoadLoRAAdapterRequest, "text/plain", (400, 401, 403, 413, 503)),
    Operation("post", "/v1/unload_lora_adapter", "Unload a LoRA adapter (vLLM)",
              UnloadLoRAAdapterRequest, "text/plain", (400, 401, 403, 413, 503)),
    Operation("post", "/tokenize", "Token ids of a prompt or chat (vLLM)", TokenizeRequest,
              TokenizeResponse, (400, 404, 413)),
    Operation("post", "/detokenize", "Text of token ids (vLLM)", DetokenizeRequest,
              DetokenizeResponse, (400, 404, 413)),
    Operation("get", "/health", "200 while the engine loop runs", None, None, (503,)),
    Operation("get", "/version", "The Pagoda version and what each model runs on", None,
              VersionResponse),
    Operation("get", "/metrics", "Prometheus metrics", None, "text/plain"),
)


def openapi_document(title: str, version: str, api_key_required: bool) -> dict:
    """The OpenAPI 3.1 document of OPERATIONS (with bearer auth on /v1 when the server has
    an API key)."""
    pairs = [(op.request, "validation") for op in OPERATIONS if op.request is not None]
    pairs += [(op.response, "serialization") for op in OPERATIONS
              if isinstance(op.response, type)]
    pairs += [(op.chunk, "serialization") for op in OPERATIONS if op.chunk is not None]
    pairs.append((ErrorResponse, "serialization"))
    refs, definitions = models_json_schema(pairs, ref_template=REF_TEMPLATE)
    error_schema = refs[(ErrorResponse, "serialization")]
    paths: dict[str, dict] = {}
    for op in OPERATIONS:
        operation: dict = {"summary": op.summary, "operationId": op.summary,
                           "responses": {"200": _success(op, refs)}}
        for status in op.errors:
            operation["responses"][str(status)] = {
                "description": ERROR_MEANINGS[status],
                "content": {"application/json": {"schema": error_schema}},
            }
        parameters = [{"name": name, "in": "path", "required": True,
                       "schema": {"type": "string"}}
                      for name in re.findall(r"{(\w+)}", op.path)] + list(op.query)
        if parameters:
            operation["parameters"] = parameters
        if op.request is not None:
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": refs[(op.request, "validation")]}}}
        if api_key_required and op.path.startswith("/v1"):
            operation["security"] = [{"apiKey": []}]
        paths.setdefault(op.path, {})[op.method] = operation
    document = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": definitions.get("$defs", {})},
    }
    if api_key_required:
        document["components"]["securitySchemes"] = {
            "apiKey": {"type": "http", "scheme": "bearer"}}
    return document


def _success(op: Operation, refs: dict) -> dict:
    if op.response is None:
        return {"description": "OK (no body)"}
    if isinstance(op.response, str):
        return {"description": "OK", "content": {op.response: {"schema": {"type": "string"}}}}
    content = {"application/json": {"schema": refs[(op.response, "serialization")]}}
    if op.chunk is not None:
        content["text/event-stream"] = {"schema": _sse_event(refs[(op.chunk, "serialization")],
                                                             refs[(ErrorResponse, "serialization")])}
    return {"description": "OK", "content": content}


def _sse_event(chunk_schema: dict, error_schema: dict) -> dict:
    """One server-sent event of a stream: `data:` a JSON chunk, or an error body (the stream
    then ends), or the last event, `[DONE]`."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"anyOf": [chunk_schema, error_schema]}},
        ]}},
    }
