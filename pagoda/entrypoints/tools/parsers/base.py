"""What every tool-call parser shares: the result types, the call checks, and the piece loop
that makes streaming and whole parsing one machine.

A parser is fed the output's text deltas (`feed`, then `finish` once the output ended); each
call returns the `StreamDelta` to send: content text and OpenAI's `delta.tool_calls`
fragments. `parse_output` feeds a fresh parser the whole text at once, so a streamed answer
assembles to exactly the non-streamed one, however the text was cut.

Most formats are a `PieceParser`: it keeps the text not yet released in a buffer and asks
the format, again and again, what the buffer's start is (`next_piece`):

    buffer:  | piece | piece | ...      the rest: None until more text (or the end) decides

    TEXT   content, sent now (its trailing whitespace waits: it is dropped if a call follows)
    GAP    held like that whitespace (e.g. <|python_tag|>): dropped if a call follows, else sent
    CALLS  one or more calls, each sent as it is found
    DROP   consumed, never sent (a format's closing or end-of-sequence token)

A piece is decided once and never revisited, so no text is sent and then retracted; text
that might still start a call is simply not a piece yet. Whitespace (and the format's
`separators`) right after a call is dropped; content is None when nothing is left.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagoda.entrypoints.markers import partial_suffix
from pagoda.entrypoints.tools.parsers.scanning import BracketScanner


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


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser(ABC):
    """The streaming parser of one output (one choice). Subclasses name their format."""

    name: ClassVar[str]
    keeps_special_tokens: ClassVar[bool] = False
    """Whether the format's markers are special tokens, so the output must be decoded with
    them (skip_special_tokens false)."""

    def __init__(self, tool_names: Collection[str] | None = None,
                 max_calls: int | None = None,
                 schemas: Mapping[str, dict[str, Any] | None] | None = None) -> None:
        """`tool_names`: the functions a call may name (None: any); `max_calls`: keep only
        the first this many calls (None: all); `schemas`: each function's `parameters`
        (formats whose argument values are text read them by their schema)."""
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self.max_calls = max_calls
        self.schemas = dict(schemas or {})
        self.num_calls = 0
        """Calls found so far (dropped ones included)."""

    @abstractmethod
    def feed(self, text: str) -> StreamDelta:
        """Take the next piece of output text; return what can be sent now."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """The output ended: release everything still held back."""

    def allows(self, name: Any) -> bool:
        """Whether `name` is a function this output may call."""
        return isinstance(name, str) and (self.tool_names is None or name in self.tool_names)

    def new_call(self, name: str) -> int | None:
        """Count a new call; its index, or None when it is past `max_calls` (dropped)."""
        index = self.num_calls
        self.num_calls += 1
        if self.max_calls is not None and index >= self.max_calls:
            return None
        return index

    def call_fragments(self, name: str, arguments: str) -> list[ToolCallFragment]:
        """The fragments of a new whole call (none when it is past `max_calls`)."""
        index = self.new_call(name)
        if index is None:
            return []
        return [ToolCallFragment(index, new_call_id(), name, ""),
                ToolCallFragment(index, arguments=arguments)]

    def read_call(self, body: str) -> tuple[str, str] | None:
        """(name, arguments JSON text) if `body` is a JSON call object, else None."""
        try:
            call = load_json(body)
        except ValueError:
            return None
        return self.read_call_object(call)

    def read_call_object(self, call: Any) -> tuple[str, str] | None:
        """(name, arguments JSON text) of {"name": f, "arguments": {...}} ("parameters" is
        taken too; arguments may be the JSON text of an object; absent means {}), if f is
        allowed; else None."""
        if not isinstance(call, dict) or not self.allows(call.get("name")):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = load_json(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return call["name"], dump_arguments(arguments)


def load_json(text: str) -> Any:
    """JSON as JSON defines it (json.loads takes NaN and Infinity too): ValueError if not."""
    return json.loads(text, parse_constant=_refuse_constant)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def dump_arguments(arguments: dict[str, Any]) -> str:
    """Arguments as JSON text (ValueError for values JSON cannot hold)."""
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)


TEXT, GAP, CALLS, DROP = "text", "gap", "calls", "drop"


@dataclass(frozen=True)
class Piece:
    """What the first `size` characters of the unreleased text are (see the module doc)."""

    size: int
    kind: str
    calls: tuple[tuple[str, str], ...] = ()
    """For CALLS: (name, arguments JSON text) of each."""


WHITESPACE = " \t\r\n"


class PieceParser(ToolParser):
    """A parser driven by `next_piece` (the module doc's loop)."""

    separators: ClassVar[str] = ""
    """Characters dropped, with whitespace, right after a call (e.g. ";" between calls)."""

    def __init__(self, tool_names: Collection[str] | None = None,
                 max_calls: int | None = None,
                 schemas: Mapping[str, dict[str, Any] | None] | None = None) -> None:
        super().__init__(tool_names, max_calls, schemas)
        self._buffer = ""
        """Text not yet released: its start is no piece yet."""
        self._pending = ""
        """Held text (whitespace, GAPs): dropped if a call follows, else sent before the
        next content."""
        self.after_call = False
        """The last piece was a call: leading whitespace and separators are dropped."""
        self._scanner: BracketScanner | None = None
        """The scan of a bracketed candidate in the buffer, kept across feeds."""

    @abstractmethod
    def next_piece(self, text: str, final: bool) -> Piece | None:
        """The piece at the start of `text` (the unreleased text, never empty), or None
        while that depends on text still to come. `final`: no more text comes (then never
        None)."""

    def feed(self, text: str) -> StreamDelta:
        self._buffer += text
        return self._release(final=False)

    def finish(self) -> StreamDelta:
        delta = self._release(final=True)
        delta.content += self._pending
        self._pending = ""
        return delta

    def bracket_end(self, text: str, start: int, final: bool, python: bool = False) -> int | None:
        """Where the bracket at text[start] closes (the index after it), or None if it
        does not close in `text`; the scan resumes where it stopped on the next feed."""
        if self._scanner is None or self._scanner.start != start:
            self._scanner = BracketScanner(start, python)
        return self._scanner.end(text, final)

    def _release(self, final: bool) -> StreamDelta:
        delta = StreamDelta()
        while self._buffer:
            piece = self.next_piece(self._buffer, final)
            if piece is None:
                assert not final, f"{self.name}: no piece at the end of the output"
                break
            assert piece.size > 0, piece
            text, self._buffer = self._buffer[:piece.size], self._buffer[piece.size:]
            self._scanner = None
            if piece.kind == TEXT:
                delta.content += self._text(text)
            elif piece.kind == GAP:
                self._pending += text
            elif piece.kind == CALLS:
                self._pending = ""
                self.after_call = True
                for name, arguments in piece.calls:
                    delta.tool_calls.extend(self.call_fragments(name, arguments))
        return delta

    def _text(self, text: str) -> str:
        """Content to send now: pending text first, trailing whitespace held back."""
        if self.after_call:
            text = text.lstrip(WHITESPACE + self.separators)
            if not text:
                return ""
            self.after_call = False
        text = self._pending + text
        kept = text.rstrip()
        self._pending = text[len(kept):]
        return kept


def text_piece(text: str, final: bool, markers: tuple[str, ...]) -> Piece | None:
    """Content up to the first of `markers` (which must not be at text[0]), holding back
    an end that may be the start of one; None when nothing can be sent yet."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if found:
        return Piece(min(found), TEXT)
    if final:
        return Piece(len(text), TEXT)
    size = len(text) - max(partial_suffix(text, m) for m in markers)
    return Piece(size, TEXT) if size else None


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
