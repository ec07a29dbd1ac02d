"""Reasoning parsers: a reasoning model's output text -> its reasoning + the content, streamed
or whole (vLLM's `--reasoning-parser`, OpenAI-compatible `reasoning_content`).

Both formats write the thinking between `<think>` and `</think>`, before the answer:

    qwen3        <think>\\nreasoning\\n</think>\\n\\ncontent     the model opens the block itself
                 content                                     no block: all content (e.g.
                                                             `enable_thinking: false`, where the
                                                             template put an empty block in the
                                                             prompt)
    deepseek_r1  reasoning\\n</think>\\n\\ncontent              the template's generation prompt
                                                             ends with `<think>\\n`: the output
                                                             begins inside the reasoning

A parser is a small state machine fed the output's text deltas (`feed`, then `finish` once the
output ended), like the tool-call parsers (pagoda/entrypoints/tools/parsers.py); each call
returns the `ReasoningDelta` to send. The whole-output result is the same machine fed
everything at once (`split_reasoning`), so a streamed answer assembles to exactly the
non-streamed one however the text was cut, and text is never sent and then retracted: while
the text might be the start of a marker it is held back. The rules:

    start ──(lstripped text is "<think>")──> reasoning ──("</think>")──> content
      │     (a proper prefix of it, or only whitespace: wait)               ^
      └──(anything else)──> qwen3: content, verbatim ───────────────────────┘
                            deepseek_r1: reasoning (a leading "<think>" is dropped too)

- Reasoning is the text between the markers without its leading and trailing whitespace;
  a block still open when the output ends is reasoning to the end (a model cut by max_tokens
  while thinking: no content). deepseek_r1 without any `</think>`: everything is reasoning,
  as vLLM does.
- Content after `</think>` loses its leading whitespace; content of an output without a
  reasoning block is the text as written. A later `<think>` in the content is content.
- The markers are text: Qwen3's and the DeepSeek-R1 distills' tokenizers have `<think>` and
  `</think>` as ordinary (non-special) added tokens, so the detokenized text carries them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pagoda.entrypoints.markers import partial_suffix
from pagoda.structured_outputs import ReasoningSpan

THINK_START = "<think>"
THINK_END = "</think>"

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


@dataclass
class ReasoningDelta:
    """What one `feed` or `finish` releases."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)

    def extend(self, other: ReasoningDelta) -> ReasoningDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        return self


@dataclass(frozen=True)
class ReasoningSplit:
    """A whole output, split."""

    reasoning: str | None
    """The reasoning; None when there is none (or it is only whitespace)."""
    content: str | None
    """The text after the reasoning; None when empty."""


class ReasoningParser:
    """The streaming parser of one output (one choice). Subclasses name their format."""

    name: ClassVar[str]
    starts_in_reasoning: ClassVar[bool]
    """Whether an output without a leading `<think>` begins inside the reasoning."""
    keeps_special_tokens: ClassVar[bool] = False
    """Whether the format's markers are special tokens, so the output must be decoded with
    them (skip_special_tokens false: harmony's)."""

    def __init__(self) -> None:
        self._state = _START
        self._buffer = ""
        """Text not yet released: an undecided start, or a possible `</think>`."""
        self._pending_space = ""
        """Whitespace after the reasoning so far: dropped if `</think>` follows, else sent."""
        self._reasoning_begun = False
        """Reasoning text was sent (before it, whitespace is dropped)."""
        self._strip_content = False
        """The content follows `</think>`: its leading whitespace is dropped."""

    @classmethod
    def span(cls) -> ReasoningSpan | None:
        """The part of the output a structured-output constraint must leave free; None where
        no constraint can follow the format's reasoning."""
        return ReasoningSpan(THINK_START, THINK_END, begins_inside=cls.starts_in_reasoning)

    @property
    def in_content(self) -> bool:
        """Whether the reasoning is over (or there is none): what follows is content."""
        return self._state == _CONTENT

    def feed(self, text: str) -> ReasoningDelta:
        """Take the next piece of output text; return what can be sent now."""
        self._buffer += text
        delta = ReasoningDelta()
        while True:
            if self._state == _START:
                head = self._buffer.lstrip()
                if head.startswith(THINK_START):
                    self._buffer = head[len(THINK_START):]
                    self._state = _REASONING
                elif THINK_START.startswith(head):  # "", "<", "<th", ...: undecided
                    return delta
                else:
                    self._state = _REASONING if self.starts_in_reasoning else _CONTENT
                continue
            if self._state == _REASONING:
                end = self._buffer.find(THINK_END)
                if end >= 0:
                    delta.reasoning += self._reasoning(self._buffer[:end], last=True)
                    self._buffer = self._buffer[end + len(THINK_END):]
                    self._state = _CONTENT
                    self._strip_content = True
                    continue
                cut = len(self._buffer) - partial_suffix(self._buffer, THINK_END)
                delta.reasoning += self._reasoning(self._buffer[:cut], last=False)
                self._buffer = self._buffer[cut:]
                return delta
            delta.content += self._content(self._buffer)
            self._buffer = ""
            return delta

    def finish(self) -> ReasoningDelta:
        """The output ended: release everything still held back."""
        text, self._buffer = self._buffer, ""
        if self._state == _START and not self.starts_in_reasoning:
            return ReasoningDelta(content=text)  # only whitespace or part of "<think>"
        if self._state == _CONTENT:
            return ReasoningDelta(content=self._content(text))
        return ReasoningDelta(reasoning=self._reasoning(text, last=True))

    def _reasoning(self, text: str, last: bool) -> str:
        """Reasoning text to send now, without the block's leading whitespace; trailing
        whitespace is held until more text shows it is inside (`last`: it is not)."""
        if not self._reasoning_begun:
            text = text.lstrip()
            if not text:
                return ""
            self._reasoning_begun = True
        text = self._pending_space + text
        kept = text.rstrip()
        self._pending_space = "" if last else text[len(kept):]
        return kept

    def _content(self, text: str) -> str:
        if self._strip_content:
            text = text.lstrip()
            if not text:
                return ""
            self._strip_content = False
        return text


class Qwen3ReasoningParser(ReasoningParser):
    """`<think>...</think>` at the start of the output is reasoning; no block: all content."""

    name = "qwen3"
    starts_in_reasoning = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    """Everything up to `</think>` is reasoning (the prompt opened the block)."""

    name = "deepseek_r1"
    starts_in_reasoning = True




def assemble(deltas: list[ReasoningDelta]) -> ReasoningSplit:
    """The whole result of a stream of deltas (what a client assembles)."""
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    return ReasoningSplit(reasoning or None, content or None)


def split_reasoning(parser: ReasoningParser, text: str) -> ReasoningSplit:
    """A whole output, through a fresh `parser` (the same machine that streams)."""
    return assemble([parser.feed(text), parser.finish()])
