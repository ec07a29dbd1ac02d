"""Calls in tagged blocks anywhere in the text, the Hermes way:

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(Hermes 2 Pro, Qwen2.5, and Pagoda's fallback prompt for templates without tools.) A block is
a call when its body is a JSON call object naming one of the request's functions (see
ToolParser.read_call); otherwise the block stays in the content, verbatim, and so does a block
still open at the end whose body is not a call (an unclosed block that is a call counts:
models often stop at EOS instead of writing the end tag). Qwen3-Coder's blocks differ only in
their body (qwen3_coder.py).
"""

from __future__ import annotations

from typing import ClassVar

from pagoda.entrypoints.tools.parsers.base import CALLS, TEXT, Piece, PieceParser, text_piece


class TaggedBlockParser(PieceParser):
    """Blocks START body END anywhere in the text; `read_block` says which are calls."""

    START: ClassVar[str] = "<tool_call>"
    END: ClassVar[str] = "</tool_call>"

    def read_block(self, body: str) -> tuple[str, str] | None:
        """(name, arguments JSON text) if the block's body is a call, else None."""
        return self.read_call(body)

    def next_piece(self, text: str, final: bool) -> Piece | None:
        if not text.startswith(self.START):
            return text_piece(text, final, (self.START,))
        end = text.find(self.END, len(self.START))
        if end < 0 and not final:
            return None
        body = text[len(self.START):] if end < 0 else text[len(self.START):end]
        size = len(text) if end < 0 else end + len(self.END)
        call = self.read_block(body)
        return Piece(size, TEXT) if call is None else Piece(size, CALLS, (call,))


class HermesToolParser(TaggedBlockParser):
    """`<tool_call>{json}</tool_call>` blocks (the module doc)."""

    name = "hermes"
