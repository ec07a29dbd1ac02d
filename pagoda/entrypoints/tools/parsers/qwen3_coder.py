"""Qwen3-Coder's XML calls, in `<tool_call>` blocks anywhere in the text (like Hermes):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A block is a call when its body is exactly one `<function=NAME>` element naming one of the
request's functions, holding only `<parameter=KEY>` elements (a missing `</parameter>` or
`</function>` is tolerated, as Qwen's own parser does); anything else leaves the block in the
content, verbatim. A value is the text between the tags less one newline at each end, read by
the parameter's type in the function's JSON schema:

    a type list with null                null / none (any case) -> null; else by the rest
    string (or a type list with string)  the text, as written
    integer / number                     int / float (written without a point: an int)
    boolean                              true / false (any case)
    object / array                       JSON (or a Python literal)
    no type in the schema                JSON if it parses, else the text
    not in the schema                    the text

A value its type cannot read stays text (the model's words are kept, not dropped).
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from pagoda.entrypoints.tools.parsers.base import dump_arguments, load_json
from pagoda.entrypoints.tools.parsers.hermes import TaggedBlockParser

FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)",
                       re.DOTALL)
INTEGER = re.compile(r"[+-]?[0-9]+")


class Qwen3CoderToolParser(TaggedBlockParser):
    name = "qwen3_coder"

    def read_block(self, body: str) -> tuple[str, str] | None:
        function = FUNCTION.match(body)
        if function is None:
            return None
        name, inner = function.group(1).strip(), function.group(2)
        if not self.allows(name):
            return None
        properties = (self.schemas.get(name) or {}).get("properties") or {}
        arguments: dict[str, Any] = {}
        position = 0
        for parameter in PARAMETER.finditer(inner):
            if inner[position:parameter.start()].strip():
                return None  # text between parameters: not this format
            key, value = parameter.group(1).strip(), parameter.group(2)
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key] = typed_value(value, properties.get(key), key in properties)
            position = parameter.end()
        if inner[position:].strip():
            return None
        return name, dump_arguments(arguments)  # (values are JSON values: it cannot fail)


def typed_value(text: str, schema: Any, known: bool) -> Any:
    """A parameter's text as its schema's type (the module doc's table)."""
    if not known:
        return text
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if not types:
        return _json_or_text(text)
    word = text.strip()
    if "null" in types and word.lower() in ("null", "none"):
        return None
    if "string" in types:
        return text
    for kind in types:
        try:
            if kind == "integer" and INTEGER.fullmatch(word):
                return int(word)
            if kind == "number":
                number = float(word)
                if not math.isfinite(number):
                    continue
                return int(word) if INTEGER.fullmatch(word) else number
            if kind == "boolean" and word.lower() in ("true", "false"):
                return word.lower() == "true"
            if kind in ("object", "array"):
                value = _json_or_literal(word)
                if isinstance(value, dict if kind == "object" else list):
                    return value
        except (ValueError, OverflowError):
            continue
    return text


def _json_or_text(text: str) -> Any:
    try:
        return load_json(text)
    except ValueError:
        return text


def _json_or_literal(text: str) -> Any:
    """The JSON value of `text` written as JSON or as a Python literal (tuples become
    lists); None when it is neither, or holds what JSON cannot (sets, bytes, NaN)."""
    try:
        return load_json(text)
    except ValueError:
        pass
    try:
        return load_json(json.dumps(ast.literal_eval(text), allow_nan=False))
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None
