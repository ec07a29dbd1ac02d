"""`--tool-call-parser auto` and the parser choice in the server, without a model: the rules
that pick a parser from the chat template, then each parser through the chat endpoint on a
scripted fake engine (whole and streamed alike), with special tokens kept for the formats
whose markers are special tokens."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from pagoda.entrypoints.openai.model_registry import ServedModel
from pagoda.entrypoints.openai.server import build_app
from pagoda.entrypoints.openai.server_state import ServerState
from pagoda.entrypoints.tools.parsers import TOOL_PARSER_CHOICES, resolve_tool_call_parser
from tests.entrypoints import tool_family_templates as templates
from tests.entrypoints.test_serving_pipeline import sse_events
from tests.entrypoints.test_serving_tools import QUESTION, TOOLS, ScriptedEngine
from tests.entrypoints.test_tool_rendering import SMOLLM_TEMPLATE


@pytest.mark.parametrize("template, parser", [
    (templates.LLAMA31, "llama3_json"),
    # Llama 3.2's JSON template: the ipython role, no <|python_tag|>
    (templates.LLAMA31.replace("<|python_tag|>", ""), "llama3_json"),
    (templates.PYTHONIC, "pythonic"),
    ("{{ '<|python_start|>' }}{{ '<|header_start|>ipython<|header_end|>' }}", "pythonic"),
    (templates.MISTRAL, "mistral"),
    ("{{ '[TOOL_CALLS]' + name + '[ARGS]' + arguments }}", "mistral"),
    (templates.QWEN3_CODER, "qwen3_coder"),  # its blocks are <tool_call> too: not hermes
    (templates.HERMES, "hermes"),
    (SMOLLM_TEMPLATE, "hermes"),  # no tool conventions: the fallback prompt's format
    ({"default": SMOLLM_TEMPLATE, "tool_use": templates.MISTRAL}, "mistral"),
    ({"default": templates.QWEN3_CODER}, "qwen3_coder"),
    (None, "hermes"),
])
def test_auto_picks_the_parser_the_template_calls_for(template, parser):
    assert resolve_tool_call_parser("auto", template) == parser


def test_a_named_parser_is_kept_and_an_unknown_one_refused():
    for name in TOOL_PARSER_CHOICES[:-1]:
        assert resolve_tool_call_parser(name, templates.MISTRAL) == name
    assert TOOL_PARSER_CHOICES[-1] == "auto"
    with pytest.raises(ValueError, match="unknown tool-call parser 'json'"):
        resolve_tool_call_parser("json", None)


OUTPUTS = {
    "hermes": 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
              "</tool_call>",
    "llama3_json": '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}',
    "pythonic": "[get_time(zone='UTC')]",
    "mistral": 'Checking.[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}</s>',
    "qwen3_coder": "Checking.\n<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n"
                   "</parameter>\n</function>\n</tool_call>",
}


def chat(parser: str, script: str, chat_template: str | None = None, **fields):
    """(whole body, streamed chunks' choices, the engine) of one chat request."""
    engine = ScriptedEngine([script])
    state = ServerState(models=[ServedModel("m", engine, "/m")],
                        chat_template=chat_template, tool_call_parser=parser)
    body = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 200, **fields}
    with TestClient(build_app(state)) as client:
        whole = client.post("/v1/chat/completions", json=body).json()
        streamed = [c["choices"][0] for c in sse_events(
            client.post("/v1/chat/completions", json={**body, "stream": True}))]
    return whole, streamed, engine


@pytest.mark.parametrize("parser", OUTPUTS)
def test_each_parser_reads_its_format_through_the_chat_endpoint(parser):
    whole, streamed, engine = chat(parser, OUTPUTS[parser])
    choice = whole["choices"][0]
    content = "Checking." if OUTPUTS[parser].startswith("Checking.") else None
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == content
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    text = "".join(c["delta"].get("content") or "" for c in streamed)
    arguments = "".join(f["function"].get("arguments", "") for c in streamed
                        for f in c["delta"].get("tool_calls") or [])
    assert (text or None, arguments) == (content, call["function"]["arguments"])
    assert streamed[-1]["finish_reason"] == "tool_calls"
    skips = {request.params.skip_special_tokens for request in engine.added}
    assert skips == {parser != "mistral"}


def test_auto_reads_the_format_of_the_served_template():
    # the template has Mistral's conventions but reads no `tools` (so the fake renders it)
    template = "{# [TOOL_CALLS] #}" + SMOLLM_TEMPLATE
    whole, _, engine = chat("auto", OUTPUTS["mistral"], chat_template=template)
    assert whole["choices"][0]["message"]["content"] == "Checking."
    assert json.loads(whole["choices"][0]["message"]["tool_calls"][0]["function"][
        "arguments"]) == {"zone": "UTC"}
    assert engine.added[0].params.skip_special_tokens is False


def test_special_tokens_stay_skipped_when_the_request_says_so_or_calls_are_forced():
    _, _, engine = chat("mistral", OUTPUTS["mistral"], skip_special_tokens=True)
    assert {r.params.skip_special_tokens for r in engine.added} == {True}
    _, _, engine = chat("mistral", OUTPUTS["mistral"], tool_choice="none")
    assert {r.params.skip_special_tokens for r in engine.added} == {True}
