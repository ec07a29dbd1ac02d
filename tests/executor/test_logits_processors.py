"""Logits processors through the sampler (CPU, deterministic): top-k / top-p / min-p masks,
logit_bias, min_tokens' banned stop tokens, and the repetition / frequency / presence
penalties (pagoda/executor/logits_processors.py)."""

from __future__ import annotations

import math

import torch

from pagoda.executor.logits_processors import apply_penalties
from pagoda.sampling_params import SamplingParams
from tests.executor.sampler_helpers import (
    EOS,
    VOCAB,
    build,
    make_logits,
    sampled_ids,
    seeded,
)

# --------------------------------------------------------------------------- masks


def test_top_k_1_is_greedy_at_temperature_1() -> None:
    logits = make_logits(4) * 0.1  # flat: plain sampling would not be argmax
    torch.manual_seed(0)
    for _ in range(20):
        assert sampled_ids(logits, [SamplingParams(top_k=1)] * 4) == logits.argmax(-1).tolist()
    # with top_p enabled too the sort path is taken; must still be greedy
    params = [SamplingParams(top_k=1, top_p=0.99)] * 4
    for _ in range(20):
        assert sampled_ids(logits, params) == logits.argmax(-1).tolist()


def test_top_k_restricts_to_k_tokens() -> None:
    logits = make_logits(1) * 0.1
    allowed = set(logits[0].topk(3).indices.tolist())
    params = [SamplingParams(top_k=3, seed=0)]
    gen = seeded(0)
    seen = {sampled_ids(logits, params, generators=[gen])[0] for _ in range(300)}
    assert seen == allowed


def test_top_p_tiny_is_greedy() -> None:
    logits = make_logits(4) * 0.1
    torch.manual_seed(0)
    for _ in range(20):
        assert sampled_ids(logits, [SamplingParams(top_p=1e-6)] * 4) == logits.argmax(-1).tolist()


def test_top_p_keeps_nucleus() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two tokens only
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    gen = seeded(1)
    params = [SamplingParams(top_p=0.7, seed=1)]
    seen = {sampled_ids(logits, params, generators=[gen])[0] for _ in range(300)}
    assert seen == {0, 1}


def test_min_p_masks_low_probability_tokens() -> None:
    # probs of the first 4 tokens are >= 0.1 * max; the rest are far below
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, :4] = torch.tensor([2.0, 1.5, 1.0, 0.5])
    logits[0, 4] = 2.0 + math.log(0.05)  # prob = 0.05 * max, below min_p=0.1
    params = [SamplingParams(min_p=0.1, seed=7)]
    gen = seeded(7)
    seen = {sampled_ids(logits, params, generators=[gen])[0] for _ in range(500)}
    assert seen == {0, 1, 2, 3}
    # without min_p token 4 does show up with the same draws
    params = [SamplingParams(seed=7)]
    gen = seeded(7)
    seen = {sampled_ids(logits, params, generators=[gen])[0] for _ in range(500)}
    assert 4 in seen


# --------------------------------------------------------------------------- logits processors


def test_logit_bias_forces_and_bans() -> None:
    logits = make_logits(2)
    forced = int(logits[0].argmin())
    top = int(logits[1].argmax())
    params = [SamplingParams(temperature=0.0, logit_bias={forced: 100.0}),
              SamplingParams(temperature=0.0, logit_bias={top: -100.0})]
    ids = sampled_ids(logits, params)
    assert ids[0] == forced
    assert ids[1] != top
    assert ids[1] == int(logits[1].topk(2).indices[1])
    # the bias is added, not assigned: 1.0 + 0.5 beats 1.2, a bare 0.5 would not
    small = torch.full((1, VOCAB), -5.0)
    small[0, 0], small[0, 1] = 1.0, 1.2
    assert sampled_ids(small, [SamplingParams(temperature=0.0, logit_bias={0: 0.5})]) == [0]
    # at temperature 1 too
    torch.manual_seed(0)
    params = [SamplingParams(logit_bias={forced: 100.0})]
    assert all(sampled_ids(logits[:1], params)[0] == forced for _ in range(20))


def eos_favoured_logits(num_rows: int) -> torch.Tensor:
    logits = make_logits(num_rows)
    logits[:, EOS] = 50.0
    logits[:, 5] = 49.0
    return logits


def test_min_tokens_blocks_eos_until_reached() -> None:
    logits = eos_favoured_logits(3)
    params = [SamplingParams(temperature=0.0, min_tokens=2)] * 3
    ids = sampled_ids(logits, params, outputs=[[], [7], [7, 8]])
    assert ids == [5, 5, EOS]
    # random sampling respects it as well
    torch.manual_seed(0)
    ids = sampled_ids(logits, [SamplingParams(min_tokens=2)] * 3, outputs=[[], [7], [7, 8]])
    assert ids == [5, 5, EOS]


def test_ignore_eos_makes_eos_no_stop_token_under_min_tokens() -> None:
    # ignore_eos: EOS is not a stop token, so min_tokens does not ban it (vLLM semantics);
    # the engine simply keeps going after it.
    logits = eos_favoured_logits(1)
    assert sampled_ids(logits, [SamplingParams(temperature=0.0, min_tokens=4,
                                               ignore_eos=True)]) == [EOS]


def test_stop_token_ids_blocked_under_min_tokens() -> None:
    logits = eos_favoured_logits(2)
    params = [SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[5]),
              SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[5],
                             ignore_eos=True)]
    ids = sampled_ids(logits, params)
    assert ids[0] not in (EOS, 5)
    assert ids[0] == int(logits[0].topk(3).indices[2])
    assert ids[1] == EOS
    # once min_tokens is reached the stop token is back
    assert sampled_ids(logits, params, outputs=[[9], [9]]) == [EOS, EOS]


def test_penalties_formula() -> None:
    vocab = 6
    logits = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.5, 3.0],
                           [1.0, -1.0, 2.0, -2.0, 0.5, 3.0]])
    prompts = [[0, 1], [4]]
    outputs = [[2, 2, 3], []]
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                             presence_penalty=0.25),
              SamplingParams(repetition_penalty=1.5)]
    meta = build(params, outputs=outputs, prompts=prompts, vocab=vocab)
    got = apply_penalties(logits.clone(), meta.prompt_token_ids, meta.output_token_ids,
                          meta.repetition_penalties, meta.frequency_penalties,
                          meta.presence_penalties, vocab)
    expected = torch.tensor([
        # 0: prompt, 1.0/2; 1: prompt, -1*2; 2: output x2, 2/2 - 0.5*2 - 0.25;
        # 3: output x1, -2*2 - 0.5 - 0.25; 4, 5 unseen
        [0.5, -2.0, 1.0 - 1.0 - 0.25, -4.0 - 0.5 - 0.25, 0.5, 3.0],
        # only token 4 seen (prompt)
        [1.0, -1.0, 2.0, -2.0, 0.5 / 1.5, 3.0],
    ])
    torch.testing.assert_close(got, expected)


def test_penalties_without_repetition_skip_prompt_and_change_sampling() -> None:
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    meta = build(params, outputs=[[4, 4, 4]])
    assert meta.prompt_token_ids is None and meta.output_token_ids is not None
    assert build([SamplingParams()]).no_penalties
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = 5.0
    logits[0, 6] = 0.5
    # 5 - 2 * 3 = -1 < 0.5: the penalty moves the argmax from 4 to 6
    assert sampled_ids(logits, params, outputs=[[4, 4, 4]]) == [6]
    params = [SamplingParams(temperature=0.0, presence_penalty=2.0)]
    assert sampled_ids(logits, params, outputs=[[4]]) == [4]  # 5 - 2 = 3 > 0.5
