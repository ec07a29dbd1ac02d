"""Structured outputs behind a reasoning model's thinking (`after_reasoning`,
pagoda/engine/core/grammar.py): the thinking may hold any text, the constraint holds from the end
marker on, whether the markers are single (llguidance-special) tokens or spelled out in text,
for every kind of constraint and both span shapes (Qwen3's optional block, DeepSeek-R1's
output that begins inside)."""

from __future__ import annotations

import dataclasses
import json
import string

import numpy as np
import pytest

from pagoda.engine.core.grammar import GrammarCompiler, allocate_bitmask
from pagoda.entrypoints.tools.plan import ToolPlan
from pagoda.structured_outputs import ReasoningSpan
from pagoda.structured_outputs import StructuredOutputsParams as Constraint
from tests.thinking_tokenizer import spelled, thinking_tokenizer

QWEN3 = ReasoningSpan()
DEEPSEEK_R1 = ReasoningSpan(begins_inside=True)
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
CONSTRAINTS = [  # (constraint, an answer it allows, an answer it refuses)
    (Constraint(json={"type": "object", "properties": {"a": {"type": "integer"}},
                      "required": ["a"]}), '{"a":1}', '{"a":"x"}'),
    (Constraint(json_object=True), '{"ok":true}', "[1]"),
    (Constraint(choice=["yes", "no"]), "yes", "maybe"),
    (Constraint(regex="[0-9]+"), "42", "4x"),
    (Constraint(grammar='root ::= "ok" | "fine"'), "fine", "bad"),
    (ToolPlan.of(TOOLS, "required", False).structured_outputs(),
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
     '<tool_call>\n{"name": "get_date", "arguments": {}}\n</tool_call>'),
]


@pytest.fixture(scope="module")
def tokenizer():
    return thinking_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def accepts(compiler, tokenizer, constraint, token_ids: list[int]) -> bool:
    """Whether the grammar takes every token, then EOS, and is then finished."""
    matcher = compiler.matcher(compiler.compile(constraint))
    return (all(matcher.accept(t) for t in token_ids)
            and matcher.accept(tokenizer.eos_token_id) and matcher.is_finished)


def allowed(compiler, constraint, token_ids: list[int], vocab_size: int) -> set[int]:
    matcher = compiler.matcher(compiler.compile(constraint))
    assert all(matcher.accept(t) for t in token_ids)
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size]
    return set(np.nonzero(bits)[0].tolist())


@pytest.mark.parametrize(("constraint", "good", "bad"), CONSTRAINTS,
                         ids=[c.kind for c, _, _ in CONSTRAINTS])
def test_free_thinking_then_the_constraint(compiler, tokenizer, constraint, good, bad):
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
    think, end = encode("<think>"), encode("</think>")
    assert len(think) == len(end) == 1  # the markers are tokens here
    thinking = encode("\nHmm: {not json} 4x </thin maybe [1]\n")
    qwen3 = dataclasses.replace(constraint, after_reasoning=QWEN3)
    r1 = dataclasses.replace(constraint, after_reasoning=DEEPSEEK_R1)
    for span_constraint in (qwen3, r1):
        for closing in (end, spelled(tokenizer, "</think>")):  # the token, or text
            for opening in (think, spelled(tokenizer, "<think>")):
                output = opening + thinking + closing + encode("\n\n")
                assert accepts(compiler, tokenizer, span_constraint, output + encode(good))
                assert not accepts(compiler, tokenizer, span_constraint, output + encode(bad))
    # Qwen3: no block, the constraint from the first token; a block must open the output.
    assert accepts(compiler, tokenizer, qwen3, encode(good))
    assert not accepts(compiler, tokenizer, qwen3, encode("Sure. ") + end + encode(good))
    # DeepSeek-R1: the output begins inside the thinking, which must end before the answer.
    assert accepts(compiler, tokenizer, r1, thinking + end + encode(good))
    assert not accepts(compiler, tokenizer, r1, encode(good))
    # Without the span, thinking is refused (the span is what frees it).
    assert not accepts(compiler, tokenizer, constraint, think + thinking + end + encode(good))


def test_the_thinking_allows_any_text_token_but_eos(compiler, tokenizer):
    constraint = Constraint(json_object=True, after_reasoning=DEEPSEEK_R1)
    inside = allowed(compiler, constraint, tokenizer.encode("Let me", add_special_tokens=False),
                     len(tokenizer))
    end_id = tokenizer.convert_tokens_to_ids("</think>")
    ascii_ids = {t for c in string.printable for t in tokenizer.encode(c, add_special_tokens=False)}
    assert len(ascii_ids) == len(string.printable) and ascii_ids <= inside and end_id in inside
    assert tokenizer.eos_token_id not in inside
    after = allowed(compiler, constraint, tokenizer.encode("Done</think>",
                                                           add_special_tokens=False),
                    len(tokenizer))
    space, brace = (tokenizer.convert_tokens_to_ids(c) for c in ("Ġ", "{"))
    assert after >= {space, brace} and tokenizer.convert_tokens_to_ids("a") not in after


def test_a_text_end_marker_is_the_end_however_the_tokens_cut_it(compiler, tokenizer):
    constraint = Constraint(choice=["yes"], after_reasoning=DEEPSEEK_R1)
    assert accepts(compiler, tokenizer, constraint, spelled(tokenizer, "a</think>yes"))
    # After the first end marker the answer begins: a second thought is refused.
    assert not accepts(compiler, tokenizer, constraint,
                       spelled(tokenizer, "a</think> more</think>yes"))


def test_spans_are_part_of_the_cache_key(compiler):
    base = Constraint(regex="[0-9]+")
    grammars = {compiler.compile(base), compiler.compile(dataclasses.replace(
        base, after_reasoning=QWEN3)), compiler.compile(dataclasses.replace(
            base, after_reasoning=DEEPSEEK_R1))}
    assert len(grammars) == 3


def test_bad_spans_are_refused():
    with pytest.raises(Exception, match="after_reasoning"):
        ReasoningSpan(end="")
    with pytest.raises(Exception, match="after_reasoning"):
        Constraint(regex="a", after_reasoning="</think>")


@pytest.mark.slow
def test_the_bundled_model_opens_a_think_block_then_writes_the_json(bundled_llm):
    """On the real engine (its sampler masks with the grammar): biased towards `<` and the
    pieces of `</think>`, the model opens the block with `<`, closes it, then the schema
    holds (the biased pieces are refused inside the JSON)."""
    from pagoda import SamplingParams

    tokenizer = bundled_llm.get_tokenizer()
    bias = {tokenizer.encode(piece, add_special_tokens=False)[0]: value
            for piece, value in (("<", 50), ("</", 100), ("think", 100), (">", 100))}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=24, logit_bias=bias,
                            structured_outputs=Constraint(json=schema, after_reasoning=QWEN3))
    output = bundled_llm.chat([{"role": "user", "content": "Give me a JSON object."}], params,
                              use_tqdm=False)[0].outputs[0]
    assert output.text.startswith("<think>") and output.finish_reason == "stop", output.text
    answer = output.text.split("</think>", 1)[1]
    assert isinstance(json.loads(answer)["a"], int)


@pytest.mark.slow
def test_llm_chat_passes_chat_template_kwargs(bundled_llm):
    from pagoda import SamplingParams

    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n"
                "</think>\n\n{% endif %}{% endif %}")
    conversation = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(temperature=0, max_tokens=1)
    thinking, plain = (bundled_llm.chat(conversation, params, chat_template=template,
                                        chat_template_kwargs=kwargs, use_tqdm=False)[0]
                       for kwargs in ({}, {"enable_thinking": False}))
    assert thinking.prompt.endswith("<|im_start|>assistant\n")
    assert plain.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    partial = bundled_llm.chat([*conversation, {"role": "assistant", "content": "Hel"}],
                               params, chat_template=template, add_generation_prompt=False,
                               continue_final_message=True, use_tqdm=False)[0]
    assert partial.prompt.endswith("<|im_start|>assistant\nHel")
