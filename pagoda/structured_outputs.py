"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a few
strings, or a grammar (vLLM's `StructuredOutputsParams`, field for field).

Plain data, validated on construction for its shape only (exactly one constraint, the right
types); whether the schema, regex or grammar itself is valid is decided by the grammar
engine at the edge (pagoda/engine/core/grammar.py, through the InputProcessor), before the
request is queued.

A reasoning model thinks before it answers: `after_reasoning` leaves its thinking free and
applies the constraint to the text after it (the reasoning parsers' span,
pagoda/entrypoints/reasoning/parsers.py):

    [<think>] free text </think> [whitespace] <what the constraint allows>
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagoda.errors import InvalidRequestError

PARAM = "structured_outputs"
"""The request field errors name (endpoints rename it: response_format, guided_json, ...)."""


@dataclass(frozen=True)
class ReasoningSpan:
    """Free text at the start of an output, before the part a constraint covers."""

    start: str = "<think>"
    """The text that opens the span."""
    end: str = "</think>"
    """The text that closes it; whitespace after it is allowed."""
    begins_inside: bool = False
    """True: the output begins inside the span (DeepSeek-R1: the prompt opened it; a
    leading `start` is allowed too). False: the span is optional and, when there, opens
    the output with `start` (Qwen3); an output without it is constrained from its first
    token."""

    def __post_init__(self) -> None:
        if not all(isinstance(m, str) and m for m in (self.start, self.end)):
            raise _refuse("has a bad after_reasoning: its start and end must be non-empty "
                          "strings")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | bool | None = None
    """A JSON schema (a dict or its JSON text) the output must validate against."""
    regex: str | None = None
    """A regular expression the whole output must match."""
    choice: list[str] | tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A grammar the output must derive: Lark syntax, or GBNF / EBNF (llama.cpp's
    `root ::= ...`, as vLLM's guided_grammar takes it)."""
    json_object: bool = False
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    after_reasoning: ReasoningSpan | None = None
    """Leave a leading reasoning span free: the constraint applies after it (set by the
    server when it runs a reasoning parser)."""

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise _refuse("needs exactly one of json, regex, choice, grammar, json_object; "
                          f"got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict, bool)):
            raise _refuse("has a bad json: it must be a JSON schema (an object or its text), "
                          f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _refuse(f"has a bad {name}: it must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise _refuse("has a bad choice: it must be a non-empty list of non-empty "
                              "strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.after_reasoning is not None and not isinstance(self.after_reasoning,
                                                               ReasoningSpan):
            raise _refuse("has a bad after_reasoning: it must be a ReasoningSpan")

    @property
    def kind(self) -> str:
        """json, regex, choice, grammar or json_object."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar")
                    if getattr(self, name) is not None)

    def key(self) -> tuple[str, ...]:
        """(kind, canonical text[, span start, span end]): equal constraints share one
        compiled grammar."""
        span = self.after_reasoning
        if span is None:
            return self._constraint_key()
        return (*self._constraint_key(), span.start, span.end, str(span.begins_inside))

    def _constraint_key(self) -> tuple[str, str]:
        kind = self.kind
        if kind == "json_object":
            return kind, ""
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            return kind, json.dumps(value, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(list(value))
        return kind, value


def _refuse(detail: str) -> InvalidRequestError:
    """"structured_outputs <detail>", re-rendered under the client's field name by renamed()."""
    return InvalidRequestError.about(PARAM, detail)
