"""Adding up replicas' EngineSnapshots, for the totals of /metrics, the web view and the
queue check.

Counters (running totals) must never go down, yet a restarted replica counts from zero
again. So the server keeps, per replica, `retired`: the counters of its past incarnations
(`counters_only` of each one's last snapshot, merged); that replica's cumulative view is
merge([retired, current]), and the totals are the merge of every replica's cumulative view.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import zip_longest

from pagoda.engine.stats.snapshot import EngineSnapshot, SpecDecodeTotals

_SUMMED = (
    "num_tracked_requests", "num_running_seqs", "num_waiting_seqs", "num_kv_blocks",
    "num_free_kv_blocks", "num_cached_free_kv_blocks", "last_step_num_seqs",
    "last_step_num_tokens", "last_step_num_prefill_tokens", "last_step_num_decode_tokens",
    "num_preempted_seqs",
)
_COUNTERS = (
    "num_steps", "num_prompt_tokens", "num_computed_prompt_tokens", "num_generation_tokens",
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_structured_requests",
    "grammar_compile_seconds",
)
_CONCATENATED = ("running_request_ids", "waiting_request_ids", "request_timelines")
_TALLIES = ("batch_sizes", "finished_by_reason", "steps_by_executor")
"""Counts by a key (mappings), summed key by key."""


def counters_only(snapshot: EngineSnapshot) -> EngineSnapshot:
    """The running totals of `snapshot`, its gauges at zero (a dead incarnation's share)."""
    return EngineSnapshot(
        **{name: getattr(snapshot, name) for name in _COUNTERS + _TALLIES},
        spec_decode=snapshot.spec_decode,
    )


def _sum_elementwise(rows) -> tuple[int, ...]:
    return tuple(sum(values) for values in zip_longest(*rows, fillvalue=0))


def merge_snapshots(snapshots: Sequence[EngineSnapshot]) -> EngineSnapshot:
    """One snapshot for several engines: counts summed, id lists and timelines concatenated,
    KV usage weighted by each engine's blocks. Layout fields (block size, KV groups' windows)
    come from the first snapshot that has a KV cache (replicas run the same model)."""
    if not snapshots:
        return EngineSnapshot()
    fields: dict = {name: sum(getattr(s, name) for s in snapshots) for name in _SUMMED + _COUNTERS}
    for name in _CONCATENATED:
        fields[name] = tuple(item for s in snapshots for item in getattr(s, name))
    with_cache = [s for s in snapshots if s.num_kv_blocks > 0]
    if with_cache:
        fields["kv_block_size"] = with_cache[0].kv_block_size
        fields["kv_group_windows"] = with_cache[0].kv_group_windows
        fields["kv_cache_usage"] = (sum(s.kv_cache_usage * s.num_kv_blocks for s in with_cache)
                                    / sum(s.num_kv_blocks for s in with_cache))
    fields["kv_group_num_blocks"] = _sum_elementwise(s.kv_group_num_blocks for s in snapshots)
    fields["kv_group_num_free_blocks"] = _sum_elementwise(
        s.kv_group_num_free_blocks for s in snapshots)
    for name in ("running_lora_adapters", "waiting_lora_adapters"):  # the union, in order
        fields[name] = tuple(dict.fromkeys(n for s in snapshots for n in getattr(s, name)))
    fields["max_lora"] = max(s.max_lora for s in snapshots)
    for name in _TALLIES:
        tally: Counter = Counter()
        for s in snapshots:
            tally.update(getattr(s, name))
        fields[name] = dict(tally)
    specs = [s.spec_decode for s in snapshots]
    fields["spec_decode"] = SpecDecodeTotals(
        sum(x.num_drafts for x in specs), sum(x.num_draft_tokens for x in specs),
        sum(x.num_accepted_tokens for x in specs),
        _sum_elementwise(x.accepted_per_position for x in specs),
    )
    return EngineSnapshot(**fields)
