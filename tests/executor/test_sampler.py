"""The batched sampler (CPU, deterministic).

SamplingParams itself: tests/engine/test_sampling_params.py."""

from __future__ import annotations

import pytest
import torch

from pagoda.engine.core.input_processor import InputProcessor
from pagoda.errors import InvalidRequestError
from pagoda.executor.sampler import (
    Sampler,
    _first_passing,
    compute_token_logprobs,
    random_sample,
)
from pagoda.sampling_params import SamplingParams
from tests.executor.sampler_helpers import (
    VOCAB,
    build,
    make_logits,
    sample,
    sampled_ids,
    seeded,
)

# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax() -> None:
    logits = make_logits(6)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.logprob_token_ids is None


def test_temperature_zero_is_greedy_in_mixed_batch() -> None:
    # Flat-ish logits so that random rows would often miss the argmax. Even rows are greedy:
    # temperature 0, or a temperature too small to divide by (below SAMPLING_EPS), seeded or
    # not; odd rows sample.
    logits = make_logits(8) * 0.1
    greedy = [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6),
              SamplingParams(temperature=0.0, seed=7), SamplingParams(temperature=1e-7, seed=3)]
    params = [greedy[i // 2] if i % 2 == 0 else SamplingParams(temperature=1.0) for i in range(8)]
    argmax = logits.argmax(-1).tolist()
    sampled_odd_rows = set()
    for step in range(5):
        torch.manual_seed(step)
        ids = sampled_ids(logits, params)
        assert [ids[i] for i in range(0, 8, 2)] == [argmax[i] for i in range(0, 8, 2)]
        sampled_odd_rows.add(tuple(ids[i] for i in range(1, 8, 2)))
    assert len(sampled_odd_rows) > 1  # the temperature-1 rows really sample


# --------------------------------------------------------------------------- seeds


def run_steps(
    logits_per_step: list[torch.Tensor], params: list[SamplingParams], gens: list
) -> list[list[int]]:
    return [sampled_ids(logits, params, generators=gens) for logits in logits_per_step]


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    num_steps = 6
    target = make_logits(num_steps, seed=42) * 0.3  # one row per step for the seeded request
    target_params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)

    # Alone in the batch.
    gen = seeded(1234)
    alone = [sampled_ids(target[s : s + 1], [target_params], generators=[gen])[0]
             for s in range(num_steps)]

    # Third of five rows, next to unseeded, greedy and differently seeded rows.
    gen = seeded(1234)
    others = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(seed=99),
              SamplingParams(top_p=0.5)]
    mixed = []
    for s in range(num_steps):
        batch = make_logits(5, seed=100 + s)
        batch[2] = target[s]
        params = others[:2] + [target_params] + others[2:]
        gens = [None, None, gen, seeded(s), None]
        mixed.append(sampled_ids(batch, params, generators=gens)[2])

    # First of two rows.
    gen = seeded(1234)
    first = []
    for s in range(num_steps):
        batch = torch.stack([target[s], make_logits(1, seed=200 + s)[0]])
        params = [target_params, SamplingParams(min_p=0.2)]
        first.append(sampled_ids(batch, params, generators=[gen, None])[0])

    assert alone == mixed == first
    assert len(set(alone)) > 1  # flat enough that this is a real check


def test_different_seeds_differ() -> None:
    logits = make_logits(1) * 0.1
    params = [SamplingParams(seed=1)]
    runs = []
    for seed in (1, 2):
        gen = seeded(seed)
        runs.append(run_steps([logits] * 10, params, [gen]))
    assert runs[0] != runs[1]


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_with_ranks_and_top_n() -> None:
    logits = make_logits(3)
    raw = torch.log_softmax(logits, dim=-1)
    # Processing (bias, temperature) must not leak into the reported logprobs.
    params = [SamplingParams(temperature=0.0, logprobs=5, logit_bias={0: 100.0}),
              SamplingParams(temperature=0.7, logprobs=2, seed=3),
              SamplingParams(temperature=0.0)]
    out = sample(logits, params, generators=[None, seeded(3), None])
    sampled = out.sampled_token_ids
    assert sampled[0] == 0
    assert out.logprob_token_ids.shape == (3, 6) and out.logprobs.shape == (3, 6)
    assert out.logprob_token_ids[:, 0].tolist() == sampled.tolist()
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top = raw.topk(5, dim=-1)
    assert out.logprob_token_ids[:, 1:].tolist() == top.indices.tolist()
    torch.testing.assert_close(out.logprobs[:, 1:], top.values)
    assert (out.logprobs[:, 1:].diff(dim=-1) <= 0).all()  # descending
    order = raw.argsort(dim=-1, descending=True)
    ranks = [order[i].tolist().index(int(sampled[i])) + 1 for i in range(3)]
    assert out.sampled_token_ranks.tolist() == ranks
    assert out.sampled_token_ranks[2] == 1  # greedy, no bias
    assert out.sampled_token_ranks[0] > 1  # forced token 0 is not the raw argmax here


def test_logprobs_zero_returns_only_the_sampled_token() -> None:
    logits = make_logits(2)
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=0)] * 2)
    assert out.logprobs.shape == (2, 1)
    torch.testing.assert_close(out.logprobs[:, 0], torch.log_softmax(logits, -1).amax(-1))
    assert out.sampled_token_ranks.tolist() == [1, 1]


def test_compute_token_logprobs_matches_log_softmax() -> None:
    logits = make_logits(5, seed=3)
    token_ids = torch.tensor([0, 7, 31, 4, 4])
    before = logits.clone()
    ids, logprobs, ranks = compute_token_logprobs(logits, token_ids, num_top=3)
    torch.testing.assert_close(logits, before)  # untouched
    raw = torch.log_softmax(logits, dim=-1)
    assert ids[:, 0].tolist() == token_ids.tolist()
    torch.testing.assert_close(logprobs[:, 0], raw[torch.arange(5), token_ids])
    assert ids[:, 1:].tolist() == raw.topk(3).indices.tolist()
    torch.testing.assert_close(logprobs[:, 1:], raw.topk(3).values)
    expected_ranks = (raw > raw[torch.arange(5), token_ids][:, None]).sum(-1) + 1
    assert ranks.tolist() == expected_ranks.tolist()
    _, lp0, _ = compute_token_logprobs(logits, token_ids, num_top=0)
    assert lp0.shape == (5, 1)


# --------------------------------------------------------------------------- distribution


def test_sampled_frequencies_follow_softmax() -> None:
    vocab, num_draws = 5, 20000
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5, -0.5]])
    probs = torch.softmax(logits[0], -1)
    meta = build([SamplingParams()] * num_draws, vocab=vocab)
    torch.manual_seed(0)
    ids = Sampler()(logits.expand(num_draws, vocab).clone(), meta).sampled_token_ids
    counts = torch.bincount(ids, minlength=vocab).double()
    expected = probs.double() * num_draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0  # 4 dof: p(chi2 > 25) ~ 5e-5
    # temperature 0.5 sharpens the distribution: same check against softmax(logits / 0.5)
    meta = build([SamplingParams(temperature=0.5)] * num_draws, vocab=vocab)
    ids = Sampler()(logits.expand(num_draws, vocab).clone(), meta).sampled_token_ids
    counts = torch.bincount(ids, minlength=vocab).double()
    expected = torch.softmax(logits[0] / 0.5, -1).double() * num_draws
    assert float(((counts - expected) ** 2 / expected).sum()) < 25.0


@pytest.mark.parametrize("field", ["logit_bias", "stop_token_ids"])
def test_out_of_vocab_token_ids_rejected(field: str) -> None:
    """Refused at the edge (the input processor, naming the field), and never silently
    indexed out of range should one reach the sampler."""
    p = SamplingParams(**{field: {VOCAB: 1.0} if field == "logit_bias" else [VOCAB]},
                       min_tokens=1)
    processor = InputProcessor(tokenizer=None, vocab_size=VOCAB, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="out of the vocabulary") as caught:
        processor.process("r", [1, 2], p)
    assert caught.value.param == field
    with pytest.raises(AssertionError, match="out of the vocabulary"):
        build([p])  # stop ids are banned while under min_tokens: both are looked up
    inside = SamplingParams(**{field: {VOCAB - 1: 1.0} if field == "logit_bias"
                               else [VOCAB - 1]})
    assert processor.process("r", [1, 2], inside).params is inside


def test_random_sample_spans_cdf_blocks_and_skips_zero_weights() -> None:
    # 1000 tokens = 3 full blocks of CDF_BLOCK plus a padded tail; weight on a few tokens in
    # different blocks (incl. the first and last token), zero everywhere else
    vocab, num_draws = 1000, 40000
    weights = torch.zeros(vocab)
    support = [0, 255, 256, 600, 999]
    weights[support] = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.5])
    torch.manual_seed(0)
    ids = random_sample(weights.expand(num_draws, vocab).contiguous(), {})
    counts = torch.bincount(ids, minlength=vocab).double()
    assert set(torch.nonzero(counts).flatten().tolist()) == set(support)
    expected = weights.double() / weights.sum() * num_draws
    chi2 = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    assert chi2 < 25.0  # 4 dof: p(chi2 > 25) ~ 5e-5


def test_random_sample_target_at_total_lands_on_last_weighted_token() -> None:
    # rounding can put u * total at the total: the pick must still be a token with weight,
    # not a trailing zero-weight token or the padding past the vocabulary
    cdf = torch.tensor([[0.0, 1.0, 1.0, 3.0, 3.0, 3.0]], dtype=torch.float64)
    assert _first_passing(cdf, torch.tensor([[3.0]], dtype=torch.float64)).item() == 3
    assert _first_passing(cdf, torch.tensor([[0.0]], dtype=torch.float64)).item() == 1
    assert _first_passing(cdf, torch.tensor([[1.0]], dtype=torch.float64)).item() == 3


def test_bfloat16_logits_greedy_and_random() -> None:
    logits = make_logits(6, vocab=300)
    expected = logits.bfloat16().float().argmax(-1)
    greedy = sample(logits.bfloat16(), [SamplingParams(temperature=0.0)] * 6)
    assert greedy.sampled_token_ids.tolist() == expected.tolist()
    sampler = Sampler()
    for rows in (6, 2, 6):  # the float32 buffer is reused, shrunk views and all
        bf16 = logits[:rows].bfloat16()
        params = [SamplingParams(top_k=1, seed=rows)] * rows  # top-k 1: sampling is argmax
        ids = sampler(bf16, build(params, vocab=300)).sampled_token_ids
        assert ids.tolist() == expected[:rows].tolist()
        assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, logits[:rows].bfloat16())
