"""deploy/prometheus/: the alert rules pass `promtool check rules`, their unit tests
(alerts_test.yml: each alert fires on recorded series that breach it and stays silent on
healthy ones) pass `promtool test rules`, and prometheus.yml passes `promtool check config`.
promtool comes from Debian's prometheus package (.ci/run installs it)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.deploy.metric_names import (
    DEPLOY,
    PROMETHEUS_OWN,
    pagoda_metric_names,
    ray_serve_metric_names,
    selected_names,
)

PROMETHEUS = DEPLOY / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")

ALERTS = {
    # what the issue asks for -> the rules that cover it
    "P95 TTFT over an SLO": ["PagodaTTFTP95OverSLO"],
    "queue growing": ["PagodaQueueGrowing"],
    "KV usage above 95 %": ["PagodaKVCacheNearlyFull"],
    "preemption rate": ["PagodaPreemptionRate"],
    "error rate": ["PagodaServeErrorRate", "PagodaAbortRate"],
    "a replica down": ["PagodaServeReplicaDown", "PagodaDataParallelReplicaDown",
                       "PagodaServerDown"],
    "a replica restarting in a loop": ["PagodaServeReplicaRestartLoop",
                                       "PagodaDataParallelReplicaRestartLoop"],
}


def promtool(*args: str) -> str:
    result = subprocess.run([PROMTOOL, *args], cwd=PROMETHEUS, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def rules() -> list[dict]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


@needs_promtool
def test_promtool_checks_the_rules():
    assert f"SUCCESS: {len(rules())} rules found" in promtool("check", "rules", "alerts.yml")


@needs_promtool
def test_every_alert_fires_on_breaching_series_and_not_on_healthy_ones():
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")
    # every rule has a test that expects it to fire
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"]
             if case.get("exp_alerts")}
    assert fired == {rule["alert"] for rule in rules()}


@needs_promtool
def test_a_broken_threshold_fails_the_unit_tests(tmp_path):
    """The unit tests have teeth: the KV rule at 99 % misses the recorded 97 %."""
    for name in ("alerts.yml", "alerts_test.yml"):
        shutil.copy(PROMETHEUS / name, tmp_path / name)
    alerts = tmp_path / "alerts.yml"
    text = alerts.read_text()
    assert "(pagoda:kv_cache_usage_perc) > 0.95" in text
    alerts.write_text(text.replace("(pagoda:kv_cache_usage_perc) > 0.95",
                                   "(pagoda:kv_cache_usage_perc) > 0.99"))
    result = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
    assert "PagodaKVCacheNearlyFull" in result.stdout + result.stderr


@needs_promtool
def test_promtool_checks_the_prometheus_config():
    out = promtool("check", "config", "prometheus.yml")
    assert "SUCCESS: 1 rule files found" in out


def test_the_rules_cover_what_the_issue_asks_for():
    names = {rule["alert"] for rule in rules()}
    for what, alerts in ALERTS.items():
        assert set(alerts) <= names, f"{what}: missing {set(alerts) - names}"
    assert names == {a for alerts in ALERTS.values() for a in alerts}
    for rule in rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert selected_names(rule["expr"])  # parses, and reads some series


def test_the_rules_read_only_series_that_pagoda_or_ray_serve_export():
    known = pagoda_metric_names() | ray_serve_metric_names() | PROMETHEUS_OWN
    for rule in rules():
        unknown = selected_names(rule["expr"]) - known
        assert not unknown, f"{rule['alert']} reads series nobody exports: {unknown}"
