"""Chat's tool handling in-process, on a fake engine that writes scripted text one character
per step (no model): calls parsed out of "auto" output, whole and streamed (a chunk per
fragment, finish_reason "tool_calls", n > 1 parsed per choice), tools written into the
prompt (the fake template has no tool section: the Hermes fallback), and "none" leaving the
text alone. The same on the real model: test_server_tools.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from pagoda.engine.core.input_processor import EngineRequest, InputProcessor
from pagoda.engine.loop.request_stream import RequestStream
from pagoda.entrypoints.openai.model_registry import ServedModel
from pagoda.entrypoints.openai.server import build_app
from pagoda.entrypoints.openai.server_state import ServerState
from pagoda.outputs import CompletionOutput, RequestOutput
from tests.entrypoints.test_serving_pipeline import VOCAB, FakeAsyncEngine, sse_events

CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {
        "type": "string"}}}}}]
QUESTION = [{"role": "user", "content": "Time?"}]


class ScriptedEngine(FakeAsyncEngine):
    """Choice j writes scripts[j] (cycling through the list), one character per step, then
    stops ("stop")."""

    def __init__(self, scripts: list[str]) -> None:
        super().__init__()
        self.scripts = scripts
        self.max_model_len = 4096
        self.input_processor = InputProcessor(self.tokenizer, VOCAB, self.max_model_len)

    async def add_request(self, request: EngineRequest) -> RequestStream:
        self.added.append(request)
        stream = RequestStream(request.request_id, request.params.n)
        asyncio.get_running_loop().create_task(self._write(request, stream))
        return stream

    async def _write(self, request: EngineRequest, stream: RequestStream) -> None:
        n = request.params.n
        scripts = [self.scripts[j % len(self.scripts)] for j in range(n)]
        completions = [CompletionOutput(index=j) for j in range(n)]
        for step in range(max(len(s) for s in scripts)):
            await asyncio.sleep(0)
            for c, script in zip(completions, scripts):
                piece = script[step:step + 1]
                c.delta_text = piece
                c.delta_token_ids = [ord(piece)] if piece else []
                c.text += piece
                c.token_ids = c.token_ids + c.delta_token_ids
                if step + 1 >= len(script):
                    c.finish_reason = "stop"
            finished = all(c.finish_reason for c in completions)
            stream.put(RequestOutput(request.request_id, request.prompt,
                                     request.prompt_token_ids,
                                     [CompletionOutput(**vars(c)) for c in completions], finished))


def client_for(scripts: list[str]) -> tuple[TestClient, ScriptedEngine]:
    engine = ScriptedEngine(scripts)
    app = build_app(ServerState(models=[ServedModel("m", engine, "/m")]))
    return TestClient(app), engine


def test_auto_calls_are_parsed_out_of_the_text():
    client, engine = client_for(["Checking.\n" + CALL])
    with client:
        body = client.post("/v1/chat/completions", json={
            "messages": QUESTION, "tools": TOOLS, "max_tokens": 200}).json()
    prompt = engine.added[0].prompt
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in prompt
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}


def test_streamed_calls_come_as_fragments_one_per_chunk_per_choice():
    client, _ = client_for([CALL + "\n" + CALL, "No call here."])
    with client:
        response = client.post("/v1/chat/completions", json={
            "messages": QUESTION, "tools": TOOLS, "max_tokens": 200, "n": 2, "stream": True})
    chunks = [c["choices"][0] for c in sse_events(response)]
    fragments = [c["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["delta"]]
    assert all(len(f) == 1 for f in fragments)  # one fragment per chunk
    ids = [f[0].get("id") for f in fragments]
    assert [f[0]["index"] for f in fragments] == [0, 0, 1, 1]
    assert ids[0].startswith("call_") and ids[2].startswith("call_") and ids[1] is None
    assert fragments[0][0] == {"index": 0, "id": ids[0], "type": "function",
                               "function": {"name": "get_time", "arguments": ""}}
    assert fragments[1][0] == {"index": 0, "function": {"arguments": '{"zone": "UTC"}'}}
    texts = {0: "", 1: ""}
    reasons = {}
    for chunk in chunks:
        texts[chunk["index"]] += chunk["delta"].get("content") or ""
        if chunk["finish_reason"]:
            reasons[chunk["index"]] = chunk["finish_reason"]
    assert texts == {0: "", 1: "No call here."}
    assert reasons == {0: "tool_calls", 1: "stop"}
    assert all(c["index"] == 0 for c in chunks if "tool_calls" in c["delta"])


def test_without_parallel_tool_calls_only_the_first_call_is_kept():
    client, _ = client_for(["Two calls: " + CALL + CALL.replace("UTC", "CET")])
    with client:
        for parallel, zones in [(True, ["UTC", "CET"]), (False, ["UTC"])]:
            body = client.post("/v1/chat/completions", json={
                "messages": QUESTION, "tools": TOOLS, "max_tokens": 200,
                "parallel_tool_calls": parallel}).json()
            message = body["choices"][0]["message"]
            assert message["content"] == "Two calls:"
            assert [json.loads(c["function"]["arguments"])["zone"]
                    for c in message["tool_calls"]] == zones


def test_tool_choice_none_neither_offers_tools_nor_reads_calls():
    client, engine = client_for([CALL])
    with client:
        body = client.post("/v1/chat/completions", json={
            "messages": QUESTION, "tools": TOOLS, "tool_choice": "none",
            "max_tokens": 200}).json()
    assert "<tools>" not in engine.added[0].prompt
    choice = body["choices"][0]
    assert choice["message"]["content"] == CALL and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_history_with_calls_and_results_reaches_the_prompt(stream):
    client, engine = client_for(["It is noon."])
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    with client:
        response = client.post("/v1/chat/completions", json={
            "messages": history, "tools": TOOLS, "max_tokens": 200, "stream": stream})
    assert response.status_code == 200, response.text
    prompt = engine.added[0].prompt
    assert "<assistant>" + CALL + "<user><tool_response>\n12:00\n</tool_response>" in prompt
