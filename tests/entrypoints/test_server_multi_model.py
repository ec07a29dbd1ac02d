"""Two real models in one `pagoda serve` (the bundled GGUF and a tiny random checkpoint), a
third loaded and unloaded while load runs on the first (issue 20, item 2): each answers as
it does offline, no request of the first fails, a request for the model being loaded
waits for it, memory returns after the unload, and a reload keeps a stream in flight."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from pagoda import LLM, SamplingParams
from tests.entrypoints.server_helpers import RemoteServer
from tests.executor.tiny_checkpoints import build_checkpoint_with_bundled_tokenizer

pytestmark = pytest.mark.slow

KEY = "sk-multi"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_checkpoint_with_bundled_tokenizer(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def server(tiny, bundled_gguf):
    with RemoteServer(["--model", bundled_gguf, "--model", tiny, "--served-model-name", "smol",
                       "--served-model-name", "tiny", "--api-key", KEY]) as server:
        yield server


def complete(server: RemoteServer, model: str, max_tokens: int = 8, timeout: float = 120):
    return httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=timeout, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})


def states(server: RemoteServer) -> dict[str, str]:
    data = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
    return {card["id"]: card["state"] for card in data}


def rss(server: RemoteServer) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            return float(line.split()[1])
    raise KeyError("process_resident_memory_bytes")


def test_each_model_answers_as_it_does_offline(server, tiny, bundled_llm):
    assert states(server) == {"smol": "ready", "tiny": "ready"}
    params = SamplingParams(temperature=0, max_tokens=8)
    expected_smol = bundled_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    tiny_llm = LLM(model=tiny, dtype="float32", kv_cache_memory=1 << 24, max_model_len=256)
    expected_tiny = tiny_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    assert expected_smol != expected_tiny
    assert complete(server, "smol").json()["choices"][0]["text"] == expected_smol
    assert complete(server, "tiny").json()["choices"][0]["text"] == expected_tiny
    assert complete(server, "nope").status_code == 404
    # /metrics has both models' counters, each family once
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'pagoda:generation_tokens_total{model_name="smol"}' in text
    assert 'pagoda:generation_tokens_total{model_name="tiny"}' in text
    assert text.count("# TYPE pagoda:generation_tokens_total counter") == 1


def test_load_and_unload_a_third_model_under_load(server, bundled_gguf):
    statuses: list[int] = []
    stop = threading.Event()

    def load_on_the_first() -> None:
        while not stop.is_set():
            statuses.append(complete(server, "smol", max_tokens=16).status_code)

    background = threading.Thread(target=load_on_the_first)
    background.start()
    try:
        before = rss(server)
        loaded: list[httpx.Response] = []
        loader = threading.Thread(target=lambda: loaded.append(httpx.post(
            server.url + "/v1/models/load", headers=AUTH, timeout=300, json={
                "model": "third", "path": bundled_gguf,
                "options": {"kv_cache_memory": 64 << 20, "max_model_len": 512}})))
        loader.start()
        deadline = time.time() + 60
        while "third" not in states(server) and time.time() < deadline:
            time.sleep(0.02)
        waited = complete(server, "third")  # sent while loading: waits, then answers
        loader.join(300)
        assert loaded[0].status_code == 200, loaded[0].text
        assert waited.status_code == 200, waited.text
        assert waited.json()["model"] == "third"
        assert states(server) == {"smol": "ready", "tiny": "ready", "third": "ready"}
        with_third = rss(server)
        assert with_third > before + 40e6  # its weights (~90 MB of 4-bit codes) are in memory
        unloaded = httpx.post(server.url + "/v1/models/unload", headers=AUTH, timeout=120,
                              json={"model": "third"})
        assert unloaded.status_code == 200, unloaded.text
        assert states(server) == {"smol": "ready", "tiny": "ready"}
        assert complete(server, "third").status_code == 404
        after = rss(server)
        assert after <= 1.10 * before, (before, with_third, after)
    finally:
        stop.set()
        background.join(120)
    assert len(statuses) >= 3 and set(statuses) == {200}


def test_reload_keeps_the_stream_in_flight(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    events: list[dict] = []
    reloaded: list[httpx.Response] = []
    reloaded_while_streaming = None
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, json=body,
                      timeout=120) as stream:
        reloader = None
        for line in stream.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line.removeprefix("data: ")))
            if reloaded and reloaded_while_streaming is None:
                reloaded_while_streaming = True
            if reloader is None:  # the stream runs: reload its model under it
                reloader = threading.Thread(target=lambda: reloaded.append(httpx.post(
                    server.url + "/v1/models/load", headers=AUTH, timeout=300,
                    json={"model": "tiny"})))
                reloader.start()
        reloader.join(300)
    assert reloaded[0].status_code == 200, reloaded[0].text
    assert reloaded_while_streaming  # the new engine took over before the stream ended
    assert "error" not in events[-1]
    assert events[-1]["usage"]["completion_tokens"] == 2000
    assert states(server)["tiny"] == "ready"
    assert complete(server, "tiny").status_code == 200


def test_sigterm_after_the_default_model_was_reloaded_stops_the_server(server):
    """Reloading the start-up default ("smol") replaces its engine; SIGTERM must still drain
    and exit 0 (it once raised in the signal handler, on the old model's engine, and the
    server never stopped). Last in the module: it stops the module's server."""
    reloaded = httpx.post(server.url + "/v1/models/load", headers=AUTH, timeout=300,
                          json={"model": "smol"})
    assert reloaded.status_code == 200, reloaded.text
    assert complete(server, "smol").status_code == 200
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    log = server.log_text()
    assert "received SIGTERM" in log and "Traceback" not in log
