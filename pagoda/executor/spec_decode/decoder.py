"""The runner's speculative-decoding side: after each step, proposals for the requests that
sampled (those the adaptive switch lets propose); before verification, the distributions
the proposals were drawn from.

The proposer is n-gram lookup (over the runner's own token record) or a draft model
(draft_proposer.py); the engine never sees which.
"""

from __future__ import annotations

import logging

import torch

from pagoda.executor.input_batch import CachedRequestState, InputBatch
from pagoda.executor.spec_decode.adaptive import AdaptiveSwitch
from pagoda.executor.spec_decode.ngram_proposer import NgramProposer
from pagoda.executor.spec_decode.step_cost import StepCostModel, allocate_proposals
from pagoda.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

STEP_COST_LOG_EVERY = 200
"""Decode-shaped steps between two DEBUG lines of the fitted step cost."""


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, draft_proposer=None) -> None:
        """draft_proposer: a DraftModelProposer for method "draft_model", else None."""
        self.config = config
        self.adaptive = AdaptiveSwitch(config.adaptive)
        self.step_cost = StepCostModel()
        self.num_steps_observed = 0
        self.draft_proposer = draft_proposer
        self.ngram_proposer = None
        if config.method == "ngram":
            self.ngram_proposer = NgramProposer(config.num_speculative_tokens,
                                                config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, states: list[CachedRequestState], batch: InputBatch) -> dict[str, list[int]]:
        """Request id -> proposed next tokens (requests without proposals left out). Each
        request's proposals are cut to what pays for its share of the next step, from its
        acceptance rate and the measured step cost (step_cost.allocate_proposals)."""
        rates = {s.request_id: self.adaptive.rate(s.request_id) for s in states}
        proposing = [s for s in states if rates[s.request_id] is not None]
        if not proposing:
            return {}
        if self.ngram_proposer is not None:
            proposals = {}
            for state in proposing:
                tokens = self.ngram_proposer.propose(
                    batch.token_ids[state.row, : batch.num_tokens[state.row]])
                if tokens:
                    proposals[state.request_id] = tokens
        else:
            proposals = self.draft_proposer.propose(proposing, batch)
        if not self.config.adaptive or not proposals:
            return proposals
        ids = list(proposals)
        counts = allocate_proposals([rates[i] for i in ids], [len(proposals[i]) for i in ids],
                                    self.step_cost, num_plain=len(states) - len(ids))
        return {i: proposals[i][:n] for i, n in zip(ids, counts) if n}

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode-shaped step's forward and sampling took `seconds`."""
        self.step_cost.observe(num_tokens, seconds)
        self.num_steps_observed += 1
        if self.num_steps_observed % STEP_COST_LOG_EVERY == 0 and logger.isEnabledFor(logging.DEBUG):
            a, b = self.step_cost.coefficients()
            logger.debug("decode step cost fitted over the recent steps: %.2f ms + %.2f ms "
                         "per token", a * 1e3, b * 1e3)

    def draft_probs(self, request_id: str, num_proposals: int) -> torch.Tensor | None:
        """(num_proposals, vocab) float32: what the request's proposals were drawn from, or
        None when they were chosen deterministically (n-gram lookup, a greedy request)."""
        if self.draft_proposer is None:
            return None
        return self.draft_proposer.draft_probs(request_id, num_proposals)

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """One verification (the draft model needs no word of it: its next proposal
        compares what it fed with the request's real tokens)."""
        self.adaptive.record(request_id, num_proposed, num_accepted)

    def remove(self, request_id: str, preempted: bool = False) -> None:
        """A request finished (forget it) or was preempted (it returns as new: its draft
        state is recomputed, its acceptance record kept)."""
        if not preempted:
            self.adaptive.remove(request_id)
        if self.draft_proposer is not None:
            self.draft_proposer.remove(request_id)
