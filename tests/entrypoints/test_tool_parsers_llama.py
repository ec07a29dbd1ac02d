"""The Llama parsers without a model: llama3_json (JSON call objects, optionally after
<|python_tag|>, joined by ";") and pythonic (a Python list of calls, read with ast): calls
and content of whole outputs, every way of streaming them giving the same (see
tool_parser_checks.py), malformed or unknown calls left as content, max_calls."""

from __future__ import annotations

import pytest

from pagoda.entrypoints.tools.parsers import (
    TOOL_PARSERS,
    Llama3JsonToolParser,
    PythonicToolParser,
)
from tests.entrypoints.tool_parser_checks import parse

WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
TIME = '{"name": "get_time", "arguments": {"zone": "UTC"}}'


def json_calls(text, **kwargs):
    return parse(Llama3JsonToolParser, text, **kwargs)


def test_llama3_json_calls():
    paris = ("get_weather", {"city": "Paris", "days": 3})
    assert json_calls(WEATHER) == (None, [paris])
    assert json_calls("<|python_tag|>" + WEATHER) == (None, [paris])
    assert json_calls("\n  " + WEATHER + "\n") == (None, [paris])
    both = [paris, ("get_time", {"zone": "UTC"})]
    assert json_calls(WEATHER + "; " + TIME) == (None, both)
    assert json_calls("<|python_tag|>" + WEATHER + ";" + TIME + ";") == (None, both)
    assert json_calls(WEATHER + "\n" + TIME) == (None, both)
    assert json_calls('{"name": "get_time"}') == (None, [("get_time", {})])
    # text after the calls is content; whitespace and ";" between are dropped
    assert json_calls(WEATHER + "; I asked for the weather.") == (
        "I asked for the weather.", [paris])
    # parallel_tool_calls false
    assert json_calls(WEATHER + "; " + TIME, max_calls=1) == (None, [paris])


@pytest.mark.parametrize("text", [
    "The weather is fine. " + WEATHER,  # calls only where the answer starts
    "  Plain answer with a { brace }",
    '{"name": "launch_rockets", "parameters": {}}',  # not one of the request's functions
    '{"name": "get_weather", "parameters": [1]}',  # arguments not an object
    '{"name": "get_weather", "parameters": {"city": }}',  # bad JSON
    '{"name": "get_weather", "parameters": {"city": NaN}}',  # not JSON (json.loads takes it)
    '{"city": "Paris"}',  # no name
    '{"name": "get_weather", "parameters": {"city": "Par',  # cut short
    "<|python_tag|>brave_search.call(query=\"weather\")",  # Llama's built-in tools
    "<|python_ta",
    "",
])
def test_llama3_json_non_calls_are_content_verbatim(text):
    assert json_calls(text) == (text or None, [])


def test_llama3_json_stops_reading_calls_at_the_first_non_call():
    bad = '{"name": "launch_rockets", "parameters": {}}'
    assert json_calls(WEATHER + "; " + bad + "; " + TIME) == (
        bad + "; " + TIME, [("get_weather", {"city": "Paris", "days": 3})])


def pythonic(text, **kwargs):
    return parse(PythonicToolParser, text, **kwargs)


def test_pythonic_calls():
    assert pythonic('[get_weather(city="Paris", days=3)]') == (
        None, [("get_weather", {"city": "Paris", "days": 3})])
    text = ("[get_weather(city='Rome', days=-2, hot=True, note=None, factor=1.5, "
            "tags=['a', \"b]\"], where={'lat': 41.9, 'tags': []}), get_time()]")
    assert pythonic(text) == (None, [
        ("get_weather", {"city": "Rome", "days": -2, "hot": True, "note": None, "factor": 1.5,
                         "tags": ["a", "b]"], "where": {"lat": 41.9, "tags": []}}),
        ("get_time", {})])
    assert pythonic('<|python_start|>[get_time(zone="UTC")]<|python_end|>') == (
        None, [("get_time", {"zone": "UTC"})])
    assert pythonic('  [get_time(zone="""a ] \' " b""")]\nDone.') == (
        "Done.", [("get_time", {"zone": "a ] ' \" b"})])
    assert pythonic("[get_time(zone='UTC'), get_time(zone='CET')]", max_calls=1) == (
        None, [("get_time", {"zone": "UTC"})])


@pytest.mark.parametrize("text", [
    "[1, 2, 3]",  # a list, not calls
    "[]",
    "Sure: [get_time()]",  # calls only where the answer starts
    '[get_weather("Paris")]',  # positional arguments
    "[get_weather(city=x)]",  # a name, not a literal
    "[get_weather(city=open('/etc/passwd').read())]",  # never run
    "[get_weather(city=b'Paris')]",  # bytes
    "[get_weather(city=1e999)]",  # infinity is no JSON number
    "[get_weather(**{'city': 'Paris'})]",
    "[get_weather(city='Paris'), launch_rockets()]",  # one unknown function: all content
    "[os.system(cmd='ls')]",  # dotted name
    "[get_weather(city='Paris'",  # cut short
    "[get_weather(city='Paris')",
    "<|python_start|>Hello",
])
def test_pythonic_non_calls_are_content_verbatim(text):
    assert pythonic(text) == (text or None, [])


def test_the_parsers_are_registered():
    assert TOOL_PARSERS["llama3_json"] is Llama3JsonToolParser
    assert TOOL_PARSERS["pythonic"] is PythonicToolParser
