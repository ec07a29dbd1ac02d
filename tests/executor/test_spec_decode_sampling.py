"""Speculative decoding's executor parts without the engine: n-gram lookup, the adaptive
switch and the step-cost model that size proposals, and rejection sampling, whose emitted tokens must follow the target's distribution
(a chi-square test over real logits of a tiny random target and draft) and not the
draft's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagoda.executor.sampler import Sampler
from pagoda.executor.sampling_metadata import SamplingMetadata
from pagoda.executor.spec_decode.adaptive import (
    MIN_ACCEPTANCE_RATE,
    PAUSE_STEPS,
    RELAX,
    AdaptiveSwitch,
)
from pagoda.executor.spec_decode.ngram_proposer import NgramProposer
from pagoda.executor.spec_decode.rejection_sampler import rejection_sample
from pagoda.executor.spec_decode.step_cost import (
    VERIFY_COST,
    StepCostModel,
    allocate_proposals,
)
from pagoda.sampling_params import SamplingParams

# ---- n-gram lookup ----------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_most_recent_longest_match():
    proposer = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=3)
    tokens = np.array([5, 6, 7, 1, 2, 9, 9, 6, 7, 3, 4, 8, 8, 6, 7])
    # "6 7" is the longest suffix seen before (3-gram "8 6 7" is not); its latest match
    # is followed by 3 4 8
    assert proposer.propose(tokens) == [3, 4, 8]


def test_ngram_respects_min_length_and_the_end_of_the_tokens():
    assert NgramProposer(3, 2, 3).propose(np.array([1, 2, 3, 4, 3])) == []  # only "3" repeats
    assert NgramProposer(4, 1, 2).propose(np.array([1, 2, 3, 4, 3])) == [4, 3]
    assert NgramProposer(2, 1, 5).propose(np.array([7])) == []


# ---- adaptive switch --------------------------------------------------------------------


def test_poor_acceptance_pauses_a_request_and_good_acceptance_keeps_it():
    switch = AdaptiveSwitch()
    switch.record("good", 4, 4)
    switch.record("middling", 4, 2)  # 1 + 2 accepted of 1 + 2 + 1 rejection: 0.75
    assert switch.rate("good") == 1.0 and switch.rate("new") == 1.0
    assert switch.rate("middling") == pytest.approx((0.5 + 2 + RELAX) / (0.5 + 3 + RELAX))
    first = switch.rate("middling")
    assert switch.rate("middling") > first  # unverified, it drifts back up
    switch.record("bad", 4, 0)
    switch.record("bad", 4, 0)  # accepted 0.25 of attempts 1.75: below the threshold
    paused = [switch.rate("bad") for _ in range(PAUSE_STEPS + 1)]
    assert paused[:PAUSE_STEPS] == [None] * PAUSE_STEPS
    assert paused[-1] == pytest.approx((MIN_ACCEPTANCE_RATE + RELAX) / (1 + RELAX))
    switch.record("bad", 4, 0)  # one more poor verification: a longer pause
    assert all(switch.rate("bad") is None for _ in range(2 * PAUSE_STEPS))
    assert switch.rate("bad") is not None
    off = AdaptiveSwitch(enabled=False)
    for _ in range(5):
        off.record("r", 4, 0)
    assert off.rate("r") == 1.0


def test_the_step_cost_is_learned_from_the_steps_seen():
    cost = StepCostModel()
    a, b = cost.coefficients()
    assert b / a == pytest.approx(VERIFY_COST / (1 - VERIFY_COST))  # the prior
    for _ in range(20):
        for tokens in (1, 4, 8):
            cost.observe(tokens, 0.010 + 0.002 * tokens)
    assert cost.coefficients() == pytest.approx((0.010, 0.002), rel=1e-6)
    flat = StepCostModel()
    for _ in range(10):
        flat.observe(4, 0.02)  # one size only: the prior's shape, scaled to the times seen
    assert flat.step_seconds(4) == pytest.approx(0.02)


def _cost(a: float, b: float) -> StepCostModel:
    cost = StepCostModel()
    for tokens in (1, 2, 3, 4) * 5:
        cost.observe(tokens, a + b * tokens)
    return cost


def test_proposals_go_where_they_pay_for_the_wider_step():
    cheap, dear = _cost(0.010, 0.0005), _cost(0.0001, 0.020)
    # a near-free token: every proposal of a likely request is worth verifying
    assert allocate_proposals([0.95], [8], cheap) == [8]
    # a step that costs per token, nearly nothing per step: nothing pays
    assert allocate_proposals([0.95], [8], dear) == [0]
    # between: the likelier request gets more, the unlikely one none, and a big batch
    # (whose step is already wide) gets fewer than a lone request
    middle = _cost(0.010, 0.003)
    counts = allocate_proposals([0.9, 0.3], [6, 6], middle)
    assert counts[0] > counts[1] == 0
    assert sum(allocate_proposals([0.9], [6], middle, num_plain=15)) < \
        sum(allocate_proposals([0.9], [6], middle))
    assert allocate_proposals([1.0, 1.0], [2, 3], cheap) == [2, 3]  # never above the caps


# ---- rejection sampling -----------------------------------------------------------------


def _metadata(params: list[SamplingParams], vocab_size: int) -> SamplingMetadata:
    rows = len(params)
    return SamplingMetadata.build(params, [[0]] * rows, [[] for _ in range(rows)],
                                  [None] * rows, [1], vocab_size, torch.device("cpu"))


def test_greedy_rows_accept_while_the_argmax_agrees():
    vocab = 6
    logits = torch.full((6, vocab), -1.0)
    # request 0: proposals 3, 4, 5; the target's argmax per row is 3, 4, 0, 2
    for row, best in enumerate([3, 4, 0, 2]):
        logits[row, best] = 5.0
    # request 1: no proposals, argmax 1; request 2: proposal 2, argmax 0 then 5
    logits[4, 1] = 5.0
    logits[5, 0] = 5.0
    logits = torch.cat([logits, torch.full((1, vocab), -1.0)])
    logits[6, 5] = 5.0
    params = [SamplingParams(temperature=0.0)] * 7
    result = rejection_sample(Sampler(), logits, _metadata(params, vocab),
                              [[3, 4, 5], [], [2]], [None, None, None])
    assert result.num_accepted == [2, 0, 0]
    assert result.token_ids == [[3, 4, 0], [1], [0]]


@pytest.fixture(scope="module")
def tiny_distributions() -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logits of a tiny random target and a tiny random draft (vocab 16) after
    the same prompt: their softmaxes differ markedly."""
    logits = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.3)
            logits.append(model(torch.tensor([[1, 5, 9, 3]])).logits[0, -1])
    return logits[0], logits[1]


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against expected probabilities (cells with an
    expected count under 5 pooled)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         statistic / 2))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_first_emitted_token_follows_the_target_not_the_draft(tiny_distributions, temperature):
    target_logits, draft_logits = tiny_distributions
    vocab, num_requests = 16, 20000
    p = torch.softmax(target_logits / temperature, dim=-1)
    q = torch.softmax(draft_logits / temperature, dim=-1)
    generator = torch.Generator().manual_seed(0)
    proposals = torch.multinomial(q, num_requests, replacement=True, generator=generator)
    # each request: one proposal drawn from q, rows [target after prompt, target after it]
    logits = target_logits.repeat(2 * num_requests, 1)
    params = [SamplingParams(temperature=temperature)] * (2 * num_requests)
    torch.manual_seed(1)
    result = rejection_sample(Sampler(), logits, _metadata(params, vocab),
                              [[t] for t in proposals.tolist()], [q[None, :]] * num_requests)
    first = torch.tensor([tokens[0] for tokens in result.token_ids])
    counts = torch.bincount(first, minlength=vocab)
    assert _chi_square_p_value(counts, p) > 1e-3
    assert _chi_square_p_value(counts, q) < 1e-9
    # the draft really was wrong often: acceptance is the overlap sum(min(p, q))
    acceptance = sum(result.num_accepted) / num_requests
    assert acceptance == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.02)
    assert acceptance < 0.9


def test_deterministic_proposals_are_one_hot_drafts(tiny_distributions):
    """n-gram proposals (no draft distribution): accepted with probability p(token)."""
    target_logits, _ = tiny_distributions
    p = torch.softmax(target_logits, dim=-1)
    token = int(p.argmax())
    num_requests = 20000
    logits = target_logits.repeat(2 * num_requests, 1)
    params = [SamplingParams(temperature=1.0)] * (2 * num_requests)
    torch.manual_seed(2)
    result = rejection_sample(Sampler(), logits, _metadata(params, 16),
                              [[token]] * num_requests, [None] * num_requests)
    first = torch.tensor([tokens[0] for tokens in result.token_ids])
    assert _chi_square_p_value(torch.bincount(first, minlength=16), p) > 1e-3
    assert sum(result.num_accepted) / num_requests == pytest.approx(float(p[token]), abs=0.02)
