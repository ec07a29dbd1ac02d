"""The Hermes tool-call parser without a model: calls and content of whole outputs with zero,
one and two `<tool_call>` blocks, malformed blocks left as content, and the streaming parser
fed the same texts in random pieces giving the same result, fragment by fragment."""

from __future__ import annotations

import json
import random

import pytest

from pagoda.entrypoints.tools.parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    ParsedOutput,
    StreamDelta,
    assemble,
    parse_output,
)
from tests.entrypoints.tool_parser_checks import check_streaming

NAMES = {"get_weather", "get_time"}
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC", "format": "24h"}}\n' \
       '</tool_call>'


def parse(text: str, tool_names=NAMES, max_calls=None) -> ParsedOutput:
    return parse_output(HermesToolParser(tool_names, max_calls), text)


def calls_of(parsed: ParsedOutput) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def test_text_without_calls_is_content_unchanged():
    for text in ["The weather is fine.", "  spaced  \n", "a < b and <tool>s <tool_c", "<"]:
        parsed = parse(text)
        assert parsed.content == text and parsed.tool_calls == []
    assert parse("").content is None


def test_one_call_alone_and_after_text():
    parsed = parse(WEATHER)
    assert parsed.content is None
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"})]
    call = parsed.tool_calls[0]
    assert call.id.startswith("call_") and len(call.id) > len("call_")
    assert call.arguments == json.dumps({"city": "Paris"})

    parsed = parse("Let me look that up.\n\n" + WEATHER + "\n")
    assert parsed.content == "Let me look that up."
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"})]


def test_two_calls_keep_their_order_and_distinct_ids():
    parsed = parse(WEATHER + "\n" + TIME)
    assert parsed.content is None
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"}),
                                ("get_time", {"zone": "UTC", "format": "24h"})]
    assert len({call.id for call in parsed.tool_calls}) == 2
    # parallel_tool_calls false: only the first call is kept.
    assert calls_of(parse(WEATHER + "\n" + TIME, max_calls=1)) == [
        ("get_weather", {"city": "Paris"})]


def test_text_between_and_after_calls_is_content():
    parsed = parse("First " + WEATHER + " then " + TIME + " done.")
    assert parsed.content == "Firstthendone."  # whitespace touching a call is dropped
    assert [name for name, _ in calls_of(parsed)] == ["get_weather", "get_time"]


@pytest.mark.parametrize("block", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',  # bad JSON
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # no }
    "<tool_call>\nget_weather(city='Paris')\n</tool_call>",  # not JSON at all
    '<tool_call>\n["get_weather"]\n</tool_call>',  # not an object
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',  # arguments a list
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # unknown function
])
def test_a_malformed_block_stays_in_the_content_verbatim(block):
    parsed = parse("Calling. " + block + " Done.")
    assert parsed.tool_calls == []
    assert parsed.content == "Calling. " + block + " Done."
    # ... and does not stop a good call after it.
    parsed = parse(block + "\n" + WEATHER)
    assert parsed.content == block
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"})]


def test_argument_variants_models_write():
    as_text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}' \
              '</tool_call>'
    assert calls_of(parse(as_text)) == [("get_weather", {"city": "Rome"})]
    parameters = '<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo"}}</tool_call>'
    assert calls_of(parse(parameters)) == [("get_weather", {"city": "Oslo"})]
    no_arguments = '<tool_call>{"name": "get_time"}</tool_call>'
    assert calls_of(parse(no_arguments)) == [("get_time", {})]
    assert calls_of(parse(no_arguments, tool_names=None)) == [("get_time", {})]


def test_a_block_left_open_at_the_end():
    # Models often stop at EOS instead of writing the end tag: a complete call still counts.
    assert calls_of(parse(WEATHER.removesuffix("</tool_call>"))) == [
        ("get_weather", {"city": "Paris"})]
    cut = WEATHER[:40]
    parsed = parse("Sure. " + cut)
    assert parsed.tool_calls == [] and parsed.content == "Sure. " + cut


TEXTS = [
    "",
    "Plain answer, no tools at all. A < sign and a <tool> tag.",
    WEATHER,
    "Let me check.\n" + WEATHER + "\n" + TIME + "\nThat is all.",
    "Broken: <tool_call>{\"name\": \"get_weather\", \"arguments\": {]}</tool_call>\n" + TIME,
    WEATHER + "\n<tool_call>\n{\"name\": \"get_time\"",  # open and incomplete at the end
    "  \n" + TIME + "  \n  ",
]


def feed_in_pieces(text: str, rng: random.Random, max_calls=None) -> list[StreamDelta]:
    parser = HermesToolParser(NAMES, max_calls)
    deltas, i = [], 0
    while i < len(text):
        size = rng.randint(1, 12)
        deltas.append(parser.feed(text[i:i + size]))
        i += size
    deltas.append(parser.finish())
    return deltas


def without_ids(parsed: ParsedOutput) -> tuple:
    return parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("max_calls", [None, 1])
def test_streaming_in_random_pieces_assembles_to_the_whole_result(text, max_calls):
    whole = without_ids(parse(text, max_calls=max_calls))
    rng = random.Random(1234)
    for _ in range(50):
        deltas = feed_in_pieces(text, rng, max_calls)
        assert without_ids(assemble(deltas)) == whole
        # Each call: a first fragment with id and name and no arguments, then its arguments.
        fragments = [f for d in deltas for f in d.tool_calls]
        for index in {f.index for f in fragments}:
            own = [f for f in fragments if f.index == index]
            assert own[0].id.startswith("call_") and own[0].name and own[0].arguments == ""
            assert all(f.id is None and f.name is None for f in own[1:])


def test_text_that_may_start_a_call_is_held_back_until_it_cannot():
    parser = HermesToolParser(NAMES)
    assert parser.feed("Hello <tool").content == "Hello"  # the space waits too
    assert parser.feed("box> and more").content == " <toolbox> and more"
    assert parser.feed(" <tool_ca").content == ""
    delta = parser.feed('ll>{"name": "get_time", "arguments": {}}</tool_call>')
    assert delta.content == "" and [f.name for f in delta.tool_calls] == ["get_time", None]
    assert parser.finish() == StreamDelta()


def test_parsers_are_registered_by_name():
    assert TOOL_PARSERS["hermes"] is HermesToolParser


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_cut_at_every_position_assembles_to_the_whole_result(text):
    for max_calls in (None, 1):
        whole = check_streaming(HermesToolParser, text, tool_names=NAMES, max_calls=max_calls)
        assert without_ids(whole) == without_ids(parse(text, max_calls=max_calls))
