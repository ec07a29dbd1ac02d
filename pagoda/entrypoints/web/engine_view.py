"""The live engine view's data: one JSON-ready dict per tick, built from EngineSnapshots only.

`EngineView` belongs to one open stream: it keeps the last RATE_WINDOW_S of ticks' snapshots
so that it can report rates (tokens/s, steps/s, recent prefix-cache hit rate) over that
window: a step can take longer than a tick, and a rate over one tick would swing between 0
and a spike. Nothing
here touches the engine: it reads the frozen snapshot the engine thread swapped in, so an
open page costs the engine nothing per step.

Times in `requests` are seconds relative to the tick's `time` (negative: in the past), so
the page never compares its clock with the server's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import numpy

from pagoda.engine.stats.request_timeline import RequestTimeline
from pagoda.engine.stats.snapshot import EngineSnapshot

NUM_TIMELINE_REQUESTS = 30
"""Requests shown in the timeline: the most recent finished and in-flight ones."""
RATE_WINDOW_S = 2.0


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict | None:
    """{"p50": ..., ...} by linear interpolation between order statistics (numpy's
    default); None without values."""
    if not values:
        return None
    return {f"p{q}": float(v) for q, v in zip(qs, numpy.percentile(values, qs))}


def _state(record: RequestTimeline) -> str:
    if record.finish_time is not None:
        return "finished"
    if record.first_token_time is not None:
        return "decode"
    return "prefill" if record.prefill_chunks else "queued"


def _relative(t: float | None, now: float) -> float | None:
    return None if t is None else round(t - now, 4)


def timeline_json(record: RequestTimeline, now: float) -> dict:
    return {
        "id": record.request_id,
        "state": _state(record),
        "arrival": _relative(record.arrival_time, now),
        "prompt_tokens": record.num_prompt_tokens,
        "chunks": [[_relative(start, now), _relative(end, now), n]
                   for start, end, n in record.prefill_chunks],
        "first_token": _relative(record.first_token_time, now),
        "finish": _relative(record.finish_time, now),
        "finish_reason": record.finish_reason,
        "output_tokens": record.num_output_tokens,
        "preemptions": record.num_preemptions,
    }


def tiers_json(snapshot: EngineSnapshot) -> dict | None:
    """The KV tiers below the pool (--kv-offload-memory / --kv-offload-dir); None: off."""
    tiers = snapshot.kv_offload
    if tiers is None:
        return None
    stats = tiers.stats
    return {
        "host_bytes": tiers.host_bytes,
        "disk_bytes": tiers.disk_bytes,
        "keys": tiers.num_keys,
        "swap_bytes": tiers.swap_bytes,
        "hit_tokens": tiers.hit_tokens,
        "loaded_blocks": tiers.loaded_blocks,
        "failed_loads": tiers.failed_loads,
        "swapped_out_blocks": tiers.swapped_out_blocks,
        "host": {name: stats.get(f"host_{name}", 0)
                 for name in ("hits", "misses", "bytes_written", "bytes_read", "evictions")},
        "disk": {name: stats.get(f"disk_{name}", 0)
                 for name in ("hits", "misses", "bytes_written", "bytes_read", "evictions")},
        "corrupt_entries": stats.get("corrupt_entries", 0),
        "disk_errors": stats.get("disk_errors", 0),
    }


def _rate(delta: float, seconds: float) -> float | None:
    return delta / seconds if seconds > 0 else None


class EngineView:
    """Ticks of one stream: `tick(snapshot)` -> the event's dict."""

    def __init__(self, model: str, clock=time.time) -> None:
        self.model = model
        self.clock = clock
        self._history: deque[tuple[float, EngineSnapshot]] = deque()
        """Earlier ticks, oldest first: the one just before the window, then those in it."""

    def tick(self, snapshot: EngineSnapshot) -> dict:
        now = self.clock()
        history = self._history
        while len(history) > 1 and history[1][0] <= now - RATE_WINDOW_S:
            history.popleft()
        then, before = history[0] if history else (now, snapshot)
        seconds = now - then
        history.append((now, snapshot))

        num_used = snapshot.num_kv_blocks - snapshot.num_free_kv_blocks
        # (the cached count is refreshed less often than the others: keep it within free)
        num_cached = min(snapshot.num_cached_free_kv_blocks, snapshot.num_free_kv_blocks)
        queries = snapshot.prefix_cache_queries - before.prefix_cache_queries
        hits = snapshot.prefix_cache_hits - before.prefix_cache_hits
        records = snapshot.request_timelines
        finished = [r for r in records if r.finish_time is not None]
        ttfts = [r.ttft for r in finished if r.ttft is not None]
        tpots = [r.tpot for r in finished if r.tpot is not None]
        shown = records[-NUM_TIMELINE_REQUESTS:]
        return {
            "model": self.model,
            "time": now,
            "interval": round(seconds, 4),  # what the rates are over (0 at first: no rates)
            "queue": {
                "waiting": len(snapshot.waiting_request_ids),
                "running": len(snapshot.running_request_ids),
                "preempted": snapshot.num_preempted_seqs,
                "waiting_seqs": snapshot.num_waiting_seqs,
                "running_seqs": snapshot.num_running_seqs,
            },
            "batch": {
                "num_seqs": snapshot.last_step_num_seqs,
                "num_tokens": snapshot.last_step_num_tokens,
                "num_prefill_tokens": snapshot.last_step_num_prefill_tokens,
                "num_decode_tokens": snapshot.last_step_num_decode_tokens,
            },
            "kv": {
                "num_blocks": snapshot.num_kv_blocks,
                "block_size": snapshot.kv_block_size,
                "used": num_used,
                "cached": num_cached,
                "free": snapshot.num_free_kv_blocks - num_cached,
                "usage": snapshot.kv_cache_usage,
                "tiers": tiers_json(snapshot),
            },
            "prefix_cache": {
                "queries": snapshot.prefix_cache_queries,
                "hits": snapshot.prefix_cache_hits,
                "hit_rate": (snapshot.prefix_cache_hits / snapshot.prefix_cache_queries
                             if snapshot.prefix_cache_queries else None),
                "recent_hit_rate": hits / queries if queries else None,
            },
            "throughput": {
                "generation_tokens_per_s": _rate(
                    snapshot.num_generation_tokens - before.num_generation_tokens, seconds),
                "prompt_tokens_per_s": _rate(
                    snapshot.num_computed_prompt_tokens - before.num_computed_prompt_tokens,
                    seconds),
                "steps_per_s": _rate(snapshot.num_steps - before.num_steps, seconds),
            },
            "latency": {
                "num_requests": len(finished),
                "ttft": percentiles(ttfts),
                "tpot": percentiles(tpots),
            },
            "counters": {
                "num_steps": snapshot.num_steps,
                "num_prompt_tokens": snapshot.num_prompt_tokens,
                "num_generation_tokens": snapshot.num_generation_tokens,
                "num_preemptions": snapshot.num_preemptions,
                "finished_by_reason": dict(snapshot.finished_by_reason),
            },
            "requests": [timeline_json(r, now) for r in shown],
        }
