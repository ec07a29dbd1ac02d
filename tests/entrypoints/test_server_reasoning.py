"""--reasoning-parser through `pagoda serve` on the bundled model, with the openai client: a
DeepSeek-R1-style chat template (its generation prompt opens `<think>`) makes `auto` pick
deepseek_r1; the model (which never closes the block) answers with reasoning only, whole
and streamed; a response_format does not touch the thinking (the same greedy text comes
out); the template gets chat_template_kwargs and reasoning_effort."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.server_helpers import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow

R1_STYLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}")
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "r1_style.jinja"
    template.write_text(R1_STYLE_TEMPLATE)
    with RemoteServer(["--chat-template", str(template), "--reasoning-parser", "auto"]) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def create(client, **fields):
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0,
                                          max_tokens=8, **fields)


def streamed(client, **fields) -> tuple[str, str, str | None]:
    reasoning, content, finish = "", "", None
    for chunk in create(client, stream=True, **fields):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


def test_auto_picks_deepseek_r1_and_the_unclosed_thinking_is_all_reasoning(server, client):
    assert "reasoning parser deepseek_r1 (auto, from the chat template)" in server.log_text()
    choice = create(client).choices[0]
    reasoning = choice.message.reasoning_content  # an extra field: the client keeps it
    assert reasoning and choice.message.content is None
    assert choice.finish_reason == "length"
    assert streamed(client) == (reasoning, "", "length")


def test_a_response_format_leaves_the_thinking_free(client):
    free = create(client).choices[0].message.reasoning_content
    choice = create(client, response_format=SCHEMA).choices[0]
    # Not JSON from the first token: the model thinks as it would unconstrained.
    assert choice.message.reasoning_content == free and choice.message.content is None
    assert streamed(client, response_format=SCHEMA) == (free, "", "length")


def test_the_template_gets_the_request_s_kwargs(server, client):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        def prompt(**fields) -> str:
            tokens = http.post("/tokenize", json={"messages": MESSAGES, **fields}).json()
            return http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]

        assert prompt().endswith("<|im_start|>assistant\n<think>\n")
        assert prompt(chat_template_kwargs={"enable_thinking": False}).endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    choice = create(client, reasoning_effort="low",
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    # The prompt closed the thinking, so the output starts after it: no `</think>` comes,
    # and deepseek_r1 takes all of it for reasoning (as vLLM does).
    assert choice.message.reasoning_content and choice.message.content is None
