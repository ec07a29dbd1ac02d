"""The verdict of an A/B analysis in words: one paragraph from `analyze()`'s dict.

The rules that pick the outcome live in pagoda/ab/stats.py (its docstring); this file
only phrases them: "B against A: P95 TTFT 38% lower (95% CI 31–44%), ..., choose B."
"""

from __future__ import annotations

ASPECT = {"ttft": "to first token", "tpot": "per output token", "e2el": "end to end",
          "goodput": "in goodput at the SLO"}
"""How a mixed result names what each side is faster at."""


def _magnitude(x: float) -> str:
    """0.384 -> '38', 0.0234 -> '2.3' (percent, no sign)."""
    value = abs(x) * 100.0
    return f"{value:.0f}" if value >= 9.95 else f"{value:.1f}"


def _signed(x: float) -> str:
    return ("-" if x < 0 else "+") + _magnitude(x)


def format_change(row: dict, confidence: float, inline: bool = False) -> str:
    """'P95 TTFT 38% lower (95% CI 31–44%)', 'P50 TPOT +2.0% (95% CI -6.1 to +11%)',
    'goodput at the SLO 1.90x (95% CI 1.62–2.21x)'; inline: ', 95% CI ...' instead of the
    parentheses. The interval is left out when there is none."""
    d, low, high = row["difference"], row["low"], row["high"]
    if d is None:
        return f"{row['name']} not comparable"
    if row["higher_is_better"]:
        value = f"{1 + d:.2f}x"
        ci = None if low is None else f"{1 + low:.2f}–{1 + high:.2f}x"
    elif low is None:
        value, ci = f"{_signed(d)}%", None
    elif high < 0:
        value, ci = f"{_magnitude(d)}% lower", f"{_magnitude(high)}–{_magnitude(low)}%"
    elif low > 0:
        value, ci = f"{_magnitude(d)}% higher", f"{_magnitude(low)}–{_magnitude(high)}%"
    else:
        value, ci = f"{_signed(d)}%", f"{_signed(low)} to {_signed(high)}%"
    if ci is None:
        return f"{row['name']} {value}"
    ci = f"{confidence * 100:g}% CI {ci}"
    return f"{row['name']} {value}, {ci}" if inline else f"{row['name']} {value} ({ci})"


def _errors_clause(c: dict) -> str:
    e = c["error_rate"]
    if not e["worse"]:
        return ""
    worse_is_candidate = e["worse"] == c["candidate"]
    other = c["baseline"] if worse_is_candidate else c["candidate"]
    worse_rate, other_rate = ((e["candidate_rate"], e["baseline_rate"]) if worse_is_candidate
                              else (e["baseline_rate"], e["candidate_rate"]))
    low, high = sorted((abs(e["low"]), abs(e["high"])))
    return (f"{e['worse']} fails more requests ({worse_rate:.1%} against {other}'s "
            f"{other_rate:.1%}; {c['confidence'] * 100:g}% CI of the difference "
            f"{low * 100:.1f}–{high * 100:.1f} points). ")


def _extras(c: dict) -> list[str]:
    extras = []
    if c["output_throughput_ratio"] is not None:
        extras.append(f"output throughput {c['output_throughput_ratio']:.2f}x")
    goodput = next((r for r in c["metrics"] if r["metric"] == "goodput"), None)
    if goodput and not goodput["significant"]:
        extras.append(format_change(goodput, c["confidence"]))
    if c["cost_per_million_output_tokens_ratio"] is not None:
        extras.append(f"cost per million output tokens "
                      f"{c['cost_per_million_output_tokens_ratio']:.2f}x")
    agreement = c["output_agreement"]
    if agreement["pairs"]:
        extras.append(f"greedy outputs identical in {agreement['share']:.0%} of "
                      f"{agreement['pairs']} pairs")
    return extras


def _comparison_sentence(c: dict, single: bool) -> str:
    base, cand = c["baseline"], c["candidate"]
    differing = [r for r in c["metrics"] if r["significant"]]
    extras = _extras(c)
    outcome = c["outcome"]
    if outcome == "no_difference":
        decisive = [r for r in c["metrics"] if r["decisive"] and r["low"] is not None]
        if not decisive and c.get("too_few_blocks"):
            body = (f"only {c['num_blocks']} blocks of requests ran on each side, and an "
                    f"interval needs at least {c['min_blocks']}: run more --repeats or "
                    "a smaller --block-size")
        elif not decisive:
            body = "too few successful requests on both sides to compare their latencies"
        else:
            shown = "; ".join(format_change(r, c["confidence"], inline=True) for r in decisive)
            body = f"no difference within the noise at this sample size ({shown})"
        detect = c["detect"]
        if c["more_requests"]:
            widest = next(r for r in decisive if r["name"] == c["widest_metric"])
            half = (widest["high"] - widest["low"]) / 2.0
            body += (f": run about {c['more_requests']} more requests per endpoint to narrow "
                     f"the widest interval ({widest['name']}, now ±{_magnitude(half)}%) "
                     f"to ±{detect:.0%}")
        elif decisive:
            body += (f": every decisive interval is already within ±{detect:.0%} of its "
                     "estimate, so any real difference is small")
        others = [x for x in extras if not x.startswith("goodput")]
        return f"{cand} against {base}: {body}." + (
            f" {others[0][0].upper()}{', '.join(others)[1:]}." if others else "")
    changes = [format_change(r, c["confidence"]) for r in differing] or [
        "no latency difference within the noise"]
    body = ", ".join(changes + extras)
    if outcome == "mixed" and c["errors_block_winner"]:
        faster = c["error_rate"]["worse"]
        conclusion = f"{faster} is faster but fails more requests: fix them before choosing it"
    elif outcome == "mixed":
        aspects: dict[str, list[str]] = {}
        for r in differing:
            aspect = ASPECT.get(r["metric"], r["metric"])
            if aspect not in aspects.setdefault(r["favours"], []):
                aspects[r["favours"]].append(aspect)
        conclusion = "mixed: " + ", ".join(f"{side} faster {' and '.join(a)}"
                                           for side, a in aspects.items())
    else:
        conclusion = f"choose {c['winner']}" if single else f"{c['winner']} is better"
        conclusion += {
            "goodput": " (goodput at the SLO decides the mixed result)",
            "e2el": " (end-to-end latency decides the mixed result)",
            "errors": f" ({c['error_rate']['worse']} fails more requests)",
        }.get(c.get("decided_by"), "")
    return f"{cand} against {base}: {_errors_clause(c)}{body}; {conclusion}."


def verdict(analysis: dict) -> str:
    """One paragraph: each candidate against the baseline, then the choice (the module
    docstring's rules). Reads only `analysis` (also after a JSON round trip)."""
    comparisons = analysis["comparisons"]
    if not comparisons:
        return f"Only one endpoint ({analysis['baseline']}): nothing to compare."
    sentences = [_comparison_sentence(c, len(comparisons) == 1) for c in comparisons]
    if len(comparisons) > 1:
        better = [c["candidate"] for c in comparisons if c["outcome"] == "better"]
        choice = analysis.get("choice")
        if choice:
            sentences.append(f"Choose {choice}.")
        elif len(better) > 1:
            sentences.append(f"{' and '.join(better)} each beat {analysis['baseline']}: "
                             "compare them with each other.")
        else:
            sentences.append("No endpoint is better than the others on this evidence.")
    calibration = _calibration_sentence(analysis.get("calibration") or {})
    return " ".join(sentences + ([calibration] if calibration else []))


def _calibration_sentence(calibration: dict) -> str:
    """What the A/A noise floor was (calibration.py), when calibration was asked for."""
    if not calibration.get("requested"):
        return ""
    if calibration.get("floor") is None:
        return ("No A/A noise floor: it needs two passes (--repeats 2) or at least two "
                "blocks per endpoint.")
    per_metric = calibration["per_metric"]
    widest = max(per_metric, key=per_metric.get)
    halves = ("passes" if calibration["method"] == "repeats" else "blocks")
    return (f"A/A noise floor from each endpoint's own {halves}, odd against even: up to "
            f"{_magnitude(calibration['floor'])}% ({widest}); no difference below the larger "
            "of 2% and that floor is called.")
