"""The statistics and the verdict of an A/B run (`pagoda bench ab`): pure numpy, no I/O.

Input: an A/B result (endpoints, requests tagged with `endpoint`, `key`, `repeat`, and each
endpoint's `duration`). Output: `analyze()`'s JSON-ready dict and `verdict()`'s paragraph
(phrased in pagoda/ab/verdict.py; the bootstrap is pagoda/ab/bootstrap.py).

**Differences.** Every difference is relative, candidate against baseline (the first endpoint):
statistic(candidate) / statistic(baseline) - 1, so -0.38 is "38% lower". Its interval is a
percentile bootstrap (`resamples` draws with replacement):

- *Paired* when at least `MIN_PAIRS` requests succeeded on both sides with the same
  (`key`, `repeat`): the draws pick pairs, so a request's two runs stay together and the
  spread of the requests themselves (long prompts, long answers) cancels. Repeats of a key
  are separate pairs (run k on A against run k on B); a request that failed on either side
  drops out of the pairs (the error rate reports it). Otherwise *unpaired*: each side's
  successful requests are drawn on their own.
- *Blocks*: a replay by `pagoda bench ab` runs its requests in blocks, each block on one
  endpoint and then the next (replay.py); requests of one block share those seconds of the
  machine, so the draws pick whole blocks (a pair's two runs belong to the same block
  number), not requests one by one (bootstrap.py's clustered draws), and the interval
  is widened for having few of them (`few_clusters_widening`: Student's t, not the normal;
  ~1.17x at 12 blocks). With fewer than `MIN_BLOCKS` blocks there is no interval at all:
  more `--repeats` or a smaller `--block-size` give one. Records without blocks (a live
  proxy's) draw requests.
- *ITL* pools every gap between chunks; its interval draws whole requests (a request's gaps
  move together, so drawing gaps one by one would make it far too narrow) and reads each
  draw's percentile off a histogram of the pooled gaps (`ITL_BINS` bins of equal count,
  linear inside a bin). The point estimate is exact.
- *Goodput* (requests within every `--slo` bound, per second) compares the share of
  requests that met the SLO, drawn like the latencies but over every request sent (a
  failure is not good), times the ratio of request rates (requests / duration).
- *Error rate* is an absolute difference in the share of failed requests, same draws.
- *Output agreement*: the share of greedy pairs with the same text, over pairs whose
  histories are the same (a turn that carried each endpoint's own earlier replies,
  `live_history`, is left out: its history differs wherever an earlier reply did).
- *Output throughput* (tokens / wall time) and *cost per million output tokens*
  (cost_per_hour * duration / 3600 / output tokens * 1e6) are ratios with no interval:
  each run has one wall time, and a replay at recorded arrival times follows the schedule
  more than the engine.

**Verdict rules.**

1. The decisive metrics are P50 and P95 of TTFT, TPOT and end-to-end latency (lower is
   better), and with an SLO the goodput (higher is better). P99 and ITL are reported but
   do not decide: a P99 interval from a few hundred requests rests on a handful of them.
2. A decisive metric *differs* when its interval at the Bonferroni level
   1 - (1 - confidence) / (number of decisive metrics) excludes zero (so that identical
   servers are called different at most 5% of the time, not once per metric) and the
   difference is at least `NEGLIGIBLE` (2%): smaller ones do not choose an engine. With
   calibration (`--calibrate`, or by default when every endpoint reports the same
   hardware) the bar is the larger of 2% and the A/A noise floor, the most any decisive
   metric moved between an endpoint's own passes (calibration.py): two processes of one
   configuration differ by more than the bootstrap sees, and an A/A must not call a winner.
3. An endpoint whose error rate is worse (its 95% interval excludes zero) is said so first
   and is never chosen: "B is faster but fails more requests".
4. Every differing metric favours the candidate: *better*; all favour the baseline: *worse*;
   both ways, a tie-break: goodput when it differs (the SLO says what matters), else
   end-to-end latency when its differing percentiles agree (it weighs TTFT against TPOT
   by this traffic's own output lengths); else *mixed* ("mixed: B faster to first token,
   A faster per output token"). None differs: *no difference*, with the number of further
   requests per endpoint after which the widest decisive interval would narrow to
   +-`DETECT` (5%): width scales as 1/sqrt(n), so n_needed = n * (half_width / 0.05)^2.
5. With one candidate: better -> "choose B", worse -> "choose A" (the baseline). With
   several: the single candidate that beats the baseline is chosen; if several do, compare
   them with each other.
"""

from __future__ import annotations

import numpy as np

from pagoda.ab.bootstrap import (
    bootstrap_ratio_ci,
    bootstrap_statistics,
    few_clusters_widening,
    interval,
    pooled_bootstrap,
    relative_draws,
    widened,
)
from pagoda.ab.calibration import noise_floor
from pagoda.ab.outcome import DETECT, choice_of, outcome_of
from pagoda.ab.result_requests import (
    ResultRequest,
    endpoint_duration,
    json_number,
    read_endpoints,
    read_requests,
)
from pagoda.ab.verdict import verdict
from pagoda.bench import BenchError
from pagoda.bench.metrics import meets_slo, summarize

__all__ = ["analyze", "bootstrap_ratio_ci", "verdict"]

MIN_PAIRS = 10
"""Fewer pairs than this and a comparison is unpaired."""
MIN_BLOCKS = 6
"""Fewer blocks than this on a side (drawn whole) and no interval is given."""
NEGLIGIBLE = 0.02
"""A relative difference smaller than this never decides, however sure."""
COMPARED_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"))
COMPARED_STATISTICS = ("mean", "median", "p95", "p99")
DECISIVE = (("ttft", "median"), ("ttft", "p95"), ("tpot", "median"), ("tpot", "p95"),
            ("e2el", "median"), ("e2el", "p95"))


# ---- analyze -----------------------------------------------------------------------------------


def _summary(meta: dict, requests: list[ResultRequest], duration: float,
             slo: dict[str, float] | None) -> dict:
    summary = {**meta, **summarize([r.record for r in requests], duration, slo)}
    summary.setdefault("slo_s", None)
    summary.setdefault("num_good", None)
    summary.setdefault("goodput", None)
    summary["success_rate"] = (summary["completed"] / summary["num_requests"]
                               if summary["num_requests"] else None)
    cost, tokens = meta.get("cost_per_hour"), summary["total_output_tokens"]
    summary["cost_per_million_output_tokens"] = (
        cost * duration / 3600.0 / tokens * 1e6 if cost is not None and tokens else None)
    return summary


def _statistic_name(metric_label: str, statistic: str) -> str:
    prefix = {"mean": "mean", "median": "P50"}.get(statistic, statistic.upper())
    return f"{prefix} {metric_label}"


def _row(metric: str, statistic: str, name: str, higher_is_better: bool, paired: bool,
         sides: tuple[int, int], values: tuple | None, confidence: float) -> dict:
    """One metric's comparison. values: (baseline value, candidate value, relative draws)
    or None when there is too little data."""
    row = {"metric": metric, "statistic": statistic, "name": name,
           "higher_is_better": higher_is_better, "paired": paired,
           "num_baseline": sides[0], "num_candidate": sides[1],
           "decisive": (metric, statistic) in DECISIVE or metric == "goodput",
           "baseline_value": None, "candidate_value": None, "difference": None,
           "low": None, "high": None, "excludes_zero": False,
           "family_low": None, "family_high": None, "significant": False, "favours": None}
    if values is None:
        return row
    base, cand, draws = values
    row["baseline_value"], row["candidate_value"] = json_number(base), json_number(cand)
    if not base:
        return row
    row["difference"] = json_number(cand / base - 1.0)
    if draws is None:  # too few blocks to draw from
        return row
    bounds = interval(draws, confidence)
    if bounds:
        row["low"], row["high"] = bounds
        row["excludes_zero"] = bounds[0] > 0 or bounds[1] < 0
    row["_draws"] = draws
    return row


def _draw_blocks_of(base: list[ResultRequest], cand: list[ResultRequest]) -> bool:
    """Whether every request carries the replay block it ran in (so blocks are drawn)."""
    return all(r.block is not None for r in (*base, *cand))


def _too_few_blocks(labels: tuple[list, list] | None) -> bool:
    return labels is not None and min(len(set(labels[0])), len(set(labels[1]))) < MIN_BLOCKS


def _block_widened(draws: np.ndarray, point: float, labels: tuple[list, list] | None,
                   confidence: float) -> np.ndarray:
    """Clustered draws spread by few_clusters_widening (the fewer blocks, the wider)."""
    if labels is None:
        return draws
    blocks = min(len(set(labels[0])), len(set(labels[1])))
    return widened(draws, point, few_clusters_widening(blocks, confidence))


def _latency_rows(base: list[ResultRequest], cand: list[ResultRequest], pairs: list[tuple], paired: bool,
                  confidence: float, resamples: int, rng: np.random.Generator) -> list[dict]:
    """`pairs`: (baseline ResultRequest, candidate ResultRequest), both successful."""
    rows = []
    by_blocks = _draw_blocks_of(base, cand)
    base_ok = [r for r in base if r.record.success]
    cand_ok = [r for r in cand if r.record.success]
    for metric, label in COMPARED_METRICS:
        def value(request, metric=metric):
            record = request.record
            return record.itl if metric == "itl" else (
                record.latency if metric == "e2el" else getattr(record, metric))
        if paired:
            both = [(value(a), value(b), a.block) for a, b in pairs
                    if value(a) is not None and value(b) is not None]
            a_values, b_values = [x for x, _, _ in both], [y for _, y, _ in both]
            labels = ([k for _, _, k in both],) * 2
        else:
            a_side = [(value(r), r.block) for r in base_ok if value(r) is not None]
            b_side = [(value(r), r.block) for r in cand_ok if value(r) is not None]
            a_values, b_values = [v for v, _ in a_side], [v for v, _ in b_side]
            labels = ([k for _, k in a_side], [k for _, k in b_side])
        labels = labels if by_blocks else None
        if metric == "itl":
            enough = min(len(a_values), len(b_values)) >= 2 and min(
                sum(map(len, a_values)), sum(map(len, b_values))) >= 2
            results = pooled_bootstrap(a_values, b_values, COMPARED_STATISTICS, paired,
                                       resamples, rng, labels) if enough else None
            sides = (sum(map(len, a_values)), sum(map(len, b_values)))
        else:
            enough = min(len(a_values), len(b_values)) >= 2
            results = bootstrap_statistics(a_values, b_values, COMPARED_STATISTICS, paired,
                                           resamples, rng, labels) if enough else None
            sides = (len(a_values), len(b_values))
        for statistic in COMPARED_STATISTICS:
            values = None
            if results:
                stat_a, stat_b, draws_a, draws_b = results[statistic]
                draws = None if _too_few_blocks(labels) else _block_widened(
                    relative_draws(draws_b, draws_a), stat_b / stat_a - 1.0 if stat_a else 0.0,
                    labels, confidence)
                values = (stat_a, stat_b, draws)
            rows.append(_row(metric, statistic, _statistic_name(label, statistic), False,
                             paired, sides, values, confidence))
    return rows


def _indicator_draws(base: list[ResultRequest], cand: list[ResultRequest], matched: list[tuple],
                     paired: bool, indicator, resamples: int, rng: np.random.Generator):
    """Shares of requests for which indicator(record) holds on each side, with draws."""
    if paired:
        a = [float(indicator(x.record)) for x, _ in matched]
        b = [float(indicator(y.record)) for _, y in matched]
        labels = ([x.block for x, _ in matched],) * 2
    else:
        a = [float(indicator(r.record)) for r in base]
        b = [float(indicator(r.record)) for r in cand]
        labels = ([r.block for r in base], [r.block for r in cand])
    if not a or not b:
        return None
    labels = labels if _draw_blocks_of(base, cand) else None
    stat_a, stat_b, draws_a, draws_b = bootstrap_statistics(
        a, b, ["mean"], paired, resamples, rng, labels)["mean"]
    if _too_few_blocks(labels):
        return stat_a, stat_b, None, None
    return stat_a, stat_b, draws_a, draws_b


def _error_rate(base: dict, cand: dict, base_requests: list[ResultRequest],
                cand_requests: list[ResultRequest], matched: list[tuple], paired: bool,
                confidence: float, resamples: int, rng: np.random.Generator) -> dict:
    """The failed shares of both sides, their difference's interval, and the side that fails
    more when the interval excludes zero (rule 3)."""
    failed = _indicator_draws(base_requests, cand_requests, matched, paired,
                              lambda r: not r.success, resamples, rng)
    errors = {"baseline_rate": None, "candidate_rate": None, "difference": None, "low": None,
              "high": None, "worse": None}
    if failed:
        rate_a, rate_b, draws_a, draws_b = failed
        bounds = None if draws_a is None else interval(draws_b - draws_a, confidence)
        errors.update(baseline_rate=rate_a, candidate_rate=rate_b, difference=rate_b - rate_a)
        if bounds:
            errors["low"], errors["high"] = bounds
            if bounds[0] > 0:
                errors["worse"] = cand["name"]
            elif bounds[1] < 0:
                errors["worse"] = base["name"]
    return errors


def _output_agreement(matched: list[tuple]) -> dict:
    """The share of greedy pairs with the same text (histories alike), and up to five keys
    that differed."""
    greedy = [(a.key, a.output_text == b.output_text) for a, b in matched
              if a.record.success and b.record.success and a.greedy and b.greedy
              and not (a.live_history or b.live_history)
              and isinstance(a.output_text, str) and isinstance(b.output_text, str)]
    equal = sum(1 for _, same in greedy if same)
    differing = list(dict.fromkeys(key for key, same in greedy if not same))[:5]
    return {"pairs": len(greedy), "equal": equal,
            "share": equal / len(greedy) if greedy else None, "differing_keys": differing}


def _compare(base: dict, cand: dict, base_requests: list[ResultRequest],
             cand_requests: list[ResultRequest], slo: dict[str, float] | None, confidence: float,
             resamples: int, rng: np.random.Generator,
             floor: float | None = None) -> dict:
    """One candidate against the baseline. `floor`: the A/A noise floor (calibration.py); a
    difference is called only at or above max(NEGLIGIBLE, floor)."""
    by_id = {r.pair_id: r for r in base_requests if r.pair_id is not None}
    matched = [(by_id[r.pair_id], r) for r in cand_requests if r.pair_id in by_id]
    ok_pairs = [(a, b) for a, b in matched if a.record.success and b.record.success]
    paired = len(ok_pairs) >= MIN_PAIRS
    by_blocks = _draw_blocks_of(base_requests, cand_requests)
    num_blocks = min(len({r.block for r in side}) for side in (base_requests, cand_requests))
    rows = _latency_rows(base_requests, cand_requests, ok_pairs, paired, confidence,
                         resamples, rng)
    if slo:
        shares = _indicator_draws(base_requests, cand_requests, matched, paired,
                                  lambda r: meets_slo(r, slo), resamples, rng)
        values = None
        if shares and shares[0] > 0 and base["goodput"]:
            # goodput = share meeting the SLO * requests / duration; the draws vary the share
            rate_ratio = ((cand["num_requests"] / cand["duration_s"])
                          / (base["num_requests"] / base["duration_s"]))
            _, _, draws_a, draws_b = shares
            draws = None
            if draws_a is not None:
                draws = relative_draws(draws_b * rate_ratio, draws_a)
                if by_blocks:
                    point = cand["goodput"] / base["goodput"] - 1.0
                    draws = widened(draws, point, few_clusters_widening(num_blocks, confidence))
            values = (base["goodput"], cand["goodput"], draws)
        rows.append(_row("goodput", "rate", "goodput at the SLO", True, paired,
                         (len(matched) if paired else base["num_requests"],
                          len(matched) if paired else cand["num_requests"]),
                         values, confidence))
    # Bonferroni over the decisive metrics that have an interval (rule 2 of the docstring)
    decisive = [r for r in rows if r["decisive"] and "_draws" in r]
    family = 1.0 - (1.0 - confidence) / max(len(decisive), 1)
    for r in rows:
        draws = r.pop("_draws", None)
        if r["difference"]:
            candidate_better = (r["difference"] > 0) == r["higher_is_better"]
            r["favours"] = cand["name"] if candidate_better else base["name"]
        r["min_difference"] = max(NEGLIGIBLE, floor or 0.0)
        bounds = interval(draws, family) if draws is not None and r["decisive"] else None
        if bounds:
            r["family_low"], r["family_high"] = bounds
            r["significant"] = ((bounds[0] > 0 or bounds[1] < 0)
                                and abs(r["difference"]) >= r["min_difference"])

    errors = _error_rate(base, cand, base_requests, cand_requests, matched, paired, confidence,
                         resamples, rng)
    def ratio(x, y):
        return json_number(x / y) if x is not None and y else None

    comparison = {
        "baseline": base["name"], "candidate": cand["name"], "paired": paired,
        "resampled": "blocks" if by_blocks else "requests",
        "num_blocks": num_blocks if by_blocks else None,
        "too_few_blocks": by_blocks and num_blocks < MIN_BLOCKS, "min_blocks": MIN_BLOCKS,
        "num_pairs": len(ok_pairs),
        "num_compared": len(ok_pairs) if paired else min(base["completed"], cand["completed"]),
        "confidence": confidence, "family_confidence": family, "metrics": rows,
        "error_rate": errors,
        "output_throughput_ratio": ratio(cand["output_throughput"], base["output_throughput"]),
        "cost_per_million_output_tokens_ratio": ratio(cand["cost_per_million_output_tokens"],
                                                      base["cost_per_million_output_tokens"]),
        "output_agreement": _output_agreement(matched),
    }
    comparison.update(outcome_of(comparison))
    return comparison


def analyze(result: dict, slo: dict[str, float] | None = None, confidence: float = 0.95,
            resamples: int = 2000, seed: int = 0, calibrate: bool | None = None) -> dict:
    """Summaries per endpoint, each candidate against the first endpoint, and the verdict
    (the module docstring's rules). Deterministic for a given seed; JSON-serializable.
    `calibrate`: measure the A/A noise floor (calibration.py) and call no difference
    below it; None: when every endpoint reports the same hardware (same engine, CPU,
    dtypes and kernels: replicas or settings of one engine on one machine)."""
    if not 0.5 <= confidence < 1.0:
        raise BenchError(f"confidence must be in [0.5, 1), got {confidence}")
    if resamples < 100:
        raise BenchError(f"resamples must be at least 100, got {resamples}")
    endpoints = read_endpoints(result)
    names = [e["name"] for e in endpoints]
    requests = read_requests(result, names)
    for name in names:
        if not requests[name]:
            raise BenchError(f"the A/B result has no requests for endpoint {name!r}: "
                             "nothing to measure it by")
    summaries = [_summary(e, requests[e["name"]],
                          endpoint_duration(result, e["name"], requests[e["name"]]), slo)
                 for e in endpoints]
    if calibrate is None:
        calibrate = same_hardware(endpoints)
    calibration = _calibration(requests, slo) if calibrate else None
    floor = calibration["floor"] if calibration else None
    rng = np.random.default_rng(seed)
    comparisons = [_compare(summaries[0], s, requests[names[0]], requests[s["name"]], slo,
                            confidence, resamples, rng, floor) for s in summaries[1:]]
    analysis = {"baseline": names[0], "confidence": confidence, "resamples": resamples,
                "seed": seed, "slo_s": dict(slo) if slo else None,
                "rules": {"min_pairs": MIN_PAIRS, "min_blocks": MIN_BLOCKS,
                          "negligible": NEGLIGIBLE, "detect": DETECT},
                "endpoints": summaries, "comparisons": comparisons,
                "calibration": {"requested": bool(calibrate), **(calibration or {})}}
    analysis["choice"] = choice_of(analysis)
    analysis["verdict"] = verdict(analysis)
    return analysis


def same_hardware(endpoints: list[dict]) -> bool:
    """Whether every endpoint reported what it runs on, and all the same."""
    hardware = [e.get("hardware") for e in endpoints]
    return all(h for h in hardware) and all(h == hardware[0] for h in hardware)


def _calibration(requests: dict[str, list[ResultRequest]], slo: dict[str, float] | None):
    names = {(metric, statistic): _statistic_name(label, statistic)
             for metric, label in COMPARED_METRICS for statistic in COMPARED_STATISTICS}
    names[("goodput", "rate")] = "goodput at the SLO"
    return noise_floor(requests, DECISIVE, names,
                       (lambda record: meets_slo(record, slo)) if slo else None)
