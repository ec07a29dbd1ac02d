"""Grammars for structured outputs: compiled and validated once per constraint (cached),
refused with a typed error naming the field, and matchers that allow exactly what the
constraint allows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagoda.engine.core.grammar import allocate_bitmask
from pagoda.errors import InvalidRequestError
from pagoda.structured_outputs import StructuredOutputsParams as Constraint


@pytest.fixture
def tokenizer(bundled_tokenizer):
    return bundled_tokenizer


@pytest.fixture
def compiler(bundled_grammar_compiler):
    return bundled_grammar_compiler


def allowed_tokens(matcher, vocab_size) -> set[int]:
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size]
    return set(np.nonzero(bits)[0].tolist())


def generate_greedy_within(matcher, tokenizer, text: str) -> None:
    """Feed `text`'s tokens, each of which must be allowed when it comes."""
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        assert token_id in allowed_tokens(matcher, len(tokenizer)), tokenizer.decode([token_id])
        assert matcher.accept(token_id)


def test_equal_constraints_compile_once(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    before = compiler.num_compiled
    first = compiler.compile(Constraint(json=schema))
    assert compiler.compile(Constraint(json=json.dumps(schema, sort_keys=True,
                                                       separators=(",", ":")))) == first
    assert compiler.compile(Constraint(json=dict(reversed(schema.items())))) == first
    assert compiler.num_compiled == before + 1 and compiler.compile_seconds > 0


@pytest.mark.parametrize("constraint, problem", [
    (Constraint(json={"type": "objectx"}), "json"),
    (Constraint(json="{not json"), "json"),
    (Constraint(regex="a(b"), "regex"),
    (Constraint(grammar="root ::= ( 'a'"), "grammar"),
    (Constraint(grammar="root ::= missing"), "grammar"),
])
def test_invalid_constraints_are_refused_naming_the_field(compiler, constraint, problem):
    with pytest.raises(InvalidRequestError, match=f"an invalid {problem}") as refused:
        compiler.compile(constraint)
    assert refused.value.param == "structured_outputs"


@pytest.mark.parametrize("fields", [{}, {"regex": "a", "choice": ["a"]}, {"choice": []},
                                    {"regex": ""}, {"json": 5}])
def test_the_shape_of_the_constraint_is_checked_on_construction(fields):
    with pytest.raises(InvalidRequestError) as refused:
        Constraint(**fields)
    assert refused.value.param == "structured_outputs"


def test_a_choice_allows_only_its_strings_then_only_eos(compiler, tokenizer):
    matcher = compiler.matcher(compiler.compile(Constraint(choice=["yes", "no"])))
    first = allowed_tokens(matcher, len(tokenizer))
    assert tokenizer.encode("yes")[0] in first and tokenizer.encode("no")[0] in first
    assert tokenizer.encode("maybe")[0] not in first
    generate_greedy_within(matcher, tokenizer, "yes")
    assert allowed_tokens(matcher, len(tokenizer)) == {tokenizer.eos_token_id}
    assert matcher.accept(tokenizer.eos_token_id) and matcher.is_finished


def test_gbnf_and_lark_grammars_and_regexes_derive_their_language(compiler, tokenizer):
    gbnf = compiler.matcher(compiler.compile(Constraint(grammar='root ::= "a" ("b" | "c")+')))
    generate_greedy_within(gbnf, tokenizer, "abcb")
    lark = compiler.matcher(compiler.compile(Constraint(grammar='start: "x" NUMBER\n'
                                                        '%import common.NUMBER')))
    generate_greedy_within(lark, tokenizer, "x42")
    regex = compiler.matcher(compiler.compile(Constraint(regex=r"[a-z]+@[a-z]+\.com")))
    generate_greedy_within(regex, tokenizer, "ann@mail.com")
    assert tokenizer.encode(" ")[0] not in allowed_tokens(regex, len(tokenizer))


def test_a_refused_token_is_reported(compiler, tokenizer):
    matcher = compiler.matcher(compiler.compile(Constraint(choice=["yes"])))
    assert not matcher.accept(tokenizer.encode("no")[0])
    assert matcher.error
