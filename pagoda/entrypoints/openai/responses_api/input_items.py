"""The `input` of a Responses request: a string, or items (messages with text content, function
calls and their outputs, reasoning items), parsed strictly.

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

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, field_validator, model_validator

ITEM_STATUS = Literal["in_progress", "completed", "incomplete"]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def tagged(kind: str, members: dict[str, type], tag_of) -> Any:
    """A union of `members` (name -> model) picked by `tag_of(value)` (a member name, or
    None for the Unsupported member under "unsupported"); tags read `kind[name]`."""
    def discriminate(value: Any) -> str:
        name = tag_of(value)  # any JSON value: the type may be a list
        return f"{kind}[{name if isinstance(name, str) and name in members else 'unsupported'}]"

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
            raise ValueError(f"{cls.what} of type {repr(kind)[:40]} are not supported "
                             f"({cls.served})")
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
