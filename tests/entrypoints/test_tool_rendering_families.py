"""A conversation with tools, a call and its result through templates written after each
family's documented format (tool_family_templates.py): the prompt carries the tools, the call
in the family's syntax and the result in the family's role, and the family's parser reads the
rendered call back to the same call (a round trip). Mistral's 9-character call ids are mapped
from OpenAI's consistently; `--tool-call-parser auto` picks each family's parser."""

from __future__ import annotations

import json
import re

import jinja2
import pytest

from pagoda.entrypoints.tools.parsers import (
    TOOL_PARSERS,
    parse_output,
    resolve_tool_call_parser,
)
from pagoda.entrypoints.tools.rendering import render_chat, short_call_id
from tests.entrypoints import tool_family_templates as templates
from tests.entrypoints.test_tool_rendering import tokenizer_with as plain_tokenizer_with
from tests.entrypoints.tool_parser_checks import NAMES, SCHEMAS

TOOLS = [{"type": "function", "function": {"name": name, "parameters": SCHEMAS[name]}}
         for name in NAMES]
ARGUMENTS = {"city": "Paris", "days": 3}


def tokenizer_with(template: str):
    tokenizer = plain_tokenizer_with(template)
    tokenizer.bos_token, tokenizer.eos_token = "<s>", "</s>"
    return tokenizer


def call(call_id: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}


def conversation(*calls: dict) -> list[dict]:
    results = [{"role": "tool", "tool_call_id": c["id"], "content": f'{{"temperature": {i}}}'}
               for i, c in enumerate(calls, start=20)]
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": list(calls)}, *results]


# family: (template, parser, the rendered call turn as a regex, a tool result as rendered)
FAMILIES = {
    "llama3_json": (templates.LLAMA31, r"assistant<\|end_header_id\|>\n\n(.*?)<\|eom_id\|>",
                    ('<|start_header_id|>ipython<|end_header_id|>\n\n{"temperature": 20}'
                    "<|eot_id|>")),
    "pythonic": (templates.PYTHONIC, r"assistant<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>",
                 '<|start_header_id|>ipython<|end_header_id|>\n\n{"temperature": 20}'),
    "mistral": (templates.MISTRAL, r"\[/INST\](.*?)\[TOOL_RESULTS\]",
                '[TOOL_RESULTS] {"content": {"temperature": 20}, "call_id": "'),
    "qwen3_coder": (templates.QWEN3_CODER, r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>",
                    '<|im_start|>user\n<tool_response>\n{"temperature": 20}\n</tool_response>'),
    "hermes": (templates.HERMES, r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>",
               '<|im_start|>user\n<tool_response>\n{"temperature": 20}\n</tool_response>'),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_call_renders_in_the_family_format_and_parses_back(family):
    template, turn, result = FAMILIES[family]
    prompt = render_chat(tokenizer_with(template), conversation(call("call_abc", ARGUMENTS)),
                         TOOLS)
    assert '"get_time"' in prompt and '"get_weather"' in prompt  # the tools, as the family lists them
    assert result in prompt
    rendered_call = re.search(turn, prompt, re.DOTALL).group(1)
    parser = TOOL_PARSERS[family](NAMES, None, SCHEMAS)
    parsed = parse_output(parser, rendered_call)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", ARGUMENTS)], rendered_call
    assert not (parsed.content or "").strip()
    assert resolve_tool_call_parser("auto", template) == family


def test_the_family_syntax_is_the_documented_one():
    prompts = {family: render_chat(tokenizer_with(template), conversation(
        call("call_abc", ARGUMENTS)), TOOLS) for family, (template, _, _) in FAMILIES.items()}
    assert ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
            in prompts["llama3_json"])
    assert "[get_weather(city='Paris', days=3)]" in prompts["pythonic"]
    assert ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}, '
            '"id": "') in prompts["mistral"]
    assert ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n"
            "3\n</parameter>\n</function>") in prompts["qwen3_coder"]


def test_mistral_gets_nine_character_ids_that_keep_calls_and_results_matched():
    calls = [call("call_0f3a9c2e71b84d5e9a6c1b2d", ARGUMENTS),
             call("call_7d1e8b4a2c9f4e6a8b3d5c1e", {"city": "Rome"}), call("Ab3dE6gH9", {})]
    prompt = render_chat(tokenizer_with(templates.MISTRAL), conversation(*calls), TOOLS)
    call_ids = re.findall(r'"id": "([^"]*)"', prompt)
    result_ids = re.findall(r'"call_id": "([^"]*)"', prompt)
    assert call_ids == result_ids == [short_call_id(c["id"]) for c in calls]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in call_ids)
    assert len(set(call_ids)) == 3 and call_ids[2] == "Ab3dE6gH9"  # a Mistral id stays
    assert short_call_id("call_0f3a9c2e71b84d5e9a6c1b2d") == call_ids[0]  # the same every time
    # other templates see OpenAI's ids unchanged
    hermes = render_chat(tokenizer_with(templates.HERMES + "{{ messages[2].tool_call_id }}"),
                         conversation(calls[0]), TOOLS)
    assert hermes.endswith(calls[0]["id"])


def test_llama31_refuses_parallel_calls_in_one_turn():
    two = conversation(call("call_1", ARGUMENTS), call("call_2", ARGUMENTS))
    with pytest.raises(jinja2.TemplateError, match="single tool-calls"):
        render_chat(tokenizer_with(templates.LLAMA31), two, TOOLS)
