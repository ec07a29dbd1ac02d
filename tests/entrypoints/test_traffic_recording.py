"""`pagoda serve --record-traffic FILE [--record-redact]` (pagoda/entrypoints/openai/
traffic_recorder.py): the middleware on a tiny app (timings, usage, a failing file), then a real
server on the bundled model recording streamed and whole requests of both endpoints, redacted
or not, and the flags' one-line errors."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest

from pagoda.entrypoints.openai.protocol.responses import UsageInfo
from pagoda.entrypoints.openai.serving.pipeline import USAGE_STATE
from pagoda.entrypoints.openai.traffic_recorder import (
    TrafficRecorder,
    TrafficRecorderMiddleware,
    carries_output,
)
from pagoda.traffic_record import TrafficEntry, read_traffic
from tests.entrypoints.server_helpers import MODEL_NAME, RemoteServer
from tests.entrypoints.test_cli import assert_one_line_error, run_cli

# ---- the middleware on a tiny app --------------------------------------------------------------

CHUNK_DELAY_S = 0.05


async def tiny_chat_app(scope, receive, send) -> None:
    """Reads the body, answers a stream: chat's opening role delta, one content delta, [DONE]
    (CHUNK_DELAY_S apart), leaving its usage where the serving pipeline does."""
    while (await receive()).get("more_body"):
        pass
    scope.setdefault("state", {})[USAGE_STATE] = UsageInfo(prompt_tokens=11, completion_tokens=1,
                                            total_tokens=12)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
    for delta in ({"role": "assistant", "content": ""}, {"content": "Hi"}):
        await asyncio.sleep(CHUNK_DELAY_S)
        event = json.dumps({"choices": [{"index": 0, "delta": delta}]})
        await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode(),
                    "more_body": True})
    await asyncio.sleep(CHUNK_DELAY_S)
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def post_all(app, bodies: list[bytes], path: str = "/v1/chat/completions") -> None:
    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for body in bodies:
                await client.post(path, content=body)

    asyncio.run(run())


def test_the_middleware_times_a_stream_and_reads_the_pipelines_usage(tmp_path) -> None:
    path = str(tmp_path / "traffic.jsonl")
    recorder = TrafficRecorder(path)
    app = TrafficRecorderMiddleware(tiny_chat_app, recorder)
    body = {"messages": [{"role": "user", "content": "hello"}], "stream": True}
    post_all(app, [json.dumps(body).encode(), b"not json", json.dumps(body).encode()])
    post_all(app, [b"{}"], path="/v1/models")  # not a recorded route
    recorder.close()
    first, second = read_traffic(path)  # the non-JSON body is not recorded
    assert first.arrival == 0.0 < second.arrival
    assert first.endpoint == "chat" and first.body == body and first.status == 200
    assert (first.prompt_tokens, first.output_tokens) == (11, 1)
    # ttft is the content delta (the second chunk), not the opening role delta
    assert 2 * CHUNK_DELAY_S <= first.ttft < first.latency
    assert first.latency >= 3 * CHUNK_DELAY_S and first.source == "pagoda serve"


def test_a_failing_record_file_warns_once_and_stops_recording(tmp_path, caplog) -> None:
    recorder = TrafficRecorder(str(tmp_path / "traffic.jsonl"))

    def broken(entry) -> None:
        raise OSError(28, "No space left on device")

    recorder.writer.write = broken
    with caplog.at_level(logging.WARNING):
        post_all(TrafficRecorderMiddleware(tiny_chat_app, recorder), [b"{}"] * 3)
        recorder.close()
    warnings = [r for r in caplog.records if "record-traffic" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    assert not recorder.enabled


def test_carries_output() -> None:
    def chunk(choice: dict) -> bytes:
        return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()

    assert not carries_output(chunk({"delta": {"role": "assistant", "content": ""}}))
    assert carries_output(chunk({"delta": {"content": " the"}}))
    assert carries_output(chunk({"delta": {"tool_calls": [{"index": 0}]}}))
    assert carries_output(chunk({"text": "x", "index": 0}))
    assert not carries_output(chunk({"text": "", "finish_reason": "length"}))
    assert not carries_output(b"data: [DONE]\n\n")


# ---- a real server -----------------------------------------------------------------------------

PROMPT = "The quick brown fox jumps over the lazy dog. Zanzibar parliament ostrich"
SECRET_WORDS = ("quick", "brown", "Zanzibar", "parliament", "ostrich", "Bartholomew")


def requests_of_each_kind() -> list[tuple[str, dict]]:
    messages = [{"role": "system", "content": "You are Bartholomew, a terse assistant."},
                {"role": "user", "content": PROMPT}]
    common = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0}
    usage = {"stream_options": {"include_usage": True}}
    return [
        ("completions", {**common, "prompt": PROMPT}),
        ("completions", {**common, "prompt": PROMPT, "stream": True, **usage}),
        ("chat", {**common, "messages": messages}),
        ("chat", {**common, "messages": messages, "stream": True, **usage}),
    ]


PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def send(server: RemoteServer, endpoint: str, body: dict) -> dict:
    """The usage the server answered (the stream's usage chunk, for a stream)."""
    response = httpx.post(server.url + PATHS[endpoint], json=body, timeout=120)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        return response.json()["usage"]
    events = [json.loads(line[5:]) for line in response.text.splitlines()
              if line.startswith("data:") and line != "data: [DONE]"]
    return [e for e in events if e.get("usage")][-1]["usage"]


def wait_for_lines(path, count: int, timeout: float = 30.0) -> list[TrafficEntry]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, encoding="utf-8") as f:
            if len(f.read().splitlines()) >= count:
                break
        time.sleep(0.1)
    return read_traffic(str(path))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(the record, the usages answered): a server recording 4 requests, a refused one and a
    body that is not JSON."""
    path = tmp_path_factory.mktemp("traffic") / "traffic.jsonl"
    with RemoteServer(["--record-traffic", str(path)]) as server:
        usages = [send(server, endpoint, body) for endpoint, body in requests_of_each_kind()]
        refused = httpx.post(server.url + "/v1/completions", timeout=60,
                             json={"prompt": "hi", "max_tokens": -1})
        assert refused.status_code == 400
        garbled = httpx.post(server.url + "/v1/completions", content=b"{oops", timeout=60)
        assert garbled.status_code == 400
        entries = wait_for_lines(path, 5)
    return entries, usages


@pytest.mark.slow
def test_every_request_is_recorded_with_the_servers_counts(recorded) -> None:
    entries, usages = recorded
    sent = requests_of_each_kind()
    assert len(entries) == 5  # not the body that is not JSON
    assert entries[0].arrival == 0.0
    assert [e.arrival for e in entries] == sorted(e.arrival for e in entries)
    for entry, (endpoint, body), usage in zip(entries, sent, usages):
        assert entry.endpoint == endpoint and entry.body == body and entry.status == 200
        assert entry.prompt_tokens == usage["prompt_tokens"]
        assert entry.output_tokens == usage["completion_tokens"] > 0
        assert entry.latency > 0 and entry.source == "pagoda serve"
        if body.get("stream"):
            assert 0 < entry.ttft <= entry.latency
        else:
            assert entry.ttft is None
    refused = entries[4]
    assert refused.status == 400 and refused.body["max_tokens"] == -1
    assert refused.prompt_tokens is None and refused.output_tokens is None


@pytest.fixture(scope="module")
def redacted(tmp_path_factory):
    """(the record, the usages answered, the redacted bodies' prompt tokens per /tokenize)."""
    path = tmp_path_factory.mktemp("redacted") / "traffic.jsonl"
    with RemoteServer(["--record-traffic", str(path), "--record-redact"]) as server:
        usages = [send(server, endpoint, body) for endpoint, body in requests_of_each_kind()]
        entries = wait_for_lines(path, 4)
        counts = []
        for entry in entries:
            field = "prompt" if entry.endpoint == "completions" else "messages"
            response = httpx.post(server.url + "/tokenize", timeout=60,
                                  json={"model": MODEL_NAME, field: entry.body[field]})
            counts.append(response.json()["count"])
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return entries, usages, counts, text


@pytest.mark.slow
def test_redacted_records_keep_counts_and_no_text(redacted) -> None:
    entries, usages, counts, text = redacted
    for word in SECRET_WORDS:
        assert word not in text
    sent = requests_of_each_kind()
    assert len(entries) == 4
    for entry, (endpoint, body), usage, count in zip(entries, sent, usages, counts):
        assert entry.prompt_tokens == usage["prompt_tokens"]
        assert entry.output_tokens == usage["completion_tokens"]
        assert abs(count - entry.prompt_tokens) <= 0.02 * entry.prompt_tokens
        kept = {k: v for k, v in body.items() if k not in ("prompt", "messages")}
        assert {k: v for k, v in entry.body.items() if k not in ("prompt", "messages")} == kept
        if endpoint == "chat":
            assert [m["role"] for m in entry.body["messages"]] == ["system", "user"]


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "fragment"), [
    (["--record-redact"], "--record-redact needs --record-traffic"),
    (["--record-traffic", "/nonexistent-folder/traffic.jsonl"], "no such folder"),
])
def test_bad_record_flags_are_one_line_errors(flags, fragment) -> None:
    assert_one_line_error(run_cli("serve", *flags), fragment)
