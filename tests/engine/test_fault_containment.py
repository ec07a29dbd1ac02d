"""A fault in one request's step fails that request alone (issue 19, item 3): a NaN in its
logits, an exception in its grammar or in its detokenization stops it with a clear error, while the other requests of the same batches
finish with exactly the tokens they get without the fault, and no KV block stays held."""

from __future__ import annotations

import pytest
import torch

from pagoda import SamplingParams
from pagoda.entrypoints.llm import RequestFailedError

pytestmark = pytest.mark.slow  # (make test-fast skips it)

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
VICTIM = 1  # the prompt whose logits turn NaN from its 4th decode step on


@pytest.fixture
def poison_one_request(bundled_llm, monkeypatch):
    """From the victim's 4th pure decode step on, its row of the logits is NaN."""
    runner = bundled_llm.engine.runner
    model = runner.model
    poisoned_row = {"row": None}
    decode_steps = {"count": 0}
    execute, head_logits = runner.execute_model, model.head_logits
    victim = {"id": None}

    def execute_model(scheduler_output):
        poisoned_row["row"] = None
        ids = scheduler_output.request_ids
        if (victim["id"] in ids and not scheduler_output.new_requests
                and all(n == 1 for n in scheduler_output.num_scheduled_tokens)):
            decode_steps["count"] += 1
            if decode_steps["count"] >= 4:
                poisoned_row["row"] = ids.index(victim["id"])
        return execute(scheduler_output)

    def poisoned(hidden):
        logits = head_logits(hidden)
        if poisoned_row["row"] is not None:
            logits = logits.clone()
            logits[poisoned_row["row"], 7] = float("nan")
        return logits

    monkeypatch.setattr(runner, "execute_model", execute_model)
    monkeypatch.setattr(model, "head_logits", poisoned)
    return victim


def test_nan_logits_fail_their_request_alone(bundled_llm, poison_one_request) -> None:
    reference = bundled_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    engine = bundled_llm.engine
    poison_one_request["id"] = str(int(reference[-1].request_id) + 1 + VICTIM)  # next ids
    with pytest.raises(RequestFailedError) as caught:
        bundled_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    error = caught.value
    assert list(error.failed) == [poison_one_request["id"]]
    assert "non-finite logits" in str(error)
    for index, (ours, theirs) in enumerate(zip(error.outputs, reference, strict=True)):
        if index == VICTIM:
            assert ours is None  # stopped: no output after the fault
        else:
            assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
            assert ours.outputs[0].finish_reason == "length"
    snapshot = engine.snapshot()
    assert snapshot.num_free_kv_blocks == snapshot.num_kv_blocks  # no block left held
    assert snapshot.num_running_seqs == 0
    assert not engine.has_unfinished_requests()
    assert engine.take_failed_requests() == {}
    # the engine goes on serving
    again = bundled_llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    assert again[0].outputs[0].token_ids == reference[0].outputs[0].token_ids


def test_the_runner_zeroes_non_finite_rows_for_the_sampler() -> None:
    from pagoda.executor.request_faults import contain_non_finite
    from pagoda.step_data import ModelRunnerOutput

    class State:
        def __init__(self, request_id):
            self.request_id = request_id

    logits = torch.randn(3, 10)
    logits[2, 4] = float("inf")
    output = ModelRunnerOutput(request_ids=["a", "b", "c"], sampled_token_ids=[None] * 3)
    contained = contain_non_finite(logits, [State("a"), State("b"), State("c")], output)
    assert list(output.failed) == ["c"]
    assert torch.equal(contained[:2], logits[:2]) and not contained[2].any()


def _assert_victim_failed_alone(llm, prompts, params, victim: int, reference, match: str):
    """Run `prompts` again: the victim's request fails with `match` in its reason, every
    other one gets exactly its reference tokens, no KV block stays held, and the engine
    serves the next request."""
    engine = llm.engine
    with pytest.raises(RequestFailedError) as caught:
        llm.generate(prompts, params, use_tqdm=False)
    error = caught.value
    assert len(error.failed) == 1 and match in next(iter(error.failed.values()))
    for index, (ours, theirs) in enumerate(zip(error.outputs, reference, strict=True)):
        if index == victim:
            assert ours is None
        else:
            assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
    snapshot = engine.snapshot()
    assert snapshot.num_free_kv_blocks == snapshot.num_kv_blocks
    assert not engine.has_unfinished_requests()
    first_params = params[0] if isinstance(params, list) else params
    again = llm.generate(prompts[:1], first_params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == reference[0].outputs[0].token_ids


def test_a_detokenizer_error_fails_its_request_alone(bundled_llm, monkeypatch) -> None:
    from pagoda.engine.core.detokenizer import IncrementalDetokenizer

    reference = bundled_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    victim_ids = bundled_llm.get_tokenizer().encode(PROMPTS[VICTIM])
    init, update = IncrementalDetokenizer.__init__, IncrementalDetokenizer.update

    def marking_init(self, tokenizer, prompt_token_ids, *args):
        init(self, tokenizer, prompt_token_ids, *args)
        self.updates_left = 5 if list(prompt_token_ids) == victim_ids else None

    def faulty_update(self, new_token_ids):
        if self.updates_left is not None:  # the victim's: breaks at its 5th token
            self.updates_left -= 1
            if self.updates_left == 0:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault")
        return update(self, new_token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", marking_init)
    monkeypatch.setattr(IncrementalDetokenizer, "update", faulty_update)
    _assert_victim_failed_alone(bundled_llm, PROMPTS, PARAMS, VICTIM, reference,
                                "processing its new token failed: UnicodeDecodeError")


def test_a_grammar_error_fails_its_request_alone(bundled_llm, monkeypatch) -> None:
    from pagoda.engine.core.grammar import GrammarMatcher
    from pagoda.structured_outputs import StructuredOutputsParams

    params = [PARAMS, SamplingParams(temperature=0, max_tokens=12,
                                     structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))]
    prompts = PROMPTS[:2]
    reference = bundled_llm.generate(prompts, params, use_tqdm=False)
    calls = {"count": 0}
    fill = GrammarMatcher.fill_bitmask

    def faulty_fill(self, bitmask, row):
        calls["count"] += 1
        if calls["count"] == 3:
            raise RuntimeError("injected matcher fault")
        return fill(self, bitmask, row)

    monkeypatch.setattr(GrammarMatcher, "fill_bitmask", faulty_fill)
    _assert_victim_failed_alone(bundled_llm, prompts, params, 1, reference,
                                "computing its grammar's allowed tokens failed: RuntimeError")


def test_a_row_without_finite_probabilities_fails_its_request_alone(bundled_llm,
                                                                     monkeypatch) -> None:
    """The sampler finds no finite probability for one row (as a repetition penalty of
    5e-324 once did, before its range was bounded: found by schemathesis, it sampled an
    out-of-range token that failed the whole next step): that request fails alone."""
    from pagoda.executor import logits_processors, sampler

    reference = bundled_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    apply_penalties = logits_processors.apply_penalties

    def overflowing(logits, prompt_ids, output_ids, repetition, *rest):
        logits = apply_penalties(logits, prompt_ids, output_ids, repetition, *rest)
        return logits.masked_fill((repetition == 1.5)[:, None], float("inf"))

    monkeypatch.setattr(sampler, "apply_penalties", overflowing)
    params = [PARAMS, SamplingParams(temperature=1.0, repetition_penalty=1.5, max_tokens=12),
              PARAMS]
    _assert_victim_failed_alone(bundled_llm, PROMPTS, params, 1, reference,
                                "probabilities were not finite")


def test_random_sample_gives_no_token_for_a_row_without_finite_weights() -> None:
    from pagoda.executor.sampler import NO_TOKEN, random_sample

    probs = torch.rand(4, 1000)
    probs[1, 5] = float("nan")
    probs[2, 9] = float("inf")
    probs[3] = 0.0
    tokens = random_sample(probs, {})
    assert tokens[1:].tolist() == [NO_TOKEN] * 3
    assert 0 <= int(tokens[0]) < 1000


def test_a_forward_that_raises_fails_its_batch_and_the_engine_serves_on(bundled_llm,
                                                                       monkeypatch) -> None:
    """The model forward raises at the third step: the step's requests are aborted (their
    KV blocks freed) and reported in BatchFailedError; a request added afterwards runs to
    exactly its reference tokens."""
    from pagoda.engine.loop.llm_engine import BatchFailedError

    reference = bundled_llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0]
    engine = bundled_llm.engine
    runner = engine.runner
    execute, calls = runner.execute_model, {"count": 0}

    def exploding(scheduler_output):
        calls["count"] += 1
        if calls["count"] == 3:
            raise RuntimeError("injected kernel fault")
        return execute(scheduler_output)

    monkeypatch.setattr(runner, "execute_model", exploding)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"batch-{index}", prompt, PARAMS)
    engine.step()
    engine.step()
    with pytest.raises(BatchFailedError, match="injected kernel fault") as caught:
        engine.step()
    assert sorted(caught.value.request_ids) == [f"batch-{i}" for i in range(len(PROMPTS))]
    snapshot = engine.snapshot()
    assert snapshot.num_free_kv_blocks == snapshot.num_kv_blocks
    assert not engine.has_unfinished_requests()
    again = bundled_llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == reference.outputs[0].token_ids
