"""Tool calling through `pagoda serve --tool-call-parser auto` and the official openai client,
on the bundled model (whose template has no tool section: the Hermes fallback format, so auto
picks hermes): a forced call (tool_choice "required" or named) is always a valid call of the
given schemas; a named function is called exactly once, as OpenAI does, and so is any with
"required" and parallel_tool_calls false; a forced call ends with finish_reason "tool_calls"
(also when it fills max_tokens exactly), and one cut by max_tokens leaks none of its wrapper
into the content; a round trip (call -> tool result -> answer) works streamed and not;
streamed `delta.tool_calls` fragments assemble (by hand and by the client's own stream
helper) to exactly the non-streamed calls; "auto" output is parsed into calls and content;
bad tool inputs are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pagoda.entrypoints.tools.constraints import tool_call_grammar
from tests.entrypoints.server_helpers import MODEL_NAME, SHARED_API_KEY, SHARED_AUTH

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 16},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY = {"model": MODEL_NAME, "temperature": 0, "seed": 7, "max_tokens": 60}


@pytest.fixture(scope="module")
def server(shared_server):
    """The session's shared server: it runs --tool-call-parser auto."""
    return shared_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=SHARED_API_KEY, max_retries=0)


def calls_of(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def assert_valid_calls(message) -> None:
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def stream_assembled(client, **request) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, calls, finish_reason) assembled from the chunks, checking OpenAI's fragment
    order: per call a first fragment with id, type and name (arguments ""), then arguments."""
    content, calls, finish_reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for fragment in choice.delta.tool_calls or []:
            if fragment.index not in calls:
                assert fragment.id.startswith("call_") and fragment.type == "function"
                assert fragment.function.name and fragment.function.arguments == ""
                calls[fragment.index] = [fragment.function.name, ""]
            else:
                assert fragment.id is None and fragment.function.name is None
                calls[fragment.index][1] += fragment.function.arguments
        finish_reason = choice.finish_reason or finish_reason
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish_reason


def test_forced_calls_are_valid_and_streams_assemble_to_them(client):
    for tool_choice, parallel in [("required", True),
                                  ({"type": "function", "function": {"name": "get_time"}}, False)]:
        request = dict(GREEDY, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                       parallel_tool_calls=parallel, max_tokens=120)
        response = client.chat.completions.create(**request)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        assert_valid_calls(choice.message)
        if not parallel:
            assert [name for name, _ in calls_of(choice.message)] == ["get_time"]
        assert stream_assembled(client, **request) == (None, calls_of(choice.message),
                                                       "tool_calls")
        if parallel:  # the client's own accumulation of the fragments agrees
            with client.chat.completions.stream(**request) as stream:
                final = stream.get_final_completion()
            assert calls_of(final.choices[0].message) == calls_of(choice.message)


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice, parallel", [
    (NAMED, None), (NAMED, False), ("required", False)])
def test_exactly_one_forced_call_ending_with_tool_calls(client, tool_choice, parallel):
    request = dict(GREEDY, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                   max_tokens=100)
    if parallel is not None:  # (None: the field left out; OpenAI's default is true)
        request["parallel_tool_calls"] = parallel
    response = client.chat.completions.create(**request)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message)
    if tool_choice == NAMED:
        assert choice.message.tool_calls[0].function.name == "get_weather"
    assert response.usage.completion_tokens < 100  # the request ended with the call
    assert stream_assembled(client, **request) == (None, calls_of(choice.message), "tool_calls")


def test_forced_calls_cut_by_max_tokens_leak_no_wrapper(client, server):
    assert "--tool-call-parser auto: hermes" in server.log_text()
    request = dict(GREEDY, messages=QUESTION, tools=TOOLS, tool_choice=NAMED, max_tokens=100)
    full = client.chat.completions.create(**request)
    [(name, arguments)] = calls_of(full.choices[0].message)
    # A call that fills max_tokens exactly is complete: "tool_calls", not "length".
    exact = dict(request, max_tokens=full.usage.completion_tokens)
    choice = client.chat.completions.create(**exact).choices[0]
    assert (choice.finish_reason, calls_of(choice.message)) == ("tool_calls", [(name, arguments)])
    # Cut in the wrapper's head: nothing; cut in the arguments: the call so far. Never the
    # wrapper as content.
    for max_tokens in (3, 24):
        cut = dict(request, max_tokens=max_tokens)
        choice = client.chat.completions.create(**cut).choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None, choice
        calls = calls_of(choice.message)
        if max_tokens == 3:
            assert calls == []
        else:
            [(cut_name, cut_arguments)] = calls
            assert cut_name == name and arguments.startswith(cut_arguments)
            assert "{" in cut_arguments and cut_arguments != arguments
        assert stream_assembled(client, **cut) == (None, calls, "length")


def test_round_trip_call_result_answer(client):
    request = dict(GREEDY, messages=QUESTION, tools=TOOLS, tool_choice="required",
                   parallel_tool_calls=False)
    message = client.chat.completions.create(**request).choices[0].message
    assert_valid_calls(message)
    call = message.tool_calls[0]
    history = QUESTION + [
        message,  # sent back as the client returned it
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"temperature": 21, "unit": "celsius", "sky": "clear"})},
    ]
    final = dict(GREEDY, messages=history, tools=TOOLS, tool_choice="none", max_tokens=80)
    answer = client.chat.completions.create(**final).choices[0]
    assert answer.finish_reason == "stop", answer
    assert answer.message.content and answer.message.tool_calls is None
    assert stream_assembled(client, **final) == (answer.message.content, [], "stop")
    # The streamed call, sent back as the client assembled it, gives the same answer.
    _, streamed_calls, _ = stream_assembled(client, **request)
    assert streamed_calls == calls_of(message)


def test_auto_output_is_parsed_into_content_and_calls(client):
    # Make the model's "auto" text deterministic: a guided grammar that writes a sentence,
    # then two Hermes calls (exactly what the parser reads from a model that calls tools).
    calls = tool_call_grammar([WEATHER["function"], TIME["function"]], parallel=True)
    grammar = calls.replace('start: call ("\\n" call)*', 'start: "Let me check.\\n" call "\\n" call')
    request = dict(GREEDY, messages=QUESTION, tools=TOOLS, max_tokens=90,
                   extra_body={"guided_grammar": grammar})
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert_valid_calls(choice.message)
    assert len(choice.message.tool_calls) == 2
    assert stream_assembled(client, **request) == (
        "Let me check.", calls_of(choice.message), "tool_calls")
    # Unparsed model text in "auto" is plain content.
    plain = client.chat.completions.create(**dict(GREEDY, messages=QUESTION, tools=TOOLS,
                                                  max_tokens=8)).choices[0]
    assert plain.message.tool_calls is None and plain.message.content


BAD_SCHEMA = {"type": "object", "properties": {"city": {"type": "strnig"}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize("fields, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_date"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
     "tools[0].function.name"),
    ({"messages": QUESTION + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                              {"role": "tool", "content": "21 C"}]},
     "messages[2].tool_call_id"),
    ({"messages": QUESTION + [{"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "Hi", "tool_calls": [CALL]}]},
     "messages[0].tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_bad_tool_inputs_are_400s_naming_the_field(server, fields, param):
    body = {"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 4, **fields}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60,
                          headers=SHARED_AUTH)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"]
