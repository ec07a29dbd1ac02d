"""What POST /v1/responses answers: the `Response` object, its output items and usage, and the
streamed events, with OpenAI's field names (openai.types.responses: Response,
ResponseOutputMessage, ResponseFunctionToolCall, ResponseReasoningItem, ResponseUsage and the
Response*Event types; tests/entrypoints/test_responses_objects.py validates them with the
SDK's own models). Serialized without dropping nulls, as OpenAI's shapes carry them.

Ids: `resp_…` responses, `msg_…` messages, `fc_…` function calls (their `call_id` is the
chat call id, `call_…`), `rs_…` reasoning.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import Field

from pagoda.entrypoints.openai.protocol.responses import ResponseModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputTextPart(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)
    """Per token {token, bytes, logprob, top_logprobs}: with include
    "message.output_text.logprobs" (else empty)."""


class ReasoningTextPart(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageItem(ResponseModel):
    id: str = Field(default_factory=lambda: new_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "completed"
    content: list[OutputTextPart] = Field(default_factory=list)


class FunctionCallItem(ResponseModel):
    id: str = Field(default_factory=lambda: new_id("fc"))
    type: Literal["function_call"] = "function_call"
    status: ItemStatus = "completed"
    call_id: str
    name: str
    arguments: str = ""


class ReasoningItem(ResponseModel):
    id: str = Field(default_factory=lambda: new_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus = "completed"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningTextPart] = Field(default_factory=list)
    encrypted_content: str | None = None


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class ResponseErrorInfo(ResponseModel):
    code: str = "server_error"
    message: str


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens", "content_filter"] | None = None


class Response(ResponseModel):
    """OpenAI's Response. The request's settings are echoed (with OpenAI's defaults where
    the request left them out)."""

    id: str = Field(default_factory=lambda: new_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "failed", "in_progress", "incomplete"] = "in_progress"
    completed_at: int | None = None
    background: bool = False
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[MessageItem | FunctionCallItem | ReasoningItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(
        default_factory=lambda: {"effort": None, "summary": None})
    service_tier: str = "default"
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int = 0
    top_p: float = 1.0
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)

    def finish(self, status: str, usage: ResponseUsage | None) -> None:
        """Mark it ended: "completed", "incomplete" (cut at max_output_tokens) or
        "failed" (set `error` first)."""
        self.status = status
        self.usage = usage
        if status == "completed":
            self.completed_at = int(time.time())
        if status == "incomplete":
            self.incomplete_details = IncompleteDetails(reason="max_output_tokens")

    @property
    def output_text(self) -> str:
        return "".join(part.text for item in self.output if isinstance(item, MessageItem)
                       for part in item.content)


class DeletedResponse(ResponseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItemList(ResponseModel):
    """GET /v1/responses/{id}/input_items: a page of the response's input items."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class ResponseStreamEvent(ResponseModel):
    """One streamed event (`data:` of an SSE whose `event:` is its type): response.created,
    response.in_progress, response.output_item.added, response.content_part.added,
    response.output_text.delta, ..., response.completed (events.py makes them). The other
    fields depend on the type, as OpenAI's Response*Event types give them."""

    type: str
    sequence_number: int
