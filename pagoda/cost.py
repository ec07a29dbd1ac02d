"""Cost per token from a price per hour: the arithmetic that /metrics
(entrypoints/openai/cost_metrics.py), the autoscaler's ledger (deploy/scaling_ledger.py)
and `pagoda bench serve` share. Pure arithmetic, no I/O.

The hardware costs `cost_per_hour` USD an hour whether it computes or idles, so what a token
costs is the money spent over a span divided by the tokens made in it:

    cost_usd                   = cost_per_hour * seconds / 3600
    per_million_input_tokens   = cost_usd / input_tokens  * 1e6
    per_million_output_tokens  = cost_usd / output_tokens * 1e6
    per_million_tokens         = cost_usd / (input_tokens + output_tokens) * 1e6

Each per-kind figure charges the whole cost to that kind of token (what a million prompt
tokens cost at this traffic's mix, or a million generated ones): they are alternatives, not
parts, and must not be added. A figure is None where its tokens are 0 (no rate to divide by).
"""

from __future__ import annotations

import math

SECONDS_PER_HOUR = 3600.0
PER_MILLION = 1e6


def check_cost_per_hour(value: float, flag: str = "--cost-per-hour") -> float:
    """`value`, or ValueError naming `flag` when it is negative, NaN or infinite."""
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{flag} must be a finite number of USD >= 0, got {value}")
    return value


def cost_usd(cost_per_hour: float, seconds: float) -> float:
    return cost_per_hour * max(seconds, 0.0) / SECONDS_PER_HOUR


def per_million(cost: float, tokens: float) -> float | None:
    """USD per million tokens; None for no tokens."""
    return cost / tokens * PER_MILLION if tokens > 0 else None


def cost_figures(cost_per_hour: float, seconds: float, input_tokens: float,
                 output_tokens: float) -> dict[str, float | None]:
    """The figures of one span (a benchmark run, a server's life so far), as the JSON of
    `pagoda bench serve` records them: cost_per_hour, hours, cost_usd, and the three
    per-million figures above."""
    cost = cost_usd(cost_per_hour, seconds)
    return {
        "cost_per_hour": cost_per_hour,
        "hours": max(seconds, 0.0) / SECONDS_PER_HOUR,
        "cost_usd": cost,
        "per_million_input_tokens": per_million(cost, input_tokens),
        "per_million_output_tokens": per_million(cost, output_tokens),
        "per_million_tokens": per_million(cost, input_tokens + output_tokens),
    }
