"""Rules 3-5 of an A/B verdict (pagoda/ab/stats.py's docstring) over one comparison's rows:
the outcome (better, worse, mixed, no difference) and its winner, and the one choice over
every candidate. Pure Python over the JSON-ready dicts."""

from __future__ import annotations

import math

DETECT = 0.05
"""The difference a "run N more requests" estimate aims to resolve."""


def outcome_of(c: dict) -> dict:
    """Rules 3-4 of the docstring: outcome, winner, and for no difference the further
    requests per endpoint that would narrow the widest decisive interval to +-DETECT."""
    base, cand = c["baseline"], c["candidate"]
    differing = [r for r in c["metrics"] if r["significant"]]
    sides = {r["favours"] for r in differing}
    decided_by = None
    if not differing:
        outcome = "no_difference"
    elif len(sides) == 1:
        outcome = "better" if sides == {cand} else "worse"
    else:
        outcome = "mixed"
        for metric in ("goodput", "e2el"):  # rule 4's tie-breaks, in order
            tie_break = {r["favours"] for r in differing if r["metric"] == metric}
            if len(tie_break) == 1:
                outcome = "better" if tie_break == {cand} else "worse"
                decided_by = metric
                break
    worse_errors = c["error_rate"]["worse"]
    blocked = False
    if worse_errors:  # rule 3: the side that fails more is never chosen
        if {"better": cand, "worse": base}.get(outcome) == worse_errors:
            blocked, outcome, decided_by = True, "mixed", None
        elif outcome != ("better" if worse_errors == base else "worse"):
            outcome = "better" if worse_errors == base else "worse"
            decided_by = "errors"
    more, widest = None, None
    if outcome == "no_difference":
        half_widths = [((r["high"] - r["low"]) / 2.0, r["name"]) for r in c["metrics"]
                       if r["decisive"] and r["low"] is not None]
        if half_widths:
            half, widest = max(half_widths)
            needed = c["num_compared"] * (half / DETECT) ** 2
            if needed > c["num_compared"]:
                more = round_up(needed - c["num_compared"])
    return {"outcome": outcome, "winner": {"better": cand, "worse": base}.get(outcome),
            "decided_by": decided_by, "errors_block_winner": blocked, "more_requests": more,
            "widest_metric": widest, "detect": DETECT}


def round_up(x: float) -> int:
    """Up to two significant digits: 1234 -> 1300."""
    x = max(1, math.ceil(x))
    step = 10 ** max(len(str(x)) - 2, 0)
    return -(-x // step) * step


def choice_of(analysis: dict) -> str | None:
    comparisons = analysis["comparisons"]
    better = [c["candidate"] for c in comparisons if c["outcome"] == "better"]
    if len(better) == 1:
        return better[0]
    if comparisons and not better and all(c["outcome"] == "worse" for c in comparisons):
        return analysis["baseline"]
    return None
