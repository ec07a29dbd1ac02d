"""A Responses request as the chat request it runs as, and chat's errors named back.

    previous_response_id's conversation ─┐
    input (a string: one user message) ──┴─ items ─┬─ instructions      -> system message first
                                                   ├─ message           -> a message (parts joined)
                                                   ├─ function_call     -> an assistant message's
                                                   │                       tool_calls (consecutive
                                                   │                       calls: one message)
                                                   ├─ function_call_output -> a tool message
                                                   └─ reasoning         -> left out
    tools, tool_choice, text.format, max_output_tokens, top_logprobs ... -> chat's fields

Chat's validation (serving_chat / serving_pipeline) then checks everything once; its errors
name chat's fields (`messages[3].tool_calls[0].function.arguments`, `response_format`,
`max_completion_tokens`), which `responses_error` renames to the field the client sent
(`input[4].arguments`, `text.format`, `max_output_tokens`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from pydantic import ValidationError

from pagoda.entrypoints.openai.protocol.errors import from_validation_error
from pagoda.entrypoints.openai.protocol.requests import ChatCompletionRequest
from pagoda.entrypoints.openai.responses_api.input_items import (
    InputFunctionCall,
    InputFunctionCallOutput,
    InputMessage,
    InputReasoning,
    content_text,
)
from pagoda.entrypoints.openai.responses_api.protocol import (
    FunctionChoice,
    JsonObjectTextFormat,
    JsonSchemaTextFormat,
    ResponsesRequest,
)
from pagoda.errors import InvalidRequestError

PREVIOUS_PARAM = "previous_response_id"
"""What errors about items of the stored conversation name."""

CHAT_TAKES_REASONING_EFFORT = "reasoning_effort" in ChatCompletionRequest.model_fields
"""Whether chat passes `reasoning_effort` to the template (the reasoning parsers' issue):
then `reasoning.effort` goes there."""

RENAMED_FIELDS = {"max_completion_tokens": "max_output_tokens",
                  "reasoning_effort": "reasoning.effort",
                  "max_tokens": "max_output_tokens", "logprobs": "top_logprobs",
                  "structured_outputs": "text.format", "response_format": "text.format",
                  "messages": "input"}


@dataclass
class ChatConversion:
    request: ChatCompletionRequest
    message_params: list[str] = field(default_factory=list)
    """Per chat message, the Responses field it came from ("instructions", "input[2]", or
    PREVIOUS_PARAM)."""
    call_params: dict[tuple[int, int], str] = field(default_factory=dict)
    """(message index, call index) -> the function_call item's field."""


def own_items(request: ResponsesRequest) -> list:
    """The request's input as items (a string is one user message)."""
    if isinstance(request.input, str):
        return [InputMessage(role="user", content=request.input)]
    return list(request.input)


def chat_conversion(request: ResponsesRequest, items: list, item_params: list[str]
                    ) -> ChatConversion:
    """The chat request of `request` over the conversation `items` (the stored one, then the
    request's own), `item_params[i]` naming item i in errors."""
    conversion = ChatConversion(request=None)  # type: ignore[arg-type]
    messages: list[dict] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
        conversion.message_params.append("instructions")
    called_ids: set[str] = set()
    for item, param in zip(items, item_params):
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": content_text(item.content)})
            conversion.message_params.append(param)
        elif isinstance(item, InputFunctionCall):
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
                conversion.message_params.append(param)
            calls = messages[-1].setdefault("tool_calls", [])
            conversion.call_params[(len(messages) - 1, len(calls))] = param
            calls.append({"id": item.call_id, "type": "function",
                          "function": {"name": item.name, "arguments": item.arguments}})
            called_ids.add(item.call_id)
        elif isinstance(item, InputFunctionCallOutput):
            if item.call_id not in called_ids:
                raise InvalidRequestError.about(
                    f"{param}.call_id", f"{item.call_id!r} answers no function_call item "
                                        "before it: send the call too, or previous_response_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": content_text(item.output)})
            conversion.message_params.append(param)
        else:
            assert isinstance(item, InputReasoning)  # left out of the prompt
    if not messages:
        raise InvalidRequestError.about("input", "has no message: give at least one")
    body = {"model": request.model, "messages": messages, **sampling_fields(request),
            **tool_fields(request)}
    try:
        conversion.request = ChatCompletionRequest.model_validate_json(json.dumps(
            {k: v for k, v in body.items() if v is not None}))
    except ValidationError as e:  # what protocol.py did not check the same way
        error = from_validation_error(e)
        raise responses_error(InvalidRequestError(error.message, error.param, error.code),
                              conversion) from None
    return conversion


def sampling_fields(request: ResponsesRequest) -> dict:
    fields = {
        "stream": request.stream, "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k,
        "min_p": request.min_p, "repetition_penalty": request.repetition_penalty,
        "priority": request.priority, "response_format": response_format(request),
    }
    if request.stream:
        fields["stream_options"] = {"include_usage": True}  # the final usage
    if request.wants_logprobs:
        fields.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    if CHAT_TAKES_REASONING_EFFORT and request.reasoning is not None:
        fields["reasoning_effort"] = request.reasoning.effort
    return fields


def response_format(request: ResponsesRequest) -> dict | None:
    text_format = request.text.format if request.text is not None else None
    if isinstance(text_format, JsonObjectTextFormat):
        return {"type": "json_object"}
    if isinstance(text_format, JsonSchemaTextFormat):
        json_schema = {"name": text_format.name, "schema": text_format.schema_,
                       "description": text_format.description, "strict": text_format.strict}
        return {"type": "json_schema",
                "json_schema": {k: v for k, v in json_schema.items() if v is not None}}
    return None


def tool_fields(request: ResponsesRequest) -> dict:
    tools = None
    if request.tools is not None:
        tools = [{"type": "function", "function": {
            k: v for k, v in {"name": tool.name, "description": tool.description,
                              "parameters": tool.parameters, "strict": tool.strict}.items()
            if v is not None}} for tool in request.tools]
    tool_choice = request.tool_choice
    if isinstance(tool_choice, FunctionChoice):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    return {"tools": tools, "tool_choice": tool_choice,
            "parallel_tool_calls": request.parallel_tool_calls}


_MESSAGE_PARAM = re.compile(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function)?)?(.*)")
_TOOL_PARAM = re.compile(r"tools\[(\d+)\]\.function(.*)")


def responses_param(param: str, conversion: ChatConversion) -> str:
    """Chat's name of a field -> the Responses request's."""
    match = _MESSAGE_PARAM.fullmatch(param)
    if match:
        index, call, rest = int(match[1]), match[2], match[3]
        if call is not None and (index, int(call)) in conversion.call_params:
            return conversion.call_params[(index, int(call))] + rest
        base = (conversion.message_params[index] if index < len(conversion.message_params)
                else "input")
        rest = {".tool_call_id": ".call_id", ".content": ".content"}.get(rest, "")
        return base + ("" if base in ("instructions", PREVIOUS_PARAM) else rest)
    match = _TOOL_PARAM.fullmatch(param)
    if match:
        return f"tools[{match[1]}]{match[2]}"
    if param.startswith("response_format"):
        return "text.format" + param.removeprefix("response_format").replace(
            ".json_schema.schema", ".schema").replace(".json_schema", "")
    return RENAMED_FIELDS.get(param, param)


def responses_error(error: InvalidRequestError, conversion: ChatConversion
                    ) -> InvalidRequestError:
    """`error` (about the chat request) about the Responses request's field instead."""
    if error.param is None:
        return error
    param = responses_param(error.param, conversion)
    if param == error.param:
        return error
    renamed = error.renamed(param)
    if renamed.detail is None:  # a message that names chat's field in its own words
        message = renamed.message.replace(error.param, param)
        renamed = InvalidRequestError(re.sub(r"\bmessages\b", "input", message), param,
                                      error.code)
    return renamed
