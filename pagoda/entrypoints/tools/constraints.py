"""The grammar that makes `tool_choice: "required"` or a named function always produce valid
calls: the output is exactly one Hermes block per call, each function's arguments following
its own `parameters` schema, in the layout the fallback prompt shows (rendering.py):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    </tool_call>

A Lark grammar for llguidance (`StructuredOutputsParams(grammar=...)`):

    start: call ("\\n" call)*          ("required" with parallel_tool_calls; else start: call)
    call: call_0 | call_1 | ...        (the allowed functions: all for "required", one if named)
    call_0: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " %json {...} "}\\n</tool_call>"

The name and the JSON around the arguments are literal text, so each `parameters` schema is
the root of its own `%json` (its "$ref"s resolve as written); JSON whitespace is fixed to
`json.dumps`' separators. A named function is called exactly once (as OpenAI does), and a
grammar that allows no more calls is complete after the last `</tool_call>`, which ends the
request at once (engine/core/lifecycle.py). parsers/forced.py reads the result, streaming each
call's arguments as they are written and never sending the wrapper as content.
"""

from __future__ import annotations

import json
from typing import Any

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                    "additionalProperties": False}
"""A function without `parameters` takes none (OpenAI: "an empty parameter list")."""
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options: the layout json.dumps writes (and the prompt shows)."""


CALL_HEAD = '<tool_call>\n{"name": '
"""A call's text: CALL_HEAD, the name as a JSON string, ARGUMENTS_KEY, the arguments
object, CALL_TAIL; calls are joined by CALL_SEPARATOR (what parsers/forced.py reads)."""
ARGUMENTS_KEY = ', "arguments": '
CALL_TAIL = "}\n</tool_call>"
CALL_SEPARATOR = "\n"


def parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The schema a function's arguments follow."""
    return EMPTY_PARAMETERS if parameters is None else parameters


def tool_call_grammar(functions: list[dict[str, Any]], parallel: bool) -> str:
    """The Lark grammar of one call (or, when `parallel`, one or more calls) to any of
    `functions` ({"name", "parameters"} dicts; names are plain identifiers, checked by the
    protocol)."""
    assert functions, "a constrained call needs at least one function"
    rules = []
    tail = json.dumps(CALL_TAIL)
    for i, function in enumerate(functions):
        schema = {**parameters_schema(function.get("parameters")), "x-guidance": JSON_LAYOUT}
        head = CALL_HEAD + json.dumps(function["name"]) + ARGUMENTS_KEY
        rules.append(f"call_{i}: {json.dumps(head)} %json {json.dumps(schema)} {tail}")
    start = f"start: call ({json.dumps(CALL_SEPARATOR)} call)*" if parallel else "start: call"
    alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
    return "\n".join([start, f"call: {alternatives}", *rules]) + "\n"
