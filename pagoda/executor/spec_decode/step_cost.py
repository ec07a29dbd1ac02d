"""What a decode step costs as a function of its tokens, learned while serving: the time of
each decode-shaped step (every request decoding or verifying, no prefill chunk) is fitted
to t(T) = a + b * T over the recent steps. Speculation then proposes only as many tokens
as pay for their share of the wider step (adaptive.py), on whatever CPU or GPU runs it:
nothing here is tuned to one machine.

Until the steps seen differ enough in size to fit b, the prior b / a = VERIFY_COST holds.
"""

from __future__ import annotations

VERIFY_COST = 0.3
"""Prior cost of one more token in a step, in one-token steps: a guess that only has to be
of the right order, since the fit replaces it within a few dozen steps."""
DECAY = 0.98
"""Weight kept by older observations at each new one (about the last 50 steps count)."""
MIN_SIZE_VARIANCE = 0.25
"""Variance of the step sizes seen below which the slope is not fitted (the prior holds)."""


class StepCostModel:
    def __init__(self) -> None:
        self._weight = self._sum_t = self._sum_y = self._sum_tt = self._sum_ty = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One decode-shaped step of num_tokens tokens took `seconds`."""
        for name, value in (("_weight", 1.0), ("_sum_t", num_tokens), ("_sum_y", seconds),
                            ("_sum_tt", num_tokens * num_tokens),
                            ("_sum_ty", num_tokens * seconds)):
            setattr(self, name, DECAY * getattr(self, name) + value)

    def coefficients(self) -> tuple[float, float]:
        """(a, b) of t(T) = a + b * T, in seconds (or in one-token steps before any data)."""
        if self._weight == 0:
            return 1.0 - VERIFY_COST, VERIFY_COST
        mean_t, mean_y = self._sum_t / self._weight, self._sum_y / self._weight
        variance = self._sum_tt / self._weight - mean_t * mean_t
        if variance < MIN_SIZE_VARIANCE:
            one_token = mean_y / (1.0 + VERIFY_COST * (mean_t - 1.0))
            return one_token * (1.0 - VERIFY_COST), one_token * VERIFY_COST
        slope = max((self._sum_ty / self._weight - mean_t * mean_y) / variance, 0.0)
        intercept = max(mean_y - slope * mean_t, 1e-6)
        return intercept, slope

    def step_seconds(self, num_tokens: int) -> float:
        a, b = self.coefficients()
        return a + b * num_tokens


def allocate_proposals(
    rates: list[float], caps: list[int], cost: StepCostModel, num_plain: int = 0,
) -> list[int]:
    """How many proposals each request of a decode step verifies, to maximise the expected
    tokens per second of the step: request i with acceptance rate r gains r^j from its j-th
    proposal (its first j all accepted) and has at most caps[i]; num_plain more requests
    decode one token without proposals. Proposals are added best first while the step's
    expected tokens per second rises.

        tokens = requests + sum of the gains taken,   step size T = requests + proposals
    """
    counts = [0] * len(rates)
    tokens, size = float(len(rates) + num_plain), len(rates) + num_plain
    while True:
        best, gain = None, 0.0
        for i, (rate, cap) in enumerate(zip(rates, caps)):
            if counts[i] < cap and rate ** (counts[i] + 1) > gain:
                best, gain = i, rate ** (counts[i] + 1)
        if best is None:
            return counts
        if (tokens + gain) * cost.step_seconds(size) <= tokens * cost.step_seconds(size + 1):
            return counts  # the next best proposal no longer pays for its share of the step
        counts[best] += 1
        tokens += gain
        size += 1
