"""Logits processors: the batched stages that reshape a step's logits before sampling.

Each works on the whole (num_rows, vocab_size) float32 batch, in place, with per-row
parameter tensors built by SamplingMetadata (pagoda/executor/sampler.py, which runs them in
its pipeline's order): repetition / frequency / presence penalties, top-k and top-p masks,
min-p on probabilities.
"""

from __future__ import annotations

import torch


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor,
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """Repetition, frequency and presence penalties (vLLM / HF formulas), in place.

    logits (num_rows, vocab_size); token ids (num_rows, len) padded with ``vocab_size``;
    penalties (num_rows,). ``prompt_token_ids`` may be None when no row has a repetition
    penalty (the prompt only matters to that one).
    """
    output_counts = _token_counts(output_token_ids, vocab_size, logits.dtype)  # (rows, V)
    output_mask = output_counts > 0
    if prompt_token_ids is not None:
        seen = output_mask | _token_mask(prompt_token_ids, vocab_size)
        # 1 where unseen, so that those logits pass through unchanged
        penalties = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
        scaled = torch.where(logits > 0, logits / penalties, logits * penalties)
        logits.copy_(scaled)
    logits -= frequency_penalties.unsqueeze(1) * output_counts
    logits -= presence_penalties.unsqueeze(1) * output_mask
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int = 0,
) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf.

    logits (num_rows, vocab_size); top_k (num_rows,) int64 with vocab_size where disabled;
    top_p (num_rows,) with 1.0 where disabled. Top-k keeps ties with the k-th logit; top-p keeps
    the smallest set of most likely tokens whose mass reaches p (at least one token).
    """
    if top_p is None:
        if top_k is None:
            return logits
        return _apply_top_k_only(logits, top_k, max_top_k)
    # One ascending sort serves both masks.
    logits_sorted, sorted_idx = logits.sort(dim=-1)  # (num_rows, vocab_size) each
    vocab_size = logits.shape[-1]
    if top_k is not None:
        kth_idx = (vocab_size - top_k).unsqueeze(1)  # position of the k-th largest
        kth_value = logits_sorted.gather(1, kth_idx)  # (num_rows, 1)
        logits_sorted.masked_fill_(logits_sorted < kth_value, float("-inf"))
    probs_sorted = logits_sorted.softmax(dim=-1)
    cumulative = probs_sorted.cumsum(dim=-1)
    # Drop the tail whose mass, excluding the tokens we keep, is at most 1 - p.
    top_p_mask = cumulative <= 1 - top_p.unsqueeze(1)
    top_p_mask[:, -1] = False  # the most likely token always survives
    logits_sorted.masked_fill_(top_p_mask, float("-inf"))
    return logits.scatter_(dim=-1, index=sorted_idx, src=logits_sorted)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k without a full sort: ``topk(max_top_k)`` gives each row's k-th largest logit."""
    vocab_size = logits.shape[-1]
    disabled = top_k >= vocab_size  # (num_rows,)
    max_top_k = max_top_k or int(top_k.masked_fill(disabled, 1).max())
    k = top_k.masked_fill(disabled, 1)
    top_values = logits.topk(max_top_k, dim=-1).values  # (num_rows, max_top_k), descending
    kth_value = top_values.gather(1, (k - 1).unsqueeze(1))  # (num_rows, 1)
    kth_value.masked_fill_(disabled.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < kth_value, float("-inf"))


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero probabilities below ``min_p`` times the row's top probability, in place.

    probs (num_rows, vocab_size), normalised or not; min_p (num_rows,), 0 where disabled.
    """
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # (num_rows, 1)
    return probs.masked_fill_(probs < threshold, 0.0)


def _token_counts(token_ids: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """(num_rows, len) padded ids -> (num_rows, vocab_size) occurrence counts."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=dtype, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=dtype))
    return counts[:, :vocab_size]  # drop the padding column


def _token_mask(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(num_rows, len) padded ids -> (num_rows, vocab_size) bool: token occurs in the row."""
    mask = torch.zeros(
        token_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=token_ids.device
    )
    mask.scatter_(1, token_ids, True)
    return mask[:, :vocab_size]
