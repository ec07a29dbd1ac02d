"""Chat's tool calling, between the protocol and pagoda/entrypoints/tools/:

    request ── ToolPlan (tools/plan.py): tool_choice, checks ──┬─ prompt: tools listed
       │                                                     │   (tools/rendering.py)
       │   each function's parameters compiled once by the  ├─ "required" / named: the
       │   grammar engine (a bad schema is a 400 naming it)  │   call grammar as the
       │                                                     │   output constraint
    output text ── the plan's parser (tools/parsers/) ────────┴─ message.tool_calls /
                                                                 delta.tool_calls,
                                                                 finish_reason "tool_calls"
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagoda.entrypoints.openai.protocol.requests import ChatCompletionRequest, ChatMessage
from pagoda.entrypoints.openai.protocol.responses import DeltaMessage
from pagoda.entrypoints.openai.protocol.tool_fields import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagoda.entrypoints.openai.serving.job import ChoiceState, SamplingFields
from pagoda.entrypoints.tools.constraints import parameters_schema
from pagoda.entrypoints.tools.parsers import (
    TOOL_PARSERS,
    ForcedCallParser,
    ParsedOutput,
    StreamDelta,
    ToolParser,
)
from pagoda.entrypoints.tools.plan import ToolPlan
from pagoda.errors import InvalidRequestError
from pagoda.structured_outputs import StructuredOutputsParams


@dataclass
class ChatChoiceState(ChoiceState):
    tools_planned: bool = False
    """Whether `parser` was decided (on the choice's first delta)."""
    parser: ToolParser | None = None
    """The choice's tool-call parser, when its request offers tools."""


def plan_of(request: ChatCompletionRequest) -> ToolPlan:
    """The request's tool plan (cheap; InvalidRequestError for inconsistent fields)."""
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
    return ToolPlan.of(tools, request.tool_choice_value(), request.parallel_tool_calls)


def conversation_of(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them (InvalidRequestError naming the
    message field at fault)."""
    conversation = []
    for i, message in enumerate(messages):
        # "developer" is OpenAI's newer name for "system"; templates know "system".
        role = "system" if message.role == "developer" else message.role
        entry = {"role": role, "content": message.text()}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            if role != "assistant":
                raise InvalidRequestError.about(f"messages[{i}].tool_calls",
                                                "are only allowed on assistant messages")
            for j, call in enumerate(message.tool_calls):
                _check_arguments(call.function.arguments,
                                 f"messages[{i}].tool_calls[{j}].function.arguments")
            entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if role == "tool":
            if message.tool_call_id is None:
                raise InvalidRequestError.about(
                    f"messages[{i}].tool_call_id",
                    "is required on tool messages: the id of the call this result answers")
            entry["tool_call_id"] = message.tool_call_id
        elif message.tool_call_id is not None:
            raise InvalidRequestError.about(f"messages[{i}].tool_call_id",
                                            "is only allowed on tool messages")
        conversation.append(entry)
    return conversation


def _check_arguments(arguments: str, param: str) -> None:
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidRequestError.about(param, f"must be the JSON text of an object, got "
                                               f"{arguments[:80]!r}")


def check_tool_schemas(plan: ToolPlan, grammar_compiler) -> None:
    """Every function's parameters compiled by the grammar engine (cached), whatever
    tool_choice is, so a request that works with "auto" also works with "required"."""
    if grammar_compiler is None:
        return
    for i, tool in enumerate(plan.tools):
        schema = parameters_schema(tool["function"].get("parameters"))
        try:
            grammar_compiler.compile(StructuredOutputsParams(json=schema))
        except InvalidRequestError as e:
            detail = e.message.removeprefix("structured_outputs: ")
            raise InvalidRequestError.about(f"tools[{i}].function.parameters",
                                            f"is not a schema Pagoda can follow: {detail}"
                                            ) from None


def constrain_to_calls(plan: ToolPlan, fields: SamplingFields) -> None:
    """With "required" or a named function, make the output calls (the grammar engine's
    errors about it then name tool_choice)."""
    if not plan.constrained:
        return
    if fields.structured_outputs is not None:
        other = fields.name_of("structured_outputs")
        raise InvalidRequestError.about(
            "tool_choice", f"{plan.mode!r} makes the output tool calls; it cannot be combined "
                           f"with {other} (use tool_choice 'auto' or drop {other})")
    fields.structured_outputs = plan.structured_outputs()
    fields.field_names["structured_outputs"] = "tool_choice"


def keep_special_tokens(plan: ToolPlan, parser_name: str, request) -> None:
    """A format whose markers are special tokens (mistral's [TOOL_CALLS]) is decoded with
    them, unless the request says otherwise (skip_special_tokens, as vLLM does)."""
    if (plan.offers_tools and not plan.constrained
            and TOOL_PARSERS[parser_name].keeps_special_tokens
            and "skip_special_tokens" not in request.model_fields_set):
        request.skip_special_tokens = False


def new_parser(plan: ToolPlan, parser_name: str) -> ToolParser:
    """Forced calls follow the layout of tools/constraints.py's grammar (parsers/forced.py);
    "auto" output is read by the server's --tool-call-parser."""
    parser_type = ForcedCallParser if plan.constrained else TOOL_PARSERS[parser_name]
    schemas = {f["name"]: f.get("parameters") for f in plan.functions(plan.call_names)}
    return parser_type(plan.call_names, plan.max_calls, schemas)


def response_calls(parsed: ParsedOutput) -> list[ToolCall] | None:
    calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in parsed.tool_calls]
    return calls or None


def delta_messages(delta: StreamDelta) -> list[DeltaMessage]:
    """One streamed delta as chunk deltas: its content, then each call fragment in a chunk
    of its own (clients merge fragments by index across chunks, not within one)."""
    messages = []
    if delta.content or not delta.tool_calls:
        messages.append(DeltaMessage(content=delta.content or None))
    for fragment in delta.tool_calls:
        call = DeltaToolCall(index=fragment.index, id=fragment.id,
                             type="function" if fragment.id is not None else None,
                             function=DeltaFunctionCall(name=fragment.name,
                                                        arguments=fragment.arguments))
        messages.append(DeltaMessage(tool_calls=[call]))
    return messages


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's "tool_calls" when an answer that ended by itself made calls."""
    return "tool_calls" if made_calls and reason == "stop" else reason
