"""How closely a faster mode (bf16, quantized weights) follows the float32 model.

Teacher forcing: both models read the same real text; at every position we compare their
top-1 next-token choices and each model's perplexity on the actual next token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagoda.executor.model_runner import ModelRunner


@dataclass(frozen=True)
class FidelityReport:
    num_positions: int
    top1_agreement: float
    """Share of positions where both models' most likely next token is the same."""
    reference_perplexity: float
    candidate_perplexity: float

    @property
    def perplexity_delta(self) -> float:
        return self.candidate_perplexity - self.reference_perplexity


def _next_token_logits(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    """(len - 1, vocab) float32 logits predicting tokens 1.. of `token_ids`."""
    return runner.prompt_logits([token_ids])[0][:-1]


def compare_teacher_forced(
    reference: ModelRunner, candidate: ModelRunner, token_ids: list[int]
) -> FidelityReport:
    """Score `candidate` against `reference` on len(token_ids) - 1 predicted positions."""
    targets = torch.tensor(token_ids[1:])
    ref_logits = _next_token_logits(reference, token_ids).cpu()
    cand_logits = _next_token_logits(candidate, token_ids).cpu()
    agreement = (ref_logits.argmax(-1) == cand_logits.argmax(-1)).float().mean().item()

    def perplexity(logits: torch.Tensor) -> float:
        nll = torch.nn.functional.cross_entropy(logits, targets)
        return math.exp(nll.item())

    return FidelityReport(len(targets), agreement, perplexity(ref_logits), perplexity(cand_logits))
