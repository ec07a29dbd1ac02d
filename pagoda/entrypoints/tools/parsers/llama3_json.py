"""Llama 3.1 / 3.2 JSON calls: the whole answer is one or more call objects, optionally after
Llama's python tag token, separated by ";":

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

("arguments" is read as well as "parameters".) Calls are only looked for where the answer
starts (after whitespace) and right after a call: an answer whose first text is anything
else is content, as written. Reading stops at the first object that is not a call (bad JSON,
a function not offered, not an object): from there on the text is content, verbatim. An
object still open at the end is content too.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from pagoda.entrypoints.tools.parsers.base import (
    CALLS,
    GAP,
    TEXT,
    WHITESPACE,
    Piece,
    PieceParser,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(PieceParser):
    name = "llama3_json"
    separators = ";"

    def __init__(self, tool_names: Collection[str] | None = None,
                 max_calls: int | None = None,
                 schemas: Mapping[str, dict[str, Any] | None] | None = None) -> None:
        super().__init__(tool_names, max_calls, schemas)
        self._calls_possible = True
        """False once the answer had content: the rest is content."""

    def next_piece(self, text: str, final: bool) -> Piece | None:
        if not self._calls_possible:
            return Piece(len(text), TEXT)
        skip = len(text) - len(text.lstrip(WHITESPACE + (";" if self.after_call else "")))
        if skip:  # whitespace waits (before a call it is dropped); separators after a call go
            return Piece(skip, TEXT)
        if text.startswith(PYTHON_TAG):
            return Piece(len(PYTHON_TAG), GAP)
        if PYTHON_TAG.startswith(text) and not final:
            return None
        if text[0] == "{":
            end = self.bracket_end(text, 0, final)
            if end is None and not final:
                return None
            call = None if end is None else self.read_call(text[:end])
            if call is not None:
                return Piece(end, CALLS, (call,))
        self._calls_possible = False
        return Piece(len(text), TEXT)
