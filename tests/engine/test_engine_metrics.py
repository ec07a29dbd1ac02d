"""EngineMetrics counters follow the snapshot's running totals: the structured-output ones."""

from __future__ import annotations

from prometheus_client import generate_latest

from pagoda.engine.metrics import EngineMetrics
from pagoda.engine.snapshot import EngineSnapshot

MODEL = "m"


def sample(metrics: EngineMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(f"pagoda:{name}", {"model_name": MODEL})
    assert value is not None, name
    return value


def test_structured_output_counters_follow_snapshot_totals():
    metrics = EngineMetrics(MODEL)
    exported = generate_latest(metrics.registry).decode()
    assert 'pagoda:structured_output_requests_total{model_name="m"} 0.0' in exported
    assert 'pagoda:grammar_compile_seconds_total{model_name="m"} 0.0' in exported

    metrics.update(EngineSnapshot(num_structured_requests=2, grammar_compile_seconds=0.25))
    assert sample(metrics, "structured_output_requests_total") == 2
    assert sample(metrics, "grammar_compile_seconds_total") == 0.25

    # The same totals again (an update after an abort, say) count nothing twice.
    metrics.update(EngineSnapshot(num_structured_requests=2, grammar_compile_seconds=0.25))
    assert sample(metrics, "structured_output_requests_total") == 2

    metrics.update(EngineSnapshot(num_structured_requests=5, grammar_compile_seconds=0.75))
    assert sample(metrics, "structured_output_requests_total") == 5
    assert sample(metrics, "grammar_compile_seconds_total") == 0.75
