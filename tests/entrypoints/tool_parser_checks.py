"""Checks every tool-call parser must pass, shared by the per-format tests: a streamed answer
assembles to exactly the whole one however the text is cut (at every position, one character
at a time, in random pieces), each call's fragments come in OpenAI's order, and max_calls
keeps the first calls."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from pagoda.entrypoints.tools.parsers import ParsedOutput, StreamDelta, ToolParser, assemble

NAMES = ("get_weather", "get_time")
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "hot": {"type": "boolean"},
        "tags": {"type": "array"}, "where": {"type": "object"}, "factor": {"type": "number"},
        "note": {"type": ["string", "null"]}}},
    "get_time": {"type": "object", "properties": {"zone": {"type": "string"}}},
}
ParserFactory = Callable[..., ToolParser]


def results(parsed: ParsedOutput) -> tuple[str | None, list[tuple[str, dict]]]:
    """Content and (name, arguments) of each call: what must not depend on the cuts."""
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def raw_results(parsed: ParsedOutput) -> tuple[str | None, list[tuple[str, str]]]:
    return parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


def feed(parser: ToolParser, pieces: list[str]) -> list[StreamDelta]:
    return [parser.feed(piece) for piece in pieces] + [parser.finish()]


def check_fragments(deltas: list[StreamDelta]) -> None:
    """Per call: first a fragment with id and name and no arguments, then only arguments;
    indices 0, 1, 2, ... in order."""
    fragments = [f for d in deltas for f in d.tool_calls]
    firsts = [f for f in fragments if f.id is not None]
    assert [f.index for f in firsts] == list(range(len(firsts)))
    for first in firsts:
        own = [f for f in fragments if f.index == first.index]
        assert own[0] is first and first.id.startswith("call_") and first.name
        assert first.arguments == ""
        assert all(f.id is None and f.name is None for f in own[1:])


def check_streaming(make: ParserFactory, text: str, **kwargs) -> ParsedOutput:
    """The whole result of `text`, after checking that every way of streaming it gives the
    same (content, calls with their argument text)."""
    whole_deltas = feed(make(**kwargs), [text])
    whole = assemble(whole_deltas)
    check_fragments(whole_deltas)
    expected = raw_results(whole)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    rng = random.Random(len(text))
    pieces = []
    for _ in range(5):
        sizes, i = [], 0
        while i < len(text):
            sizes.append(text[i:i + rng.randint(1, 9)])
            i += len(sizes[-1])
        pieces.append(sizes)
    for cut in [*cuts, list(text), *pieces]:
        deltas = feed(make(**kwargs), cut)
        assert raw_results(assemble(deltas)) == expected, (cut, expected)
        check_fragments(deltas)
    return whole


def parse(make: ParserFactory, text: str, names=NAMES, max_calls=None,
          schemas=None) -> tuple[str | None, list[tuple[str, dict]]]:
    """`text` through the checks above; its (content, calls)."""
    return results(check_streaming(make, text, tool_names=names, max_calls=max_calls,
                                   schemas=SCHEMAS if schemas is None else schemas))
