"""The Responses request without a server: every field of OpenAI's published request schema is
a field here (checked against the installed openai SDK, so the two cannot drift), the
conversion to a chat request, and chat's field names mapped back to the Responses ones."""

from __future__ import annotations

import typing

from openai.types.responses import response_create_params

from pagoda.entrypoints.openai.responses_api.protocol import IGNORED_FIELDS, ResponsesRequest
from pagoda.entrypoints.openai.responses_api.to_chat import (
    chat_conversion,
    own_items,
    responses_error,
    responses_param,
)
from pagoda.errors import InvalidRequestError


def test_every_field_of_openais_request_schema_is_accepted():
    openai_fields = set(typing.get_type_hints(
        response_create_params.ResponseCreateParamsStreaming, include_extras=False))
    assert openai_fields - set(ResponsesRequest.model_fields) == set()
    assert set(IGNORED_FIELDS) <= openai_fields


def conversion_of(body: dict):
    request = ResponsesRequest.model_validate(body)
    items = own_items(request)
    return chat_conversion(request, items, [f"input[{i}]" for i in range(len(items))])


def test_the_chat_request_of_a_responses_request():
    conversion = conversion_of({
        "instructions": "Sys", "max_output_tokens": 9, "temperature": 0.5, "top_p": 0.9,
        "parallel_tool_calls": False, "tool_choice": {"type": "function", "name": "f"},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"},
                   "strict": True}],
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
        "input": [{"role": "user", "content": "Hi"},
                  {"type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": "Let me "},
                               {"type": "output_text", "text": "check."}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                  {"type": "reasoning", "summary": [], "id": "rs_1"},
                  {"type": "function_call_output", "call_id": "c1", "output": "1"},
                  {"type": "function_call_output", "call_id": "c2",
                   "output": [{"type": "input_text", "text": "2"}]}]})
    chat = conversion.request
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Sys"}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
        {"role": "tool", "content": "2", "tool_call_id": "c2"}]
    assert conversion.message_params == ["instructions", "input[0]", "input[1]", "input[5]",
                                         "input[6]"]
    assert conversion.call_params == {(2, 0): "input[2]", (2, 1): "input[3]"}
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p) == (9, 0.5, 0.9)
    assert chat.parallel_tool_calls is False and not chat.stream
    assert chat.tool_choice_value() == {"type": "function", "function": {"name": "f"}}
    assert chat.tools[0].function.model_dump(exclude_none=True) == {
        "name": "f", "parameters": {"type": "object"}, "strict": True}
    assert chat.response_format.model_dump(by_alias=True, exclude_none=True) == {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    streamed = conversion_of({"input": "Hi", "stream": True,
                              "include": ["message.output_text.logprobs"]}).request
    assert streamed.include_usage and streamed.logprobs and streamed.top_logprobs == 0


def test_chats_field_names_map_back_to_the_responses_ones():
    conversion = conversion_of({"instructions": "Sys", "input": [
        {"role": "user", "content": "Hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"}]})
    assert [responses_param(param, conversion) for param in [
        "messages", "messages[0]", "messages[1].content",
        "messages[2].tool_calls[0].function.arguments", "messages[3].tool_call_id",
        "tools[2].function.parameters", "response_format", "response_format.json_schema.schema",
        "structured_outputs", "max_completion_tokens", "top_logprobs", "temperature",
    ]] == ["input", "instructions", "input[0].content", "input[1].arguments", "input[2].call_id",
           "tools[2].parameters", "text.format", "text.format.schema", "text.format",
           "max_output_tokens", "top_logprobs", "temperature"]
    renamed = responses_error(InvalidRequestError.about("max_completion_tokens", "must be >= 1"),
                              conversion)
    assert (renamed.param, renamed.message) == ("max_output_tokens", "max_output_tokens must be >= 1")
    long = responses_error(InvalidRequestError(
        "messages is 99 tokens, but ... Please reduce the length of the messages.", "messages",
        "context_length_exceeded"), conversion)
    assert (long.param, long.code) == ("input", "context_length_exceeded")
    assert long.message == "input is 99 tokens, but ... Please reduce the length of the input."


def test_the_openapi_document_describes_the_responses_routes():
    from pagoda.entrypoints.openai.openapi import openapi_document

    document = openapi_document("Pagoda", "0", True)
    paths = document["paths"]
    create = paths["/v1/responses"]["post"]
    assert set(create["responses"]) == {"200", "400", "401", "404", "408", "413", "500", "503"}
    assert set(create["responses"]["200"]["content"]) == {"application/json",
                                                          "text/event-stream"}
    assert create["security"] == [{"apiKey": []}]
    for method in ("get", "delete"):
        operation = paths["/v1/responses/{response_id}"][method]
        assert operation["parameters"] == [{"name": "response_id", "in": "path",
                                            "required": True, "schema": {"type": "string"}}]
        assert set(operation["responses"]) == {"200", "401", "404", "503"}
    listing = paths["/v1/responses/{response_id}/input_items"]["get"]
    assert [p["name"] for p in listing["parameters"]] == ["response_id", "limit", "order",
                                                          "after"]
    schemas = document["components"]["schemas"]
    request = schemas["ResponsesRequest"]
    assert request["additionalProperties"] is False and request["required"] == ["input"]
    assert request["properties"]["top_logprobs"]["maximum"] == 20
    assert schemas["UnsupportedTool"]["not"] == {}  # never valid: refused with its type named
    assert {"Response", "ResponseUsage", "MessageItem", "FunctionCallItem",
            "ReasoningItem"} <= set(schemas)
