"""deploy/grafana/pagoda.json: a dashboard Grafana can import (valid JSON, panels laid on
the 24-column grid without overlap, unique ids), whose every query parses as PromQL
(promql-parser, and Prometheus's own parser through promtool where installed) and reads
only series that Pagoda or Ray Serve export, covering what the issue lists."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.metric_names import (
    DEPLOY,
    GRAFANA_VARIABLES,
    PROMETHEUS_OWN,
    pagoda_metric_names,
    ray_serve_metric_names,
    selected_names,
)

DASHBOARD = DEPLOY / "grafana" / "pagoda.json"

COVERED = {
    # what the issue asks the dashboard to show -> a series that shows it
    "TTFT percentiles": "pagoda:time_to_first_token_seconds_bucket",
    "TPOT percentiles": "pagoda:request_time_per_output_token_seconds_bucket",
    "ITL percentiles": "pagoda:inter_token_latency_seconds_bucket",
    "throughput": "pagoda:generation_tokens_total",
    "queue": "pagoda:num_requests_waiting",
    "KV usage": "pagoda:kv_cache_usage_perc",
    "prefix hits": "pagoda:prefix_cache_hits_total",
    "KV tiers": "pagoda:kv_offload_hits_total",
    "spec-decode acceptance": "pagoda:spec_decode_num_accepted_tokens_total",
    "replicas (Ray Serve's own)": "ray_serve_deployment_replica_healthy",
    "replicas over time (ledger)": "pagoda:serve_replicas",
    "cost": "pagoda:cost_usd_total",
    "replica-hours": "pagoda:serve_replica_hours_total",
}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every query, the templating's included."""
    found = [(panel["title"], target["expr"]) for panel in dashboard["panels"]
             for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append((f"${variable['name']}", variable["query"]["query"]))
    return found


def test_the_dashboard_is_importable(dashboard):
    assert dashboard["title"] == "Pagoda" and dashboard["uid"]
    assert isinstance(dashboard["schemaVersion"], int)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    occupied: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {(grid["x"] + i, grid["y"] + j) for i in range(grid["w"])
                 for j in range(grid["h"])}
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["type"] == "timeseries", panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_every_query_parses_and_reads_exported_series(dashboard):
    known = pagoda_metric_names() | ray_serve_metric_names() | PROMETHEUS_OWN
    used = set()
    for title, expr in queries(dashboard):
        if expr.startswith("label_values("):
            metric = expr.removeprefix("label_values(").split(",")[0].strip()
            names = {metric}
        else:
            names = selected_names(expr)  # raises on PromQL that does not parse
        unknown = names - known
        assert not unknown, f"panel {title!r} reads series nobody exports: {unknown}"
        used |= names
    for what, series in COVERED.items():
        assert series in used, f"the dashboard shows no {what} ({series})"


def test_the_metric_name_check_has_teeth():
    known = pagoda_metric_names() | ray_serve_metric_names()
    assert "pagoda:time_to_first_token_seconds_bucket" in known
    assert "ray_serve_deployment_replica_healthy" in known
    assert selected_names("rate(pagoda:ttft_seconds_bucket[$__rate_interval])") - known
    with pytest.raises(ValueError):
        selected_names("sum(rate(pagoda:prompt_tokens_total[5m])")  # unbalanced


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (Debian: apt-get install prometheus)")
def test_prometheus_own_parser_accepts_every_query(dashboard, tmp_path):
    """Each query as a recording rule: `promtool check rules` parses it with Prometheus's
    PromQL parser (Grafana's interval variables replaced by durations)."""
    rules = []
    for i, (_, expr) in enumerate(queries(dashboard)):
        if expr.startswith("label_values("):
            continue
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
