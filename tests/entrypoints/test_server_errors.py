"""A battery of bad requests: each gets the documented status and an OpenAI error body
naming the culprit, and the server keeps serving. Also the API key (from PAGODA_API_KEY)."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.server_helpers import (
    MODEL_NAME,
    SHARED_API_KEY,
    SHARED_AUTH,
    RemoteServer,
)

pytestmark = pytest.mark.slow

API_KEY, AUTH = SHARED_API_KEY, SHARED_AUTH
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


def cmpl(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, **fields}


# (id, method, path, body (dict, or raw bytes), headers, status, expected param, code or None)
CASES = [
    ("malformed-json", "POST", CMPL, b"{bad", AUTH, 400, None, "invalid_json"),
    ("body-not-object", "POST", CMPL, b"[1, 2]", AUTH, 400, None, "invalid_json"),
    ("empty-body", "POST", CMPL, b"", AUTH, 400, None, "invalid_json"),
    ("missing-prompt", "POST", CMPL, {"model": MODEL_NAME}, AUTH, 400, "prompt", None),
    ("prompt-wrong-type", "POST", CMPL, cmpl(prompt=5), AUTH, 400, "prompt", None),
    ("prompt-mixed-list", "POST", CMPL, cmpl(prompt=[1, "a"]), AUTH, 400, "prompt", None),
    ("prompt-empty-string", "POST", CMPL, cmpl(prompt=""), AUTH, 400, "prompt", None),
    ("prompt-empty-token-list", "POST", CMPL, cmpl(prompt=[[5], []]), AUTH, 400, "prompt[1]", None),
    ("prompt-token-out-of-vocab", "POST", CMPL, cmpl(prompt=[10**7]), AUTH, 400, "prompt", None),
    ("prompt-token-negative", "POST", CMPL, cmpl(prompt=[5, -1]), AUTH, 400, "prompt", None),
    ("n-string", "POST", CMPL, cmpl(n="2"), AUTH, 400, "n", None),
    ("n-zero", "POST", CMPL, cmpl(n=0), AUTH, 400, "n", None),
    ("n-too-large", "POST", CMPL, cmpl(n=1000), AUTH, 400, "n", None),
    ("temperature-negative", "POST", CMPL, cmpl(temperature=-1), AUTH, 400, "temperature", None),
    ("temperature-string", "POST", CMPL, cmpl(temperature="hot"), AUTH, 400, "temperature", None),
    ("top-p-zero", "POST", CMPL, cmpl(top_p=0), AUTH, 400, "top_p", None),
    ("top-p-above-one", "POST", CMPL, cmpl(top_p=1.5), AUTH, 400, "top_p", None),
    ("max-tokens-zero", "POST", CMPL, cmpl(max_tokens=0), AUTH, 400, "max_tokens", None),
    ("max-tokens-bool", "POST", CMPL, cmpl(max_tokens=True), AUTH, 400, "max_tokens", None),
    ("max-tokens-over-context", "POST", CMPL, cmpl(max_tokens=5000), AUTH, 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt-over-context", "POST", CMPL, cmpl(prompt=[5] * 2100), AUTH, 400, "prompt",
     "context_length_exceeded"),
    ("presence-penalty-range", "POST", CMPL, cmpl(presence_penalty=3), AUTH, 400,
     "presence_penalty", None),
    ("frequency-penalty-range", "POST", CMPL, cmpl(frequency_penalty=-2.5), AUTH, 400,
     "frequency_penalty", None),
    ("logit-bias-key", "POST", CMPL, cmpl(logit_bias={"abc": 1}), AUTH, 400, "logit_bias", None),
    ("logit-bias-value", "POST", CMPL, cmpl(logit_bias={"5": 200}), AUTH, 400, "logit_bias", None),
    ("logit-bias-out-of-vocab", "POST", CMPL, cmpl(logit_bias={"99999999": 1}), AUTH, 400,
     "logit_bias", None),
    ("logprobs-too-many", "POST", CMPL, cmpl(logprobs=21), AUTH, 400, "logprobs", None),
    ("stop-not-strings", "POST", CMPL, cmpl(stop=[1]), AUTH, 400, "stop", None),
    ("stop-empty-string", "POST", CMPL, cmpl(stop=[""]), AUTH, 400, "stop", None),
    ("seed-string", "POST", CMPL, cmpl(seed="x"), AUTH, 400, "seed", None),
    ("unknown-field", "POST", CMPL, cmpl(temprature=0.5), AUTH, 400, "temprature",
     "unknown_parameter"),
    ("suffix", "POST", CMPL, cmpl(suffix="end"), AUTH, 400, "suffix", "unsupported_parameter"),
    ("best-of", "POST", CMPL, cmpl(best_of=3), AUTH, 400, "best_of", "unsupported_parameter"),
    ("unknown-model", "POST", CMPL, cmpl(model="gpt-4"), AUTH, 404, "model", "model_not_found"),
    ("stream-not-bool", "POST", CMPL, cmpl(stream="yes"), AUTH, 400, "stream", None),
    ("stream-options-unknown", "POST", CMPL, cmpl(stream=True, stream_options={"x": 1}), AUTH,
     400, "stream_options.x", "unknown_parameter"),
    ("top-k-negative", "POST", CMPL, cmpl(top_k=-5), AUTH, 400, "top_k", None),
    ("min-p-range", "POST", CMPL, cmpl(min_p=2), AUTH, 400, "min_p", None),
    ("repetition-penalty-zero", "POST", CMPL, cmpl(repetition_penalty=0), AUTH, 400,
     "repetition_penalty", None),
    ("min-tokens-over-max", "POST", CMPL, cmpl(min_tokens=5), AUTH, 400, "min_tokens", None),
    ("echo-int", "POST", CMPL, cmpl(echo=1), AUTH, 400, "echo", None),
    ("priority-string", "POST", CMPL, cmpl(priority="high"), AUTH, 400, "priority", None),
    ("chat-missing-messages", "POST", CHAT, {"model": MODEL_NAME}, AUTH, 400, "messages", None),
    ("chat-empty-messages", "POST", CHAT, chat(messages=[]), AUTH, 400, "messages", None),
    ("chat-bad-role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), AUTH,
     400, "messages[0].role", None),
    ("chat-message-not-object", "POST", CHAT, chat(messages=["hi"]), AUTH, 400, "messages[0]",
     None),
    ("chat-image-part", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), AUTH, 400,
     "messages[0].content", None),
    ("chat-top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=2), AUTH, 400,
     "top_logprobs", None),
    ("chat-top-logprobs-too-many", "POST", CHAT, chat(logprobs=True, top_logprobs=30), AUTH, 400,
     "top_logprobs", None),
    ("chat-tool-choice-unknown-function", "POST", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}),
     AUTH, 400, "tool_choice", "invalid_value"),
    ("chat-response-format-bad-schema", "POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}),
     AUTH, 400, "response_format", "invalid_value"),
    ("guided-regex-bad", "POST", CMPL, cmpl(guided_regex="a(b"), AUTH, 400, "guided_regex",
     "invalid_value"),
    ("chat-max-completion-tokens-over-context", "POST", CHAT,
     chat(max_completion_tokens=5000), AUTH, 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("chat-unknown-model", "POST", CHAT, chat(model="nope"), AUTH, 404, "model",
     "model_not_found"),
    ("chat-stream-bad-temperature", "POST", CHAT, chat(stream=True, temperature=-0.5), AUTH, 400,
     "temperature", None),
    ("unknown-route", "POST", "/v1/audio/speech", cmpl(), AUTH, 404, None, "unknown_url"),
    ("wrong-method", "GET", CMPL, None, AUTH, 405, None, "method_not_allowed"),
    ("no-api-key", "POST", CMPL, cmpl(), {}, 401, None, "invalid_api_key"),
    ("wrong-api-key", "POST", CMPL, cmpl(), {"Authorization": "Bearer nope"}, 401, None,
     "invalid_api_key"),
    ("tokenize-nothing", "POST", "/tokenize", {}, {}, 400, "prompt", None),
    ("detokenize-out-of-vocab", "POST", "/detokenize", {"tokens": [10**7]}, {}, 400, "tokens",
     None),
    ("tokenize-unknown-model", "POST", "/tokenize", {"model": "x", "prompt": "a"}, {}, 404,
     "model", "model_not_found"),
]


@pytest.fixture(scope="module")
def server(shared_server):
    """The session's shared server: its API key comes from PAGODA_API_KEY."""
    return shared_server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def send(http: httpx.Client, method: str, path: str, body, headers: dict) -> httpx.Response:
    if isinstance(body, bytes):
        return http.request(method, path, content=body,
                            headers={**headers, "Content-Type": "application/json"})
    return http.request(method, path, json=body, headers=headers)


def run_battery(http: httpx.Client) -> None:
    """Send every case of the battery; each gets its documented status."""
    for case_id, method, path, body, headers, status, _, _ in CASES:
        response = send(http, method, path, body, headers)
        assert response.status_code == status, (case_id, response.text)


@pytest.mark.parametrize(
    "method, path, body, headers, status, param, code", [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_bad_request(http, method, path, body, headers, status, param, code):
    response = send(http, method, path, body, headers)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and len(error["message"]) > 10
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code


def engine_totals(server: RemoteServer) -> tuple[float, float]:
    """(prompt tokens the engine admitted, sequences it finished for any reason)."""
    finished = sum(server.metric("request_success_total", f'finished_reason="{reason}"')
                   for reason in ("stop", "length", "abort"))
    return server.metric("prompt_tokens_total"), finished


def test_refused_requests_never_reach_the_engine(server, http):
    """Validation happens once, at the edge: a refused request costs the engine nothing (no
    admitted prompt tokens, no sequence started and aborted)."""
    before = engine_totals(server)
    run_battery(http)
    assert engine_totals(server) == before
    assert server.metric("num_requests_running") == 0


def test_context_length_message_has_the_numbers(http):
    response = http.post(CMPL, json=cmpl(prompt=[5] * 100, max_tokens=2000), headers=AUTH)
    message = response.json()["error"]["message"]
    assert response.status_code == 400
    assert all(number in message for number in ("2048", "2100", "100", "2000")), message
    response = http.post(CHAT, json=chat(max_completion_tokens=3000), headers=AUTH)
    message = response.json()["error"]["message"]
    assert "2048" in message and "3000" in message and "messages" in message


def test_sampling_params_message_is_reused(http):
    response = http.post(CHAT, json=chat(logprobs=True, top_logprobs=30), headers=AUTH)
    assert response.json()["error"]["message"] == (
        "top_logprobs must be an int in [0, 20] or None, got 30"
    )


def test_api_key(server, http):
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/models", headers={"Authorization": API_KEY}).status_code == 401
    response = http.get("/v1/models", headers=AUTH)
    assert response.status_code == 200 and response.json()["data"][0]["id"] == MODEL_NAME
    # Like vLLM, only /v1 is protected.
    for path in ("/health", "/metrics", "/version"):
        assert http.get(path).status_code == 200, path
    response = http.post(CMPL, json=cmpl(max_tokens=3, temperature=0), headers=AUTH)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


def test_server_keeps_serving_after_the_battery(server, http):
    run_battery(http)
    assert server.proc.poll() is None
    assert http.get("/health").status_code == 200
    response = http.post(CHAT, json=chat(max_tokens=4, temperature=0), headers=AUTH)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"]
    assert server.metric("num_requests_running") == 0
    assert "Traceback" not in server.log_text()
