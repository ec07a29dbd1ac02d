"""OpenAI's harmony format (gpt-oss) as its output reads: what the reasoning parser
(reasoning/harmony.py, `openai_gptoss`) and the tool-call parser (tools/parsers/openai.py,
`openai`) share.

An assistant turn is one or more messages; the chat template's generation prompt wrote the
first `<|start|>assistant`, so the output opens with that message's header:

    <|channel|>analysis<|message|>The user asks the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

    <|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>

A message is a header (the role, `<|channel|>` and its name, a recipient `to=...`, a content
type, the recipient also written before the channel: `assistant to=functions.f<|channel|>
commentary json`), `<|message|>`, the body, and one end: `<|end|>`, `<|return|>` (the turn is
over) or `<|call|>` (a tool call waits for its result). The channels: analysis (the
reasoning), commentary (tool calls; without a recipient, a preamble the user may see),
final (the answer). The markers are special tokens: the output is decoded with them
(skip_special_tokens false).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pagoda.entrypoints.markers import partial_suffix

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
ENDS = (END, RETURN, CALL)
HEADER_STARTS = (START, CHANNEL)
"""What a message's header begins with (the first message's: `<|channel|>`, or a recipient:
FIRST_HEADER_STARTS)."""
FIRST_HEADER_STARTS = (*HEADER_STARTS, " to=", "to=")
"""...and the output's first header may begin with its recipient."""
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"(\w+)")


@dataclass(frozen=True)
class Header:
    channel: str | None
    recipient: str | None

    @property
    def function(self) -> str | None:
        """The function a tool call names (recipient `functions.NAME`), else None."""
        if self.recipient is None or not self.recipient.startswith("functions."):
            return None
        return self.recipient.removeprefix("functions.")


def read_header(text: str) -> Header:
    """The header before a `<|message|>` (its <|start|> and role included or not)."""
    channel, recipient = _CHANNEL.search(text), _RECIPIENT.search(text)
    return Header(channel and channel.group(1), recipient and recipient.group(1))


def may_open_header(text: str, starts: tuple[str, ...] = HEADER_STARTS) -> bool:
    """Whether `text` begins with a header opener, or is too short to tell."""
    return any(text.startswith(s) or s.startswith(text) for s in starts)


def find_end(text: str, start: int = 0) -> tuple[int, str] | None:
    """(position, marker) of the first message end in text[start:], or None."""
    found = [(i, end) for end in ENDS if (i := text.find(end, start)) >= 0]
    return min(found) if found else None


def partial_end(text: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of a message end."""
    return max(partial_suffix(text, end) for end in ENDS)
