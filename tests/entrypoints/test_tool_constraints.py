"""The grammar of forced tool calls, compiled by the engine's grammar compiler on the bundled
tokenizer: it derives exactly the calls the forced-call parser reads (the name one of the
allowed functions, the arguments valid against that function's schema, one call or several),
and nothing else; a named tool_choice allows one call only, and a grammar that allows no more
calls is complete (it ends the request) right after the last `</tool_call>`."""

from __future__ import annotations

import json

import pytest

from pagoda.entrypoints.tools.constraints import tool_call_grammar
from pagoda.entrypoints.tools.parsers import ForcedCallParser, parse_output
from pagoda.entrypoints.tools.plan import ToolPlan
from pagoda.structured_outputs import StructuredOutputsParams

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}
TIME = {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
    "$defs": {"zone": {"enum": ["UTC", "CET"]}}}}
NOW = {"name": "now"}  # no parameters: takes {}


@pytest.fixture
def tokenizer(bundled_tokenizer):
    return bundled_tokenizer


@pytest.fixture
def compiler(bundled_grammar_compiler):
    return bundled_grammar_compiler


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def derives(compiler, tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar accepts `text`, then EOS, token by token."""
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(grammar=grammar)))
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept(token_id):
            return False
    return matcher.accept(tokenizer.eos_token_id)


def test_one_call_to_any_allowed_function(compiler, tokenizer):
    grammar = tool_call_grammar([WEATHER, TIME, NOW], parallel=False)
    for text in [call("get_weather", {"city": "Paris", "unit": "celsius"}),
                 call("get_time", {"zone": "CET"}), call("now", {})]:
        assert derives(compiler, tokenizer, grammar, text), text
        parsed = parse_output(ForcedCallParser({"get_weather", "get_time", "now"}), text)
        assert parsed.content is None and len(parsed.tool_calls) == 1
    for text in [call("get_weather", {"city": "Paris"}),  # a required argument missing
                 call("get_weather", {"city": "Paris", "unit": "kelvin"}),  # not in the enum
                 call("get_time", {"zone": "PST"}),  # $ref resolved in its own schema
                 call("now", {"x": 1}),  # takes no arguments
                 call("get_date", {}),  # not an allowed function
                 "Sure! " + call("now", {}),  # text around the call
                 call("now", {}) + "\n" + call("now", {}),  # two calls without parallel
                 ""]:
        assert not derives(compiler, tokenizer, grammar, text), text


def test_parallel_calls_and_named_function(compiler, tokenizer):
    parallel = tool_call_grammar([WEATHER, TIME], parallel=True)
    two = call("get_time", {"zone": "UTC"}) + "\n" + call("get_weather", {
        "city": "Oslo", "unit": "fahrenheit"})
    assert derives(compiler, tokenizer, parallel, two)
    assert derives(compiler, tokenizer, parallel, call("get_time", {"zone": "UTC"}))
    assert [c.name for c in parse_output(ForcedCallParser(), two).tool_calls] == [
        "get_time", "get_weather"]
    named = tool_call_grammar([TIME], parallel=True)
    assert not derives(compiler, tokenizer, named, call("get_weather", {
        "city": "Oslo", "unit": "celsius"}))


def test_the_layout_is_fixed_so_the_model_cannot_wander(compiler, tokenizer):
    grammar = tool_call_grammar([TIME], parallel=False)
    spaced = '<tool_call>\n{"name": "get_time", "arguments": {"zone":   "UTC"}}\n</tool_call>'
    compact = '<tool_call>\n{"name":"get_time","arguments":{"zone":"UTC"}}\n</tool_call>'
    assert not derives(compiler, tokenizer, grammar, spaced)
    assert not derives(compiler, tokenizer, grammar, compact)


def test_a_named_function_is_called_once_even_with_parallel_calls(compiler, tokenizer):
    tools = [{"type": "function", "function": f} for f in (WEATHER, TIME)]
    named = ToolPlan.of(tools, {"type": "function", "function": {"name": "get_time"}}, True)
    grammar = named.structured_outputs().grammar
    once = call("get_time", {"zone": "UTC"})
    assert derives(compiler, tokenizer, grammar, once)
    assert not derives(compiler, tokenizer, grammar, once + "\n" + once)
    required = ToolPlan.of(tools, "required", True).structured_outputs().grammar
    assert derives(compiler, tokenizer, required, once + "\n" + once)


def test_the_grammar_is_complete_right_after_the_last_call(compiler, tokenizer):
    text = call("get_time", {"zone": "UTC"})
    for parallel, complete in [(False, True), (True, False)]:
        grammar = tool_call_grammar([TIME], parallel=parallel)
        matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(grammar=grammar)))
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        for token_id in token_ids[:-1]:
            assert matcher.accept(token_id) and not matcher.is_finished
        assert matcher.accept(token_ids[-1])
        assert matcher.is_finished == complete  # (parallel: a "\n" and another call may follow)
