"""The serving pipeline in-process, against a fake async engine (no model, no server process):
errors become 400s from the typed error's param and code, each endpoint's shapes, usage,
choice numbering, echo, SSE framing, and that every engine request ends finished or aborted.
The same behaviour on the real model: test_server_openai.py and test_server_errors.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from pagoda.engine.core.input_processor import EngineRequest, InputProcessor
from pagoda.engine.loop.request_stream import EngineStepError, QueueFullError, RequestStream
from pagoda.entrypoints.openai.model_registry import ServedModel
from pagoda.entrypoints.openai.server import build_app
from pagoda.entrypoints.openai.server_state import ServerState
from pagoda.errors import InvalidRequestError
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput

VOCAB = 1000
MAX_MODEL_LEN = 64
FIRST_TOKEN = ord("a")
"""Choice j of every request generates chr(FIRST_TOKEN + j) once per step."""


class FakeTokenizer:
    """One token per character (its code point); the template tags roles."""

    chat_template = "fake"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(t) for t in token_ids)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [chr(t) for t in token_ids]

    def apply_chat_template(self, messages, chat_template=None, tokenize=False,
                            add_generation_prompt=True, **template_kwargs) -> str:
        # (template_kwargs: variables for a template, e.g. reasoning_effort; this one has none)
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeAsyncEngine:
    """The async engine's interface; each request runs `max_tokens` steps, one token each."""

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.vocab_size = VOCAB
        self.max_model_len = MAX_MODEL_LEN
        self.input_processor = InputProcessor(self.tokenizer, VOCAB, MAX_MODEL_LEN)
        self.is_alive = True
        self.added: list[EngineRequest] = []
        self.aborted: list[str] = []
        self.queue_full_after: int | None = None
        """Refuse (QueueFullError) every request after this many were added."""
        self.fail_at_step: int | None = None
        """Fail every stream with EngineStepError at this step."""

    def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    def check_queue(self, num_seqs: int) -> None:
        pass

    async def add_request(self, request: EngineRequest) -> RequestStream:
        if self.queue_full_after is not None and len(self.added) >= self.queue_full_after:
            raise QueueFullError("the server is at capacity: the queue holds at most 0")
        self.added.append(request)
        stream = RequestStream(request.request_id, request.params.n)
        asyncio.get_running_loop().create_task(self._run(request, stream))
        return stream

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def synchronize(self) -> None:
        pass  # (aborts take effect at once here)

    async def _run(self, request: EngineRequest, stream: RequestStream) -> None:
        params = request.params
        completions = [CompletionOutput(index=j) for j in range(params.n)]
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [{t: Logprob(-1.0, 1, chr(t))}
                                        for t in request.prompt_token_ids[1:]]
        for step in range(1, request.max_tokens + 1):
            await asyncio.sleep(0)
            if request.request_id in self.aborted:
                return
            if step == self.fail_at_step:
                stream.put(EngineStepError("the engine failed while running this request"))
                return
            for j, c in enumerate(completions):
                token = FIRST_TOKEN + j
                c.token_ids = c.token_ids + [token]
                c.text += chr(token)
                c.delta_text, c.delta_token_ids = chr(token), [token]
                if params.logprobs is not None:
                    c.delta_logprobs = [{token: Logprob(-0.25, 1, chr(token))}]
                    c.logprobs = (c.logprobs or []) + c.delta_logprobs
                if step == request.max_tokens:
                    c.finish_reason = "length"
            finished = step == request.max_tokens
            stream.put(RequestOutput(
                request.request_id, request.prompt, request.prompt_token_ids,
                [CompletionOutput(**vars(c)) for c in completions], finished,
                prompt_logprobs=prompt_logprobs,
            ))


@pytest.fixture
def engine() -> FakeAsyncEngine:
    return FakeAsyncEngine()


@pytest.fixture
def client(engine):
    app = build_app(ServerState(models=[ServedModel("m", engine, "/m")]))
    with TestClient(app) as client:
        yield client


def error_of(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def sse_events(response) -> list:
    assert response.status_code == 200, response.text
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_sampling_param_errors_speak_the_endpoints_field_names(client):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    error = error_of(client.post("/v1/chat/completions",
                                 json={**chat, "logprobs": True, "top_logprobs": 30}))
    assert error["message"] == "top_logprobs must be an int in [0, 20] or None, got 30"
    assert (error["param"], error["code"]) == ("top_logprobs", "invalid_value")
    error = error_of(client.post("/v1/chat/completions",
                                 json={**chat, "max_completion_tokens": 100}))
    assert (error["param"], error["code"]) == ("max_completion_tokens", "context_length_exceeded")
    assert "messages" in error["message"] and "100" in error["message"]
    error = error_of(client.post("/v1/completions", json={"prompt": "Hi", "logprobs": 30}))
    assert error["message"] == "logprobs must be an int in [0, 20] or None, got 30"
    assert error["param"] == "logprobs"


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"prompt": ["ab", ""]}, "prompt[1]", "invalid_value"),
    ({"prompt": [[5], [VOCAB]]}, "prompt[1]", "invalid_value"),
    ({"prompt": "x" * MAX_MODEL_LEN}, "prompt", "context_length_exceeded"),
    ({"prompt": "Hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens", "context_length_exceeded"),
    ({"prompt": "Hi", "logit_bias": {str(VOCAB): 1}}, "logit_bias", "invalid_value"),
    ({"prompt": "Hi", "logit_bias": {"x": 1}}, "logit_bias", "invalid_value"),
    ({"prompt": "Hi", "stop_token_ids": [VOCAB]}, "stop_token_ids", "invalid_value"),
    ({"prompt": "Hi", "n": 129}, "n", "invalid_value"),
    ({"prompt": "Hi", "suffix": "x"}, "suffix", "unsupported_parameter"),
])
def test_completion_errors(client, engine, body, param, code):
    error = error_of(client.post("/v1/completions", json=body))
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert engine.added == []  # refused before the engine saw anything


def test_the_error_is_mapped_from_its_fields_not_its_text(client, engine, monkeypatch):
    def refuse(*args, **kwargs):
        raise InvalidRequestError("Something the server must pass on as it is.", "weird_field",
                                  "some_code")

    monkeypatch.setattr(engine.input_processor, "process", refuse)
    error = error_of(client.post("/v1/completions", json={"prompt": "Hi"}))
    assert error == {"message": "Something the server must pass on as it is.",
                     "type": "invalid_request_error", "param": "weird_field", "code": "some_code"}


def test_completion_choices_are_numbered_per_prompt_and_counted(client, engine):
    response = client.post("/v1/completions", json={
        "prompt": [[5, 6], [7, 8, 9]], "n": 2, "max_tokens": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "aaa"), (1, "bbb"), (2, "aaa"), (3, "bbb")]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    assert [r.request_id for r in engine.added] == [f"{body['id']}-0", f"{body['id']}-1"]
    assert engine.aborted == []  # both finished: nothing to abort


def test_completion_echo_with_logprobs(client):
    body = client.post("/v1/completions", json={
        "prompt": "Hey", "max_tokens": 2, "echo": True, "logprobs": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == "Heyaa"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == list("Heyaa")
    assert logprobs["token_logprobs"] == [None, -1.0, -1.0, -0.25, -0.25]
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4]


def test_completion_stream_with_usage_and_echo(client):
    response = client.post("/v1/completions", json={
        "prompt": ["x", "yz"], "max_tokens": 2, "echo": True, "stream": True,
        "stream_options": {"include_usage": True}})
    events = sse_events(response)
    texts = ["", ""]
    for event in events[:-1]:
        assert event["object"] == "text_completion" and event["usage"] is None
        [choice] = event["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == ["xaa", "yzaa"]
    assert events[-1]["choices"] == []
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_continuous_usage_stats_put_usage_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (GuideLLM and AIPerf send it with
    include_usage): each chunk's usage counts the tokens so far, the last one all of them."""
    response = client.post("/v1/completions", json={
        "prompt": ["x", "yz"], "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = sse_events(response)
    counts = [event["usage"]["completion_tokens"] for event in events]
    assert all(event["usage"]["prompt_tokens"] == 3 for event in events)
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 4
    assert events[-1]["choices"] == []
    without = sse_events(client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 2, "stream": True,
        "stream_options": {"continuous_usage_stats": True}}))  # (needs include_usage)
    assert all("usage" not in event for event in without)


def test_chat_response_and_stream(client, engine):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 2,
            "logprobs": True, "top_logprobs": 0}
    body = client.post("/v1/chat/completions", json=chat).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c["message"] for c in body["choices"]] == [
        {"role": "assistant", "content": "aa", "refusal": None},
        {"role": "assistant", "content": "bb", "refusal": None}]
    assert [t["token"] for t in body["choices"][1]["logprobs"]["content"]] == ["b", "b"]
    prompt = "<user>Hi<assistant>"
    assert engine.added[0].prompt_token_ids == [ord(c) for c in prompt]
    assert engine.added[0].request_id == body["id"]
    assert body["usage"]["prompt_tokens"] == len(prompt)

    events = sse_events(client.post("/v1/chat/completions", json={**chat, "stream": True}))
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in events)
    assert [e["choices"][0]["delta"] for e in events[:2]] == [
        {"role": "assistant", "content": ""}] * 2
    content = {0: "", 1: ""}
    for event in events[2:]:
        content[event["choices"][0]["index"]] += event["choices"][0]["delta"]["content"]
    assert content == {0: "aa", 1: "bb"}
    assert [e["choices"][0]["finish_reason"] for e in events[-2:]] == ["length", "length"]


def test_a_refused_prompt_aborts_the_ones_already_added(client, engine):
    engine.queue_full_after = 1
    response = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 50})
    error = error_of(response, 503)
    assert error["code"] == "server_overloaded" and "at most 0" in error["message"]
    assert response.headers["Retry-After"] == "1"
    assert engine.aborted == [engine.added[0].request_id]


def test_engine_failure_mid_request(client, engine):
    engine.fail_at_step = 2
    error = error_of(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 5}), 500)
    assert error["type"] == "server_error" and "engine failed" in error["message"]
    response = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True})
    events = sse_events(response)
    assert events[-2]["choices"][0]["delta"] == {"content": "a"}
    assert events[-1]["error"]["type"] == "server_error"
