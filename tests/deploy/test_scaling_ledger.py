"""The autoscaler's ledger (pagoda/deploy/scaling_ledger.py): replicas over time,
replica-hours, decisions and cost, from Ray Serve's own status objects, logged and exported."""

from __future__ import annotations

import logging
import threading

import pytest

from pagoda.deploy.scaling_ledger import (
    DeploymentView,
    LedgerPoller,
    ScalingLedger,
    deployment_views,
    start_ledger,
)

serve_schema = pytest.importorskip("ray.serve.schema")
common = pytest.importorskip("ray.serve._private.common")

HOUR = 3600.0
LABELS = {"application": "pagoda", "deployment": "PagodaDeployment"}
KEY = "pagoda/PagodaDeployment"


def serve_status(status: str, running: int, starting: int = 0, message: str = ""):
    """A ServeStatus as `ray.serve.status()` returns it: one application, one deployment."""
    states = {common.ReplicaState.RUNNING: running}
    if starting:
        states[common.ReplicaState.STARTING] = starting
    deployment = serve_schema.DeploymentStatusOverview(
        status=common.DeploymentStatus(status),
        status_trigger=common.DeploymentStatusTrigger.AUTOSCALING,
        replica_states=states, message=message)
    app = serve_schema.ApplicationStatusOverview(
        status=serve_schema.ApplicationStatus.RUNNING, message="", last_deployed_time_s=0.0,
        deployments={"PagodaDeployment": deployment})
    return serve_schema.ServeStatus(applications={"pagoda": app})


def sample(ledger: ScalingLedger, name: str, **labels: str) -> float | None:
    return ledger.registry.get_sample_value(f"pagoda:{name}", {**LABELS, **labels})


def test_views_read_ray_serves_status_objects():
    views = deployment_views(serve_status("UPSCALING", 1, starting=2, message="Upscaling"))
    assert views == {KEY: DeploymentView(running=1, status="UPSCALING", message="Upscaling")}


def test_a_ramp_up_and_down_is_logged_counted_and_integrated(caplog):
    clock = [0.0]
    ledger = ScalingLedger(cost_per_hour=2.0, clock=lambda: clock[0])
    caplog.set_level(logging.INFO, logger="pagoda.deploy.scaling_ledger")

    def at(hours: float, status: str, running: int, starting: int = 0) -> None:
        clock[0] = round(hours * HOUR, 6)
        ledger.observe_status(serve_status(status, running, starting,
                                           message=f"{status.lower()} to target"))

    at(0.0, "HEALTHY", 1)
    assert sample(ledger, "serve_replicas") == 1
    assert sample(ledger, "serve_replica_hours_total") == 0
    assert sample(ledger, "autoscaler_decisions_total", direction="up") == 0
    at(1.0, "UPSCALING", 1, starting=2)   # 1 replica for the first hour
    at(1.1, "UPSCALING", 3)               # still the same decision: counted once
    at(1.5, "HEALTHY", 3)                 # 3 replicas for 0.5 h
    at(2.0, "DOWNSCALING", 3)             # 3 more for 0.5 h
    at(2.5, "HEALTHY", 1)                 # 3 until the status shows 1: 3 * 0.5 h

    assert sample(ledger, "serve_replicas") == 1
    # (0.1 h at 1 replica between the UPSCALING reads: RUNNING was still 1)
    hours = 1 * 1.0 + 1 * 0.1 + 3 * 0.4 + 3 * 0.5 + 3 * 0.5
    assert sample(ledger, "serve_replica_hours_total") == pytest.approx(hours)
    assert sample(ledger, "serve_cost_usd_total") == pytest.approx(2.0 * hours)
    assert sample(ledger, "autoscaler_decisions_total", direction="up") == 1
    assert sample(ledger, "autoscaler_decisions_total", direction="down") == 1

    summary = ledger.summary()[KEY]
    assert summary["timeline"] == [[0.0, 1], [3960.0, 3], [9000.0, 1]]  # seconds
    assert summary["peak_replicas"] == 3 and summary["replicas"] == 1
    assert summary["decisions"] == {"up": 1, "down": 1}
    assert summary["cost_usd"] == pytest.approx(2.0 * hours)
    log = caplog.text
    assert f"{KEY} scales up from 1 replicas (upscaling to target)" in log
    assert f"{KEY} replicas 1 -> 3" in log and f"{KEY} replicas 3 -> 1" in log
    assert f"{KEY} scales down from 3 replicas" in log


def test_a_deleted_deployment_stops_accruing():
    clock = [0.0]
    ledger = ScalingLedger(clock=lambda: clock[0])
    ledger.observe({KEY: DeploymentView(running=2)})
    clock[0] = HOUR
    ledger.observe({})
    clock[0] = 5 * HOUR
    ledger.observe({})
    assert sample(ledger, "serve_replica_hours_total") == pytest.approx(2.0)
    assert sample(ledger, "serve_replicas") == 0
    assert sample(ledger, "serve_cost_usd_total") is None  # no cost per hour given


def test_the_poller_survives_a_failed_read_and_stops():
    ledger = ScalingLedger()
    reads = []
    fed = threading.Event()

    def read_status():
        reads.append(1)
        if len(reads) == 1:
            raise ConnectionError("controller restarting")
        fed.set()
        return serve_status("HEALTHY", 2)

    poller = LedgerPoller(ledger, read_status, interval_s=0.01).start()
    assert fed.wait(10)
    poller.stop()
    assert sample(ledger, "serve_replicas") == 2
    with pytest.raises(ValueError, match="poll interval"):
        LedgerPoller(ledger, read_status, interval_s=0)


def test_a_bad_cost_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--cost-per-hour must be a finite number"):
        ScalingLedger(cost_per_hour=-1.0)


def test_start_ledger_serves_the_series_for_prometheus():
    import httpx

    poller = start_ledger(1.5, lambda: serve_status("HEALTHY", 2), metrics_port=0,
                          host="127.0.0.1", interval_s=0.01)
    try:
        url = f"http://127.0.0.1:{poller.http_server.server_port}/metrics"
        for _ in range(500):
            text = httpx.get(url, timeout=5).text
            if 'pagoda:serve_replicas{application="pagoda",deployment="PagodaDeployment"} 2.0' in text:
                break
            threading.Event().wait(0.01)
        else:
            raise AssertionError(text)
        assert "pagoda:serve_cost_usd_total" in text
        assert "pagoda:autoscaler_decisions_total" in text
    finally:
        poller.stop()
    with pytest.raises(httpx.HTTPError):
        httpx.get(url, timeout=2)
