"""Constrained decoding through the whole engine on the bundled model: outputs follow their
constraint, requests without one are unaffected by sharing the batch, n > 1 and logprobs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagoda import LLM, SamplingParams
from pagoda.structured_outputs import StructuredOutputsParams as Constraint

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "city": {"enum": ["Paris", "Lima", "Oslo"]}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def ask(llm: LLM, prompt: str, params: SamplingParams):
    return llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]


def test_constrained_and_free_requests_share_a_batch(bundled_llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["Describe a person.", "Write a haiku about rain.", "Pick a date.",
               "Tell me about owls."]
    alone = [bundled_llm.generate(p, free, use_tqdm=False)[0] for p in prompts[1::2]]
    constrained = [
        SamplingParams(temperature=0.7, seed=1, max_tokens=80,
                       structured_outputs=Constraint(json=PERSON)),
        free,
        SamplingParams(temperature=0.7, seed=2, max_tokens=20,
                       structured_outputs=Constraint(regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")),
        free,
    ]
    outputs = bundled_llm.generate(prompts, constrained, use_tqdm=False)
    person = outputs[0].outputs[0]
    assert person.finish_reason == "stop"
    jsonschema.validate(json.loads(person.text), PERSON)
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", outputs[2].outputs[0].text)
    # the free rows are exactly what they are alone: the mask touched only its own rows
    assert [o.outputs[0].token_ids for o in outputs[1::2]] == [
        o.outputs[0].token_ids for o in alone]
    assert bundled_llm.engine.snapshot().num_structured_requests >= 2


def test_n_choices_each_follow_the_constraint_with_their_own_seed(bundled_llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=80, logprobs=2,
                            structured_outputs=Constraint(json=PERSON))
    output = ask(bundled_llm, "Invent three people.", params)
    texts = [c.text for c in output.outputs]
    for completion in output.outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), PERSON)
        # logprobs are reported for every sampled token, from the unmasked distribution
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(completion.token_ids[i] in position
                   for i, position in enumerate(completion.logprobs))
    assert len(set(texts)) > 1


def test_choice_and_grammar_end_the_output_when_complete(bundled_llm: LLM) -> None:
    choice = ask(bundled_llm, "Is water wet?", SamplingParams(
        temperature=0.0, max_tokens=50, structured_outputs=Constraint(choice=["yes", "no"])))
    assert choice.outputs[0].text in ("yes", "no")
    assert choice.outputs[0].finish_reason == "stop"
    grammar = ask(bundled_llm, "Count to three.", SamplingParams(
        temperature=0.0, max_tokens=50,
        structured_outputs=Constraint(grammar='root ::= "one, two" (", three")?')))
    assert grammar.outputs[0].text in ("one, two", "one, two, three")


def test_an_invalid_constraint_is_refused_before_anything_runs(bundled_llm: LLM) -> None:
    steps = bundled_llm.engine.snapshot().num_steps
    with pytest.raises(ValueError, match="invalid regex") as refused:
        bundled_llm.generate("x", SamplingParams(structured_outputs=Constraint(regex="(")),
                             use_tqdm=False)
    assert refused.value.param == "structured_outputs"
    assert bundled_llm.engine.snapshot().num_steps == steps
    assert not bundled_llm.engine.has_unfinished_requests()


def test_offline_chat_renders_tools_and_tool_turns_as_the_server_does(bundled_llm: LLM) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    conversation = [
        {"role": "user", "content": "What time is it in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "14:05"},
    ]
    forced = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=Constraint(
        regex=r"It is [0-9]{2}:[0-9]{2} in Paris\."))
    output = bundled_llm.chat(conversation, forced, tools=tools, use_tqdm=False)[0]
    prompt = output.prompt
    assert "<tools>" in prompt and '"get_time"' in prompt  # the tools, in the system turn
    assert '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n14:05\n</tool_response>" in prompt
    assert re.fullmatch(r"It is [0-9]{2}:[0-9]{2} in Paris\.", output.outputs[0].text)
    plain = bundled_llm.chat(conversation[:1], forced, use_tqdm=False)[0].prompt
    assert "<tools>" not in plain
    with pytest.raises(ValueError, match="role"):
        bundled_llm.chat([{"content": "no role"}], forced, tools=tools, use_tqdm=False)
