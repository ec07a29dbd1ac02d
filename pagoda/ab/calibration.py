"""The A/A noise floor of an A/B run: how far each decisive statistic moves between two
halves of one endpoint's own requests, which ran on the same server and are the same A/A.

Why. The bootstrap's interval covers the spread of the requests and of the blocks, but not
what differs between two server processes of one configuration (start order, warm-up,
memory layout, which core the scheduler favoured): measured on an AMD EPYC Zen 4, two such
processes differ by a few percent, enough to clear the fixed 2% threshold with
significance. The floor measures how much a statistic moves with nothing changed, on this
machine and these endpoints, and the verdict calls no difference smaller than it.

Halves of one endpoint (its requests as ab_stats reads them: `pair_id` is (key, repeat,
occurrence), `block` is (repeat, block number) or None):

- two or more repeats: the even passes against the odd ones, pass 2k against pass 2k+1
  request by request (a request's two runs ran the same prompt);
- one repeat: the even blocks against the odd ones (different requests: unpaired, so the
  floor also holds the spread of the traffic itself, and is wider);
- neither (one block, one pass): no floor.

The floor is the largest relative difference between the halves (|P50(odd) / P50(even) - 1|
and so on) over the decisive statistics and the endpoints, one number for the run: on a
shared machine the statistic that happened to move most between two passes says how far
any of them can move, and a floor per statistic let a quiet one call a false winner (1 of
the first 4 A/A runs, P95 E2E -19 %, where the one floor called none: BENCHMARKS.md). `analyze` calls a decisive
difference only when it is at least max(NEGLIGIBLE, the floor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

MIN_HALF_REQUESTS = 4
"""Fewer successful requests than this in a half and that endpoint gives no floor."""


def _value(record, metric: str) -> float | None:
    return record.latency if metric == "e2el" else getattr(record, metric)


def _statistic(values: Sequence[float], statistic: str) -> float:
    """median / pNN as numpy's linear percentile (as the bootstrap's point estimates)."""
    q = 50.0 if statistic == "median" else float(statistic[1:])
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def _halves(requests: Sequence) -> tuple[str, list[tuple], list[tuple]] | None:
    """(method, first half, second half): each half a list of (pairing id or None, request)
    over successful requests; None when the run cannot be split."""
    ok = [r for r in requests if r.record.success]
    repeats = {r.pair_id[1] for r in ok if r.pair_id is not None}
    if len(repeats) >= 2:
        halves: tuple[list, list] = ([], [])
        for r in ok:
            if r.pair_id is not None:
                key, repeat, occurrence = r.pair_id
                halves[repeat % 2].append(((key, repeat // 2, occurrence), r))
        return "repeats", *halves
    blocks = sorted({r.block for r in ok if r.block is not None})
    if len(blocks) >= 2:
        parity = {block: i % 2 for i, block in enumerate(blocks)}
        halves = ([], [])
        for r in ok:
            if r.block is not None:
                halves[parity[r.block]].append((None, r))
        return "blocks", *halves
    return None


def _matched(first: list[tuple], second: list[tuple]) -> tuple[list, list]:
    """Paired halves keep the requests that ran in both; unpaired ones keep all."""
    if first and first[0][0] is not None:
        second_by_id = {pid: r for pid, r in second}
        both = [(r, second_by_id[pid]) for pid, r in first if pid in second_by_id]
        return [a for a, _ in both], [b for _, b in both]
    return [r for _, r in first], [r for _, r in second]


def _endpoint_differences(requests: Sequence, decisive: Sequence[tuple[str, str]],
                          slo_indicator: Callable | None) -> tuple[str, dict] | None:
    """(method, {(metric, statistic): |relative difference between the halves|})."""
    split = _halves(requests)
    if split is None:
        return None
    method, first, second = split
    first, second = _matched(first, second)
    if min(len(first), len(second)) < MIN_HALF_REQUESTS:
        return None
    out = {}
    for metric, statistic in decisive:
        a = [v for r in first if (v := _value(r.record, metric)) is not None]
        b = [v for r in second if (v := _value(r.record, metric)) is not None]
        if min(len(a), len(b)) >= MIN_HALF_REQUESTS:
            base = _statistic(a, statistic)
            if base > 0:
                out[(metric, statistic)] = abs(_statistic(b, statistic) / base - 1.0)
    if slo_indicator is not None:
        share_a = float(np.mean([slo_indicator(r.record) for r in first]))
        share_b = float(np.mean([slo_indicator(r.record) for r in second]))
        if share_a > 0:
            out[("goodput", "rate")] = abs(share_b / share_a - 1.0)
    return method, out


def noise_floor(requests_by_endpoint: dict[str, Sequence], decisive: Sequence[tuple[str, str]],
                names: dict[tuple[str, str], str],
                slo_indicator: Callable | None = None) -> dict | None:
    """The module docstring's floor, JSON-ready: {"method", "floor" (the largest difference),
    "per_metric": {name: the largest over the endpoints}, "by_endpoint": {endpoint: {name:
    difference}}}. None when no endpoint could be split."""
    by_endpoint, floors, methods = {}, {}, set()
    for endpoint, requests in requests_by_endpoint.items():
        found = _endpoint_differences(requests, decisive, slo_indicator)
        if found is None:
            continue
        method, differences = found
        methods.add(method)
        by_endpoint[endpoint] = {names[k]: round(v, 6) for k, v in differences.items()}
        for k, v in differences.items():
            floors[k] = max(floors.get(k, 0.0), v)
    if not floors:
        return None
    return {"method": "repeats" if methods == {"repeats"} else "blocks",
            "floor": max(floors.values()),
            "per_metric": {names[k]: round(v, 6) for k, v in floors.items()},
            "by_endpoint": by_endpoint}
