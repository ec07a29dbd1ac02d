"""Prometheus series of the KV tiers (--kv-offload-memory / --kv-offload-dir), from the
engine snapshot's KVOffloadTotals; registered on the first snapshot that has tiers, so a
server without them exports none of these.

    counters  pagoda:kv_offload_hits_total{tier}, ..._misses_total{tier} (block lookups),
              ..._bytes_written_total{tier}, ..._bytes_read_total{tier},
              ..._evictions_total{tier}                      tier = host | disk
              pagoda:kv_offload_corrupt_entries_total, ..._disk_errors_total
              pagoda:kv_offload_hit_tokens_total (prompt tokens loaded from the tiers instead
              of computed; pagoda:prefix_cache_hits_total counts the KV pool's alone),
              pagoda:kv_offload_failed_loads_total (blocks recomputed: missing or corrupt),
              pagoda:kv_swap_out_blocks_total, ..._swap_in_blocks_total,
              pagoda:kv_swap_fallbacks_total (swap preemptions that recomputed: no room)
    gauges    pagoda:kv_offload_keys (prefix blocks the tiers hold, as the engine knows),
              pagoda:kv_offload_swap_bytes (swapped-out requests' blocks in the host tier)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pagoda.engine.stats.snapshot import KVOffloadTotals

PREFIX = "pagoda:"
PER_TIER = ("hits", "misses", "bytes_written", "bytes_read", "evictions")
"""Stats the worker counts per tier, as `<tier>_<name>` (KVOffloadWorker.take_stats)."""
WHOLE = ("corrupt_entries", "disk_errors")
ENGINE_COUNTERS = {
    "kv_offload_hit_tokens": ("hit_tokens", "Prompt tokens loaded from the KV tiers."),
    "kv_offload_failed_loads": ("failed_loads", "KV blocks whose load failed (recomputed)."),
    "kv_swap_out_blocks": ("swapped_out_blocks",
                           "KV blocks of preempted requests swapped out to the host tier."),
    "kv_swap_in_blocks": ("swapped_in_blocks", "Swapped-out KV blocks loaded back."),
    "kv_swap_fallbacks": ("swap_fallbacks",
                          "Swap preemptions that recomputed instead: the host tier had no room."),
}


class KVOffloadMetrics:
    def __init__(self, registry: CollectorRegistry, labels: list[str],
                 values: tuple[str, ...]) -> None:
        self.values = values
        self._per_tier = {name: Counter(PREFIX + f"kv_offload_{name}", f"KV tier {name} "
                                        "(blocks or bytes), by tier.", [*labels, "tier"],
                                        registry=registry) for name in PER_TIER}
        self._whole = {name: Counter(PREFIX + f"kv_offload_{name}", f"KV tier {name}.", labels,
                                     registry=registry).labels(*values) for name in WHOLE}
        self._engine = {field: Counter(PREFIX + name, doc, labels, registry=registry)
                        .labels(*values) for name, (field, doc) in ENGINE_COUNTERS.items()}
        self.keys = Gauge(PREFIX + "kv_offload_keys", "Prefix blocks the KV tiers hold.",
                          labels, registry=registry).labels(*values)
        self.swap_bytes = Gauge(PREFIX + "kv_offload_swap_bytes", "Bytes of swapped-out "
                                "requests' KV blocks in the host tier.", labels,
                                registry=registry).labels(*values)
        for counter in self._per_tier.values():
            for tier in ("host", "disk"):
                counter.labels(*values, tier)  # exported as 0 from the start
        self._totals: dict[str, int] = {}

    def update(self, totals: KVOffloadTotals) -> None:
        self.keys.set(totals.num_keys)
        self.swap_bytes.set(totals.swap_bytes)
        for name, counter in self._per_tier.items():
            for tier in ("host", "disk"):
                stat = f"{tier}_{name}"
                self._advance(counter.labels(*self.values, tier), stat,
                              totals.stats.get(stat, 0))
        for name, counter in self._whole.items():
            self._advance(counter, name, totals.stats.get(name, 0))
        for field, counter in self._engine.items():
            self._advance(counter, field, getattr(totals, field))

    def _advance(self, counter, name: str, total: int) -> None:
        previous = self._totals.get(name, 0)
        if total > previous:
            counter.inc(total - previous)
            self._totals[name] = total
