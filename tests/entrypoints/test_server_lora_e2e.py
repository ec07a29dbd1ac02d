"""LoRA adapters through a real `pagoda serve` (issue 35): a tiny random Llama that speaks the
bundled tokenizer, with peft-made adapters. Each adapter's greedy answer equals the offline
LLM's with that adapter (and differs from the base's); an adapter loaded at run time serves
at once; one unloaded while its request streams lets that request finish, and new requests
naming it get 404; `pagoda bench serve --lora-names` spreads its requests over the names."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import pytest

from pagoda import LLM, SamplingParams
from tests.entrypoints.server_helpers import RemoteServer
from tests.executor.tiny_checkpoints import build_checkpoint, bundled_tokenizer
from tests.lora.lora_models import make_adapter

pytestmark = pytest.mark.slow

KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The lighthouse keeper"
NUM_TOKENS = 8
LONG = 1500
"""Tokens of the request that runs through its adapter's unload (seconds of decoding)."""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_e2e")
    tokenizer = bundled_tokenizer()
    base = build_checkpoint("llama", str(root / "base"), vocab_size=len(tokenizer),
                            max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(str(root / "base"))
    (root / "allowed").mkdir()
    make_adapter(base, str(root / "allowed" / "a"), "all", 1)
    make_adapter(base, str(root / "allowed" / "b"), "qv", 2)
    return {"base": str(root / "base"), "allowed": str(root / "allowed"),
            "a": str(root / "allowed" / "a"), "b": str(root / "allowed" / "b")}


@pytest.fixture(scope="module")
def expected(files) -> dict[str, str]:
    """The offline LLM's greedy text for the base and each adapter."""
    from pagoda.lora.request import LoRARequest

    llm = LLM(model=files["base"], dtype="float32", max_model_len=256, enable_lora=True,
              max_loras=2, kv_cache_memory=1 << 24)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    texts = {}
    for name, lora in (("base", None), ("a", LoRARequest("a", 1, files["a"])),
                       ("b", LoRARequest("b", 2, files["b"]))):
        texts[name] = llm.generate([PROMPT], params, lora_request=lora,
                                   use_tqdm=False)[0].outputs[0].text
    del llm
    return texts


@pytest.fixture(scope="module")
def server(files):
    with RemoteServer(["--model", files["base"], "--served-model-name", "base",
                       "--enable-lora", "--max-loras", "2",
                       "--lora-modules", f"a={files['a']}", "--lora-allowed-paths",
                       files["allowed"], "--api-key", KEY, "--no-access-log"]) as s:
        yield s


def complete(server, model: str, max_tokens: int = NUM_TOKENS) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def test_adapters_answer_as_offline_and_unload_lets_running_requests_finish(
        server, files, expected):
    assert expected["a"] != expected["base"] and expected["b"] != expected["base"]
    models = {card["id"]: card for card in
              httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]}
    assert models["a"]["parent"] == "base" and models["a"]["root"] == files["a"]
    for name in ("base", "a"):
        response = complete(server, name)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected[name], name
        assert response.json()["model"] == name

    loaded = httpx.post(server.url + "/v1/load_lora_adapter", headers=AUTH,
                        json={"lora_name": "b", "lora_path": files["b"]})
    assert loaded.status_code == 200, loaded.text
    assert complete(server, "b").json()["choices"][0]["text"] == expected["b"]

    # Unload b while a long request of it streams: the request runs to its end.
    first_chunk, result = threading.Event(), {}

    def stream_b() -> None:
        body = {"model": "b", "prompt": PROMPT, "max_tokens": LONG, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, json=body,
                          timeout=300) as response:
            lines = []
            for line in response.iter_lines():
                if line.startswith("data:"):
                    lines.append(line[5:].strip())
                    first_chunk.set()
            result["status"], result["lines"] = response.status_code, lines

    thread = threading.Thread(target=stream_b)
    thread.start()
    assert first_chunk.wait(120)
    unloaded = httpx.post(server.url + "/v1/unload_lora_adapter", headers=AUTH,
                          json={"lora_name": "b"})
    assert unloaded.status_code == 200, unloaded.text
    assert "status" not in result  # (it was still running)
    gone = complete(server, "b")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    thread.join(300)
    assert result["status"] == 200 and result["lines"][-1] == "[DONE]"
    usage = json.loads(result["lines"][-2])["usage"]
    assert usage["completion_tokens"] == LONG
    assert "b" not in {card["id"] for card in
                       httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]}
    # the others go on
    assert complete(server, "a").json()["choices"][0]["text"] == expected["a"]
    outside = httpx.post(server.url + "/v1/load_lora_adapter", headers=AUTH,
                         json={"lora_name": "c", "lora_path": files["base"]})
    assert outside.status_code == 400 and "--lora-allowed-paths" in outside.text
    assert "Traceback" not in server.log_text()


def test_bench_serve_spreads_requests_over_lora_names(server, tmp_path):
    output = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "pagoda", "bench", "serve", "--base-url", server.url,
         "--api-key", KEY, "--lora-names", "a,base", "--num-requests", "6", "--input-len",
         "16", "--output-len", "4", "--num-warmups", "1", "--no-progress", "--output",
         str(output)], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    summary = json.loads(output.read_text())["runs"][0]["summary"]
    assert summary["completed"] == 6
    assert {name: c["requests"] for name, c in summary["requests_by_model"].items()} == {
        "a": 3, "base": 3}
    assert "model a:" in run.stdout and "model base:" in run.stdout


def test_the_web_page_picker_lists_the_adapter_and_chats_with_it(server, expected):
    """In headless Chromium (as tests/entrypoints/test_web_page.py): the adapter is an
    option labelled with its base; chatting with it sends its name as `model`, and its live
    engine view is its base engine's."""
    from selenium.webdriver.support.ui import Select

    from tests.entrypoints import test_web_page as page  # (skips without Chromium)
    from tests.entrypoints import web_browser as browser

    with browser.chromium() as driver:
        driver.get(server.url + "/")
        driver.execute_script("localStorage.setItem('pagoda.apiKey', arguments[0])", KEY)
        driver.get(server.url + "/")
        browser.wait(driver, lambda d: len(d.find_elements(browser.By.CSS_SELECTOR,
                                                           "#model option")) >= 2, 20)
        labels = {o.get_attribute("value"): o.text
                  for o in driver.find_elements(browser.By.CSS_SELECTOR, "#model option")}
        assert labels["base"] == "base" and labels["a"] == "a (LoRA on base)"
        Select(browser.by_id(driver, "model")).select_by_value("a")
        browser.wait(driver, lambda d: int(browser.by_id(d, "engine").get_attribute(
            "data-ticks")) >= 2, 20, "no live view of the adapter's base engine")
        page.send(driver, "Hello", 4)
        browser.wait(driver, lambda d: browser.by_id(d, "chat").get_attribute("data-state")
                     == "done", 60, "the answer did not finish")
        assert [e for e in browser.console_errors(driver) if "401" not in e["message"]] == []


def test_data_parallel_replicas_serve_the_adapter_and_metrics_name_it(files, expected):
    """--data-parallel-size 2: every replica runs the adapter's requests as offline (several
    at once, so both replicas get some); /metrics has vLLM's lora_requests_info gauge with
    --max-loras as its max_lora label; an unloaded adapter is refused on every replica."""
    from concurrent.futures import ThreadPoolExecutor

    with RemoteServer(["--model", files["base"], "--served-model-name", "base",
                       "--data-parallel-size", "2", "--enable-lora", "--max-loras", "2",
                       "--lora-modules", f"a={files['a']}", f"b={files['b']}",
                       "--api-key", KEY, "--no-access-log"]) as server:
        with ThreadPoolExecutor(6) as pool:
            names = ["a", "b", "base"] * 2
            answers = list(pool.map(lambda name: complete(server, name), names))
        for name, response in zip(names, answers):
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected[name], name
        metrics = httpx.get(server.url + "/metrics").text
        gauge = [line for line in metrics.splitlines()
                 if line.startswith("pagoda:lora_requests_info{")]
        assert gauge and all('max_lora="2"' in line for line in gauge), gauge
        unloaded = httpx.post(server.url + "/v1/unload_lora_adapter", headers=AUTH,
                              json={"lora_name": "b"})
        assert unloaded.status_code == 200, unloaded.text
        assert all(complete(server, "b").status_code == 404 for _ in range(4))
        assert complete(server, "a").json()["choices"][0]["text"] == expected["a"]
        assert "Traceback" not in server.log_text()
