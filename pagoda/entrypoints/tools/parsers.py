"""Tool-call parsers: a model's output text -> content + tool calls, streamed or whole.

One parser per output format, chosen with `pagoda serve --tool-call-parser NAME` (as in vLLM)
and used with `tool_choice: "auto"`; a constrained call (`"required"` or a named function)
is always Hermes syntax (constraints.py), so it is always read by the Hermes parser.

    hermes   <tool_call>{"name": "f", "arguments": {...}}</tool_call>   (Hermes 2 Pro, Qwen2.5)

A parser is a small state machine fed the output's text deltas (`feed`, then `finish` once
the output ended); each call returns the `StreamDelta` to send: content text and OpenAI's
`delta.tool_calls` fragments. The whole-output result is the same machine fed everything at
once (`parse_output`), so a streamed answer assembles to exactly the non-streamed one, however
the text was cut. The rules:

- A `<tool_call>` block is a call when its body is a JSON object with a string "name" among
  the request's functions and an object "arguments" (or "parameters", or a JSON string of an
  object; absent means {}). Its arguments are re-serialized (`json.dumps`). Otherwise the
  block stays in the content, verbatim; so does a block still open at the end whose body is
  not a call (an unclosed block that is a call counts: models often stop at EOS instead).
- Whitespace right before and right after a call is dropped (it separates calls); content
  is the rest of the text, None when empty.
- A call is sent when its block closes: one fragment with index, id (`call_<hex>`), type and
  function.name (arguments ""), then one with its arguments. Text is never sent and then
  retracted: while the text might be the start of `<tool_call>` it is held back.
- `max_calls` (1 when the request sets parallel_tool_calls false) drops the calls past it.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class ToolCall:
    """A parsed call, as OpenAI's `message.tool_calls[i]` carries it."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text (an object)."""


@dataclass(frozen=True)
class ToolCallFragment:
    """One entry of OpenAI's streamed `delta.tool_calls`: the first fragment of a call has
    its id and name (arguments ""), the next ones only argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    """What one `feed` or `finish` releases."""

    content: str = ""
    tool_calls: list[ToolCallFragment] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def extend(self, other: StreamDelta) -> StreamDelta:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)
        return self


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    """The text outside the calls; None when there is none."""
    tool_calls: list[ToolCall]


class ToolParser(ABC):
    """The streaming parser of one output (one choice). Subclasses name their format."""

    name: ClassVar[str]

    def __init__(self, tool_names: Collection[str] | None = None,
                 max_calls: int | None = None) -> None:
        """`tool_names`: the functions a call may name (None: any); `max_calls`: keep only
        the first this many calls (None: all)."""
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self.max_calls = max_calls
        self.num_calls = 0
        """Calls found so far (dropped ones included)."""

    @abstractmethod
    def feed(self, text: str) -> StreamDelta:
        """Take the next piece of output text; return what can be sent now."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """The output ended: release everything still held back."""

    def call_fragments(self, name: str, arguments: str) -> list[ToolCallFragment]:
        """The fragments of a new call (none when it is past `max_calls`)."""
        index = self.num_calls
        self.num_calls += 1
        if self.max_calls is not None and index >= self.max_calls:
            return []
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        return [ToolCallFragment(index, call_id, name, ""),
                ToolCallFragment(index, arguments=arguments)]

    def read_call(self, body: str) -> tuple[str, str] | None:
        """(name, arguments JSON text) if `body` is a JSON call object, else None."""
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        if self.tool_names is not None and call["name"] not in self.tool_names:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)


class HermesToolParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks anywhere in the text (see the module doc)."""

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self, tool_names: Collection[str] | None = None,
                 max_calls: int | None = None) -> None:
        super().__init__(tool_names, max_calls)
        self._buffer = ""
        """Text not yet released: a possible start tag, or an open block's body."""
        self._in_block = False
        self._pending_space = ""
        """Whitespace after the content so far: dropped if a call follows, else sent."""
        self._after_call = False
        """The last thing seen was a call: leading whitespace is dropped."""

    def feed(self, text: str) -> StreamDelta:
        self._buffer += text
        delta = StreamDelta()
        while True:
            if self._in_block:
                end = self._buffer.find(self.END)
                if end < 0:
                    return delta
                delta.extend(self._close_block(self._buffer[:end], closed=True))
                self._buffer = self._buffer[end + len(self.END):]
                continue
            start = self._buffer.find(self.START)
            if start >= 0:
                delta.content += self._text(self._buffer[:start], hold_space=True)
                self._buffer = self._buffer[start + len(self.START):]
                self._in_block = True
                continue
            keep = _partial_suffix(self._buffer, self.START)
            cut = len(self._buffer) - keep
            delta.content += self._text(self._buffer[:cut], hold_space=True)
            self._buffer = self._buffer[cut:]
            return delta

    def finish(self) -> StreamDelta:
        if self._in_block:
            delta = self._close_block(self._buffer, closed=False)
        else:
            delta = StreamDelta(self._text(self._buffer, hold_space=False))
        self._buffer = ""
        return delta

    def _text(self, text: str, hold_space: bool) -> str:
        """Content text to send now; trailing whitespace is held while a call may follow."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        text = self._pending_space + text
        self._pending_space = ""
        if hold_space:
            kept = text.rstrip()
            self._pending_space = text[len(kept):]
            text = kept
        return text

    def _close_block(self, body: str, closed: bool) -> StreamDelta:
        self._in_block = False
        call = self.read_call(body)
        if call is None:  # not a call: the block is content, as written
            raw = self.START + body + (self.END if closed else "")
            text = self._pending_space + raw
            self._pending_space = ""
            self._after_call = False
            return StreamDelta(text)
        self._pending_space = ""
        self._after_call = True
        return StreamDelta(tool_calls=self.call_fragments(*call))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


TOOL_PARSERS: dict[str, type[ToolParser]] = {HermesToolParser.name: HermesToolParser}
"""--tool-call-parser NAME -> its parser class."""


def assemble(deltas: list[StreamDelta]) -> ParsedOutput:
    """The whole result of a stream of deltas (what a client assembles)."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict[str, str]] = {}
    for fragment in (f for d in deltas for f in d.tool_calls):
        call = calls.setdefault(fragment.index, {"id": "", "name": "", "arguments": ""})
        call["id"] += fragment.id or ""
        call["name"] += fragment.name or ""
        call["arguments"] += fragment.arguments
    return ParsedOutput(content or None,
                        [ToolCall(**calls[i]) for i in sorted(calls)])


def parse_output(parser: ToolParser, text: str) -> ParsedOutput:
    """A whole output, through a fresh `parser` (the same machine that streams)."""
    return assemble([parser.feed(text), parser.finish()])
