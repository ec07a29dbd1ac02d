"""gpt-oss's tool calls in OpenAI's harmony format (pagoda/entrypoints/harmony.py):
`--tool-call-parser openai`, as vLLM names it.

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

A message whose recipient is `functions.NAME` is a call of NAME with its body as the JSON
arguments (when NAME is one of the request's functions and the body a JSON object; else the
message stays content, as written). Other messages: analysis (reasoning, when no reasoning
parser took it) is dropped; final and commentary bodies are content, their headers and ends
dropped. Text outside any message is content. With the `openai_gptoss` reasoning parser in
front, this parser sees the content it passes on: the answer's text and the call messages
whole.
"""

from __future__ import annotations

from pagoda.entrypoints.harmony import (
    ENDS,
    FIRST_HEADER_STARTS,
    HEADER_STARTS,
    MESSAGE,
    find_end,
    may_open_header,
    read_header,
)
from pagoda.entrypoints.tools.parsers.base import (
    CALLS,
    DROP,
    TEXT,
    Piece,
    PieceParser,
    dump_arguments,
    load_json,
    text_piece,
)


class OpenAIToolParser(PieceParser):
    name = "openai"
    keeps_special_tokens = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_text_body = False
        """Inside a final or commentary message: its body is content up to its end."""
        self._started = False
        """A piece was taken (the output's first header may open with its recipient)."""

    def next_piece(self, text: str, final: bool) -> Piece | None:
        piece = self._piece(text, final)
        self._started = self._started or piece is not None
        return piece

    def _piece(self, text: str, final: bool) -> Piece | None:
        if self._in_text_body:
            found = find_end(text)
            if found is not None and found[0] == 0:
                self._in_text_body = False
                return Piece(len(found[1]), DROP)
            return text_piece(text, final, ENDS)
        starts = HEADER_STARTS if self._started else FIRST_HEADER_STARTS
        if not may_open_header(text, starts):
            return text_piece(text, final, HEADER_STARTS)
        header_end = text.find(MESSAGE)
        if header_end < 0:
            return Piece(len(text), DROP) if final else None  # a header cut off: markup
        header = read_header(text[:header_end])
        body_start = header_end + len(MESSAGE)
        if header.recipient is None and header.channel != "analysis":
            self._in_text_body = True
            return Piece(body_start, DROP)
        found = find_end(text, body_start)
        if found is None and not final:
            return None
        body_end, end = found if found is not None else (len(text), "")
        size = body_end + len(end)
        if header.recipient is None:
            return Piece(size, DROP)  # analysis: reasoning, not content
        call = self._call(header.function, text[body_start:body_end])
        return Piece(size, CALLS, (call,)) if call is not None else Piece(size, TEXT)

    def _call(self, name: str | None, body: str) -> tuple[str, str] | None:
        if not self.allows(name):
            return None
        try:
            arguments = load_json(body.strip() or "{}")
        except ValueError:
            return None
        return (name, dump_arguments(arguments)) if isinstance(arguments, dict) else None
