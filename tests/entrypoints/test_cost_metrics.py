"""The cost collector of `pagoda serve --cost-per-hour` (entrypoints/openai/cost_metrics.py):
figures from the price, the server's age and every served model's token totals, a
data-parallel model's per-replica copies not counted twice."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pagoda.engine.data_parallel.metrics import DataParallelMetrics
from pagoda.engine.stats.metrics import EngineMetrics
from pagoda.engine.stats.snapshot import EngineSnapshot
from pagoda.entrypoints.openai.cost_metrics import CostCollector, token_totals


def test_figures_follow_the_price_the_age_and_all_models_tokens():
    single = EngineMetrics("a")
    parallel = DataParallelMetrics("b", 2)
    clock = [100.0]
    server = CollectorRegistry()
    server.register(CostCollector(7.2, lambda: [single.registry, parallel.registry],
                                  clock=lambda: clock[0]))

    def value(name: str) -> float | None:
        return server.get_sample_value(f"pagoda:{name}")

    assert value("cost_per_hour") == 7.2 and value("cost_usd_total") == 0
    assert value("cost_per_million_input_tokens") is None  # no tokens yet: no figure

    single.update(EngineSnapshot(num_prompt_tokens=600, num_generation_tokens=100))
    # replica 1 made all of model b's tokens: its copy and the totals both list them
    parallel.update(1, EngineSnapshot(num_prompt_tokens=400, num_generation_tokens=100),
                    EngineSnapshot(num_prompt_tokens=400, num_generation_tokens=100))
    assert token_totals([single.registry, parallel.registry]) == (1000, 200)

    clock[0] += 1800  # half an hour
    assert value("replica_hours_total") == pytest.approx(0.5)
    assert value("cost_usd_total") == pytest.approx(3.6)
    assert value("cost_per_million_input_tokens") == pytest.approx(3.6 / 1000 * 1e6)
    assert value("cost_per_million_output_tokens") == pytest.approx(3.6 / 200 * 1e6)
    assert value("cost_per_million_tokens") == pytest.approx(3.6 / 1200 * 1e6)
    text = generate_latest(server).decode()
    assert "# TYPE pagoda:cost_usd_total counter" in text
    assert "# TYPE pagoda:cost_per_million_output_tokens gauge" in text


def test_a_bad_price_names_the_flag():
    with pytest.raises(ValueError, match="--cost-per-hour must be a finite number"):
        CostCollector(float("nan"), list)
