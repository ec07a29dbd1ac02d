"""Verification of proposals by rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

A request that proposed d1..dk has k + 1 logits rows: row j (0-based) is the target's
distribution p_j for the token after the prefix d1..dj. With q_j the distribution the
proposer drew d(j+1) from (one-hot for a deterministic proposer: n-gram lookup, a greedy
draft):

    for j = 0 .. k-1:  accept d(j+1) with probability min(1, p_j(d) / q_j(d));
                       on the first rejection, sample from normalise(max(p_j - q_j, 0)), stop
    all accepted:      sample the bonus token from p_k

so every emitted token follows the target's distribution exactly, whatever q was. Greedy
rows accept while the target's argmax equals the proposal, then take the argmax. The p_j
are the sampler's own (sampler.py steps 2-7: grammar, bias, min_tokens, penalties counted
over the output plus the accepted prefix, temperature, top-k/top-p/min-p): the metadata has
one row per logits row.

Rows are laid out request after request:

    rows     [ r0: p_0 .. p_k0 | r1: p_0 | r2: p_0 .. p_k2 | ... ]   (a request without
    drafts   [ d1 .. dk0  -    |   -     | d1 .. dk2  -    | ... ]    proposals has one row)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.executor.sampler import (
    Sampler,
    _argmax,
    draw_uniforms,
    gather_logprobs,
    probabilities,
    random_sample,
)
from pagoda.executor.sampling_metadata import SamplingMetadata


@dataclass
class VerifiedTokens:
    """Per request (in order): the accepted proposals then one sampled token (NO_TOKEN when
    its row had no usable probabilities), and where some row asked, the raw logprobs of
    every row's emitted token (rows of a request past its first rejection are unused)."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprob_token_ids: torch.Tensor | None = None  # (num_rows, 1 + N) int64
    logprobs: torch.Tensor | None = None  # (num_rows, 1 + N) float32
    ranks: torch.Tensor | None = None  # (num_rows,) int64


def rejection_sample(
    sampler: Sampler,
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    proposals: list[list[int]],
    draft_probs: list[torch.Tensor | None],
) -> VerifiedTokens:
    """logits (num_rows, vocab), num_rows = sum(1 + len(p) for p in proposals); metadata
    with one row per logits row; draft_probs[i]: (len(proposals[i]), vocab) float32, the
    distributions request i's proposals were drawn from, or None (drawn deterministically)."""
    device = logits.device
    num_rows = logits.shape[0]
    assert num_rows == sum(1 + len(p) for p in proposals), (num_rows, proposals)
    row_draft = torch.tensor([t for p in proposals for t in (*p, 0)], device=device)
    is_draft_row = torch.tensor([not last for p in proposals
                                 for last in (*[False] * len(p), True)], device=device)
    raw_logprobs = None
    if metadata.only_argmax:
        chosen = _argmax(logits)
        accepted = is_draft_row & (chosen == row_draft)
    else:
        processed, raw_logprobs = sampler.process(logits, metadata)
        greedy = None if metadata.all_random else _argmax(processed)
        if metadata.all_greedy:
            chosen, accepted = greedy, is_draft_row & (greedy == row_draft)
        else:
            chosen, accepted = _sample_rows(processed, metadata, proposals, draft_probs,
                                            row_draft, is_draft_row)
            if greedy is not None:
                chosen = torch.where(metadata.greedy_mask, greedy, chosen)
                accepted = torch.where(metadata.greedy_mask,
                                       is_draft_row & (greedy == row_draft), accepted)
    chosen_ids, accepted_flags = torch.stack([chosen, accepted.long()]).tolist()  # one sync
    result = VerifiedTokens(token_ids=[], num_accepted=[])
    row = 0
    for proposal in proposals:
        num_accepted = 0
        while num_accepted < len(proposal) and accepted_flags[row + num_accepted]:
            num_accepted += 1
        result.token_ids.append([*proposal[:num_accepted], chosen_ids[row + num_accepted]])
        result.num_accepted.append(num_accepted)
        row += 1 + len(proposal)
    if raw_logprobs is not None:
        emitted = torch.where(is_draft_row & accepted, row_draft, chosen)
        result.logprob_token_ids, result.logprobs, result.ranks = gather_logprobs(
            raw_logprobs, emitted, metadata.max_num_logprobs)
    return result


def _sample_rows(
    processed: torch.Tensor,
    metadata: SamplingMetadata,
    proposals: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    row_draft: torch.Tensor,
    is_draft_row: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows: (token sampled at each row from its residual (draft rows) or from p
    (last rows), whether each draft row's proposal is accepted), both (num_rows,)."""
    probs = probabilities(processed, metadata)  # unnormalised, in place
    probs = probs / probs.sum(dim=-1, keepdim=True)  # (a zero or non-finite row gives NaN:
    # nothing is accepted and random_sample returns NO_TOKEN for it)
    draft = torch.zeros_like(probs)  # q per row; last rows stay 0, so their residual is p
    row = 0
    for proposal, q in zip(proposals, draft_probs):
        rows = torch.arange(row, row + len(proposal), device=probs.device)
        if q is None:
            draft[rows, row_draft[rows]] = 1.0
        else:
            draft[rows] = q.to(draft.dtype)
        row += 1 + len(proposal)
    p_of_draft = probs.gather(1, row_draft[:, None]).squeeze(1)
    q_of_draft = draft.gather(1, row_draft[:, None]).squeeze(1)
    u = draw_uniforms(probs.shape[0], metadata.generators, probs.device)
    accepted = is_draft_row & (u * q_of_draft < p_of_draft)  # u < p / q, with q > 0
    residual = (probs - draft).clamp_(min=0.0)
    # p = q exactly leaves nothing, but then the proposal is always accepted: use p
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
    return random_sample(residual, metadata.generators), accepted
