"""The output of a forced call (tool_choice "required" or a named function), which the
grammar of tools/constraints.py makes exactly

    <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
    (\\n<tool_call>... for each further call, where parallel calls are allowed)

Since the layout is known, a call is sent as OpenAI streams one: its id and name as soon as
its arguments begin, then the arguments as they are written (the model's own text, held
back only inside an escape), never the wrapper around them:

    state:   HEAD ──name read──> ARGUMENTS ──object closed──> TAIL ──</tool_call>──> HEAD
             (CALL_SEPARATOR + CALL_HEAD after the first call)

An output cut short (max_tokens) gives no content: a call whose arguments began keeps the
arguments written so far (finish_reason "length" tells the client), a head cut before that is
dropped. Text that leaves the layout (only without the grammar, e.g. in a test) is content
from there on, as written; so is a call to a function not allowed.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

from pagoda.entrypoints.tools.constraints import (
    ARGUMENTS_KEY,
    CALL_HEAD,
    CALL_SEPARATOR,
    CALL_TAIL,
)
from pagoda.entrypoints.tools.parsers.base import (
    StreamDelta,
    ToolCallFragment,
    ToolParser,
    load_json,
    new_call_id,
)
from pagoda.entrypoints.tools.parsers.scanning import BracketScanner

HEAD, ARGUMENTS, TAIL, CONTENT = "head", "arguments", "tail", "content"
JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


class ForcedCallParser(ToolParser):
    name = "forced"

    def __init__(self, tool_names: Collection[str] | None = None,
                 max_calls: int | None = None,
                 schemas: Mapping[str, dict[str, Any] | None] | None = None) -> None:
        super().__init__(tool_names, max_calls, schemas)
        self._state = HEAD
        self._buffer = ""
        """The text not yet accounted for; in ARGUMENTS, from the arguments' "{" on."""
        self._num_sent = 0
        """In ARGUMENTS: how much of the buffer was sent."""
        self._index: int | None = None
        """The index of the call being read (None: dropped by max_calls)."""
        self._scanner: BracketScanner | None = None

    def feed(self, text: str) -> StreamDelta:
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        delta = self._advance(final=True)
        if self._state == ARGUMENTS:  # cut short: the arguments written so far
            delta.tool_calls.extend(self._arguments(self._buffer[self._num_sent:]))
        self._buffer = ""  # (a head or tail cut short: wrapper text, never content)
        return delta

    def _advance(self, final: bool) -> StreamDelta:
        delta = StreamDelta()
        while self._buffer:
            if self._state == CONTENT:
                delta.content, self._buffer = delta.content + self._buffer, ""
            elif self._state == HEAD:
                if not self._read_head(delta):
                    break
            elif self._state == ARGUMENTS:
                end = self._scanner.end(self._buffer, final)
                sent_up_to = self._scanner.position if end is None else end
                delta.tool_calls.extend(self._arguments(self._buffer[self._num_sent:sent_up_to]))
                self._num_sent = sent_up_to
                if end is None:
                    break
                self._state, self._buffer = TAIL, self._buffer[end:]
            elif self._buffer.startswith(CALL_TAIL):  # TAIL
                self._state, self._buffer = HEAD, self._buffer[len(CALL_TAIL):]
            elif CALL_TAIL.startswith(self._buffer):
                break
            else:
                self._state = CONTENT
        return delta

    def _read_head(self, delta: StreamDelta) -> bool:
        """In HEAD: announce the call once its arguments begin (then True), or go to CONTENT
        if the text left the layout (True); False while more text is needed."""
        head = CALL_HEAD if self.num_calls == 0 else CALL_SEPARATOR + CALL_HEAD
        if not self._buffer.startswith(head):
            if head.startswith(self._buffer):
                return False
            self._state = CONTENT
            return True
        name_match = JSON_STRING.match(self._buffer, len(head))
        if name_match is None:
            rest = self._buffer[len(head):]
            if rest == "" or rest.startswith('"'):
                return False
            self._state = CONTENT
            return True
        rest = self._buffer[name_match.end():]
        try:
            name = load_json(name_match.group())
        except ValueError:
            name = None
        opening = ARGUMENTS_KEY + "{"  # (the grammar's arguments are always an object)
        if not rest.startswith(opening) or not self.allows(name):
            if opening.startswith(rest) and self.allows(name):
                return False
            self._state = CONTENT
            return True
        self._index = self.new_call(name)
        if self._index is not None:
            delta.tool_calls.append(ToolCallFragment(self._index, new_call_id(), name, ""))
        self._state, self._buffer = ARGUMENTS, rest[len(ARGUMENTS_KEY):]
        self._num_sent = 0
        self._scanner = BracketScanner(0)
        return True

    def _arguments(self, text: str) -> list[ToolCallFragment]:
        if not text or self._index is None:
            return []
        return [ToolCallFragment(self._index, arguments=text)]
