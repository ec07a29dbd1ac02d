"""An A/B result's endpoints and requests, read back from its JSON (what `pagoda bench ab`
writes, or a live proxy's record): each request with its pairing identity, its replay block
and its timings as a RequestRecord. Raises BenchError naming what is missing or malformed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pagoda.bench import BenchError
from pagoda.bench.metrics import RequestRecord


@dataclass
class ResultRequest:
    """One request of the result: its pairing identity and its metrics."""

    key: object
    """The traffic entry's key as the result gives it (None: pairs with nothing)."""
    pair_id: tuple | None
    """(str(key), repeat, occurrence) or None without a key: equal ids on two endpoints
    pair; occurrence tells apart a key given twice with one repeat number."""
    greedy: bool
    output_text: str | None
    record: RequestRecord
    block: object = None
    """The replay block it ran in (drawn whole), or None (drawn alone)."""
    live_history: bool = False
    """It carried the endpoint's own earlier replies: its output is not comparable with
    another endpoint's, whose history differs wherever an earlier reply did."""


def request_record(data: dict) -> RequestRecord:
    """A RequestRecord back from its to_json() form (chunk times from ttft and the gaps)."""
    ttft, gaps = data.get("ttft"), data.get("itl") or []
    chunk_times = [] if ttft is None else [float(t) for t in np.cumsum([ttft, *gaps])]
    return RequestRecord(
        index=int(data.get("index") or 0), start=float(data.get("start") or 0.0),
        success=bool(data.get("success")), error=data.get("error"),
        error_kind=data.get("error_kind"), http_status=data.get("http_status"),
        chunk_times=chunk_times, latency=data.get("latency"),
        prompt_tokens=data.get("prompt_tokens"), output_tokens=data.get("output_tokens"),
        expected_output_tokens=data.get("expected_output_tokens"),
        finish_reason=data.get("finish_reason"))


def read_endpoints(result: dict) -> list[dict]:
    endpoints = result.get("endpoints") if isinstance(result, dict) else None
    if not isinstance(endpoints, list) or not endpoints:
        raise BenchError("the A/B result has no endpoints (expected a list under 'endpoints')")
    out, names = [], set()
    for i, e in enumerate(endpoints):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str):
            raise BenchError(f"the A/B result's endpoint {i} has no name")
        if e["name"] in names:
            raise BenchError(f"the A/B result names endpoint {e['name']!r} twice")
        names.add(e["name"])
        out.append({"name": e["name"], "url": e.get("url"), "label": e.get("label"),
                    "hardware": e.get("hardware"), "cost_per_hour": e.get("cost_per_hour")})
    return out


def read_requests(result: dict, names: list[str]) -> dict[str, list[ResultRequest]]:
    by_endpoint: dict[str, list[ResultRequest]] = {name: [] for name in names}
    seen: dict[tuple, int] = {}
    for i, data in enumerate(result.get("requests") or []):
        if not isinstance(data, dict) or data.get("endpoint") not in by_endpoint:
            got = data.get("endpoint") if isinstance(data, dict) else data
            raise BenchError(f"the A/B result's request {i}: endpoint {got!r} is not one of "
                             f"{', '.join(names)}")
        try:
            record = request_record(data)
        except (TypeError, ValueError) as e:
            raise BenchError(f"the A/B result's request {i}: bad timing fields ({e})") from None
        pair_id = None
        if data.get("key") is not None:
            base = (data["endpoint"], str(data["key"]), int(data.get("repeat") or 0))
            occurrence = seen.get(base, 0)
            seen[base] = occurrence + 1
            pair_id = (*base[1:], occurrence)
        block = data.get("block")
        by_endpoint[data["endpoint"]].append(ResultRequest(
            data.get("key"), pair_id, bool(data.get("greedy")), data.get("output_text"), record,
            None if block is None else (int(data.get("repeat") or 0), block),
            bool(data.get("live_history"))))
    return by_endpoint


def endpoint_duration(result: dict, name: str, requests: list[ResultRequest]) -> float:
    """The endpoint's wall time; without one in the result, first send to last end."""
    duration = (result.get("duration") or {}).get(name)
    if isinstance(duration, (int, float)) and duration > 0:
        return float(duration)
    ends = [r.record.start + r.record.latency for r in requests if r.record.latency is not None]
    starts = [r.record.start for r in requests]
    if ends and max(ends) > min(starts):
        return max(ends) - min(starts)
    raise BenchError(f"the A/B result has no duration for endpoint {name!r} and its requests "
                     "do not give one")


def json_number(x) -> float | None:
    """A float for JSON: None for None, NaN or infinity."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None
