"""The reasoning parsers (pagoda/entrypoints/reasoning/parsers.py): each output split whole,
and streamed cut at every position (and into single characters) assembling to exactly the
whole split, with nothing sent that could still turn out to be a marker; and `auto` picking
the parser from the chat template."""

from __future__ import annotations

import random

import pytest

from pagoda.entrypoints.reasoning import REASONING_PARSERS, resolve_reasoning_parser
from pagoda.entrypoints.reasoning.parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningSplit,
    assemble,
    split_reasoning,
)
from pagoda.structured_outputs import ReasoningSpan

QWEN3_CASES = [
    # (output, reasoning, content)
    ("<think>\nLet me add.\n</think>\n\n4", "Let me add.", "4"),
    ("<think>a</think>b", "a", "b"),
    ("  \n<think>a  b\n\n</think>  \n c \n", "a  b", "c \n"),
    ("The answer is 4.", None, "The answer is 4."),
    ("\n\nNo thinking here", None, "\n\nNo thinking here"),
    ("<think>\n\n</think>\n\nJust content", None, "Just content"),
    ("<think>\nstill thinking when cut", "still thinking when cut", None),
    ("<think>\nstill thinking </thi", "still thinking </thi", None),
    ("<think>a</think>", "a", None),
    ("<think>a</think>b<think>c</think>", "a", "b<think>c</think>"),
    ("<thinking>is not the marker", None, "<thinking>is not the marker"),
    ("<thi", None, "<thi"),
    ("x<think>a</think>y", None, "x<think>a</think>y"),
    ("", None, None),
    ("   ", None, "   "),
    ("<think>α → β</think>γ", "α → β", "γ"),
]

DEEPSEEK_R1_CASES = [
    ("Let me add.\n</think>\n\n4", "Let me add.", "4"),
    ("<think>\nLet me add.\n</think>\n\n4", "Let me add.", "4"),
    ("thinking, never closed", "thinking, never closed", None),
    ("no end marker </thin", "no end marker </thin", None),
    ("</think>answer", None, "answer"),
    ("\n</think>\n\nanswer", None, "answer"),
    ("a</think>b</think>c", "a", "b</think>c"),
    ("<thi", "<thi", None),
    ("", None, None),
    ("  \n ", None, None),
    ("a <think> b </think> c", "a <think> b", "c"),
]


def streamed(parser_type, pieces: list[str]) -> ReasoningSplit:
    parser = parser_type()
    deltas = [parser.feed(piece) for piece in pieces]
    return assemble([*deltas, parser.finish()])


def cuts(text: str):
    """Every split into two pieces, single characters, and a few random multi-cuts."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(len(text))
    for _ in range(20):
        points = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        yield [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@pytest.mark.parametrize(("parser_type", "case"),
                         [(Qwen3ReasoningParser, c) for c in QWEN3_CASES]
                         + [(DeepSeekR1ReasoningParser, c) for c in DEEPSEEK_R1_CASES])
def test_whole_and_every_streamed_cut_split_alike(parser_type, case):
    text, reasoning, content = case
    expected = ReasoningSplit(reasoning, content)
    assert split_reasoning(parser_type(), text) == expected
    for pieces in cuts(text):
        assert streamed(parser_type, pieces) == expected, pieces


@pytest.mark.parametrize("parser_type", [Qwen3ReasoningParser, DeepSeekR1ReasoningParser])
def test_nothing_is_sent_that_could_still_be_a_marker(parser_type):
    parser = parser_type()
    sent = []
    for piece in ["<think>", "\nI think", " so", "\n</", "thi", "nk", ">", "\n\n", "Yes", "."]:
        delta = parser.feed(piece)
        sent.append((delta.reasoning, delta.content))
    sent.append(tuple(vars(parser.finish()).values()))
    assert sent == [("", ""), ("I think", ""), (" so", ""), ("", ""), ("", ""), ("", ""),
                    ("", ""), ("", ""), ("", "Yes"), ("", "."), ("", "")]
    assert parser.in_content


def test_qwen3_decides_at_the_first_character_that_rules_out_think():
    parser = Qwen3ReasoningParser()
    assert not parser.feed("<")
    assert parser.feed("b>bold").content == "<b>bold"  # never a think block: content
    assert parser.in_content


def test_deepseek_r1_reasoning_flows_before_any_marker():
    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("Hmm, ").reasoning == "Hmm,"  # the space waits for what follows
    assert parser.feed("ok").reasoning == " ok"
    assert not parser.in_content


def test_the_spans_the_grammar_leaves_free():
    assert Qwen3ReasoningParser.span() == ReasoningSpan("<think>", "</think>")
    assert DeepSeekR1ReasoningParser.span() == ReasoningSpan("<think>", "</think>",
                                                             begins_inside=True)
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "openai_gptoss", "qwen3"]


QWEN3_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "<|im_end|>\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}\n")
R1_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '<｜User｜>' + message['content'] }}{% else %}{{ '<｜Assistant｜>' + "
    "message['content'].split('</think>')[-1] + '<｜end▁of▁sentence｜>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")
QWQ_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + "
    "message.content + '<|im_end|>\\n' }}{%- endfor %}\n{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}\n")
PLAIN_TEMPLATE = ("{% for message in messages %}{{ message.role }}: {{ message.content }}\n"
                  "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.mark.parametrize(("template", "expected"), [
    (QWEN3_TEMPLATE, "qwen3"),
    (R1_TEMPLATE, "deepseek_r1"),
    (QWQ_TEMPLATE, "deepseek_r1"),
    ({"default": R1_TEMPLATE, "tool_use": PLAIN_TEMPLATE}, "deepseek_r1"),
    (PLAIN_TEMPLATE, None),
    (None, None),
    # Not renderable here (an extension tag): the generation prompt is read from the text.
    ("{% generation %}" + R1_TEMPLATE, "deepseek_r1"),
    ("{% generation %}" + QWEN3_TEMPLATE, "qwen3"),
    ("{{ raise_exception('needs a system message') }}" + PLAIN_TEMPLATE, None),
])
def test_auto_picks_the_parser_from_the_chat_template(template, expected):
    assert resolve_reasoning_parser("auto", template) == expected


def test_a_named_parser_is_kept_whatever_the_template():
    assert resolve_reasoning_parser("qwen3", R1_TEMPLATE) == "qwen3"
    assert resolve_reasoning_parser(None, R1_TEMPLATE) is None
