"""The server's operational guards (pagoda/entrypoints/openai/serving/guards.py, server_args.py): a
request body cap (413), a per-request deadline (408, the engine work stopped), CORS for the
allowed origins only, HTTPS, and one-line CLI errors for their bad values."""

from __future__ import annotations

import json
import pathlib

import httpx
import pytest

from tests.entrypoints.server_helpers import RemoteServer
from tests.entrypoints.test_cli import assert_one_line_error, run_cli

pytestmark = pytest.mark.slow  # (make test-fast skips it)

API_KEY = "guard-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LIMIT = 4000
# Long enough for a 3-token request on a loaded 2-core box (seen taking up to ~4 s there),
# short of what LONG tokens take at any decode speed yet seen (2000 tokens: 6 s is 333 tok/s)
TIMEOUT_S = 6
LONG = 2000  # tokens (--max-model-len 2048, a 4-token prompt)
ORIGIN = "https://app.example.com"
TLS = pathlib.Path(__file__).parents[1] / "data" / "tls"  # a self-signed 127.0.0.1 pair


@pytest.fixture(scope="module")
def server():
    args = ["--api-key", API_KEY, "--max-request-bytes", str(LIMIT),
            "--request-timeout", str(TIMEOUT_S), "--allowed-origins", ORIGIN]
    with RemoteServer(args) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def completion(max_tokens: int, **extra) -> dict:
    return {"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "prompt": "Once upon a time",
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]


def test_a_body_over_the_cap_is_refused_with_413(http) -> None:
    padded = completion(2, user="x" * LIMIT)
    assert_error(http.post("/v1/completions", json=padded, headers=AUTH), 413,
                 "request_too_large")

    def chunks():  # no Content-Length: the cap is counted as the body arrives
        body = json.dumps(padded).encode()
        for start in range(0, len(body), 1000):
            yield body[start:start + 1000]

    response = http.post("/v1/completions", content=chunks(),
                         headers={**AUTH, "Content-Type": "application/json"})
    assert_error(response, 413, "request_too_large")
    # a body under the cap, sent in chunks, arrives whole
    small = json.dumps(completion(2)).encode()
    response = http.post("/v1/completions", content=iter([small[:10], small[10:]]),
                         headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_the_api_key_is_checked_before_the_body_is_read(http) -> None:
    response = http.post("/v1/completions", json=completion(2, user="x" * LIMIT))
    assert_error(response, 401, "invalid_api_key")


def assert_engine_holds_nothing(server) -> None:
    """No sequence running or waiting, no request tracked, no KV block held. Read right
    after the 408 (no sleep): the server answers it only once the engine has aborted the
    request and published the snapshot after the abort (AsyncLLMEngine.synchronize)."""
    for gauge in ("num_requests_running", "num_requests_waiting", "num_requests_tracked",
                  "num_kv_blocks_held"):
        assert server.metric(gauge) == 0, gauge


def test_a_request_past_the_deadline_is_stopped_with_408(server, http) -> None:
    assert http.post("/v1/completions", json=completion(3), headers=AUTH).status_code == 200
    response = http.post("/v1/completions", json=completion(LONG), headers=AUTH)
    assert_error(response, 408, "request_timeout")
    assert_engine_holds_nothing(server)
    with http.stream("POST", "/v1/completions", json=completion(LONG, stream=True),
                     headers=AUTH) as stream:
        events = []
        for line in stream.iter_lines():
            if line.startswith("data: {\"error\""):  # before [DONE]: the engine let it go
                assert_engine_holds_nothing(server)
            if line:
                events.append(line.removeprefix("data: "))
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert len(events) > 3  # tokens streamed before the deadline
    # the engine dropped both requests: nothing left, and the server still answers
    assert_engine_holds_nothing(server)
    assert http.post("/v1/completions", json=completion(3), headers=AUTH).status_code == 200


def test_cors_answers_the_allowed_origin_only(http) -> None:
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    allowed = http.options("/v1/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    other = http.options("/v1/completions", headers={"Origin": "https://evil.example",
                                                     **preflight})
    assert "access-control-allow-origin" not in other.headers
    models = http.get("/v1/models", headers={"Origin": ORIGIN, **AUTH})
    assert models.status_code == 200
    assert models.headers["access-control-allow-origin"] == ORIGIN


def test_https_with_a_key_and_certificate() -> None:
    args = ["--ssl-keyfile", str(TLS / "key.pem"), "--ssl-certfile", str(TLS / "cert.pem")]
    with RemoteServer(args, https_ca=str(TLS / "cert.pem")) as server:
        assert server.url.startswith("https://")
        response = httpx.post(server.url + "/v1/completions", json=completion(2),
                              verify=server.verify, timeout=60)
        assert response.status_code == 200
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the same port is not served
            httpx.get(server.url.replace("https", "http") + "/health", timeout=5)


@pytest.mark.parametrize("flags, fragment", [
    (["--ssl-keyfile", str(TLS / "key.pem")], "--ssl-certfile"),
    (["--ssl-keyfile", "/nonexistent.pem", "--ssl-certfile", str(TLS / "cert.pem")],
     "no such file"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--max-request-bytes", "0"], "--max-request-bytes"),
])
def test_bad_guard_flags_are_one_line_errors(flags, fragment) -> None:
    assert_one_line_error(run_cli("serve", *flags), fragment)


def test_no_request_makes_the_server_read_a_file(http, tmp_path) -> None:
    """A request's chat_template is template text: a path in it is just text, and Jinja's
    include, import and extends cannot reach the file system."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    messages = [{"role": "user", "content": "Hi"}]

    def tokenize(template: str) -> httpx.Response:
        return http.post("/tokenize", json={"messages": messages, "chat_template": template,
                                            "return_token_strs": True})

    as_text = tokenize(str(secret))
    assert as_text.status_code == 200
    assert "".join(as_text.json()["token_strs"]).replace("Ġ", " ") == str(secret)
    for statement in ("include", "import", "extends"):
        response = tokenize(f"{{% {statement} '{secret}' %}}")
        assert response.status_code == 400, response.text
        assert "TOP-SECRET" not in response.text
    chat = http.post("/v1/chat/completions", headers=AUTH, json={
        "messages": messages, "chat_template": f"{{% include '{secret}' %}}", "max_tokens": 2})
    assert chat.status_code == 400 and "TOP-SECRET" not in chat.text
