"""The OpenAI tool-calling shapes: the request fields (`tools`, `tool_choice`,
`parallel_tool_calls`), the calls an assistant message carries back, and the calls of a
response, whole and streamed. Parsed strictly like the rest of protocol.py; what the fields
mean, and the checks between them, are pagoda/entrypoints/tools/plan.py's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
)

from pagoda.entrypoints.openai.protocol.json_shapes import ToolChoice

FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
"""OpenAI's rule for function names."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object; absent means the function takes none."""
    strict: bool | None = None
    """Accepted. Calls forced by tool_choice always follow the schema; "auto" calls are the
    model's own text."""

    @field_validator("parameters")
    @classmethod
    def validate_parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError('must be the JSON schema of an object ({"type": "object", '
                             '"properties": {...}})')
        return value


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


def _check_tool_choice(value: Any) -> Any:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError:
            pass
    raise ValueError('must be "none", "auto", "required" or {"type": "function", '
                     '"function": {"name": ...}}')


class ToolFields(_Strict):
    """Mixed into protocol.ChatCompletionRequest."""

    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice = None
    """"none" | "auto" | "required" | NamedToolChoice; default "auto" with tools, else
    "none"."""
    parallel_tool_calls: bool | None = None
    """Default true: the model may make several calls in one answer."""

    @field_validator("tool_choice")
    @classmethod
    def validate_tool_choice(cls, value: Any) -> Any:
        return _check_tool_choice(value)

    def tool_choice_value(self) -> str | dict | None:
        """tool_choice as plain data (a string or the named-function dict)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice


class MessageFunctionCall(_Strict):
    name: str
    arguments: str
    """JSON text of the arguments object."""


class MessageToolCall(_Strict):
    """A call on an assistant message of the conversation (as a response gave it)."""

    id: str
    type: Literal["function"]
    function: MessageFunctionCall


class MessageToolFields(_Strict):
    """Mixed into protocol.ChatMessage."""

    tool_calls: list[MessageToolCall] | None = None
    """An assistant message's calls (its content may then be null)."""
    tool_call_id: str | None = None
    """The call a tool message answers (required on tool messages)."""


# ---- responses --------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class _DroppingNones(_Response):
    """Streamed shapes leave out what a fragment does not carry, as OpenAI does."""

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseToolCalls(_Response):
    """Mixed into responses.ChatResponseMessage: its calls, last, and left out when the
    answer made none (as OpenAI does)."""

    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_last(self, handler):
        data = handler(self)
        calls = data.pop("tool_calls", None)
        if calls is not None:
            data["tool_calls"] = calls
        return data


class DeltaFunctionCall(_DroppingNones):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DroppingNones):
    """A fragment of a streamed call: the first carries id, type and name, the next ones
    argument text; fragments with one index concatenate to the call."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
