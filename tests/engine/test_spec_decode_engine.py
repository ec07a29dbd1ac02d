"""Speculative decoding end to end on the bundled model (float32): greedy output is token
for token the output without speculation, for the n-gram proposer and for a draft model,
in mixed batches and with the features a step must keep right (penalties, min_tokens,
logprobs, stop strings, structured output, n > 1 and seeds, chunked prefill, preemption,
prefix caching); the spec-decode counters reach /metrics; a draft with another tokenizer
is refused at start."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest

from pagoda import LLM, SamplingParams
from pagoda.engine.stats.metrics import EngineMetrics
from pagoda.executor.loader.model_files import bundled_model_path
from pagoda.structured_outputs import StructuredOutputsParams
from tests.executor.tiny_checkpoints import (
    build_checkpoint,
    build_checkpoint_with_bundled_tokenizer,
    bundled_tokenizer,
)

pytestmark = pytest.mark.slow  # (make test-fast skips it)

PASSAGE = (
    "The river runs past the old mill and under the stone bridge, where the children of "
    "the village fish for trout on summer evenings. The miller keeps bees behind the mill, "
    "and every autumn he sells their honey at the market in the town square."
)

PROMPTS = [
    f"{PASSAGE}\n\nRepeat the text above word for word:\n",   # proposals match: speculates
    "Write a short list of three colours:",
    "def fibonacci(n):",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 2, "adaptive": False}  # every proposal verified: the paths run
ENGINE = {"dtype": "float32", "kv_cache_memory": 64 * 1024 * 1024, "max_model_len": 1024}


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kwargs.pop("max_tokens", 40), **kwargs)


def _token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_llm() -> LLM:
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def ngram_llm() -> LLM:
    return LLM(speculative_config=NGRAM, **ENGINE)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory) -> str:
    """A tiny random Llama with the bundled tokenizer: its proposals are mostly wrong, so
    verification rejects (and rolls back) most of them."""
    return build_checkpoint_with_bundled_tokenizer(str(tmp_path_factory.mktemp("draft")))


def test_ngram_greedy_is_token_identical_and_speculates(plain_llm, ngram_llm):
    before = ngram_llm.engine.snapshot().spec_decode
    expected = _token_ids(plain_llm, PROMPTS, _greedy(max_tokens=48))
    assert _token_ids(ngram_llm, PROMPTS, _greedy(max_tokens=48)) == expected
    after = ngram_llm.engine.snapshot().spec_decode
    assert after.num_drafts > before.num_drafts
    assert after.num_accepted_tokens - before.num_accepted_tokens >= 10  # the copy is found


def test_draft_model_greedy_is_token_identical(plain_llm, tiny_draft):
    draft_llm = LLM(speculative_config={"method": "draft_model", "model": tiny_draft,
                                        "num_speculative_tokens": 3, "adaptive": False},
                    **ENGINE)
    expected = _token_ids(plain_llm, PROMPTS, _greedy(max_tokens=24))
    assert _token_ids(draft_llm, PROMPTS, _greedy(max_tokens=24)) == expected
    totals = draft_llm.engine.snapshot().spec_decode
    assert totals.num_draft_tokens > 0
    assert totals.num_accepted_tokens < totals.num_draft_tokens  # rejections were rolled back
    # the bundled model as its own draft: every greedy proposal is accepted
    same_llm = LLM(speculative_config={"method": "draft_model", "model": bundled_model_path(),
                                       "num_speculative_tokens": 3}, **ENGINE)
    assert _token_ids(same_llm, PROMPTS[:1], _greedy(max_tokens=24)) == expected[:1]
    totals = same_llm.engine.snapshot().spec_decode
    assert totals.num_accepted_tokens >= 0.9 * totals.num_draft_tokens > 0


def test_a_draft_with_another_tokenizer_is_refused(tmp_path):
    tokenizer = bundled_tokenizer()
    tokenizer.add_tokens(["<not-in-the-target>"])
    build_checkpoint("llama", str(tmp_path), vocab_size=len(tokenizer))
    tokenizer.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="different tokenizer vocabulary"):
        LLM(speculative_config={"method": "draft_model", "model": str(tmp_path),
                                "num_speculative_tokens": 2}, **ENGINE)


@pytest.mark.parametrize("params", [
    {"repetition_penalty": 1.3, "frequency_penalty": 0.2},
    {"min_tokens": 30, "stop": ["honey"]},
    {"logit_bias": {198: -5.0}},
])
def test_per_position_sampling_rules_match_without_speculation(plain_llm, ngram_llm, params):
    """Penalties and min_tokens count the accepted prefix at each verified position; stop
    strings cut the same text."""
    expected = plain_llm.generate(PROMPTS[:1], _greedy(**params), use_tqdm=False)[0].outputs[0]
    got = ngram_llm.generate(PROMPTS[:1], _greedy(**params), use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids and got.text == expected.text
    assert got.finish_reason == expected.finish_reason


def test_logprobs_of_accepted_tokens_come_from_the_target(plain_llm, ngram_llm):
    expected = plain_llm.generate(PROMPTS[:1], _greedy(logprobs=3), use_tqdm=False)[0].outputs[0]
    got = ngram_llm.generate(PROMPTS[:1], _greedy(logprobs=3), use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids and len(got.logprobs) == len(expected.logprobs)
    for position, (a, b) in enumerate(zip(got.logprobs, expected.logprobs)):
        assert list(a) == list(b), position  # the same token, then the same top 3
        for token_id in a:
            assert a[token_id].logprob == pytest.approx(b[token_id].logprob, abs=2e-3)
    assert got.cumulative_logprob == pytest.approx(expected.cumulative_logprob, abs=2e-2)


def test_structured_output_with_speculation(plain_llm, ngram_llm):
    constraint = StructuredOutputsParams(regex=r"(honey and bees, ){2,6}the end\.")
    params = _greedy(max_tokens=60, structured_outputs=constraint)
    expected = plain_llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    got = ngram_llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert got.text == expected.text and got.text.endswith("the end.")
    assert got.finish_reason == "stop"


def test_sampling_with_seeds_and_n(ngram_llm):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=7, n=2)
    first = ngram_llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    again = ngram_llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert all(len(c.token_ids) == 32 for c in first.outputs)
    assert first.outputs[0].token_ids != first.outputs[1].token_ids


def test_chunked_prefill_preemption_and_prefix_cache(plain_llm):
    """A small token budget chunks the prompts and a small cache preempts running requests:
    output stays as without speculation, and no block is left held."""
    llm = LLM(speculative_config=NGRAM, dtype="float32", max_model_len=224, num_kv_blocks=14,
              max_num_batched_tokens=32, max_num_seqs=4)
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[2], PROMPTS[1]]  # a repeat: prefix-cache hits
    expected = _token_ids(plain_llm, prompts, _greedy(max_tokens=64))
    assert _token_ids(llm, prompts, _greedy(max_tokens=64)) == expected
    snapshot = llm.engine.snapshot()
    assert snapshot.num_preemptions > 0 and snapshot.prefix_cache_hits > 0
    assert snapshot.spec_decode.num_accepted_tokens > 0
    assert snapshot.num_free_kv_blocks == snapshot.num_kv_blocks


def test_spec_decode_counters_reach_metrics(ngram_llm):
    _token_ids(ngram_llm, PROMPTS[:1], _greedy(max_tokens=24))
    totals = ngram_llm.engine.snapshot().spec_decode
    metrics = EngineMetrics("m")
    metrics.update(ngram_llm.engine.snapshot())
    text = generate_latest(metrics.registry).decode()
    assert f'pagoda:spec_decode_num_drafts_total{{model_name="m"}} {float(totals.num_drafts)}' in text
    assert (f'pagoda:spec_decode_num_accepted_tokens_total{{model_name="m"}} '
            f'{float(totals.num_accepted_tokens)}') in text
    assert (f'pagoda:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} '
            f'{float(totals.accepted_per_position[0])}') in text


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_sliding_window_models_roll_back_in_every_kv_group(arch, tmp_path):
    """Windowed layers keep a block pool per KV-cache group: proposals (from a one-layer
    draft of the same family, so that many are rejected) are verified and rolled back there
    too, and the output is still transformers' greedy one."""
    from tests.executor.test_model_families import greedy_reference

    overrides = {"sliding_window": 8} if arch == "mistral" else {}
    target, draft = tmp_path / "target", tmp_path / "draft"
    reference = build_checkpoint(arch, str(target), **overrides)
    draft_model = build_checkpoint(arch, str(draft), num_hidden_layers=1, **overrides)
    torch.manual_seed(1)  # other weights than the target's (build_checkpoint seeds with 0)
    with torch.no_grad():
        for param in draft_model.parameters():
            param.normal_(0, 0.2)
    draft_model.save_pretrained(str(draft), safe_serialization=True)
    bundled_tokenizer().save_pretrained(str(draft))
    llm = LLM(model=str(target), tokenizer=bundled_model_path(), dtype="float32",
              kv_cache_memory=1 << 20, max_model_len=128, block_size=4,
              max_num_batched_tokens=16, speculative_config={
                  "method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                  "adaptive": False})
    prompts = [[120, 4] * 9, list(range(3, 30)), [7, 8]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert list(out.outputs[0].token_ids) == greedy_reference(reference, prompt, 12)[0]
    snapshot = llm.engine.snapshot()
    assert snapshot.spec_decode.num_draft_tokens > 0
    if arch == "mistral":  # (tiny random Gemmas, tied and soft-capped, agree with any draft)
        assert snapshot.spec_decode.num_draft_tokens > snapshot.spec_decode.num_accepted_tokens
    assert snapshot.num_free_kv_blocks == snapshot.num_kv_blocks


def test_adaptive_switch_stops_poor_proposals(plain_llm):
    """Free writing with 1-gram lookup: proposals are mostly wrong. With the adaptive switch
    (the default) requests pause and verify far fewer of them; output is the same either
    way."""
    prompts = ["Write a short story about a dragon who learns to bake bread.",
               "Explain how a bicycle works to a child.", "List some ideas for a garden."]
    lookup = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
              "prompt_lookup_max": 1}
    expected = _token_ids(plain_llm, prompts, _greedy(max_tokens=48))
    rejected = {}
    for adaptive in (False, True):
        llm = LLM(speculative_config={**lookup, "adaptive": adaptive}, **ENGINE)
        assert _token_ids(llm, prompts, _greedy(max_tokens=48)) == expected
        totals = llm.engine.snapshot().spec_decode
        rejected[adaptive] = totals.num_draft_tokens - totals.num_accepted_tokens
    assert rejected[False] > 20
    assert rejected[True] < 0.6 * rejected[False]  # fewer wrong proposals verified
