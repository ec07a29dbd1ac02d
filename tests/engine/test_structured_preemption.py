"""Constrained requests that are preempted (their KV blocks freed) and resumed by recompute
keep their place in the grammar: every output still follows its constraint, and greedy
outputs equal those of an engine with room to spare."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import jsonschema
import pytest

from pagoda import LLM, SamplingParams
from pagoda.structured_outputs import StructuredOutputsParams as Constraint

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 10},
                               "maxItems": 3}},
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"
DATES = rf"({DATE}, ){{3}}{DATE}"
"""Four dates: ~46 tokens, so each request needs blocks as it decodes."""
GRAMMAR = 'root ::= "Answer: " word ", " word ", " word ", " word "."\nword ::= [a-z]{2,8}'
TOPICS = ["a baker", "a pilot", "the moon", "a cat", "trains", "a gardener", "winter", "bees"]


def constraints() -> list[tuple[Constraint, Callable[[str], object]]]:
    """Each constraint with the check its output must pass."""
    return [
        (Constraint(json=PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON)),
        (Constraint(regex=DATES), lambda t: re.fullmatch(DATES, t) or pytest.fail(t)),
        (Constraint(grammar=GRAMMAR),
         lambda t: re.fullmatch(r"Answer: [a-z]{2,8}(, [a-z]{2,8}){3}\.", t) or pytest.fail(t)),
        (Constraint(json_object=True), lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
    ]


def test_preempted_constrained_requests_still_follow_their_constraint(bundled_llm: LLM) -> None:
    # Prompts of ~40 to ~80 tokens, outputs of up to ~46: 8 at once need far more than the
    # small engine's 12 blocks of 16 tokens, and running requests outgrow what is left.
    prompts = [f"Describe {topic}. " + "Be precise and give details. " * (6 + 2 * (i % 4))
               for i, topic in enumerate(TOPICS)]
    cases = [constraints()[i % 4] for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint)
              for constraint, _ in cases]
    reference = bundled_llm.generate(prompts, params, use_tqdm=False)

    small = LLM(dtype="float32", num_kv_blocks=12, max_model_len=192)
    outputs = small.generate(prompts, params, use_tqdm=False)
    snapshot = small.engine.snapshot()
    assert snapshot.num_preemptions > 0
    assert snapshot.num_structured_requests == len(prompts)
    for (_, check), output, ref in zip(cases, outputs, reference):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        check(completion.text)
        assert completion.token_ids == ref.outputs[0].token_ids
