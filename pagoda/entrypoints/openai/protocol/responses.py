"""Pydantic models of the OpenAI responses Pagoda sends (the requests are protocol.py's).

Responses are built from these models and serialized without dropping nulls, because
OpenAI's shapes carry explicit nulls (`"logprobs": null`, `"finish_reason": null`);
`extra="allow"` lets a handler add vLLM's extras.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from pagoda.entrypoints.openai.protocol.tool_fields import DeltaToolCall, ResponseToolCalls


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(ResponseModel):
    """OpenAI's legacy completions shape: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    """vLLM's extra: the stop string or token id that ended the choice."""


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChatLogProb(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(ResponseModel):
    content: list[ChatLogProbsContent] | None = None
    refusal: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(ResponseToolCalls, ResponseModel):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    """vLLM's: the thinking of a reasoning model (--reasoning-parser); left out when None."""

    @model_serializer(mode="wrap")
    def _optional_fields_last(self, handler):
        """reasoning_content, then tool_calls: last, and left out when None. (A model has one
        serializer: this one replaces ResponseToolCalls'.)"""
        data = handler(self)
        for name in ("reasoning_content", "tool_calls"):
            value = data.pop(name, None)
            if value is not None:
                data[name] = value
        return data


class ChatCompletionResponseChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(ResponseModel):
    """A streamed delta; fields left None are omitted, as OpenAI does (`{}` at the end)."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    """vLLM's: a piece of the thinking (--reasoning-parser)."""
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagoda"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    state: str | None = None
    """Pagoda's: loading, ready, draining (an unload or a reload waits for its requests)
    or unloaded."""


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str


class ModelRunInfo(ResponseModel):
    """What one served model runs on: a benchmark (`pagoda bench ab`) reports it as the
    endpoint's hardware."""

    id: str
    run: dict[str, Any]
    """device, cpu, cpu_features, threads, dtype, weights, attention, kernels, and for
    packed weights prefill_dtype, decode_activations, amx_tiles_from_rows; replicas with
    data parallelism."""


class VersionResponse(ResponseModel):
    version: str
    models: list[ModelRunInfo] = []


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo
