"""Pythonic calls (Llama 3.2 and Llama 4 templates that ask for them): the answer is a Python
list of calls with keyword arguments, optionally between `<|python_start|>` and
`<|python_end|>`:

    [get_weather(city="Paris", days=3), get_time(zone='UTC')]

The list is read with Python's `ast`, never run: each element must be a call of one of the
request's functions by its plain name, with keyword arguments only, each a literal: a string,
a number, True/False, None, or lists and dicts (string keys) of those; an empty list is no
call. A list that is not that stays content, verbatim, and so does everything after it.
Calls are only looked for where the answer starts (after whitespace) and right after a list
of calls, like Llama 3 JSON (llama3_json.py).
"""

from __future__ import annotations

import ast
import math
from collections.abc import Collection, Mapping
from typing import Any

from pagoda.entrypoints.tools.parsers.base import (
    CALLS,
    DROP,
    GAP,
    TEXT,
    WHITESPACE,
    Piece,
    PieceParser,
    dump_arguments,
)

START_TAG, END_TAG = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(PieceParser):
    name = "pythonic"

    def __init__(self, tool_names: Collection[str] | None = None,
                 max_calls: int | None = None,
                 schemas: Mapping[str, dict[str, Any] | None] | None = None) -> None:
        super().__init__(tool_names, max_calls, schemas)
        self._calls_possible = True
        """False once the answer had content: the rest is content."""

    def next_piece(self, text: str, final: bool) -> Piece | None:
        if not self._calls_possible:
            return Piece(len(text), TEXT)
        skip = len(text) - len(text.lstrip(WHITESPACE))
        if skip:
            return Piece(skip, TEXT)
        for tag, kind in ((START_TAG, GAP), (END_TAG, DROP)):
            if kind == DROP and not self.after_call:
                continue
            if text.startswith(tag):
                return Piece(len(tag), kind)
            if tag.startswith(text) and not final:
                return None
        if text[0] == "[":
            end = self.bracket_end(text, 0, final, python=True)
            if end is None and not final:
                return None
            calls = None if end is None else self.read_calls(text[:end])
            if calls:
                return Piece(end, CALLS, tuple(calls))
        self._calls_possible = False
        return Piece(len(text), TEXT)

    def read_calls(self, source: str) -> list[tuple[str, str]] | None:
        """The (name, arguments JSON text) of a list of calls, or None if `source` is not
        one (the module doc's rules)."""
        try:
            tree = ast.parse(source, mode="eval")
        except (SyntaxError, ValueError, RecursionError):
            return None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for element in tree.body.elts:
            if (not isinstance(element, ast.Call) or not isinstance(element.func, ast.Name)
                    or element.args or not self.allows(element.func.id)):
                return None
            arguments = {}
            for keyword in element.keywords:
                if keyword.arg is None:  # **kwargs
                    return None
                try:
                    arguments[keyword.arg] = literal(keyword.value)
                except ValueError:
                    return None
            calls.append((element.func.id, dump_arguments(arguments)))
        return calls


def literal(node: ast.expr) -> Any:
    """The JSON value of a literal node; ValueError for anything else."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (str, bool)):
            return value
        if isinstance(value, (int, float)) and math.isfinite(value):
            return value
    elif (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
          and isinstance(node.operand, ast.Constant)
          and type(node.operand.value) in (int, float)):
        value = literal(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, ast.List):
        return [literal(item) for item in node.elts]
    elif isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):  # {**other}
            raise ValueError("dict unpacking")
        keys = [literal(key) for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise ValueError("dict keys must be strings")
        return dict(zip(keys, (literal(value) for value in node.values)))
    raise ValueError(f"not a literal: {ast.dump(node)}")
