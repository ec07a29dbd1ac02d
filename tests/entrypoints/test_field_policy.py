"""The field policy (pagoda/entrypoints/openai/protocol/field_policy.py) and vLLM's extras, in-process
against the fake engine of test_serving_pipeline.py (no model):

- the policy's tables are exactly the fields of the installed `openai` SDK's request
  TypedDicts, so they cannot drift; each field is declared by the request model;
- every one of those fields is accepted; the ignored ones are named in one warning line per
  request (sent through the SDK itself); the refused ones are 400s naming them; a made-up
  field is a 400 naming it;
- chat `echo`, `return_tokens_as_token_ids` and `prompt_logprobs` have vLLM's shapes.
The same extras on the bundled model: test_real_clients.py."""

from __future__ import annotations

import logging

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types import completion_create_params as completion_params
from openai.types.chat import chat_completion_stream_options_param as stream_options_param
from openai.types.chat import completion_create_params as chat_params

from pagoda.entrypoints.openai.model_registry import ServedModel
from pagoda.entrypoints.openai.protocol.field_policy import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    FieldPolicy,
)
from pagoda.entrypoints.openai.protocol.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
)
from pagoda.entrypoints.openai.server import build_app
from pagoda.entrypoints.openai.server_state import ServerState
from tests.entrypoints.test_serving_pipeline import FakeAsyncEngine, error_of, sse_events

POLICY_LOGGER = "pagoda.entrypoints.openai.protocol.field_policy"
CHAT = [{"role": "user", "content": "Hi"}]


def sdk_fields(params_module) -> set[str]:
    """The request fields the SDK can send: its base TypedDict's, plus `stream`."""
    return (set(params_module.CompletionCreateParamsBase.__annotations__)
            | set(params_module.CompletionCreateParamsNonStreaming.__annotations__))


# A value for every field of OpenAI's chat schema, as a client would send it; the refused
# ones with a value Pagoda must refuse. The test below fails when the SDK grows a field.
CHAT_VALUES = {
    "messages": CHAT, "model": "m", "frequency_penalty": 0.5, "logit_bias": {"5": 1},
    "logprobs": True, "top_logprobs": 2, "max_completion_tokens": 2, "max_tokens": 2, "n": 1,
    "parallel_tool_calls": False, "presence_penalty": 0.1, "response_format": {"type": "text"},
    "seed": 3, "stop": ["\n"], "stream": False, "stream_options": None, "temperature": 0.5,
    "tool_choice": "none", "top_p": 0.9, "reasoning_effort": "low",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    # ignored
    "metadata": {"team": "a"}, "store": True, "service_tier": "auto", "user": "u-1",
    "prompt_cache_key": "k", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}, "safety_identifier": "s",
    "verbosity": "low", "prediction": {"type": "content", "content": "Hello"},
    "web_search_options": {"search_context_size": "low"},
    # refused
    "audio": {"voice": "alloy", "format": "mp3"}, "modalities": ["text", "audio"],
    "functions": [{"name": "f"}], "function_call": {"name": "f"},
    "moderation": {"model": "omni-moderation-latest"},
}
COMPLETION_VALUES = {
    "prompt": "Hi", "model": "m", "best_of": 3, "echo": True, "frequency_penalty": 0.5,
    "logit_bias": {"5": 1}, "logprobs": 2, "max_tokens": 2, "n": 1, "presence_penalty": 0.1,
    "seed": 3, "stop": "\n", "stream": False, "stream_options": None, "suffix": "!",
    "temperature": 0.5, "top_p": 0.9, "user": "u-1",
}
IGNORED_CHAT_VALUES = {name: CHAT_VALUES[name] for name in CHAT_FIELDS.ignored if "." not in name}


@pytest.fixture
def engine() -> FakeAsyncEngine:
    return FakeAsyncEngine()


@pytest.fixture
def client(engine):
    app = build_app(ServerState(models=[ServedModel("m", engine, "/m")]))
    with TestClient(app) as client:
        yield client


def policy_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == POLICY_LOGGER and r.levelno == logging.WARNING]


@pytest.mark.parametrize(("policy", "request_type", "params_module"), [
    (CHAT_FIELDS, ChatCompletionRequest, chat_params),
    (COMPLETION_FIELDS, CompletionRequest, completion_params),
])
def test_the_tables_are_the_sdks_fields_each_of_one_kind_and_declared(
        policy: FieldPolicy, request_type, params_module) -> None:
    assert policy.openai_fields == sdk_fields(params_module)
    kinds = [policy.honoured, {n for n in policy.ignored if "." not in n}, policy.refused]
    assert sum(map(len, kinds)) == len(policy.openai_fields)  # no field of two kinds
    assert policy.openai_fields <= set(request_type.model_fields)
    assert request_type.field_policy is policy
    for path in policy.ignored:  # nested ones name fields the models declare
        if "." in path:
            parent, name = path.split(".")
            assert parent == "stream_options" and name in StreamOptions.model_fields
    sdk_stream_options = set(stream_options_param.ChatCompletionStreamOptionsParam.__annotations__)
    assert sdk_stream_options <= set(StreamOptions.model_fields)
    # The values below cover the schema exactly (a new SDK field fails here first).
    assert set(CHAT_VALUES) == sdk_fields(chat_params)
    assert set(COMPLETION_VALUES) == sdk_fields(completion_params)


def test_reasoning_effort_is_honoured_not_warned_about() -> None:
    assert "reasoning_effort" in CHAT_FIELDS.honoured
    request = ChatCompletionRequest.model_validate({"messages": CHAT, "reasoning_effort": "high"})
    assert CHAT_FIELDS.ignored_in(request) == []


def test_every_openai_field_parses_and_only_the_refused_ones_are_refused() -> None:
    chat = ChatCompletionRequest.model_validate(CHAT_VALUES)
    assert {name for name, _ in chat.unsupported_fields()} == CHAT_FIELDS.refused
    completion = CompletionRequest.model_validate(COMPLETION_VALUES)
    assert {name for name, _ in completion.unsupported_fields()} == COMPLETION_FIELDS.refused
    honoured = {name: CHAT_VALUES[name] for name in CHAT_FIELDS.honoured}
    assert ChatCompletionRequest.model_validate(honoured).unsupported_fields() == []
    # Values that ask nothing beyond what Pagoda does pass.
    modest = {"messages": CHAT, "modalities": ["text"], "function_call": "auto",
              "audio": None, "functions": None, "moderation": None}
    assert ChatCompletionRequest.model_validate(modest).unsupported_fields() == []
    assert CompletionRequest.model_validate(
        {"prompt": "x", "n": 2, "best_of": 2, "suffix": None}).unsupported_fields() == []


def test_ignored_fields_sent_by_the_sdk_are_named_in_one_warning_line(client, caplog) -> None:
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client,
                        max_retries=0)
    caplog.set_level(logging.WARNING, logger=POLICY_LOGGER)
    response = sdk.chat.completions.create(
        model="m", messages=CHAT, max_completion_tokens=2, reasoning_effort="low",
        stream_options=None, **IGNORED_CHAT_VALUES)
    assert response.choices[0].message.content == "aa"
    names = sorted(IGNORED_CHAT_VALUES)
    assert policy_warnings(caplog) == [
        "POST /v1/chat/completions: ignored fields without meaning here: " + ", ".join(names)]

    caplog.clear()  # one line per request, none without ignored fields, nulls are not set
    sdk.chat.completions.create(model="m", messages=CHAT, max_tokens=2, user="u",
                                verbosity="high", stream=True,
                                stream_options={"include_obfuscation": False})
    sdk.chat.completions.create(model="m", messages=CHAT, max_tokens=2, store=None)
    sdk.completions.create(model="m", prompt="Hi", max_tokens=2, user="u")
    assert policy_warnings(caplog) == [
        ("POST /v1/chat/completions: ignored fields without meaning here: "
         "stream_options.include_obfuscation, user, verbosity"),
        "POST /v1/completions: ignored fields without meaning here: user"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": {"name": "f"}}, "function_call"),
    ("/v1/chat/completions", {"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"suffix": "!"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_fields_pagoda_cannot_honour_are_400s_naming_them(client, engine, path, body, param):
    base = {"messages": CHAT} if "chat" in path else {"prompt": "Hi"}
    error = error_of(client.post(path, json={**base, "max_tokens": 2, **body}))
    assert (error["param"], error["code"]) == (param, "unsupported_parameter")
    assert param in error["message"]
    assert engine.added == []


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": CHAT, "made_up_field": 1}, "made_up_field"),
    ("/v1/chat/completions", {"messages": CHAT, "suffix": "!"}, "suffix"),  # completions'
    ("/v1/completions", {"prompt": "Hi", "store": True}, "store"),  # only chat's schema
    ("/v1/completions", {"prompt": "Hi", "verbosity": "low"}, "verbosity"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"made_up": True}},
     "stream_options.made_up"),
])
def test_fields_in_no_schema_are_400s_naming_them(client, path, body, param) -> None:
    error = error_of(client.post(path, json=body))
    assert (error["param"], error["code"]) == (param, "unknown_parameter")
    assert error["message"].startswith(f"{param}: unknown field")


def test_the_sdk_sees_a_made_up_field_refused_by_name(client) -> None:
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client,
                        max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.chat.completions.create(model="m", messages=CHAT, extra_body={"temprature": 0})
    assert raised.value.body["param"] == "temprature"
    assert raised.value.body["code"] == "unknown_parameter"


# ---- vLLM's extras ------------------------------------------------------------------------


CONTINUED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def test_chat_echo_starts_the_answer_with_the_assistant_message_it_continues(client) -> None:
    body = client.post("/v1/chat/completions", json={
        "messages": CONTINUED, "max_tokens": 2, "n": 2, "echo": True}).json()
    assert [c["message"]["content"] for c in body["choices"]] == ["Helloaa", "Hellobb"]
    assert body["usage"]["completion_tokens"] == 4  # the echo is not generated
    events = sse_events(client.post("/v1/chat/completions", json={
        "messages": CONTINUED, "max_tokens": 2, "echo": True, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[:2] == [{"role": "assistant", "content": ""}, {"content": "Hello"}]
    assert "".join(d.get("content", "") for d in deltas) == "Helloaa"
    # Only an assistant message is continued; echo false sends nothing extra.
    for messages, echo in [(CHAT, True), (CONTINUED, False)]:
        body = client.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 2, "echo": echo}).json()
        assert body["choices"][0]["message"]["content"] == "aa"


def test_return_tokens_as_token_ids(client) -> None:
    chat = client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 1,
        "return_tokens_as_token_ids": True}).json()
    entry = chat["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == f"token_id:{ord('a')}"
    assert entry["bytes"] == list(f"token_id:{ord('a')}".encode())
    assert [t["token"] for t in entry["top_logprobs"]] == [f"token_id:{ord('a')}"]
    events = sse_events(client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 2, "logprobs": True, "stream": True,
        "return_tokens_as_token_ids": True}))
    streamed = [t["token"] for e in events if e["choices"][0].get("logprobs")
                for t in e["choices"][0]["logprobs"]["content"]]
    assert streamed == [f"token_id:{ord('a')}"] * 2

    completion = client.post("/v1/completions", json={
        "prompt": "Hey", "max_tokens": 2, "echo": True, "logprobs": 0,
        "return_tokens_as_token_ids": True}).json()
    logprobs = completion["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{ord(c)}" for c in "Heyaa"]
    assert logprobs["top_logprobs"][3] == {f"token_id:{ord('a')}": -0.25}
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4]  # offsets still count the text
    assert completion["choices"][0]["text"] == "Heyaa"


def test_prompt_logprobs_have_vllms_shape(client, engine) -> None:
    def expected(prompt: str) -> list:
        return [None] + [{str(ord(c)): {"logprob": -1.0, "rank": 1, "decoded_token": c}}
                         for c in prompt[1:]]

    completion = client.post("/v1/completions", json={
        "prompt": ["Hey", "Yo"], "max_tokens": 1, "n": 2, "prompt_logprobs": 0}).json()
    assert [c["prompt_logprobs"] for c in completion["choices"]] == [
        expected("Hey"), expected("Hey"), expected("Yo"), expected("Yo")]
    assert engine.added[0].params.prompt_logprobs == 0
    # echo + logprobs asks the engine for the larger number of alternatives
    client.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 1, "echo": True,
                                         "logprobs": 3, "prompt_logprobs": 1})
    assert engine.added[-1].params.prompt_logprobs == 3

    chat = client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 1, "prompt_logprobs": 2}).json()
    assert chat["prompt_logprobs"] == expected("<user>Hi<assistant>")
    assert "prompt_logprobs" not in chat["choices"][0]
    plain = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain  # only when asked
    error = error_of(client.post("/v1/completions", json={"prompt": "x", "prompt_logprobs": 21}))
    assert error["param"] == "prompt_logprobs"
