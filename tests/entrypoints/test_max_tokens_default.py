"""--max-tokens-default (issue 50): a request that gives no output cap (max_tokens,
max_completion_tokens, max_output_tokens) gets the server's, capped by the room its prompt
leaves; one that gives a cap keeps it; without the flag, chat runs up to the context and
completions keep OpenAI's default of 16.
In-process, against the serving pipeline's fake engine (one token per step)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pagoda.cli.main import EXIT_USAGE, main
from pagoda.entrypoints.openai.model_registry import ServedModel
from pagoda.entrypoints.openai.server import build_app
from pagoda.entrypoints.openai.server_state import ServerState
from tests.entrypoints.test_serving_pipeline import MAX_MODEL_LEN, FakeAsyncEngine

CHAT = [{"role": "user", "content": "Hi"}]


def make_client(default_max_tokens: int | None) -> TestClient:
    state = ServerState(models=[ServedModel("m", FakeAsyncEngine(), "/m")],
                        default_max_tokens=default_max_tokens)
    return TestClient(build_app(state))


def num_tokens(client: TestClient, path: str, body: dict) -> int:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return usage.get("completion_tokens", usage.get("output_tokens"))


def test_a_request_without_a_cap_gets_the_servers_default() -> None:
    with make_client(3) as client:
        assert num_tokens(client, "/v1/completions", {"prompt": "a"}) == 3
        assert num_tokens(client, "/v1/chat/completions", {"messages": CHAT}) == 3
        assert num_tokens(client, "/v1/responses", {"input": "Hi"}) == 3
        stream = client.post("/v1/completions", json={"prompt": "a", "stream": True})
        assert stream.text.count('"text":"a"') == 3
        # a cap the request gives wins, higher or lower
        assert num_tokens(client, "/v1/completions", {"prompt": "a", "max_tokens": 5}) == 5
        assert num_tokens(client, "/v1/chat/completions",
                          {"messages": CHAT, "max_completion_tokens": 2}) == 2
        assert num_tokens(client, "/v1/responses", {"input": "Hi", "max_output_tokens": 4}) == 4
        # never below min_tokens
        assert num_tokens(client, "/v1/completions", {"prompt": "a", "min_tokens": 4}) == 4


def test_the_default_yields_to_the_room_the_prompt_leaves() -> None:
    prompt = "x" * (MAX_MODEL_LEN - 2)
    with make_client(10) as client:
        assert num_tokens(client, "/v1/completions", {"prompt": prompt}) == 2
        # (a cap the request gives that does not fit is still a 400)
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10})
        assert response.status_code == 400


def test_without_the_flag_today_s_defaults_hold() -> None:
    """Chat runs up to the context; completions keep OpenAI's default of 16."""
    with make_client(None) as client:
        usage = client.post("/v1/chat/completions", json={"messages": CHAT}).json()["usage"]
        assert usage["completion_tokens"] == MAX_MODEL_LEN - usage["prompt_tokens"]
        assert num_tokens(client, "/v1/completions", {"prompt": "abcd"}) == 16


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_bad_default_is_a_usage_error(value, capsys) -> None:
    assert main(["serve", "--max-tokens-default", value]) == EXIT_USAGE
    assert "--max-tokens-default must be >= 1" in capsys.readouterr().err
