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

Unions that depend on a `type` (input items, content parts, tools, tool_choice,
text.format) are tagged unions whose tags are written `kind[name]`: the server's error
handler drops bracketed parts of an error's location, so a bad field is named as the client
wrote it (`input[2].call_id`), and a type Pagoda does not serve lands on an `Unsupported*`
member (`Unsupported`) whose only job is to refuse it with a message that names the type.
"""

from __future__ import annotations

import operator
from functools import reduce
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from pagoda.entrypoints.openai.json_shapes import bounded
from pagoda.entrypoints.openai.tool_fields import FUNCTION_NAME_PATTERN, FunctionDefinition
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

ITEM_STATUS = Literal["in_progress", "completed", "incomplete"]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def tagged(kind: str, members: dict[str, type], tag_of) -> Any:
    """A union of `members` (name -> model) picked by `tag_of(value)` (a member name, or
    None for the Unsupported member under "unsupported"); tags read `kind[name]`."""
    def discriminate(value: Any) -> str:
        name = tag_of(value)
        return f"{kind}[{name if name in members else 'unsupported'}]"

    return Annotated[
        reduce(operator.or_, (Annotated[model, Tag(f"{kind}[{name}]")]
                              for name, model in members.items())),
        Discriminator(discriminate),
    ]


def type_of(value: Any, default: str | None = None) -> str | None:
    if isinstance(value, dict):
        return value.get("type", default)
    return getattr(value, "type", default)


class Unsupported(BaseModel):
    """A union's catch-all member: never valid (its schema is `not {}`), it refuses whatever
    lands on it, naming the type it has. Subclasses say what they refuse."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"not": {}})
    what: ClassVar[str]
    served: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def refuse(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind is not None:
            raise ValueError(f"{cls.what} of type {kind!r} are not supported ({cls.served})")
        wrong = "needs a `type`" if isinstance(value, dict) else "must be an object"
        raise ValueError(f"{wrong} ({cls.served})")


# ---- content parts ----------------------------------------------------------------------------


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None
    """Accepted; Pagoda's prefix cache needs no breakpoints."""


class OutputText(StrictModel):
    """An assistant's text, as a response gave it (its annotations and logprobs ignored)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(StrictModel):
    type: Literal["refusal"]
    refusal: str


TEXT_PARTS = "text parts: input_text, output_text or refusal"


class UnsupportedContentPart(Unsupported):
    what, served = "content parts", f"Pagoda takes {TEXT_PARTS}"


ContentPart = tagged("part", {
    "input_text": InputText, "output_text": OutputText, "refusal": Refusal,
    "unsupported": UnsupportedContentPart,
}, type_of)
Content = Annotated[
    Annotated[str, Tag("content[text]")] | Annotated[list[ContentPart], Tag("content[parts]")],
    Discriminator(lambda v: "content[text]" if isinstance(v, str) else "content[parts]"),
]


def part_text(part: InputText | OutputText | Refusal) -> str:
    return part.refusal if isinstance(part, Refusal) else part.text


def content_text(content: str | list) -> str:
    """A message's content as one text (parts joined without a separator, as the model
    wrote them)."""
    return content if isinstance(content, str) else "".join(part_text(p) for p in content)


# ---- input items ------------------------------------------------------------------------------


class InputMessage(StrictModel):
    """A message: EasyInputMessage, an input Message, or an output message sent back."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: str | None = None
    status: ITEM_STATUS | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def validate_content(cls, value: Any) -> Any:
        if isinstance(value, (str, list)):
            return value
        raise ValueError(f"must be a string or a list of {TEXT_PARTS}")


class InputFunctionCall(StrictModel):
    """A call the model made (a response's function_call item, sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    """JSON text of the arguments object."""
    id: str | None = None
    status: ITEM_STATUS | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


OutputContent = Annotated[
    Annotated[str, Tag("output[text]")] | Annotated[list[ContentPart], Tag("output[parts]")],
    Discriminator(lambda v: "output[text]" if isinstance(v, str) else "output[parts]"),
]


class InputFunctionCallOutput(StrictModel):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: OutputContent
    """A string, or text parts."""
    id: str | None = None
    status: ITEM_STATUS | None = None
    name: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


class InputReasoning(StrictModel):
    """A reasoning item sent back: accepted and left out of the prompt (as OpenAI leaves
    earlier turns' reasoning out)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: ITEM_STATUS | None = None


class UnsupportedInputItem(Unsupported):
    what = "input items"
    served = "Pagoda takes message, function_call, function_call_output and reasoning items"


InputItem = tagged("item", {
    "message": InputMessage, "function_call": InputFunctionCall,
    "function_call_output": InputFunctionCallOutput, "reasoning": InputReasoning,
    "unsupported": UnsupportedInputItem,
}, lambda value: type_of(value, "message"))
InputItems = Annotated[
    Annotated[str, Tag("input[text]")] | Annotated[list[InputItem], Tag("input[items]")],
    Discriminator(lambda v: "input[text]" if isinstance(v, str) else "input[items]"),
]


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
