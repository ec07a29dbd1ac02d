"""Mistral calls after the `[TOOL_CALLS]` token, in either of the two styles Mistral's
tokenizers use:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (v3)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}      (v11+)

(v3 also as a single object; v13's `name[CALL_ID]id[ARGS]{...}` is read and its id replaced
by Pagoda's own.) The marker may come after some text, which is content. A v3 list is calls
when every element is a call object naming one of the request's functions; otherwise it stays
in the content, verbatim, marker included. A marker followed by anything else is content and
reading goes on after it.

The markers are special tokens, so the output is decoded with special tokens kept
(`keeps_special_tokens`); the end-of-sequence token `</s>` that then ends the text is dropped.
"""

from __future__ import annotations

import re

from pagoda.entrypoints.tools.parsers.base import (
    CALLS,
    DROP,
    TEXT,
    WHITESPACE,
    Piece,
    PieceParser,
    dump_arguments,
    load_json,
    text_piece,
)

MARKER, ARGS, CALL_ID, EOS = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "</s>"
NAME = re.compile(r"[A-Za-z0-9_.-]+")
ID = re.compile(r"[A-Za-z0-9]*")


class MistralToolParser(PieceParser):
    name = "mistral"
    keeps_special_tokens = True

    def next_piece(self, text: str, final: bool) -> Piece | None:
        if text.startswith(EOS):
            if len(text) > len(EOS):
                return Piece(len(EOS), TEXT)
            return Piece(len(EOS), DROP) if final else None
        if not text.startswith(MARKER):
            return text_piece(text, final, (MARKER, EOS))
        start = len(MARKER) + len(text[len(MARKER):]) - len(text[len(MARKER):].lstrip(WHITESPACE))
        if start == len(text):
            return Piece(len(text), TEXT) if final else None
        if text[start] in "[{":
            return self._json_calls(text, start, final)
        return self._named_call(text, start, final)

    def _json_calls(self, text: str, start: int, final: bool) -> Piece | None:
        """`[TOOL_CALLS] [{call}, ...]` or `[TOOL_CALLS] {call}`."""
        end = self.bracket_end(text, start, final)
        if end is None:
            return Piece(len(text), TEXT) if final else None
        try:
            value = load_json(text[start:end])
        except ValueError:
            return Piece(end, TEXT)
        objects = value if isinstance(value, list) else [value]
        calls = [self.read_call_object(call) for call in objects]
        if not calls or None in calls:
            return Piece(end, TEXT)
        return Piece(end, CALLS, tuple(calls))

    def _named_call(self, text: str, start: int, final: bool) -> Piece | None:
        """`[TOOL_CALLS]name[ARGS]{...}`, optionally with `[CALL_ID]id` before `[ARGS]`."""
        not_a_call = Piece(len(MARKER), TEXT)
        name = NAME.match(text, start)
        if name is None:
            return not_a_call
        position = name.end()
        if text.startswith(CALL_ID, position):
            position = ID.match(text, position + len(CALL_ID)).end()
        rest = text[position:]
        if not rest.startswith(ARGS):
            if final or not (ARGS.startswith(rest) or CALL_ID.startswith(rest)):
                return not_a_call
            return None
        position += len(ARGS)
        position += len(text[position:]) - len(text[position:].lstrip(WHITESPACE))
        if position == len(text):
            return not_a_call if final else None
        if text[position] != "{":
            return not_a_call
        end = self.bracket_end(text, position, final)
        if end is None:
            return not_a_call if final else None
        try:
            arguments = load_json(text[position:end])
        except ValueError:
            return Piece(end, TEXT)
        if not isinstance(arguments, dict) or not self.allows(name.group()):
            return Piece(end, TEXT)
        return Piece(end, CALLS, ((name.group(), dump_arguments(arguments)),))
