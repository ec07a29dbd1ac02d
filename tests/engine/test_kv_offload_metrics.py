"""The KV tiers on /metrics and in the web page's KV view: series per tier that follow the
snapshot's running totals, none without tiers."""

from __future__ import annotations

from prometheus_client import generate_latest

from pagoda.engine.stats.metrics import EngineMetrics
from pagoda.engine.stats.snapshot import EngineSnapshot, KVOffloadTotals
from pagoda.entrypoints.web.engine_view import EngineView

MODEL = "m"


def value(metrics: EngineMetrics, name: str, **labels) -> float:
    found = metrics.registry.get_sample_value(f"pagoda:{name}", {"model_name": MODEL, **labels})
    assert found is not None, name
    return found


def totals(**fields) -> KVOffloadTotals:
    return KVOffloadTotals(host_bytes=1 << 20, disk_bytes=1 << 30, disk_dir="/d", **fields)


def test_no_tier_series_without_tiers() -> None:
    metrics = EngineMetrics(MODEL)
    metrics.update(EngineSnapshot())
    assert "kv_offload" not in generate_latest(metrics.registry).decode()


def test_tier_counters_follow_the_snapshot_per_tier() -> None:
    metrics = EngineMetrics(MODEL)
    metrics.update(EngineSnapshot(kv_offload=totals()))
    exported = generate_latest(metrics.registry).decode()
    assert 'pagoda:kv_offload_hits_total{model_name="m",tier="disk"} 0.0' in exported
    stats = {"host_hits": 3, "disk_hits": 2, "host_bytes_read": 300, "disk_bytes_written": 900,
             "host_evictions": 4, "corrupt_entries": 1}
    metrics.update(EngineSnapshot(kv_offload=totals(stats=stats, hit_tokens=80, num_keys=7,
                                                    failed_loads=1, swapped_out_blocks=5)))
    assert value(metrics, "kv_offload_hits_total", tier="host") == 3
    assert value(metrics, "kv_offload_hits_total", tier="disk") == 2
    assert value(metrics, "kv_offload_bytes_read_total", tier="host") == 300
    assert value(metrics, "kv_offload_bytes_written_total", tier="disk") == 900
    assert value(metrics, "kv_offload_evictions_total", tier="host") == 4
    assert value(metrics, "kv_offload_corrupt_entries_total") == 1
    assert value(metrics, "kv_offload_hit_tokens_total") == 80
    assert value(metrics, "kv_offload_failed_loads_total") == 1
    assert value(metrics, "kv_swap_out_blocks_total") == 5
    assert value(metrics, "kv_offload_keys") == 7
    # the same totals again count nothing twice; growth counts the difference
    stats["host_hits"] = 10
    metrics.update(EngineSnapshot(kv_offload=totals(stats=stats, hit_tokens=80)))
    assert value(metrics, "kv_offload_hits_total", tier="host") == 10
    assert value(metrics, "kv_offload_hit_tokens_total") == 80
    # prefix_cache_hits stays the pool's own
    assert value(metrics, "prefix_cache_hits_total") == 0


def test_the_web_view_shows_the_tiers() -> None:
    view = EngineView(MODEL, clock=lambda: 100.0)
    assert view.tick(EngineSnapshot())["kv"]["tiers"] is None
    tick = view.tick(EngineSnapshot(kv_offload=totals(
        stats={"host_hits": 3, "disk_misses": 2}, num_keys=9, hit_tokens=48)))
    kv_offload = tick["kv"]["tiers"]
    assert kv_offload["keys"] == 9 and kv_offload["hit_tokens"] == 48
    assert kv_offload["host_bytes"] == 1 << 20 and kv_offload["disk_bytes"] == 1 << 30
    assert kv_offload["host"]["hits"] == 3 and kv_offload["disk"]["misses"] == 2
