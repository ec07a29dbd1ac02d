"""The routes that run a model: POST /v1/completions, /v1/chat/completions, /v1/responses
(and GET, DELETE /v1/responses/{id}, GET .../{id}/input_items), /v1/embeddings, and the
tokenizer's POST /tokenize, /detokenize. Each resolves the request's `model` (a served
model, or a LoRA adapter over one: common.py) and calls that model's handlers, served as
the name it gave."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagoda.entrypoints.openai.protocol.embedding import EmbeddingRequest
from pagoda.entrypoints.openai.protocol.errors import bad_request
from pagoda.entrypoints.openai.protocol.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagoda.entrypoints.openai.protocol.responses import DetokenizeResponse, TokenizeResponse
from pagoda.entrypoints.openai.responses_api import serving as responses_api
from pagoda.entrypoints.openai.responses_api.protocol import ResponsesRequest
from pagoda.entrypoints.openai.routes.common import (
    State,
    parse_body,
    resolve_model,
    serve_with_model,
)

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(raw_request: Request, state: State) -> Response:
    request = await parse_body(raw_request, CompletionRequest)
    return await serve_with_model(
        state, request.model, lambda model, served_as: model.serving.completions.serve(
            request, raw_request, served_as))


@router.post("/v1/chat/completions")
async def create_chat_completion(raw_request: Request, state: State) -> Response:
    request = await parse_body(raw_request, ChatCompletionRequest)
    return await serve_with_model(
        state, request.model, lambda model, served_as: model.serving.chat.serve(
            request, raw_request, served_as))


@router.post("/v1/responses")
async def create_response(raw_request: Request, state: State) -> Response:
    request = await parse_body(raw_request, ResponsesRequest)
    return await serve_with_model(
        state, request.model, lambda model, served_as: responses_api.OpenAIServingResponses(
            model.serving.chat, state.responses_store, served_as).create(request, raw_request))


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, state: State) -> JSONResponse:
    return responses_api.retrieve(state.responses_store, response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: State) -> JSONResponse:
    return responses_api.delete(state.responses_store, response_id)


@router.get("/v1/responses/{response_id}/input_items")
async def list_response_input_items(response_id: str, raw_request: Request,
                                    state: State) -> JSONResponse:
    return responses_api.list_input_items(state.responses_store, response_id,
                                          raw_request.query_params)


@router.post("/v1/embeddings")
async def create_embedding(raw_request: Request, state: State) -> Response:
    request = await parse_body(raw_request, EmbeddingRequest)
    return await serve_with_model(
        state, request.model, lambda model, served_as: model.serving.embeddings.serve(
            request, raw_request, served_as))


@router.post("/tokenize")
async def tokenize(raw_request: Request, state: State) -> JSONResponse:
    request = await parse_body(raw_request, TokenizeRequest)
    model = await resolve_model(state, request.model)
    chat, engine = model.serving.chat, model.engine
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


@router.post("/detokenize")
async def detokenize(raw_request: Request, state: State) -> JSONResponse:
    request = await parse_body(raw_request, DetokenizeRequest)
    model = await resolve_model(state, request.model)
    vocab_size = model.engine.vocab_size
    for token_id in request.tokens:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"tokens: token id {token_id} is out of range; ids must be "
                              f"in [0, {vocab_size})", param="tokens")
    return JSONResponse(DetokenizeResponse(prompt=model.serving.chat.tokenizer.decode(
        request.tokens)).model_dump())
