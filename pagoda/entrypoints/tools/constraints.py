"""The grammar that makes `tool_choice: "required"` or a named function always produce valid
calls: the output is exactly one Hermes block per call, each function's arguments following
its own `parameters` schema, in the layout the fallback prompt shows (rendering.py):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    </tool_call>

A Lark grammar for llguidance (`StructuredOutputsParams(grammar=...)`):

    start: call ("\\n" call)*          (parallel_tool_calls; else start: call)
    call: call_0 | call_1 | ...        (the allowed functions: all for "required", one if named)
    call_0: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " %json {...} "}\\n</tool_call>"

The name and the JSON around the arguments are literal text, so each `parameters` schema is
the root of its own `%json` (its "$ref"s resolve as written); JSON whitespace is fixed to
`json.dumps`' separators. The Hermes parser reads the result (parsers.py).
"""

from __future__ import annotations

import json
from typing import Any

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                    "additionalProperties": False}
"""A function without `parameters` takes none (OpenAI: "an empty parameter list")."""
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options: the layout json.dumps writes (and the prompt shows)."""


def parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The schema a function's arguments follow."""
    return EMPTY_PARAMETERS if parameters is None else parameters


def tool_call_grammar(functions: list[dict[str, Any]], parallel: bool) -> str:
    """The Lark grammar of one call (or, when `parallel`, one or more calls) to any of
    `functions` ({"name", "parameters"} dicts; names are plain identifiers, checked by the
    protocol)."""
    assert functions, "a constrained call needs at least one function"
    rules = []
    tail = json.dumps("}\n</tool_call>")
    for i, function in enumerate(functions):
        schema = {**parameters_schema(function.get("parameters")), "x-guidance": JSON_LAYOUT}
        head = '<tool_call>\n{"name": ' + json.dumps(function["name"]) + ', "arguments": '
        rules.append(f"call_{i}: {json.dumps(head)} %json {json.dumps(schema)} {tail}")
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
    return "\n".join([start, f"call: {alternatives}", *rules]) + "\n"
