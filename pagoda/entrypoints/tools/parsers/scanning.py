"""Where a bracketed value ends, in JSON or Python text that may still be arriving.

    text:  ... { "a": [1, "x}"], "b": {} } ...
               ^start                     ^end (the index after the closing bracket)

Brackets inside strings do not count (JSON strings in double quotes; Python strings in single
or double quotes, triple-quoted too, with backslash escapes). The scan does not check the
value's syntax (json.loads or ast does that once it is closed), only where it ends, and it
resumes where it stopped when the same text comes back longer, so a value fed one token at a
time is scanned once, not once per token.
"""

from __future__ import annotations

import re

OPENING, CLOSING = "([{", ")]}"
JSON_SPECIAL = re.compile(r'["\[\]{}]')
PYTHON_SPECIAL = re.compile(r'["\'\[\](){}]')
STRING_SPECIAL = {'"': re.compile(r'[\\"]'), "'": re.compile(r"[\\']")}


class BracketScanner:
    def __init__(self, start: int, python: bool = False) -> None:
        """`start`: the index of the opening bracket; `python`: Python's strings (else
        JSON's)."""
        self.start = start
        self.python = python
        self._position = start
        """Where the scan goes on (everything before it is accounted for)."""
        self._depth = 0
        self._quote: str | None = None
        """The quote of the string the scan is in ('"', "'", '\"\"\"' or "'''"), or None."""

    @property
    def position(self) -> int:
        """How far the scan got: text before it is part of the value."""
        return self._position

    def end(self, text: str, final: bool) -> int | None:
        """The index after the bracket that closes text[start]'s, or None if it is not
        closed in `text`. `text` must extend the text of the previous call; `final`: no more
        text comes (a quote at the very end is then not the start of a triple quote)."""
        position, length = self._position, len(text)
        special = PYTHON_SPECIAL if self.python else JSON_SPECIAL
        while True:
            if self._quote is None:
                match = special.search(text, position)
                if match is None:
                    self._position = length
                    return None
                i = match.start()
                char = text[i]
                if char in OPENING:
                    self._depth += 1
                    position = i + 1
                elif char in CLOSING:
                    self._depth -= 1
                    position = i + 1
                    if self._depth == 0:
                        self._position = position
                        return position
                elif self.python and text.startswith(char * 3, i):
                    self._quote, position = char * 3, i + 3
                elif self.python and not final and text[i:] in (char, char * 2):
                    self._position = i  # one or two quotes at the end: maybe a triple quote
                    return None
                else:
                    self._quote, position = char, i + 1
            else:
                match = STRING_SPECIAL[self._quote[0]].search(text, position)
                if match is None:
                    self._position = length
                    return None
                i = match.start()
                if text[i] == "\\":
                    if i + 1 >= length:  # the escaped character is still to come
                        self._position = i
                        return None
                    position = i + 2
                elif len(self._quote) == 1 or text.startswith(self._quote, i):
                    position = i + len(self._quote)
                    self._quote = None
                elif not final and len(self._quote) == 3 and length - i < 3:
                    self._position = i  # a quote or two at the end: maybe the closing three
                    return None
                else:
                    position = i + 1
