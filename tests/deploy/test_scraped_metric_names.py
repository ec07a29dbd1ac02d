"""A real `pagoda serve --cost-per-hour` process: its /metrics carries every pagoda:* series
the alert rules and the dashboard read (those of data-parallel servers, of the autoscaler's
ledger and of speculative decoding aside: their classes are checked in-process by
metric_names.pagoda_metric_names), the new TPOT histogram, and cost series that agree with
the price and the token counters."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from tests.deploy.metric_names import DEPLOY, pagoda_metric_names, sample_names, selected_names
from tests.entrypoints.server_helpers import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow  # a server process (make test-fast skips it)

COST_PER_HOUR = 3.6
NOT_FROM_ONE_PLAIN_SERVER = {
    "pagoda:dp_replica_healthy", "pagoda:dp_replica_restarts_total",  # --data-parallel-size
    "pagoda:serve_replicas", "pagoda:serve_replica_hours_total",       # the ledger
    "pagoda:serve_cost_usd_total", "pagoda:autoscaler_decisions_total",
    "pagoda:spec_decode_num_accepted_tokens_per_pos_total",            # after a draft
}


def read_names() -> set[str]:
    """The pagoda:* names the alert rules and the dashboard read."""
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    exprs = [rule["expr"] for group in rules for rule in group["rules"]]
    dashboard = json.loads((DEPLOY / "grafana" / "pagoda.json").read_text())
    exprs += [target["expr"] for panel in dashboard["panels"]
              for target in panel.get("targets", [])]
    return {name for expr in exprs for name in selected_names(expr)
            if name.startswith("pagoda:")}


def samples(text: str) -> dict[str, float]:
    """name -> value of the unlabelled or single-model samples (the last one listed)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if set(s.labels) <= {"model_name"}}


@pytest.fixture(scope="module")
def server():
    # with a host KV tier: its series exist only where the tiers are on
    with RemoteServer(["--cost-per-hour", str(COST_PER_HOUR),
                       "--kv-offload-memory", str(64 << 20)]) as running:
        yield running


def test_the_server_exports_what_the_rules_and_dashboard_read(server):
    response = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    text = httpx.get(server.url + "/metrics", timeout=10).text
    scraped = sample_names(text)
    missing = read_names() - NOT_FROM_ONE_PLAIN_SERVER - scraped
    assert not missing, f"the rules or the dashboard read series the server lacks: {missing}"
    # the in-process list the fast tests use is what a real server exports
    assert pagoda_metric_names() - NOT_FROM_ONE_PLAIN_SERVER - scraped == set()

    values = samples(text)
    assert values["pagoda:request_time_per_output_token_seconds_count"] == 1
    assert values["pagoda:cost_per_hour"] == COST_PER_HOUR
    hours = values["pagoda:replica_hours_total"]
    assert 0 < hours < 1
    cost = values["pagoda:cost_usd_total"]
    assert cost == pytest.approx(COST_PER_HOUR * hours)
    prompt, generated = values["pagoda:prompt_tokens_total"], values["pagoda:generation_tokens_total"]
    assert prompt > 0 and generated == 4
    assert values["pagoda:cost_per_million_input_tokens"] == pytest.approx(cost / prompt * 1e6)
    assert values["pagoda:cost_per_million_output_tokens"] == pytest.approx(cost / generated * 1e6)
    assert values["pagoda:cost_per_million_tokens"] == pytest.approx(
        cost / (prompt + generated) * 1e6)
    # the server's cost keeps running while it idles
    time.sleep(0.2)
    later = samples(httpx.get(server.url + "/metrics", timeout=10).text)
    assert later["pagoda:cost_usd_total"] > cost


def test_a_bad_price_is_refused_before_loading(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pagoda", "serve", "--cost-per-hour", "-2"],
                            capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "--cost-per-hour must be a finite number of USD >= 0, got -2.0" in result.stderr
