"""Per-request latency metrics and the summary of a benchmark run: pure arithmetic, no I/O.

One streamed request, on the client's clock (seconds from the moment it was sent):

```
sent         first token            token k       last token / [DONE]
 |---- ttft ----|--- itl[0] ---|- ... -|--- itl[n-2] ---|
 |<------------------------- e2e latency ------------------------>|
```

- TTFT: time to the first chunk that carries output text.
- ITL: every gap between consecutive output chunks (one chunk per decode step).
- TPOT: (e2e - ttft) / (output_tokens - 1), the mean decode time per token after the first;
  undefined (None) for a one-token output. `output_tokens` is the server's `usage` count,
  not the number of chunks (a chunk can carry several tokens, or none while a multi-byte
  character is incomplete).
- Goodput: successful requests per second that meet every bound of the SLO.
- TTFT by turn (multi-turn workloads): the TTFT statistics of the successful requests of
  each turn number (1 = a conversation's first turn), and of every turn from the second on
  ("later turns": the ones a prefix cache can serve from the history).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 95, 99)
"""Reported with the mean; P50 is printed as the median."""

SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
"""Keys --slo accepts: time to first token, time per output token, every inter-token gap,
end-to-end latency."""


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds; `start` is relative to the start
    of the run, the rest relative to `start`."""

    index: int
    """Position in the workload."""
    start: float = 0.0
    """When the request was sent, seconds after the run began."""
    success: bool = False
    error: str | None = None
    """Why it failed, one line; None on success."""
    error_kind: str | None = None
    """'http' (status >= 400), 'dropped' (connection lost), 'timeout', 'protocol' (bad or
    unfinished stream, error event), 'skipped' (an earlier turn of its conversation failed)."""
    http_status: int | None = None
    chunk_times: list[float] = field(default_factory=list)
    """Arrival time of every chunk that carried output text, relative to `start`."""
    latency: float | None = None
    """End-to-end: until the stream's end ([DONE]) or the error."""
    prompt_tokens: int | None = None
    """From the server's usage."""
    output_tokens: int | None = None
    """From the server's usage (None if the server sent none)."""
    expected_output_tokens: int | None = None
    """max_tokens asked for."""
    conversation: int | None = None
    turn: int | None = None
    finish_reason: str | None = None
    model: str | None = None
    """The `model` sent when the run spreads requests over names (--lora-names)."""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        return time_per_output_token(self.latency, self.ttft, self.output_tokens)

    def to_json(self) -> dict:
        data = asdict(self)
        data.update(ttft=self.ttft, tpot=self.tpot, itl=self.itl)
        del data["chunk_times"]  # the ITL list holds the same information, relative
        return data


def time_per_output_token(
    latency: float | None, ttft: float | None, output_tokens: int | None
) -> float | None:
    if latency is None or ttft is None or output_tokens is None or output_tokens < 2:
        return None
    return (latency - ttft) / (output_tokens - 1)


# ---- SLO --------------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)\s*(ms|s)?\s*$", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """'500ms' -> 0.5, '2s' -> 2.0, '50' -> 0.05 (a bare number is milliseconds)."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration; write e.g. 500ms or 0.5s")
    value = float(match.group(1))
    unit = (match.group(2) or "ms").lower()
    return value / 1000.0 if unit == "ms" else value


def parse_slo(text: str) -> dict[str, float]:
    """'ttft=500ms,tpot=50ms' -> {'ttft': 0.5, 'tpot': 0.05} (seconds)."""
    slo: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_METRICS:
            raise ValueError(
                f"--slo: bad entry {part.strip()!r}; write METRIC=DURATION[,...] with METRIC one "
                f"of {', '.join(SLO_METRICS)}, e.g. ttft=500ms,tpot=50ms"
            )
        try:
            seconds = parse_duration(value)
        except ValueError as e:
            raise ValueError(f"--slo {key}: {e}") from None
        if seconds <= 0:
            raise ValueError(f"--slo {key}: the bound must be positive, got {value.strip()!r}")
        slo[key] = seconds
    if not slo:
        raise ValueError("--slo is empty; write e.g. ttft=500ms,tpot=50ms")
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """A successful request within every bound. A one-token output has no TPOT and no ITL:
    those bounds hold trivially."""
    if not record.success:
        return False
    for key, bound in slo.items():
        if key == "ttft" and (record.ttft is None or record.ttft > bound):
            return False
        if key == "tpot" and record.tpot is not None and record.tpot > bound:
            return False
        if key == "itl" and any(gap > bound for gap in record.itl):
            return False
        if key == "e2el" and (record.latency is None or record.latency > bound):
            return False
    return True


# ---- summaries ---------------------------------------------------------------------------------


def describe(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, median, P90, P95, P99 (numpy's linear interpolation); None for no values."""
    keys = ["mean", "median"] + [f"p{p}" for p in PERCENTILES if p != 50]
    if not values:
        return dict.fromkeys(keys)
    array = np.asarray(values, dtype=np.float64)
    stats = {"mean": float(array.mean())}
    for p in PERCENTILES:
        stats["median" if p == 50 else f"p{p}"] = float(np.percentile(array, p))
    return {k: stats[k] for k in keys}


def requests_by_model(records: Sequence[RequestRecord]) -> dict[str, dict[str, int]]:
    """Per `model` sent: requests, completed, output tokens (--lora-names' spread)."""
    counts: dict[str, dict[str, int]] = {}
    for r in records:
        entry = counts.setdefault(r.model or "", {"requests": 0, "completed": 0,
                                                  "output_tokens": 0})
        entry["requests"] += 1
        if r.success:
            entry["completed"] += 1
            entry["output_tokens"] += r.output_tokens or 0
    return dict(sorted(counts.items()))


def ttft_by_turn(records: Sequence[RequestRecord]) -> list[dict]:
    """One entry per turn number, in order: {"turn": n (1 = first), "requests": successful
    requests of that turn with a TTFT, **describe(their TTFTs)}. A turn with no such request
    (all failed) is listed with requests 0 and None statistics."""
    last = max((r.turn for r in records if r.turn is not None), default=-1)
    by_turn: list[list[float]] = [[] for _ in range(last + 1)]
    for r in records:
        if r.success and r.turn is not None and r.ttft is not None:
            by_turn[r.turn].append(r.ttft)
    return [{"turn": t + 1, "requests": len(values), **describe(values)}
            for t, values in enumerate(by_turn)]


def summarize(
    records: Sequence[RequestRecord], duration: float, slo: dict[str, float] | None = None
) -> dict:
    """The figures of one run. `duration` is the run's wall time (first send to last end)."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    errors: dict[str, int] = {}
    for r in failed:
        kind = r.error_kind or "unknown"
        errors[kind] = errors.get(kind, 0) + 1
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    summary = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "errors_by_kind": errors,
        "duration_s": duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "num_missing_usage": sum(1 for r in ok if r.output_tokens is None),
        "ttft_s": describe([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": describe([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": describe([gap for r in ok for gap in r.itl]),
        "e2el_s": describe([r.latency for r in ok if r.latency is not None]),
    }
    if any(r.turn for r in records):  # some conversation has a second turn
        summary["ttft_by_turn_s"] = ttft_by_turn(records)
        summary["ttft_later_turns_s"] = describe(
            [r.ttft for r in ok if r.turn and r.ttft is not None])
    if any(r.model is not None for r in records):
        summary["requests_by_model"] = requests_by_model(records)
    if slo:
        good = sum(1 for r in ok if meets_slo(r, slo))
        summary["slo_s"] = dict(slo)
        summary["num_good"] = good
        summary["goodput"] = good / duration
    return summary

