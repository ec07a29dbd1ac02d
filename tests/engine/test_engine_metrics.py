"""EngineMetrics counters follow the snapshot's running totals: the structured-output ones."""

from __future__ import annotations

from prometheus_client import generate_latest

from pagoda.engine.stats.metrics import EngineMetrics
from pagoda.engine.stats.snapshot import EngineSnapshot

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


def step_output(request_id: str, deltas: list[list[int]], finished: bool = False):
    from pagoda.outputs import CompletionOutput, RequestOutput

    return RequestOutput(request_id, None, [1], [
        CompletionOutput(index=i, delta_token_ids=delta) for i, delta in enumerate(deltas)
    ], finished=finished)


def test_time_per_output_token_is_the_mean_decode_gap_per_finished_sequence():
    metrics = EngineMetrics(MODEL)

    def tpot(stat: str) -> float:
        return sample(metrics, f"request_time_per_output_token_seconds_{stat}")

    # Request a, two sequences: seq 0 makes tokens at t=10 (1), 11 (2: a spec-decode step),
    # 13 (1): 4 tokens in 3 s -> 1 s each after the first; seq 1 one token only (no TPOT).
    metrics.record_step([step_output("a", [[5], [6]])], now=10.0)
    metrics.record_step([step_output("a", [[5, 5], []])], now=11.0)
    assert tpot("count") == 0  # nothing until a sequence finishes
    metrics.record_step([step_output("a", [[5], []], finished=True)], now=13.0)
    assert tpot("count") == 1
    assert tpot("sum") == 1.0
    # Its per-sequence state is gone; request b's TPOT is its own.
    assert metrics._seq_tokens == {}
    metrics.record_step([step_output("b", [[1]])], now=20.0)
    metrics.record_step([step_output("b", [[1]], finished=True)], now=20.5)
    assert tpot("count") == 2
    assert tpot("sum") == 1.5
