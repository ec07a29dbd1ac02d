"""POST /v1/responses and the stored responses' routes in-process, through the openai SDK,
against the fake async engine of test_serving_pipeline.py (each request answers `a` once per
token until max_tokens: always cut, so "incomplete"): the conversation the chat template
sees (items, instructions, previous_response_id), the store (GET, DELETE, input_items, the
bound, the expiry, store false), truncation "auto", engine failures, and bad requests as 400s
naming the Responses field. The same on the real model: test_server_responses.py."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from pagoda.engine.core.input_processor import InputProcessor
from pagoda.entrypoints.openai.model_registry import ServedModel
from pagoda.entrypoints.openai.responses_api.store import ResponseStore
from pagoda.entrypoints.openai.server import build_app
from pagoda.entrypoints.openai.server_state import ServerState
from tests.entrypoints.test_serving_pipeline import VOCAB, FakeAsyncEngine


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


MAX_LEN = 1024
"""The fake engine's context here (tools in the prompt need room); requests give
max_output_tokens, as the fake answers until max_tokens."""


@pytest.fixture
def engine() -> FakeAsyncEngine:
    engine = FakeAsyncEngine()
    engine.max_model_len = MAX_LEN
    engine.input_processor = InputProcessor(engine.tokenizer, VOCAB, MAX_LEN)
    return engine


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def http(engine, clock):
    state = ServerState(models=[ServedModel("m", engine, "/m")],
                        responses_store=ResponseStore(3, 60.0, clock=clock))
    with TestClient(build_app(state)) as http:
        yield http


@pytest.fixture
def client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http,
                         max_retries=0)


def prompt_of(engine: FakeAsyncEngine) -> str:
    return engine.added[-1].prompt


def error_of(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_a_response_whole_and_streamed_and_stored(client, engine):
    response = client.responses.create(model="m", input="Hi", max_output_tokens=4)
    assert prompt_of(engine) == "<user>Hi<assistant>"
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == "aaaa" and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        len("<user>Hi<assistant>"), 4)
    assert response.usage.total_tokens == response.usage.input_tokens + 4
    assert response.max_output_tokens == 4 and response.store is True
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()

    events = list(client.responses.create(model="m", input="Hi", max_output_tokens=3,
                                          stream=True))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 3,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        final.output_text) == "aaa"
    assert final.id == events[0].response.id
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    assert engine.aborted == []  # both answers ended by themselves


def test_items_and_instructions_become_the_conversation(client, engine):
    client.responses.create(model="m", instructions="Be brief.", max_output_tokens=1, input=[
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text", "text": "you"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello", "annotations": []}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "SECRET"}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
    ], tools=[{"type": "function", "name": "f", "parameters": {"type": "object"},
               "strict": None}])
    prompt = prompt_of(engine)
    pieces = ["<system>Be brief.", "<system>Rules.", "<user>Hi you", "<assistant>Hello",
              '"name": "f", "arguments": {"x": 1}', "<user><tool_response>\n42\n</tool_response>"]
    positions = [prompt.find(piece) for piece in pieces]
    assert -1 not in positions and positions == sorted(positions), prompt
    assert prompt.endswith("</tool_response><assistant>")
    assert "SECRET" not in prompt  # reasoning items are not part of the prompt


def test_previous_response_id_continues_the_stored_conversation(client, engine):
    first = client.responses.create(model="m", input="One", instructions="Sys",
                                    max_output_tokens=2)
    second = client.responses.create(model="m", input="Two", previous_response_id=first.id,
                                     max_output_tokens=2)
    assert prompt_of(engine) == "<user>One<assistant>aa<user>Two<assistant>"  # no "Sys"
    assert second.previous_response_id == first.id
    client.responses.delete(first.id)  # the chain outlives the responses it came from
    client.responses.create(model="m", input="Three", previous_response_id=second.id,
                            max_output_tokens=1)
    assert prompt_of(engine) == "<user>One<assistant>aa<user>Two<assistant>aa<user>Three<assistant>"
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model="m", input="x", previous_response_id=first.id)
    assert error.value.body["param"] == "previous_response_id"
    assert error.value.body["code"] == "previous_response_not_found"


def test_get_delete_and_input_items(client, http):
    response = client.responses.create(model="m", max_output_tokens=1, input=[
        {"role": "user", "content": "a"}, {"role": "user", "content": "b"},
        {"role": "user", "content": [{"type": "input_text", "text": "c"}], "id": "msg_c"}])
    items = client.responses.input_items.list(response.id, order="asc")
    assert [item.content[0].text for item in items.data] == ["a", "b", "c"]
    assert items.data[2].id == "msg_c" and all(item.id.startswith("msg_") for item in items.data)
    assert [i.content[0].text for i in client.responses.input_items.list(response.id).data] == [
        "c", "b", "a"]  # newest first by default, as OpenAI
    page = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["a", "b"] and page.has_more
    rest = client.responses.input_items.list(response.id, order="asc", after=page.data[1].id)
    assert [i.content[0].text for i in rest.data] == ["c"] and not rest.has_more
    assert error_of(http.get(f"/v1/responses/{response.id}/input_items?limit=0"))[
        "param"] == "limit"
    assert error_of(http.get(f"/v1/responses/{response.id}/input_items?order=up"))[
        "param"] == "order"

    deleted = http.delete(f"/v1/responses/{response.id}")
    assert deleted.json() == {"id": response.id, "object": "response.deleted", "deleted": True}
    for method in ("get", "delete"):
        error = error_of(http.request(method, f"/v1/responses/{response.id}"), 404)
        assert (error["param"], error["code"]) == ("response_id", "response_not_found")
    error_of(http.get(f"/v1/responses/{response.id}/input_items"), 404)

    unstored = client.responses.create(model="m", input="x", max_output_tokens=1, store=False)
    assert unstored.store is False
    error_of(http.get(f"/v1/responses/{unstored.id}"), 404)


def test_the_store_keeps_the_newest_until_they_expire(client, http, clock):
    ids = [client.responses.create(model="m", input=str(i), max_output_tokens=1).id
           for i in range(4)]  # the store holds 3
    assert [http.get(f"/v1/responses/{i}").status_code for i in ids] == [404, 200, 200, 200]
    clock.now += 59
    later = client.responses.create(model="m", input="x", max_output_tokens=1).id
    clock.now += 2  # ids[1:] are now 61 s old (ttl 60), `later` 2 s
    assert [http.get(f"/v1/responses/{i}").status_code for i in ids] == [404] * 4
    assert http.get(f"/v1/responses/{later}").status_code == 200
    error = error_of(http.post("/v1/responses", json={
        "input": "x", "previous_response_id": ids[3], "max_output_tokens": 1}), 404)
    assert error["param"] == "previous_response_id"


def test_truncation_auto_drops_the_oldest_items_until_the_input_fits(client, http, engine):
    turns = [{"role": "user", "content": word * 200} for word in "bcdefg"]
    body = {"input": turns, "max_output_tokens": 2}
    error = error_of(http.post("/v1/responses", json=body))
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded")
    assert "messages" not in error["message"]
    response = client.responses.create(model="m", truncation="auto", **body)
    prompt = prompt_of(engine)
    assert len(prompt) + 2 <= MAX_LEN and prompt.endswith("<user>" + "g" * 200 + "<assistant>")
    assert prompt.count("<user>") == 4  # the fewest dropped: one more would not fit
    assert response.truncation == "auto"


def test_logprobs_when_included(client):
    response = client.responses.create(model="m", input="Hi", max_output_tokens=2,
                                       include=["message.output_text.logprobs"], top_logprobs=1)
    logprobs = response.output[0].content[0].logprobs
    assert [(lp.token, lp.logprob) for lp in logprobs] == [("a", -0.25), ("a", -0.25)]
    plain = client.responses.create(model="m", input="Hi", max_output_tokens=2)
    assert plain.output[0].content[0].logprobs == []


def test_an_engine_failure_is_a_500_or_a_failed_event(http, client, engine):
    engine.fail_at_step = 2
    error = error_of(http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 4}),
                     500)
    assert error["type"] == "server_error"
    events = list(client.responses.create(model="m", input="Hi", max_output_tokens=4,
                                          stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "server_error"
    assert events[-1].response.output_text == "a"  # what came before the failure
    assert client.responses.retrieve(events[-1].response.id).status == "failed"


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"input": "x", "bogus": 1}, "bogus", "unknown_parameter"),
    ({"input": 5}, "input", "invalid_value"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]", "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]", "invalid_value"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c"}]},
     "input[1].name", "invalid_type"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "c", "output": "1"}]},
     "input[1].call_id", "invalid_value"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}],
      "tools": [{"type": "function", "name": "f"}]}, "input[0].arguments", "invalid_value"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "invalid_value"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]", "invalid_value"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
     "tools[0].parameters", "invalid_value"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", "invalid_value"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "invalid_value"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}},
     "text.format.schema", "invalid_type"),
    ({"input": "x", "max_output_tokens": MAX_LEN}, "max_output_tokens",
     "context_length_exceeded"),
    ({"input": "x", "temperature": -1}, "temperature", "invalid_value"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"input": "x", "background": True}, "background", "unsupported_parameter"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"input": "x", "include": ["everything"]}, "include[0]", "invalid_type"),
    ({"input": [{"type": []}]}, "input[0]", "invalid_value"),  # types of any JSON type
    ({"input": [{"role": "user", "content": [{"type": {"a": 1}}]}]}, "input[0].content[0]",
     "invalid_value"),
    ({"input": "x", "tools": [{"type": ["function"]}]}, "tools[0]", "invalid_value"),
    ({"input": "x", "text": {"format": {"type": 1}}}, "text.format", "invalid_value"),
    ({"input": "x", "tool_choice": {"type": []}}, "tool_choice", "invalid_value"),
])
def test_bad_requests_are_400s_naming_the_responses_field(http, engine, body, param, code):
    error = error_of(http.post("/v1/responses", json=body))
    assert (error["param"], error["type"]) == (param, "invalid_request_error"), error
    assert error["code"] == code, error
    if code != "context_length_exceeded":  # chat's message names no field
        assert error["message"].startswith(param), error
    assert engine.added == []


def test_fields_openai_clients_send_are_accepted(http):
    body = {"input": "x", "max_output_tokens": 1, "include": ["reasoning.encrypted_content"],
            "reasoning": {"effort": "low", "summary": "auto"}, "user": "u",
            "metadata": {"k": "v"}, "service_tier": "auto", "prompt_cache_key": "p",
            "safety_identifier": "s", "store": True, "truncation": "disabled",
            "parallel_tool_calls": True, "text": {"format": {"type": "text"},
                                                  "verbosity": "low"},
            "stream_options": {"include_obfuscation": False}, "max_tool_calls": 3}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    echoed = response.json()
    assert echoed["metadata"] == {"k": "v"} and echoed["reasoning"]["effort"] == "low"
    assert echoed["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    assert echoed["user"] == "u" and echoed["max_tool_calls"] == 3


def test_an_unknown_model_is_a_404(http):
    error = error_of(http.post("/v1/responses", json={"input": "x", "model": "other",
                                                      "max_output_tokens": 1}), 404)
    assert error["code"] == "model_not_found"


def test_the_routes_need_the_api_key(engine):
    state = ServerState(models=[ServedModel("m", engine, "/m")],
                        api_key="k")
    with TestClient(build_app(state)) as http:
        for method, path in [("post", "/v1/responses"), ("get", "/v1/responses/resp_1"),
                             ("delete", "/v1/responses/resp_1"),
                             ("get", "/v1/responses/resp_1/input_items")]:
            response = http.request(method, path, content=json.dumps({"input": "x"}))
            assert response.status_code == 401, (method, path)


@pytest.mark.parametrize(("flags", "fragment"), [
    (["--responses-store-size", "-1"], "--responses-store-size must be >= 0"),
    (["--responses-store-ttl", "0"], "--responses-store-ttl must be > 0"),
    (["--responses-store-ttl", "nan"], "--responses-store-ttl must be > 0"),
])
def test_bad_store_flags_are_one_line_errors_before_anything_loads(capsys, flags, fragment):
    from pagoda.cli.main import EXIT_USAGE, main

    assert main(["serve", *flags]) == EXIT_USAGE
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"pagoda: error: {fragment}"), line


def test_a_store_of_size_zero_keeps_nothing(engine):
    state = ServerState(models=[ServedModel("m", engine, "/m")],
                        responses_store=ResponseStore(0))
    with TestClient(build_app(state)) as http:
        response = http.post("/v1/responses", json={"input": "x", "max_output_tokens": 1})
        assert response.status_code == 200 and response.json()["store"] is True
        error_of(http.get(f"/v1/responses/{response.json()['id']}"), 404)
