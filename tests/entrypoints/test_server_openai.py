"""`pagoda serve` through the official openai client: completions and chat, streaming and not,
n, stop, seed, logprobs, usage; greedy outputs equal the offline LLM's; 32 concurrent
streams; a client that disconnects frees its request; tokenize, models, metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from pagoda import SamplingParams
from tests.entrypoints.server_helpers import MODEL_NAME, SHARED_API_KEY

pytestmark = pytest.mark.slow

API_KEY = SHARED_API_KEY
PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
]
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Name three colors."},
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline_greedy(bundled_llm):
    """Offline greedy results of PROMPTS and CHAT: the reference for temperature 0."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    completions = bundled_llm.generate(PROMPTS, params, use_tqdm=False)
    chat = bundled_llm.chat(CHAT, params, use_tqdm=False)[0]
    return completions, chat


def test_models_health_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].max_model_len == 2048
    assert httpx.get(server.url + "/health").status_code == 200
    version = httpx.get(server.url + "/version").json()
    assert version["version"] == "0.1.0"
    # what the model runs on, for `pagoda bench ab`'s hardware column
    [model] = version["models"]
    assert model["id"] == MODEL_NAME
    run = model["run"]
    assert run["device"] == "cpu" and run["threads"] >= 1
    assert run["cpu"] and run["kernels"].startswith("Pagoda's CPU kernels")
    assert run["dtype"] in ("float32", "bfloat16") and run["weights"].startswith("packed ")


def test_completion_greedy_equals_offline(client, offline_greedy):
    completions, _ = offline_greedy
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0
    )
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2]
    for choice, offline in zip(choices, completions):
        assert choice.text == offline.outputs[0].text
        assert choice.finish_reason == offline.outputs[0].finish_reason
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in completions)
    assert response.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in completions)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_completion_token_id_prompts(client, offline_greedy):
    completions, _ = offline_greedy
    token_prompts = [o.prompt_token_ids for o in completions]
    response = client.completions.create(
        model=MODEL_NAME, prompt=token_prompts[0], max_tokens=MAX_TOKENS, temperature=0,
        echo=True,
    )
    assert response.choices[0].text == PROMPTS[0] + completions[0].outputs[0].text
    response = client.completions.create(
        model=MODEL_NAME, prompt=token_prompts, max_tokens=MAX_TOKENS, temperature=0
    )
    texts = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    assert texts == [o.outputs[0].text for o in completions]


def test_chat_greedy_equals_offline(client, offline_greedy):
    _, chat = offline_greedy
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0
    )
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    message = response.choices[0].message
    assert message.role == "assistant"
    assert message.content == chat.outputs[0].text
    assert response.choices[0].finish_reason == chat.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(chat.prompt_token_ids)
    assert response.usage.completion_tokens == len(chat.outputs[0].token_ids)
    # Content as a list of text parts renders the same prompt.
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=parts, max_tokens=MAX_TOKENS, temperature=0
    )
    assert response.choices[0].message.content == chat.outputs[0].text


def test_streaming_completion_with_usage(client, offline_greedy):
    completions, _ = offline_greedy
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    texts = ["", "", ""]
    finish = [None, None, None]
    chunks = list(stream)
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        choice = chunk.choices[0]
        assert finish[choice.index] is None  # nothing after a choice's finish
        texts[choice.index] += choice.text
        finish[choice.index] = choice.finish_reason
    assert texts == [o.outputs[0].text for o in completions]
    assert finish == [o.outputs[0].finish_reason for o in completions]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in completions)
    assert usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in completions)


def test_streaming_chat_with_usage(client, offline_greedy):
    _, chat = offline_greedy
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == chat.outputs[0].text
    assert chunks[-2].choices[0].finish_reason == chat.outputs[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(chat.outputs[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == len(chat.prompt_token_ids)
    # Without include_usage no chunk carries usage.
    plain = list(client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=3, temperature=0, stream=True
    ))
    assert all(c.usage is None and c.choices for c in plain)


def test_n_and_seed_reproducibility(client):
    def sample(stream: bool) -> list[str]:
        kwargs = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 8, "temperature": 1.0,
                  "n": 2, "seed": 1234}
        if not stream:
            response = client.chat.completions.create(**kwargs)
            assert response.usage.completion_tokens <= 2 * 8
            return [c.message.content for c in sorted(response.choices, key=lambda c: c.index)]
        texts = ["", ""]
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        return texts

    first = sample(stream=False)
    assert len(first) == 2
    assert sample(stream=False) == first
    assert sample(stream=True) == first
    other = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=8,
                                      temperature=1.0, n=2, seed=99)
    assert sorted(c.index for c in other.choices) == [0, 1]
    assert other.usage.completion_tokens <= 16


def test_stop_string(client, offline_greedy):
    completions, _ = offline_greedy
    greedy = completions[1].outputs[0].text
    word = greedy.split()[2]
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stop=[word]
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == greedy[: greedy.index(word)]
    assert choice.model_extra["stop_reason"] == word


def test_completion_logprobs_with_echo(client, bundled_llm):
    prompt = PROMPTS[0]
    offline = bundled_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=2), use_tqdm=False
    )[0]
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    choice = response.choices[0]
    logprobs = choice.logprobs
    num_prompt = len(offline.prompt_token_ids)
    num_tokens = num_prompt + 4
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == num_tokens
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == num_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text == prompt + offline.outputs[0].text
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(num_tokens)
    ]
    for i, position in enumerate(offline.outputs[0].logprobs):
        token_id = offline.outputs[0].token_ids[i]
        served = logprobs.token_logprobs[num_prompt + i]
        assert served == pytest.approx(position[token_id].logprob, abs=1e-4)
        top = logprobs.top_logprobs[num_prompt + i]
        assert logprobs.tokens[num_prompt + i] in top and 2 <= len(top) <= 3


def test_chat_logprobs(client, bundled_llm):
    offline = bundled_llm.chat(
        CHAT, SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == len(offline.token_ids)
    assert "".join(c.token for c in content) == response.choices[0].message.content
    for entry, token_id, position in zip(content, offline.token_ids, offline.logprobs):
        assert entry.logprob == pytest.approx(position[token_id].logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the top token


def test_32_concurrent_streams_match_greedy_alone(server, bundled_llm):
    # 16 distinct prompts, two clients each (prompts under one KV block: no prefix-cache
    # sharing); the reference is each prompt run alone through the offline engine.
    distinct = [f"Question {i}: what is {i} plus {i + 1}? Answer:" for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=8)
    alone = {p: bundled_llm.generate([p], params, use_tqdm=False)[0].outputs[0].text
             for p in distinct}
    prompts = distinct * 2

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        text = ""
        stream = await aclient.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        async for chunk in stream:
            text += chunk.choices[0].text
        return text

    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY,
                                     max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))
        finally:
            await aclient.close()

    assert asyncio.run(main()) == [alone[p] for p in prompts]


def test_disconnect_mid_stream_aborts(server):
    idle_usage = server.metric("kv_cache_usage_perc")
    aborted = server.metric("request_success_total", 'finished_reason="abort"')
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers,
                      timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(4):
            assert next(lines).startswith("data: ")
            next(lines)
        assert server.metric("num_requests_running") == 1
        assert server.metric("kv_cache_usage_perc") > idle_usage
    deadline = time.time() + 30
    while time.time() < deadline and server.metric("num_requests_running") != 0:
        time.sleep(0.1)
    assert server.metric("num_requests_running") == 0
    assert server.metric("num_requests_waiting") == 0
    assert server.metric("kv_cache_usage_perc") == idle_usage
    assert server.metric("request_success_total", 'finished_reason="abort"') == aborted + 1


def test_tokenize_and_detokenize(server, offline_greedy):
    completions, chat = offline_greedy
    response = httpx.post(server.url + "/tokenize",
                          json={"prompt": PROMPTS[0], "return_token_strs": True})
    body = response.json()
    assert body["tokens"] == completions[0].prompt_token_ids
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"])
    assert body["max_model_len"] == 2048
    body = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    assert body["tokens"] == chat.prompt_token_ids
    body = httpx.post(server.url + "/detokenize",
                      json={"tokens": completions[0].prompt_token_ids}).json()
    assert body == {"prompt": PROMPTS[0]}


def test_metrics_after_traffic(server):
    text = httpx.get(server.url + "/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert f"# TYPE pagoda:{name} histogram" in text
        assert server.metric(f"{name}_count") > 0
    for name in ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total"):
        assert server.metric(name) > 0
    assert server.metric("request_success_total", 'finished_reason="length"') > 0
    assert server.metric("request_success_total", 'finished_reason="stop"') > 0
    assert server.metric("num_requests_running") == 0
    assert server.metric("kv_cache_usage_perc") == 0
