"""The reasoning parser of OpenAI's harmony format (gpt-oss; pagoda/entrypoints/harmony.py):
`--reasoning-parser openai_gptoss`, as vLLM names it.

    analysis messages' bodies                  -> reasoning
    final messages', preambles' (commentary
      without a recipient) bodies               -> content
    a message with a recipient (a tool call)   -> content, whole and as written, from
                                                  `<|start|>assistant` to its end, for the
                                                  `openai` tool-call parser to read
    text outside any message                   -> content

Headers and message ends are never sent. Streamed and whole splits are one machine (the base
class's contract): a body is sent as it comes, less any end that may be the start of a
message end.
"""

from __future__ import annotations

from pagoda.entrypoints.harmony import (
    FIRST_HEADER_STARTS,
    HEADER_STARTS,
    MESSAGE,
    START,
    find_end,
    may_open_header,
    partial_end,
    read_header,
)
from pagoda.entrypoints.markers import partial_suffix
from pagoda.entrypoints.reasoning.parsers import ReasoningDelta, ReasoningParser
from pagoda.structured_outputs import ReasoningSpan

_REASONING, _CONTENT, _CALL, _PLAIN = "reasoning", "content", "call", "plain"


class HarmonyReasoningParser(ReasoningParser):
    """The module docstring's split."""

    name = "openai_gptoss"
    starts_in_reasoning = False
    keeps_special_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self._body: str | None = None
        """What the current message's body is (_REASONING, _CONTENT, _CALL), _PLAIN for text
        outside any message, None between messages (a header is read)."""
        self._started = False

    @classmethod
    def span(cls) -> ReasoningSpan | None:
        """None: a constraint cannot follow harmony's reasoning (its markers are special
        tokens the grammar cannot write)."""
        return None

    @property
    def in_content(self) -> bool:
        return self._body in (_CONTENT, _PLAIN)

    def feed(self, text: str) -> ReasoningDelta:
        self._buffer += text
        return self._release(final=False)

    def finish(self) -> ReasoningDelta:
        return self._release(final=True)

    def _release(self, final: bool) -> ReasoningDelta:
        delta = ReasoningDelta()
        while self._buffer:
            if self._body is None:
                if not self._read_header(delta, final):
                    break
            elif self._body == _PLAIN:
                if not self._plain(delta, final):
                    break
            elif not self._read_body(delta, final):
                break
        return delta

    def _read_header(self, delta: ReasoningDelta, final: bool) -> bool:
        """Take a whole header off the buffer; False while it is not whole."""
        starts = HEADER_STARTS if self._started else FIRST_HEADER_STARTS
        if not may_open_header(self._buffer, starts):
            self._body = _PLAIN
            return True
        end = self._buffer.find(MESSAGE)
        if end < 0:
            if final:
                self._buffer = ""  # a header cut off: markup, never content
            return False
        header, self._buffer = self._buffer[:end], self._buffer[end + len(MESSAGE):]
        self._started = True
        parsed = read_header(header)
        if parsed.recipient is not None:
            self._body = _CALL
            role_and_header = header.removeprefix(START)
            delta.content += START + (role_and_header if role_and_header.startswith(
                "assistant") else "assistant" + role_and_header) + MESSAGE
        else:
            self._body = _REASONING if parsed.channel == "analysis" else _CONTENT
        return True

    def _read_body(self, delta: ReasoningDelta, final: bool) -> bool:
        """Send the body's text so far; True when its end was taken too."""
        found = find_end(self._buffer)
        if found is None:
            cut = len(self._buffer) if final else len(self._buffer) - partial_end(self._buffer)
            self._send(delta, self._buffer[:cut])
            self._buffer = self._buffer[cut:]
            return False
        position, end = found
        self._send(delta, self._buffer[:position])
        if self._body == _CALL:
            delta.content += end
        self._buffer = self._buffer[position + len(end):]
        self._body = None
        return True

    def _plain(self, delta: ReasoningDelta, final: bool) -> bool:
        """Text outside a message: content up to the next `<|start|>`; True when one came."""
        start = self._buffer.find(START)
        if start < 0:
            cut = len(self._buffer) if final else (
                len(self._buffer) - partial_suffix(self._buffer, START))
            delta.content += self._buffer[:cut]
            self._buffer = self._buffer[cut:]
            return False
        delta.content += self._buffer[:start]
        self._buffer = self._buffer[start:]
        self._body = None
        return True

    def _send(self, delta: ReasoningDelta, text: str) -> None:
        if self._body == _REASONING:
            delta.reasoning += text
        else:
            delta.content += text

