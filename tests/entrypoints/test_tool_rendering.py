"""Tools in the prompt without a model: a template that knows tools gets them as they are
(with call arguments as objects); any other template (the bundled model's) gets the Hermes
fallback: a system block listing the tools, calls as <tool_call> blocks, results as
<tool_response> blocks in one user turn. Plus what tools/plan.py refuses."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from pagoda.entrypoints.chat_template import apply_chat_template
from pagoda.entrypoints.tools.plan import ToolPlan
from pagoda.entrypoints.tools.rendering import (
    TOOLS_FOOTER,
    TOOLS_HEADER,
    render_chat,
    template_knows_tools,
)
from pagoda.errors import InvalidRequestError

# The bundled SmolLM2-135M-Instruct's template: no tool section.
SMOLLM_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A template with its own tool section (shaped like Qwen2.5's, much shorter).
TOOL_TEMPLATE = (
    "{% if tools %}[TOOLS]{% for t in tools %}{{ t.function.name }};{% endfor %}[/TOOLS]"
    "{% endif %}{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %}[ID {{ m.tool_call_id }}]{% endif %}{% endfor %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        CALL, {**CALL, "id": "call_2", "function": {"name": "get_weather",
                                                    "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "call_1"},
    {"role": "tool", "content": '{"temperature": 25}', "tool_call_id": "call_2"},
]


def tokenizer_with(template: str) -> PreTrainedTokenizerFast:
    vocab = models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(vocab))
    tokenizer.chat_template = template
    return tokenizer


def test_which_templates_know_tools():
    assert not template_knows_tools(SMOLLM_TEMPLATE)
    assert template_knows_tools(TOOL_TEMPLATE)
    assert template_knows_tools({"default": SMOLLM_TEMPLATE, "tool_use": TOOL_TEMPLATE})
    assert not template_knows_tools(None)


def test_a_conversation_without_tools_renders_as_before():
    tokenizer = tokenizer_with(SMOLLM_TEMPLATE)
    messages = [{"role": "user", "content": "Hi"}]
    assert render_chat(tokenizer, messages) == apply_chat_template(tokenizer, messages)


def test_fallback_lists_the_tools_in_a_system_block():
    tokenizer = tokenizer_with(SMOLLM_TEMPLATE)
    text = render_chat(tokenizer, [{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    block = TOOLS_HEADER + json.dumps(TOOLS[0]) + TOOLS_FOOTER
    assert text == (f"<|im_start|>system\n{block}<|im_end|>\n"
                    "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    # A system message of the client's keeps its text; the block follows it.
    text = render_chat(tokenizer, [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi"}], TOOLS)
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{block}<|im_end|>\n")


def test_fallback_writes_calls_and_results_as_hermes_blocks():
    tokenizer = tokenizer_with(SMOLLM_TEMPLATE)
    text = render_chat(tokenizer, CONVERSATION, TOOLS, add_generation_prompt=True)
    calls = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
             '\n</tool_call>')
    results = ('<tool_response>\n{"temperature": 21}\n</tool_response>\n'
               '<tool_response>\n{"temperature": 25}\n</tool_response>')
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        f"<|im_start|>assistant\n{calls}<|im_end|>\n"
        f"<|im_start|>user\n{results}<|im_end|>\n<|im_start|>assistant\n")
    # History with calls but no tools offered: the calls and results, no tool list.
    text = render_chat(tokenizer, CONVERSATION, None)
    assert "<tools>" not in text and calls in text and results in text


def test_assistant_text_comes_before_its_calls():
    tokenizer = tokenizer_with(SMOLLM_TEMPLATE)
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]}]
    text = render_chat(tokenizer, messages, TOOLS, add_generation_prompt=False)
    assert text.endswith('<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", '
                         '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n')


def test_a_template_that_knows_tools_gets_them_as_they_are():
    tokenizer = tokenizer_with(TOOL_TEMPLATE)
    text = render_chat(tokenizer, CONVERSATION, TOOLS, add_generation_prompt=False)
    assert text == ('[TOOLS]get_weather;[/TOOLS][user]Weather in Paris and Rome?[assistant]'
                    '[CALL get_weather {"city": "Paris"}][CALL get_weather {"city": "Rome"}]'
                    '[tool]{"temperature": 21}[ID call_1][tool]{"temperature": 25}[ID call_2]')


def test_plan_defaults():
    assert ToolPlan.of(None, None, None).mode == "none"
    plan = ToolPlan.of(TOOLS, None, None)
    assert (plan.mode, plan.call_names, plan.parallel, plan.constrained) == (
        "auto", ("get_weather",), True, False)
    named = ToolPlan.of(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, False)
    assert (named.mode, named.call_names, named.max_calls) == ("named", ("get_weather",), 1)
    assert named.structured_outputs().grammar.startswith("start: call\n")
    assert ToolPlan.of(TOOLS, "required", None).structured_outputs() is not None
    assert ToolPlan.of(TOOLS, "auto", None).structured_outputs() is None
    assert not ToolPlan.of(TOOLS, "none", None).offers_tools
    assert ToolPlan.of(None, "none", None).mode == "none"


@pytest.mark.parametrize("tools, tool_choice, param", [
    (None, "required", "tool_choice"),
    (None, "auto", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    (TOOLS + TOOLS, "auto", "tools"),
])
def test_plan_refusals_name_the_field(tools, tool_choice, param):
    with pytest.raises(InvalidRequestError) as error:
        ToolPlan.of(tools, tool_choice, None)
    assert error.value.param == param
