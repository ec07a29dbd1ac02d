"""gpt-oss's harmony format (pagoda/entrypoints/harmony.py): the `openai_gptoss` reasoning
parser and the `openai` tool-call parser, each split whole and streamed cut at every position
alike; the two in series as the chat server runs them; `auto` picking both from a template
that writes harmony's channels."""

from __future__ import annotations

import pytest

from pagoda.entrypoints.reasoning import resolve_reasoning_parser
from pagoda.entrypoints.reasoning.harmony import HarmonyReasoningParser
from pagoda.entrypoints.reasoning.parsers import ReasoningSplit, split_reasoning
from pagoda.entrypoints.tools.parsers import (
    TOOL_PARSERS,
    OpenAIToolParser,
    resolve_tool_call_parser,
)
from tests.entrypoints.test_reasoning_parsers import cuts, streamed
from tests.entrypoints.tool_parser_checks import parse

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
WEATHER_CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather '
                '<|constrain|>json<|message|>{"city": "Paris"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"

REASONING_CASES = [
    # (output, reasoning, content)
    (ANALYSIS + FINAL, "The user wants the weather.", "It is 4."),
    ("<|channel|>final<|message|>Just the answer.<|return|>", None, "Just the answer."),
    (ANALYSIS + WEATHER_CALL, "The user wants the weather.", WEATHER_CALL),
    # the recipient before the channel, in the first header: re-sent from <|start|>assistant
    (' to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>', None,
     '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>'),
    # a preamble (commentary, no recipient) is content; so is text outside any message
    ("<|channel|>commentary<|message|>Checking. <|end|>" + FINAL, None, "Checking. It is 4."),
    ("plain text, no harmony", None, "plain text, no harmony"),
    # cut off while thinking, or inside a header: the reasoning so far, no markup
    ("<|channel|>analysis<|message|>still thinking <|en", "still thinking <|en", None),
    (ANALYSIS + "<|start|>assistant<|chan", "The user wants the weather.", None),
    ("<|channel|>analysis<|message|>α → β<|end|>" + FINAL, "α → β", "It is 4."),
    ("", None, None),
]


@pytest.mark.parametrize("case", REASONING_CASES)
def test_reasoning_whole_and_every_streamed_cut_split_alike(case):
    text, reasoning, content = case
    expected = ReasoningSplit(reasoning, content)
    assert split_reasoning(HarmonyReasoningParser(), text) == expected
    for pieces in cuts(text):
        assert streamed(HarmonyReasoningParser, pieces) == expected, pieces


def test_nothing_is_sent_that_could_still_be_a_message_end():
    parser = HarmonyReasoningParser()
    sent = [parser.feed(piece) for piece in
            ["<|channel|>analysis<|message|>", "Think", " <|e", "nd|>", "<|start|>assistant",
             "<|channel|>final<|message|>", "4", "<|return|>"]]
    assert [(d.reasoning, d.content) for d in sent] == [
        ("", ""), ("Think", ""), (" ", ""), ("", ""), ("", ""), ("", ""), ("", "4"), ("", "")]


def test_harmony_has_no_span_and_keeps_special_tokens():
    assert HarmonyReasoningParser.span() is None  # a constraint cannot follow it: a 400
    assert HarmonyReasoningParser.keeps_special_tokens
    assert TOOL_PARSERS["openai"] is OpenAIToolParser and OpenAIToolParser.keeps_special_tokens


TOOL_CASES = [
    # (output, content, calls)
    (ANALYSIS + WEATHER_CALL, None, [("get_weather", {"city": "Paris"})]),
    (ANALYSIS + FINAL, "It is 4.", []),
    (WEATHER_CALL + WEATHER_CALL.replace("Paris", "Rome"), None,
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    (' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}<|call|>',
     None, [("get_time", {"zone": "UTC"})]),
    # the reasoning parser's content: the answer's text, then a call message whole
    ("Let me check. " + WEATHER_CALL, "Let me check.", [("get_weather", {"city": "Paris"})]),
    # not a request's function, or arguments that are no JSON object: content as written
    (WEATHER_CALL.replace("get_weather", "delete_all"),
     WEATHER_CALL.replace("get_weather", "delete_all"), []),
    (WEATHER_CALL.replace('{"city": "Paris"}', "[1, 2]"),
     WEATHER_CALL.replace('{"city": "Paris"}', "[1, 2]"), []),
    ("plain text", "plain text", []),
]


@pytest.mark.parametrize("case", TOOL_CASES)
def test_tool_calls_whole_and_streamed_alike(case):
    text, content, calls = case
    assert parse(OpenAIToolParser, text) == (content, calls)


def test_the_two_parsers_in_series_as_the_server_runs_them():
    split = split_reasoning(HarmonyReasoningParser(), ANALYSIS + WEATHER_CALL)
    assert split.reasoning == "The user wants the weather."
    assert parse(OpenAIToolParser, split.content) == (None, [("get_weather", {"city": "Paris"})])


def test_auto_picks_both_from_a_template_that_writes_channels():
    template = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
                "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
                "{# <|channel|>analysis / final #}")
    assert resolve_reasoning_parser("auto", template) == "openai_gptoss"
    assert resolve_tool_call_parser("auto", template) == "openai"
