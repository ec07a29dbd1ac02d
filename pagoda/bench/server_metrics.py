"""Speculative-decoding acceptance read from a server's Prometheus `/metrics`.

`pagoda bench serve` scrapes GET {base_url}/metrics before and after each run's measured
traffic and reports the acceptance of the drafts made in between. The counters (Prometheus
text format, parsed by prometheus_client, each summed over its label sets such as
model_name or engine, except a data-parallel server's replica="i" copies of its totals),
for the first prefix P of SPEC_DECODE_PREFIXES the server exposes:

    {P}spec_decode_num_drafts_total                 drafts proposed (one per request per step)
    {P}spec_decode_num_draft_tokens_total           tokens proposed
    {P}spec_decode_num_accepted_tokens_total        of those, tokens accepted
    {P}spec_decode_num_accepted_tokens_per_pos_total{position="i"}
                                                    drafts whose token i was accepted

Figures of the difference (vLLM's definitions), only when the run made drafts:

    acceptance_rate           accepted tokens / draft tokens
    mean_accepted_length      1 + accepted tokens / drafts: tokens a request gains per
                              verifying step, the target model's own token included
    acceptance_per_position   [accepted at position i / drafts for every i]

Never an error: a server without /metrics, a non-200 answer, text that does not parse, text
without the counters, or counters that went down (a restarted server) yield no figures (None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

SPEC_DECODE_PREFIXES = ("pagoda:", "vllm:")
"""Tried in this order; a server exposing both (an alias) is read once, with the first."""

_DRAFTS = "spec_decode_num_drafts_total"
_DRAFT_TOKENS = "spec_decode_num_draft_tokens_total"
_ACCEPTED = "spec_decode_num_accepted_tokens_total"
_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(frozen=True)
class SpecDecodeCounters:
    """The counters at one moment, each summed over its label sets."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    accepted_per_position: tuple[float, ...] = ()
    """Index i: the position="i" counter; 0 for a position the server did not list."""


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every finite sample; raises ValueError on malformed text."""
    return [(s.name, s.labels, s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples if math.isfinite(s.value)]


def _position(labels: dict[str, str]) -> int | None:
    try:
        position = int(labels.get("position", ""))
    except ValueError:
        return None
    return position if position >= 0 else None


def _counters_with_prefix(samples, prefix: str) -> SpecDecodeCounters | None:
    """The counters named `prefix` + ..., or None if the drafts counter is not among them."""
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for name, labels, value in samples:
        if not name.startswith(prefix) or "replica" in labels:
            continue  # (a data-parallel Pagoda server's per-replica copies of its totals)
        key = name[len(prefix):]
        if key == _PER_POSITION:
            position = _position(labels)
            if position is not None:
                per_position[position] = per_position.get(position, 0.0) + value
        elif key in (_DRAFTS, _DRAFT_TOKENS, _ACCEPTED):
            totals[key] = totals.get(key, 0.0) + value
    if _DRAFTS not in totals:
        return None
    positions = range(max(per_position) + 1) if per_position else range(0)
    return SpecDecodeCounters(
        num_drafts=totals[_DRAFTS], num_draft_tokens=totals.get(_DRAFT_TOKENS, 0.0),
        num_accepted_tokens=totals.get(_ACCEPTED, 0.0),
        accepted_per_position=tuple(per_position.get(i, 0.0) for i in positions),
    )


def parse_spec_decode_counters(text: str) -> SpecDecodeCounters | None:
    """The spec-decode counters of a /metrics text; None if it has none or does not parse."""
    try:
        samples = _samples(text)
    except (ValueError, IndexError, TypeError):
        return None
    for prefix in SPEC_DECODE_PREFIXES:
        counters = _counters_with_prefix(samples, prefix)
        if counters is not None:
            return counters
    return None


async def scrape_metrics_text(base_url: str, api_key: str | None = None,
                              timeout: float = 10.0) -> str | None:
    """GET {base_url}/metrics: its Prometheus text, or None on any failure."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(headers=headers, timeout=timeout) as client:
            response = await client.get(base_url + "/metrics")
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


async def scrape_spec_decode_counters(
    base_url: str, api_key: str | None = None, timeout: float = 10.0
) -> SpecDecodeCounters | None:
    """GET {base_url}/metrics and parse it; None on any failure (see the module docstring)."""
    text = await scrape_metrics_text(base_url, api_key, timeout)
    return None if text is None else parse_spec_decode_counters(text)


def spec_decode_figures(
    before: SpecDecodeCounters | None, after: SpecDecodeCounters | None
) -> dict | None:
    """The acceptance of the drafts made between two scrapes, or None when either scrape
    found no counters or no draft (token) was made in between."""
    if before is None or after is None:
        return None
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    if drafts <= 0 or draft_tokens <= 0 or accepted < 0:
        return None
    width = max(len(before.accepted_per_position), len(after.accepted_per_position))
    start = before.accepted_per_position + (0.0,) * (width - len(before.accepted_per_position))
    end = after.accepted_per_position + (0.0,) * (width - len(after.accepted_per_position))
    return {
        "num_drafts": round(drafts),
        "num_draft_tokens": round(draft_tokens),
        "num_accepted_tokens": round(accepted),
        "acceptance_rate": accepted / draft_tokens,
        "mean_accepted_length": 1.0 + accepted / drafts,
        "acceptance_per_position": [(b - a) / drafts for a, b in zip(start, end)],
    }
