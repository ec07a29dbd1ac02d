"""Start-up log, --chat-template, queue overflow (503 + Retry-After), and graceful shutdown
on SIGTERM: an in-flight request that fits in --shutdown-timeout completes, one that does not
ends with an error event, and the process exits 0. The server runs two sequences at a time
and queues none (--max-num-seqs 2 --max-queue 0). The shutdown test ends the server: it runs
last of those on the shared server. The engine-death test runs a server of its own."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests.entrypoints.server_helpers import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow


CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    with RemoteServer(["--max-num-seqs", "2", "--max-queue", "0", "--shutdown-timeout", "10",
                       "--served-model-name", "tiny", "--chat-template", str(template)]) as server:
        yield server


def long_stream(server: RemoteServer, max_tokens: int):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    return httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120)


def test_startup_log(server):
    log = server.log_text()
    assert f"http://127.0.0.1:{server.port}" in log
    assert "'tiny'" in log and "KV cache capacity" in log
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    assert MODEL_NAME in httpx.get(server.url + "/v1/models").json()["data"][0]["root"]


def test_chat_template_file(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = "[system] Be brief.\n[user] Hi\n[assistant]"
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    expected = httpx.post(server.url + "/tokenize", json={"prompt": rendered}).json()["tokens"]
    assert tokens == expected
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": messages, "max_tokens": 2})
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


def test_queue_overflow_gets_503_with_retry_after(server):
    with long_stream(server, 1000) as first, long_stream(server, 1000) as second:
        # Keep the line iterators: dropping one closes its connection (a disconnect).
        lines = [first.iter_lines(), second.iter_lines()]
        for running in lines:
            assert next(running).startswith("data: ")  # both run: the batch is full
        response = httpx.post(server.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        })
        assert response.status_code == 503
        assert int(response.headers["Retry-After"]) >= 1
        error = response.json()["error"]
        assert error["code"] == "server_overloaded" and error["type"] == "server_error"
        assert "at most 0" in error["message"]
    # The disconnects freed the slots: requests are served again.
    deadline = time.time() + 30
    while time.time() < deadline and server.metric("num_requests_running") != 0:
        time.sleep(0.1)
    response = httpx.post(server.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert response.status_code == 200


def events(lines) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line]


def test_graceful_shutdown(server):
    """SIGTERM with two requests in flight: the short one completes, the one that outlives
    --shutdown-timeout (10 s) ends with an error event; then the process exits 0."""
    short_tokens = 16
    with long_stream(server, short_tokens) as short, long_stream(server, 2000) as long:
        short_lines, long_lines = short.iter_lines(), long.iter_lines()
        assert next(short_lines).startswith("data: ")
        assert next(long_lines).startswith("data: ")
        signalled = time.time()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:  # new work is refused: the socket is closed (or, on a race, 503)
            refused = httpx.post(server.url + "/v1/completions", timeout=10,
                                 json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 503
        except httpx.ConnectError:
            pass
        short_events = events(short_lines)
        long_events = events(long_lines)
    assert short_events[-1] == "[DONE]"
    assert json.loads(short_events[-2])["usage"]["completion_tokens"] == short_tokens
    assert json.loads(short_events[-3])["choices"][0]["finish_reason"] == "length"
    assert long_events[-1] == "[DONE]"
    error = json.loads(long_events[-2])["error"]
    assert error["type"] == "server_error" and "shut down" in error["message"]
    assert server.proc.wait(timeout=60) == 0
    assert 10 <= time.time() - signalled < 40
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)
    log = server.log_text()
    assert "received SIGTERM" in log and "Traceback" not in log


def test_a_dead_engine_loop_ends_streams_fails_health_and_exits_non_zero():
    """The engine loop dies (an injected fault in its bookkeeping) with a stream open: the
    stream ends with an error event, /health says 503 within a second, the process exits 1
    (vLLM's behaviour: a supervisor restarts it)."""
    from tests.entrypoints.fault_server import KILL_MARKER

    with RemoteServer(["--served-model-name", "tiny"],
                      module="tests.entrypoints.fault_server") as server:
        with long_stream(server, 2000) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            killer = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": f"{KILL_MARKER} now", "max_tokens": 5})
            died = time.time()
            health = httpx.get(server.url + "/health", timeout=5)
            assert health.status_code == 503 and time.time() - died < 1.0
            assert "engine loop died" in health.json()["error"]["message"]
            stream_events = events(lines)
        assert killer.status_code >= 500
        assert "injected fault" in killer.json()["error"]["message"]
        assert stream_events[-1] == "[DONE]"
        error = json.loads(stream_events[-2])["error"]
        assert error["type"] == "server_error" and "engine loop died" in error["message"]
        assert server.proc.wait(timeout=30) == 1
        assert "exiting in 2 s with code 1" in server.log_text()


def test_a_request_that_faults_fails_alone_over_http():
    """Two requests whose detokenization raises (an injected fault), one streamed and one
    not, run in the same batches as two healthy ones: the faulty ones get a 500 and an
    error event; the healthy ones get exactly the tokens they get alone."""
    import asyncio

    from tests.entrypoints.fault_server import POISON_MARKER

    healthy = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 24,
               "temperature": 0, "ignore_eos": True}
    poisoned = {**healthy, "prompt": f"Tell me a story. {POISON_MARKER}"}

    async def post(client, body, stream=False):
        if not stream:
            return await client.post("/v1/completions", json=body)
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            return [line async for line in r.aiter_lines() if line]

    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            alone = await post(client, healthy)
            together = await asyncio.gather(
                post(client, healthy), post(client, poisoned), post(client, healthy, True),
                post(client, poisoned, True))
            return alone, together

    with RemoteServer(["--served-model-name", "tiny"],
                      module="tests.entrypoints.fault_server") as server:
        alone, (whole, failed, streamed, failed_stream) = asyncio.run(main(server.url))
        assert httpx.get(server.url + "/health").status_code == 200
        assert server.metric("num_kv_blocks_held") == 0
    text = alone.json()["choices"][0]["text"]
    assert whole.status_code == 200 and whole.json()["choices"][0]["text"] == text
    chunks = [json.loads(line[6:]) for line in streamed[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    assert failed.status_code == 500
    assert "injected detokenizer fault" in failed.json()["error"]["message"]
    assert failed_stream[-1] == "data: [DONE]"
    assert "injected detokenizer fault" in json.loads(failed_stream[-2][6:])["error"]["message"]
