"""The forced-call parser (tool_choice "required" or named: the output follows the grammar of
tools/constraints.py): each call's id and name as soon as the name is read, its arguments as
they are written, the wrapper never in the content, an output cut short giving no content,
and every way of streaming an output giving the same (tool_parser_checks.py)."""

from __future__ import annotations

import json

import pytest

from pagoda.entrypoints.tools.parsers import ForcedCallParser, assemble
from tests.entrypoints.tool_parser_checks import check_streaming, feed, raw_results


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


WEATHER = call("get_weather", {"city": "Saint-\u00c9tienne \\\"Loire\\\" {x}", "days": 3})
TIME = call("get_time", {"zone": "UTC"})
WEATHER_ARGUMENTS = json.dumps({"city": "Saint-\u00c9tienne \\\"Loire\\\" {x}", "days": 3})


def forced(text: str, names=("get_weather", "get_time"), max_calls=None):
    return raw_results(check_streaming(ForcedCallParser, text, tool_names=names,
                                       max_calls=max_calls))


def test_calls_keep_the_arguments_as_written():
    assert forced(WEATHER) == (None, [("get_weather", WEATHER_ARGUMENTS)])
    assert forced(WEATHER + "\n" + TIME) == (
        None, [("get_weather", WEATHER_ARGUMENTS), ("get_time", '{"zone": "UTC"}')])
    assert forced(WEATHER + "\n" + TIME, max_calls=1) == (
        None, [("get_weather", WEATHER_ARGUMENTS)])


def test_the_name_comes_first_then_the_arguments_as_they_are_written():
    parser = ForcedCallParser({"get_weather"})
    head, rest = WEATHER.split(", \"arguments\": ")
    assert not parser.feed(head)  # the name might go on
    assert not parser.feed(', "arguments": ')  # the arguments might not be an object
    first = parser.feed(rest[0]).tool_calls
    assert [(f.index, f.id is not None, f.name, f.arguments) for f in first] == [
        (0, True, "get_weather", ""), (0, False, None, "{")]
    streamed = [parser.feed(rest[i:i + 4]) for i in range(1, len(rest), 4)]
    streamed.append(parser.finish())
    pieces = [f.arguments for d in streamed for f in d.tool_calls]
    assert len(pieces) > 5 and "{" + "".join(pieces) == WEATHER_ARGUMENTS
    assert all(not d.content for d in streamed)


@pytest.mark.parametrize("size", range(len(WEATHER)))
def test_an_output_cut_short_has_no_content(size):
    cut = WEATHER[:size]
    content, calls = forced(cut)
    assert content is None
    named = len(cut) > len('<tool_call>\n{"name": "get_weather", "arguments": ')
    if not named:
        assert calls == []
    else:  # the arguments written so far, the wrapper's tail left out
        [(name, arguments)] = calls
        assert name == "get_weather" and WEATHER_ARGUMENTS.startswith(arguments)
        assert len(arguments) == min(len(cut) - len(WEATHER) + len(WEATHER_ARGUMENTS) +
                                     len("}\n</tool_call>"), len(WEATHER_ARGUMENTS))


@pytest.mark.parametrize("text", [
    "Sure, here it is: " + TIME,  # without the grammar a model may write anything
    call("launch_rockets", {}),
    '<tool_call>\n{"name": "get_time", "arguments": ["UTC"]}\n</tool_call>',
])
def test_text_outside_the_layout_is_content_as_written(text):
    content, calls = forced(text)
    assert calls == [] and content == text


def test_text_after_the_layout_ends_is_content():
    assert forced(TIME + " and more") == (" and more", [("get_time", '{"zone": "UTC"}')])
    parser = ForcedCallParser({"get_time"})
    deltas = feed(parser, [TIME + "\n<tool_call>\n{\"name\": \"get_time\", \"arg"])
    assert raw_results(assemble(deltas)) == (None, [("get_time", '{"zone": "UTC"}')])
