"""Every Ray Serve engine replica's metrics, scrapable on its own, without a cluster: a
replica's metrics server and its published endpoint, the driver's file_sd targets file as
replicas come and go (read back by `promtool check service-discovery`), and the driver's
monitors (autoscaler ledger and targets file) started and stopped."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter

from pagoda.deploy.replica_metrics import (
    ReplicaEndpoint,
    ReplicaMetricsServer,
    TargetsFileWriter,
    live_replica_keys,
)
from pagoda.entrypoints.openai.routes.admin import metrics_page

PROMTOOL = shutil.which("promtool")


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return response.read().decode()


def details(**replicas: str) -> dict:
    """Serve controller details of app "pagoda", deployment "PagodaEngine": {id: state}."""
    listed = [{"replica_id": rid, "state": state, "node_ip": "127.0.0.1"}
              for rid, state in replicas.items()]
    return {"applications": {"pagoda": {"deployments": {
        "PagodaEngine": {"replicas": listed},
        "PagodaIngress": {"replicas": [{"replica_id": "i1", "state": "RUNNING"}]}}}}}


def endpoint(replica: str, port: int) -> ReplicaEndpoint:
    return ReplicaEndpoint("pagoda", "PagodaEngine", replica, f"10.0.0.1:{port}")


def test_a_replica_serves_its_metrics_page_on_its_own_port_and_publishes_it():
    registry = CollectorRegistry()
    Counter("pagoda:prompt_tokens", "tokens", ["model_name"], registry=registry) \
        .labels("m").inc(7)
    state = SimpleNamespace(server_registry=registry, registry=None)
    kv: dict[str, bytes] = {}
    server = ReplicaMetricsServer(
        metrics_page(state), lambda address: ReplicaEndpoint("pagoda", "PagodaEngine", "r1",
                                                             address),
        host="127.0.0.1", kv_put=kv.__setitem__, kv_del=kv.pop)
    try:
        assert server.endpoint.address.startswith("127.0.0.1:")
        assert kv == {"pagoda/PagodaEngine/r1": server.endpoint.to_json()}
        assert ReplicaEndpoint.from_json(kv["pagoda/PagodaEngine/r1"]) == server.endpoint
        assert 'pagoda:prompt_tokens_total{model_name="m"} 7.0' in scrape(server.endpoint.address)
    finally:
        server.close()
    assert kv == {}  # withdrawn: the driver drops the target
    with pytest.raises(urllib.error.URLError):
        scrape(server.endpoint.address)


def test_live_replicas_are_those_serve_lists_with_an_actor_up():
    keys = live_replica_keys(details(a="RUNNING", b="STARTING", c="STOPPING", d="STOPPED"))
    assert keys == {"pagoda/PagodaEngine/a", "pagoda/PagodaEngine/b",
                    "pagoda/PagodaEngine/c", "pagoda/PagodaIngress/i1"}
    assert live_replica_keys({}) == set()


def test_the_targets_file_follows_the_replicas_as_they_come_and_go(tmp_path):
    path = tmp_path / "pagoda_targets.json"
    kv = {e.key: e for e in (endpoint("a", 41001), endpoint("b", 41002))}
    serve = {"details": details(a="RUNNING", b="RUNNING")}
    writer = TargetsFileWriter(path, lambda: list(kv.values()), lambda: serve["details"],
                               kv.pop)
    writer.write([])
    assert json.loads(path.read_text()) == []

    writer.sync()
    assert json.loads(path.read_text()) == [
        {"targets": ["10.0.0.1:41001"], "labels": {
            "application": "pagoda", "deployment": "PagodaEngine", "serve_replica": "a"}},
        {"targets": ["10.0.0.1:41002"], "labels": {
            "application": "pagoda", "deployment": "PagodaEngine", "serve_replica": "b"}}]
    inode = os.stat(path).st_ino
    writer.sync()
    assert os.stat(path).st_ino == inode  # unchanged: not rewritten

    # b crashed (its entry was never withdrawn; Serve no longer lists it), c came up
    kv["pagoda/PagodaEngine/c"] = endpoint("c", 41003)
    serve["details"] = details(a="RUNNING", c="STARTING")
    writer.sync()
    targets = [group["targets"][0] for group in json.loads(path.read_text())]
    assert targets == ["10.0.0.1:41001", "10.0.0.1:41003"]
    assert set(kv) == {"pagoda/PagodaEngine/a", "pagoda/PagodaEngine/c"}  # b's forgotten
    assert os.stat(path).st_ino != inode  # replaced by a rename, never written in place
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left


def test_the_writer_outlives_a_bad_read_and_empties_the_file_when_stopped(tmp_path, caplog):
    path = tmp_path / "t.json"
    reads = iter([RuntimeError("controller restarting")])

    def read_details():
        for error in reads:
            raise error
        return details(a="RUNNING")

    kv = {"pagoda/PagodaEngine/a": endpoint("a", 41001)}
    writer = TargetsFileWriter(path, lambda: list(kv.values()), read_details, kv.pop,
                               interval_s=0.05)
    with caplog.at_level(logging.WARNING):
        writer.start()
        for _ in range(200):
            if json.loads(path.read_text()):
                break
            writer._stop.wait(0.05)
        writer.stop()
    assert "controller restarting" in caplog.text
    assert json.loads(path.read_text()) == []


@pytest.mark.skipif(PROMTOOL is None,
                    reason="promtool is not installed (Debian: apt-get install prometheus)")
def test_prometheus_reads_the_targets_file_with_the_shipped_job(tmp_path):
    """promtool runs job "pagoda" of deploy/prometheus/prometheus.yml's service discovery
    over a written targets file: every replica a target, with its labels."""
    import yaml

    shipped = Path(__file__).parents[2] / "deploy" / "prometheus" / "prometheus.yml"
    config = yaml.safe_load(shipped.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "pagoda"]
    (sd,) = job["file_sd_configs"]
    config.pop("rule_files")
    # promtool 2.42 (Debian 12) panics ("send on closed channel") when one job mixes
    # static_configs with file_sd_configs; Prometheus itself does not: check the file's part
    job.pop("static_configs")
    config["scrape_configs"] = [job]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    kv = {e.key: e for e in (endpoint("a", 41001), endpoint("b", 41002))}
    TargetsFileWriter(tmp_path / sd["files"][0], lambda: list(kv.values()),
                      lambda: details(a="RUNNING", b="RUNNING"), kv.pop).sync()
    result = subprocess.run([PROMTOOL, "check", "service-discovery", "prometheus.yml",
                             "pagoda", "--timeout=1s"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    discovered = json.loads(result.stdout)
    labels = {t["labels"]["__address__"]: t["labels"] for t in discovered
              if "serve_replica" in t["labels"]}
    assert set(labels) == {"10.0.0.1:41001", "10.0.0.1:41002"}
    assert labels["10.0.0.1:41002"]["serve_replica"] == "b"
    assert labels["10.0.0.1:41002"]["deployment"] == "PagodaEngine"
    assert labels["10.0.0.1:41002"]["job"] == "pagoda"


def test_the_driver_starts_and_stops_the_ledger_and_the_targets_file(tmp_path, monkeypatch,
                                                                    caplog):
    """launch.py's monitors: the ledger polls serve.status and serves its series on
    --ledger-port; --metrics-targets-file is written; stopping logs the ledger's summary."""
    pytest.importorskip("ray.serve", reason="make test installs Ray Serve (ray[serve])")
    from ray import serve

    from pagoda.deploy import launch, replica_metrics

    status = SimpleNamespace(applications={"pagoda": SimpleNamespace(deployments={
        "PagodaEngine": SimpleNamespace(status="HEALTHY", message="",
                                        replica_states={"RUNNING": 2})})})
    monkeypatch.setattr(serve, "status", lambda: status)
    kv = {"pagoda/PagodaEngine/a": endpoint("a", 41001)}
    monkeypatch.setattr(replica_metrics, "ray_kv_endpoints", lambda: list(kv.values()))
    monkeypatch.setattr(replica_metrics, "serve_details", lambda: details(a="RUNNING"))
    monkeypatch.setattr(replica_metrics, "_ray_kv_del", kv.pop)
    path = tmp_path / "targets.json"
    args = Namespace(cost_per_hour=2.0, ledger_port=0, metrics_targets_file=str(path))
    with caplog.at_level(logging.INFO, logger="pagoda.deploy.launch"):
        ledger, targets = launch.start_monitors(args)
        try:
            page = ""
            for _ in range(100):
                page = scrape(f"127.0.0.1:{ledger.http_server.server_port}")
                if "pagoda:serve_replicas{" in page and json.loads(path.read_text()):
                    break
                targets._stop.wait(0.05)
            assert ('pagoda:serve_replicas{application="pagoda",deployment="PagodaEngine"} 2.0'
                    in page)
            assert [g["labels"]["serve_replica"] for g in json.loads(path.read_text())] == ["a"]
        finally:
            launch.stop_monitors(ledger, targets)
    assert json.loads(path.read_text()) == []
    (line,) = [r.getMessage() for r in caplog.records
               if r.getMessage().startswith("autoscaler ledger: {")]
    summary = json.loads(line.removeprefix("autoscaler ledger: "))
    assert summary["pagoda/PagodaEngine"]["replicas"] == 2
    assert "cost_usd" in summary["pagoda/PagodaEngine"]
