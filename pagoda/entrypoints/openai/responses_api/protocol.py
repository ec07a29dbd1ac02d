"""The request of POST /v1/responses (OpenAI's `ResponseCreateParams`), parsed strictly as
protocol.py parses chat: wrong types and unknown fields are 400s naming the field.

Every field of OpenAI's published request schema is accepted. What each one does here:

    served          input, instructions, model, tools (function tools), tool_choice,
                    parallel_tool_calls, text.format, max_output_tokens, temperature, top_p,
                    top_logprobs, include ("message.output_text.logprobs"), stream, store,
                    previous_response_id, truncation, metadata (echoed)
    echoed only     reasoning (its effort goes to chat's `reasoning_effort` where chat takes
                    it: to_chat.py), user, service_tier, text.verbosity, max_tool_calls,
                    prompt_cache_key, safety_identifier (no meaning here; see IGNORED_FIELDS)
    refused (400)   background: true, conversation, prompt, moderation; tools and items of
                    other types than function / message / function_call /
                    function_call_output / reasoning (web search, files, images, MCP...)

vLLM's extras `top_k`, `min_p`, `repetition_penalty` and `priority` work as in chat.
`input` and its items are input_items.py's; tools, tool_choice and text.format are tagged
unions in the same way.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    Tag,
    field_validator,
)

from pagoda.entrypoints.openai.protocol.json_shapes import bounded
from pagoda.entrypoints.openai.protocol.tool_fields import FUNCTION_NAME_PATTERN, FunctionDefinition
from pagoda.entrypoints.openai.responses_api.input_items import (
    InputItems,
    StrictModel,
    Unsupported,
    tagged,
    type_of,
)
from pagoda.sampling_params import MAX_LOGPROBS, MAX_REPETITION_PENALTY

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The `include` value that adds logprobs to output_text parts."""

INCLUDABLE = Literal[
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs", "reasoning.encrypted_content",
    "message.output_text.logprobs",
]
"""OpenAI's `include` values. Only LOGPROBS_INCLUDE changes anything here; the others name
outputs of tools Pagoda does not run (or encrypted reasoning, which it does not make), so
asking for them is harmless."""

# ---- tools and output format -------------------------------------------------------------------


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object; absent means the function takes none."""
    strict: bool | None = None
    """Accepted: calls forced by tool_choice always follow the schema."""
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    output_schema: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def validate_parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return FunctionDefinition.validate_parameters(value)


class UnsupportedTool(Unsupported):
    what = "tools"
    served = 'Pagoda serves function tools: {"type": "function", "name": ..., "parameters": ...}'


Tool = tagged("tool", {"function": FunctionTool, "unsupported": UnsupportedTool}, type_of)


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class UnsupportedToolChoice(Unsupported):
    what = "tool choices"
    served = 'give "none", "auto", "required" or {"type": "function", "name": ...}'


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("choice[mode]")]
    | Annotated[FunctionChoice, Tag("choice[function]")]
    | Annotated[UnsupportedToolChoice, Tag("choice[unsupported]")],
    Discriminator(lambda v: "choice[mode]" if isinstance(v, str) else
                  "choice[function]" if type_of(v) == "function" else "choice[unsupported]"),
]


class PlainTextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectTextFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaTextFormat(StrictModel):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None
    """Accepted: the output always follows the schema (constrained decoding)."""


class UnsupportedTextFormat(Unsupported):
    what, served = "formats", "give text, json_object or json_schema"


OutputFormat = tagged("format", {
    "text": PlainTextFormat, "json_object": JsonObjectTextFormat,
    "json_schema": JsonSchemaTextFormat, "unsupported": UnsupportedTextFormat,
}, type_of)


class TextConfig(StrictModel):
    format: OutputFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    """Accepted and echoed; no meaning here."""


class ReasoningConfig(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool | None = None
    """Accepted; Pagoda's events carry no obfuscation padding."""


# ---- the request ------------------------------------------------------------------------------


class ResponsesRequest(StrictModel):
    input: InputItems
    """A user message's text, or a list of items (messages, function calls and their
    outputs, reasoning items)."""
    model: str | None = None
    instructions: str | None = None
    """A system message put first (not carried over by previous_response_id, as OpenAI)."""
    previous_response_id: str | None = None
    """Continue a stored response: its input and output come before `input`."""
    store: bool | None = True
    """Keep the response for GET and previous_response_id (default true, as OpenAI)."""
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    """Default "auto" with tools, else "none"."""
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = bounded(None, minimum=1)
    temperature: float | None = bounded(None, minimum=0)
    top_p: float | None = bounded(None, exclusiveMinimum=0, maximum=1)
    top_logprobs: int | None = bounded(None, minimum=0, maximum=MAX_LOGPROBS)
    include: list[INCLUDABLE] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    """"auto": drop the oldest items until the input fits the context."""
    metadata: dict[str, str] | None = None
    # Accepted and echoed, no meaning here.
    reasoning: ReasoningConfig | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    max_tool_calls: int | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    context_management: list[dict[str, Any]] | None = None
    # Refused when set (unsupported_fields).
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    # vLLM's extras.
    top_k: int | None = bounded(None, minimum=-1)
    min_p: float | None = bounded(None, minimum=0, maximum=1)
    repetition_penalty: float | None = bounded(None, minimum=1 / MAX_REPETITION_PENALTY,
                                               maximum=MAX_REPETITION_PENALTY)
    priority: int | None = 0

    @field_validator("input", mode="before")
    @classmethod
    def validate_input(cls, value: Any) -> Any:
        if isinstance(value, (str, list)):
            return value
        raise ValueError("must be a string or a list of input items")

    def unsupported_fields(self) -> list[tuple[str, str]]:
        set_fields = [name for name in REFUSED_FIELDS if getattr(self, name)]
        return [(name, REFUSED_FIELDS[name]) for name in set_fields]

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or bool(self.top_logprobs)


REFUSED_FIELDS = {
    "background": "background responses are not supported: stream, or wait for the response",
    "conversation": "conversations are not supported: continue a response with "
                    "previous_response_id",
    "prompt": "prompt templates are not supported: send `input` and `instructions`",
    "moderation": "moderation is not supported",
}
"""Fields Pagoda cannot honour: a 400 (code unsupported_parameter) when set."""

IGNORED_FIELDS = ("reasoning", "user", "service_tier", "max_tool_calls", "prompt_cache_key",
                  "prompt_cache_retention", "prompt_cache_options", "safety_identifier",
                  "context_management", "stream_options")
"""Fields accepted without effect; a request that sets one is logged once (serving.py)."""
