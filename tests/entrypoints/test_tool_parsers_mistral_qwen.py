"""The Mistral ([TOOL_CALLS], v3 JSON list and v11+ name[ARGS]{...}) and Qwen3-Coder (XML in
<tool_call> blocks, values typed by the function's schema) parsers without a model: calls and
content, every way of streaming them giving the same (tool_parser_checks.py), malformed or
unknown calls left as content, max_calls."""

from __future__ import annotations

import pytest

from pagoda.entrypoints.tools.parsers import (
    TOOL_PARSERS,
    MistralToolParser,
    Qwen3CoderToolParser,
)
from tests.entrypoints.tool_parser_checks import parse

PARIS = ("get_weather", {"city": "Paris"})
UTC = ("get_time", {"zone": "UTC"})


def mistral(text, **kwargs):
    return parse(MistralToolParser, text, **kwargs)


def test_mistral_v3_json_list():
    text = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, '
            '"id": "a1b2c3d4e"}, {"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}]')
    assert mistral(text) == (None, [PARIS, UTC])
    assert mistral(text + "</s>") == (None, [PARIS, UTC])  # the EOS kept with the markers
    assert mistral(text, max_calls=1) == (None, [PARIS])
    assert mistral('[TOOL_CALLS]{"name": "get_time", "arguments": {"zone": "UTC"}}') == (
        None, [UTC])
    assert mistral('Let me check. [TOOL_CALLS][{"name": "get_time", "arguments": '
                   '{"zone": "UTC"}}]') == ("Let me check.", [UTC])


def test_mistral_v11_named_calls():
    text = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
            '[TOOL_CALLS]get_time[CALL_ID]x7Yz0Q1w2[ARGS]{"zone": "UTC"}</s>')
    assert mistral(text) == (None, [PARIS, UTC])
    assert mistral("I will look.\n" + text) == ("I will look.", [PARIS, UTC])
    assert mistral(text, max_calls=1) == (None, [PARIS])
    assert mistral("[TOOL_CALLS]get_time[ARGS]{}\nDone.") == ("Done.", [("get_time", {})])


@pytest.mark.parametrize("text", [
    "Plain answer [with brackets] and [TOOL_CALL text",
    '[TOOL_CALLS] [{"name": "launch_rockets", "arguments": {}}]',  # unknown function
    '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "launch_rockets"}]',
    '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": }}]',  # bad JSON
    '[TOOL_CALLS] []',
    '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}',  # cut short
    "[TOOL_CALLS]launch_rockets[ARGS]{}",
    '[TOOL_CALLS]get_time[ARGS]["UTC"]',  # arguments not an object
    '[TOOL_CALLS]get_time[ARGS]{"zone": "UT',
    "[TOOL_CALLS]get_time",
    "[TOOL_CALLS]get time[ARGS]{}",
    "[TOOL_CALLS]",
    "an </s> in the middle stays",
])
def test_mistral_non_calls_are_content_verbatim(text):
    assert mistral(text) == (text, [])


def test_mistral_needs_its_special_tokens_decoded():
    assert MistralToolParser.keeps_special_tokens
    assert not any(TOOL_PARSERS[name].keeps_special_tokens
                   for name in ("hermes", "llama3_json", "pythonic", "qwen3_coder"))


def block(function: str, **parameters: str) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n"
                   for key, value in parameters.items())
    return f"<tool_call>\n<function={function}>\n{body}</function>\n</tool_call>"


def qwen(text, **kwargs):
    return parse(Qwen3CoderToolParser, text, **kwargs)


def test_qwen3_coder_calls_with_values_read_by_their_schema():
    text = block("get_weather", city="Paris", days="3", hot="True", tags='["a", "b"]',
                 where="{'lat': 48.9}", factor="2", note="null")
    assert qwen(text) == (None, [("get_weather", {
        "city": "Paris", "days": 3, "hot": True, "tags": ["a", "b"], "where": {"lat": 48.9},
        "factor": 2, "note": None})])
    # strings stay as written (numbers too); multi-line values keep their inner lines
    assert qwen(block("get_weather", city="42", note="line 1\n\nline 3")) == (
        None, [("get_weather", {"city": "42", "note": "line 1\n\nline 3"})])
    # a value its type cannot read stays text; a parameter not in the schema is text
    assert qwen(block("get_weather", days="three", factor="nan", extra="5")) == (
        None, [("get_weather", {"days": "three", "factor": "nan", "extra": "5"})])
    # no schema given: JSON where it parses
    assert qwen(block("get_time", zone="UTC"), schemas={}) == (
        None, [("get_time", {"zone": "UTC"})])
    two = "Checking.\n" + block("get_time", zone="UTC") + "\n" + block("get_time", zone="CET")
    assert qwen(two) == ("Checking.", [UTC, ("get_time", {"zone": "CET"})])
    assert qwen(two, max_calls=1) == ("Checking.", [UTC])


def test_qwen3_coder_tolerates_missing_end_tags():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "<parameter=days>\n3\n</function>\n</tool_call>")
    assert qwen(text) == (None, [("get_weather", {"city": "Paris", "days": 3})])
    # the model stopped at EOS before closing the block: a complete call still counts
    assert qwen(block("get_time", zone="UTC").removesuffix("\n</tool_call>")) == (None, [UTC])


@pytest.mark.parametrize("text", [
    block("launch_rockets", count="3"),  # unknown function
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # Hermes JSON
    ("<tool_call>\n<function=get_time>\nsome words\n<parameter=zone>\nUTC\n</parameter>\n"
    "</function>\n</tool_call>"),  # text between parameters
    "<tool_call>\n<function=get_time>\n</function>\ntrailing\n</tool_call>",
    "Plain <tool_call text <function=f>",
    "<tool_call>\n<function=get_time>\n<parameter=zone>\nUT",  # cut short: no </function>
])
def test_qwen3_coder_non_calls_are_content_verbatim(text):
    if text.endswith("UT"):  # an open block whose body is a call counts; this one is cut
        assert qwen(text) == (None, [("get_time", {"zone": "UT"})])
        return
    assert qwen(text) == (text, [])


def test_the_parsers_are_registered():
    assert TOOL_PARSERS["mistral"] is MistralToolParser
    assert TOOL_PARSERS["qwen3_coder"] is Qwen3CoderToolParser
