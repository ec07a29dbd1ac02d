"""Constrained decoding with llguidance: structured-output constraints compiled to grammars,
one matcher per sequence, and the token bitmask of a step.

Why llguidance: it has no dependencies (xgrammar pulls torch, triton and a TVM runtime), so
this scheduling-layer module stays torch-free and the bitmask is a numpy array the step
boundary carries; and it compiled a schema and filled masks faster than xgrammar when
measured (benchmarks/grammar_engines.py, results in BENCHMARKS.md).

    StructuredOutputsParams --compile (edge, cached by key)--> grammar text (validated)
    grammar text --matcher (per sequence, at add_request)--> GrammarMatcher
    each step: matchers of the sequences that sample --fill--> bitmask rows (int32 words,
               bit t of a row set = token t allowed); each sampled token --accept--> matcher

A constraint with `after_reasoning` (a reasoning model's thinking left free) compiles to one
llguidance grammar of two: a Lark prefix for the thinking, then the constraint's own grammar
as a nested `@constraint` with its own lexer:

    start: reasoning WS? @constraint          (begins inside: DeepSeek-R1's prompt opened it)
    start: reasoning? WS? @constraint         (else: an optional block at the start, Qwen3)
    reasoning: OPEN (think_text | THINK_TEXT <[end id]>)     (OPEN: "<think>" | <[start id]>;
                                                              optional when it begins inside)
    think_text[lazy]: /(.|\n)*/ "</think>"     the thinking ends at the first "</think>" ...
    THINK_TEXT: /(.|\n)*/                      ... or at the marker's own token
    WS: /[ \t\r\n]+/

llguidance treats a tokenizer's `<...>` added tokens (Qwen3's and the R1 distills' `<think>`
and `</think>`) as special tokens, which text never matches: where a marker is one such token,
the grammar names it by id (`<[id]>`) beside its spelling in text. Inside the thinking every
non-special token is allowed but EOS (the grammar is not complete); a model that never ends
its thinking runs into max_tokens.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from pagoda.errors import InvalidRequestError
from pagoda.structured_outputs import PARAM, ReasoningSpan, StructuredOutputsParams

CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""
JSON_OBJECT_SCHEMA = {"type": "object"}


class GrammarCompiler:
    """Validates and compiles constraints against one tokenizer; thread-safe (the async
    engine compiles on the event loop while the engine thread builds matchers)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self._hf_tokenizer = tokenizer
        self._eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, ...], str] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.compile_seconds = 0.0
        """Total time spent compiling (cache misses), for /metrics."""

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on the first structured request (~0.3 s and ~50 MB for a 49K vocabulary:
        not at start, as vLLM builds its grammar backend, so that a server which never
        serves structured outputs never holds it).
        InvalidRequestError if this tokenizer cannot serve the model's vocabulary (a
        tokenizer with more tokens than the model has logits)."""
        with self._lock:
            if self._ll_tokenizer is None:
                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size,
                        eos_token=self._eos_token_ids or None,
                    )
                except Exception as e:  # noqa: BLE001 - llguidance raises plain Exceptions
                    raise InvalidRequestError(
                        f"structured outputs are not available with this model's tokenizer: "
                        f"{e}", PARAM) from None
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar of `params`; InvalidRequestError (param
        "structured_outputs") naming the problem if the schema, regex or grammar is bad."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        ll_tokenizer = self.ll_tokenizer  # (built once; not part of the compile time)
        start = time.perf_counter()
        grammar = _to_grammar(params, self._special_token)
        error = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer)
        if error:
            raise InvalidRequestError.about(PARAM, f"is an invalid {params.kind}: {error}")
        with self._lock:
            self.num_compiled += 1
            self.compile_seconds += time.perf_counter() - start
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _special_token(self, text: str) -> str | None:
        """"<[id]>" when `text` is a single token that llguidance takes for special."""
        token_ids = self._hf_tokenizer.encode(text, add_special_tokens=False)
        if len(token_ids) == 1 and self.ll_tokenizer.is_special_token(token_ids[0]):
            return f"<[{token_ids[0]}]>"
        return None

    def matcher(self, grammar: str) -> GrammarMatcher:
        return GrammarMatcher(llguidance.LLMatcher(self.ll_tokenizer, grammar))


def _to_grammar(params: StructuredOutputsParams,
                marker_token: Callable[[str], str | None]) -> str:
    grammar = _constraint_grammar(params)
    if params.after_reasoning is not None:
        grammar = _after_reasoning(grammar, params.after_reasoning, marker_token)
    return grammar


def _constraint_grammar(params: StructuredOutputsParams) -> str:
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = JSON_OBJECT_SCHEMA if kind == "json_object" else params.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if schema is True:
                schema = {}
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": False}
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in params.choice)
            )
        try:
            lark = any_to_lark(params.grammar)
        except Exception as e:  # noqa: BLE001 - the GBNF converter raises bare Exceptions too
            raise _invalid(kind, e) from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as e:  # (JSONDecodeError is a ValueError)
        raise _invalid(kind, e) from None


REASONING_GRAMMAR_NAME = "reasoning_prefix"
CONSTRAINT_GRAMMAR_NAME = "constraint"


def _after_reasoning(grammar: str, span: ReasoningSpan,
                     marker_token: Callable[[str], str | None]) -> str:
    """`grammar` (llguidance's JSON of a list of grammars, or Lark text) behind a free
    reasoning span (the module doc). `marker_token(text)`: "<[id]>" where `text` is one
    special token, else None."""
    try:
        grammars = json.loads(grammar)["grammars"]
    except (ValueError, TypeError, KeyError):  # Lark text (what grammar_from_lark returns)
        grammars = [{"name": CONSTRAINT_GRAMMAR_NAME, "lark_grammar": grammar}]
    first = grammars[0] = dict(grammars[0])
    first["name"] = first.get("name") or CONSTRAINT_GRAMMAR_NAME
    start_token, end_token = marker_token(span.start), marker_token(span.end)
    body = "think_text" if end_token is None else f"(think_text | THINK_TEXT {end_token})"
    if span.begins_inside:  # a leading start marker spelled in text is thinking text
        opening = "" if start_token is None else f"{start_token}? "
        start = f"start: reasoning WS? @{first['name']}"
    else:
        spelled = json.dumps(span.start)
        opening = spelled + " " if start_token is None else f"({spelled} | {start_token}) "
        start = f"start: reasoning? WS? @{first['name']}"
    prefix = "\n".join([
        start,
        f"reasoning: {opening}{body}",
        f"think_text[lazy]: /(.|\\n)*/ {json.dumps(span.end)}",
        "THINK_TEXT: /(.|\\n)*/",
        "WS: /[ \\t\\r\\n]+/",
    ]) + "\n"
    return json.dumps({"grammars": [{"name": REASONING_GRAMMAR_NAME, "lark_grammar": prefix},
                                    *grammars]})


def _invalid(kind: str, error: Exception) -> InvalidRequestError:
    return InvalidRequestError.about(PARAM, f"is an invalid {kind}: {error}")


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar refused it (then the matcher is
        in error and the sequence must stop)."""
        return self._matcher.consume_token(token_id)

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (EOS was accepted)."""
        return self._matcher.is_stopped()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, from the first, the grammar accepts without completing
        (a token that ends the grammar is left out: no position may follow it). Changes
        nothing."""
        num_valid = self._matcher.validate_tokens(token_ids)
        num_consumed = 0
        for token_id in token_ids[:num_valid]:
            self._matcher.consume_token(token_id)
            num_consumed += 1
            if self._matcher.is_stopped():
                num_valid = num_consumed - 1
                break
        if num_consumed:
            self._matcher.rollback(num_consumed)
        return num_valid

    def fill_bitmask_rows(self, bitmask: np.ndarray, first_row: int, proposals: list[int]) -> None:
        """Rows first_row .. first_row + len(proposals): the allowed next tokens now, then
        after each proposal in turn (speculative decoding: one row per verified position).
        The proposals must be valid (num_valid); the matcher ends where it started."""
        self.fill_bitmask(bitmask, first_row)
        for offset, token_id in enumerate(proposals, start=1):
            accepted = self._matcher.consume_token(token_id)
            assert accepted, f"proposal {token_id} refused: {self.error}"
            self.fill_bitmask(bitmask, first_row + offset)
        if proposals:
            self._matcher.rollback(len(proposals))


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """(num_rows, ceil(vocab_size / 32)) int32, all tokens refused until filled."""
    return llguidance.numpy.allocate_token_bitmask(num_rows, vocab_size)
