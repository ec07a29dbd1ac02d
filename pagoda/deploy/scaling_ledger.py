"""The autoscaler's ledger: replicas over time, replica-hours and the scaling decisions of
each Ray Serve deployment, logged and exported as Prometheus series.

Whoever holds the Serve application (the `pagoda serve --ray-serve` driver) polls
`serve.status()` every few seconds and hands it to `ScalingLedger.observe_status`:
`start_ledger(cost_per_hour, serve.status, metrics_port)` does it on a thread and serves the
series on http://0.0.0.0:metrics_port/metrics for Prometheus (LedgerPoller.stop() ends both;
`poller.ledger.summary()` is the record to log at the end). The ledger keeps, per deployment
"application/name":

    timeline        [(seconds since the ledger began, running replicas)], a point per change
    replica-hours   the integral of running replicas over time (each interval counted at
                    the replicas seen at its start: a step function, as billing counts it)
    decisions       times the deployment turned UPSCALING or DOWNSCALING (Ray Serve's status
                    for an autoscaling decision being carried out), logged with Serve's message

and exports them in `registry` (labels application, deployment):

    pagoda:serve_replicas                     gauge    RUNNING replicas now
    pagoda:serve_replica_hours_total          counter  replica-hours so far
    pagoda:serve_cost_usd_total               counter  replica-hours * cost_per_hour (given one)
    pagoda:autoscaler_decisions_total         counter  {direction="up"|"down"}

Ray Serve's controller exports its own view too (ray_serve_autoscaling_target_replicas,
ray_serve_deployment_replica_healthy); these add the time integral and the cost.
No import of Ray here: a status is read by attribute (ServeStatus.applications[app]
.deployments[name] with .status and .replica_states), so tests pass plain objects.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from pagoda.cost import check_cost_per_hour
from pagoda.engine.stats.metrics import PREFIX

logger = logging.getLogger(__name__)

_SCALING = {"UPSCALING": "up", "DOWNSCALING": "down"}


@dataclass(frozen=True)
class DeploymentView:
    """One deployment as one status read shows it."""

    running: int
    """Replicas in state RUNNING."""
    status: str = "HEALTHY"
    """Ray Serve's DeploymentStatus: HEALTHY, UPSCALING, DOWNSCALING, UPDATING, ..."""
    message: str = ""


@dataclass
class DeploymentLedger:
    timeline: list[tuple[float, int]] = field(default_factory=list)
    replica_hours: float = 0.0
    decisions: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    status: str = ""
    last_seen: float = 0.0

    @property
    def running(self) -> int:
        return self.timeline[-1][1] if self.timeline else 0

    @property
    def peak(self) -> int:
        return max((n for _, n in self.timeline), default=0)


def deployment_views(status) -> dict[str, DeploymentView]:
    """{"application/deployment": view} of a `serve.status()` result."""
    views = {}
    for app_name, app in status.applications.items():
        for name, deployment in app.deployments.items():
            states = {str(getattr(k, "value", k)): n for k, n in deployment.replica_states.items()}
            views[f"{app_name}/{name}"] = DeploymentView(
                running=int(states.get("RUNNING", 0)),
                status=str(getattr(deployment.status, "value", deployment.status)),
                message=deployment.message or "")
    return views


class ScalingLedger:
    def __init__(self, cost_per_hour: float | None = None,
                 registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cost_per_hour = (None if cost_per_hour is None
                              else check_cost_per_hour(cost_per_hour))
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        self._began = clock()
        self._lock = threading.Lock()
        self.deployments: dict[str, DeploymentLedger] = {}
        labels = ["application", "deployment"]
        self._replicas = Gauge(PREFIX + "serve_replicas", "RUNNING replicas of the deployment.",
                               labels, registry=self.registry)
        self._hours = Counter(PREFIX + "serve_replica_hours", "Replica-hours the deployment "
                              "has run (seen by the ledger's polls).", labels,
                              registry=self.registry)
        self._cost = (Counter(PREFIX + "serve_cost_usd", "USD the deployment's replicas have "
                              "cost (replica-hours times --cost-per-hour).", labels,
                              registry=self.registry)
                      if self.cost_per_hour is not None else None)
        self._decisions = Counter(PREFIX + "autoscaler_decisions", "Times Ray Serve's "
                                  "autoscaler began to scale the deployment.",
                                  labels + ["direction"], registry=self.registry)

    def observe_status(self, status) -> None:
        self.observe(deployment_views(status))

    def observe(self, views: Mapping[str, DeploymentView], now: float | None = None) -> None:
        """Account the time since the previous observation at the replicas seen then, then
        record these views. A deployment that is gone counts 0 replicas from now on."""
        now = self._clock() if now is None else now
        with self._lock:
            for key in set(self.deployments) - set(views):
                self._record(key, DeploymentView(running=0, status="DELETED"), now)
            for key, view in views.items():
                self._record(key, view, now)

    def _record(self, key: str, view: DeploymentView, now: float) -> None:
        application, _, deployment = key.partition("/")
        labels = (application, deployment)
        ledger = self.deployments.get(key)
        if ledger is None:
            ledger = self.deployments[key] = DeploymentLedger(last_seen=now)
            # every series exported (at 0) from the first observation on
            for direction in ("up", "down"):
                self._decisions.labels(*labels, direction)
            self._hours.labels(*labels)
            if self._cost is not None:
                self._cost.labels(*labels)
            logger.info("autoscaler: %s starts with %d replicas", key, view.running)
        hours = ledger.running * max(now - ledger.last_seen, 0.0) / 3600.0
        if hours > 0:
            ledger.replica_hours += hours
            self._hours.labels(*labels).inc(hours)
            if self._cost is not None:
                self._cost.labels(*labels).inc(hours * self.cost_per_hour)
        ledger.last_seen = now
        direction = _SCALING.get(view.status)
        if direction is not None and view.status != ledger.status:
            ledger.decisions[direction] += 1
            self._decisions.labels(*labels, direction).inc()
            logger.info("autoscaler: %s scales %s from %d replicas (%s)", key, direction,
                        view.running, view.message or view.status)
        ledger.status = view.status
        if not ledger.timeline or ledger.running != view.running:
            if ledger.timeline:
                logger.info("autoscaler: %s replicas %d -> %d (%.1f replica-hours so far)",
                            key, ledger.running, view.running, ledger.replica_hours)
            ledger.timeline.append((now - self._began, view.running))
        self._replicas.labels(*labels).set(view.running)

    def summary(self) -> dict[str, dict]:
        """Per deployment: timeline, peak and current replicas, replica_hours, decisions and
        (given a cost per hour) cost_usd; JSON-ready, for a benchmark's record."""
        with self._lock:
            out = {}
            for key, ledger in self.deployments.items():
                entry = {"timeline": [[round(t, 3), n] for t, n in ledger.timeline],
                         "replicas": ledger.running, "peak_replicas": ledger.peak,
                         "replica_hours": ledger.replica_hours,
                         "decisions": dict(ledger.decisions)}
                if self.cost_per_hour is not None:
                    entry["cost_usd"] = ledger.replica_hours * self.cost_per_hour
                out[key] = entry
            return out


class LedgerPoller:
    """Calls `read_status()` (e.g. ray.serve.status) every `interval_s` seconds on a daemon
    thread and feeds the ledger; a failed read is logged and retried at the next tick."""

    def __init__(self, ledger: ScalingLedger, read_status: Callable[[], object],
                 interval_s: float = 5.0) -> None:
        if not interval_s > 0:
            raise ValueError(f"the ledger's poll interval must be > 0 seconds, got {interval_s}")
        self.ledger = ledger
        self._read_status = read_status
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagoda-scaling-ledger",
                                        daemon=True)

        self.http_server = None
        """The WSGI server of start_ledger's metrics_port (None: not serving)."""

    def start(self) -> LedgerPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval_s + 5)
        if self.http_server is not None:
            self.http_server.shutdown()
            self.http_server.server_close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.ledger.observe_status(self._read_status())
            except Exception as e:  # noqa: BLE001 -- a monitor must outlive a bad read
                logger.warning("autoscaler ledger: reading the Serve status failed (%s: %s)",
                               type(e).__name__, e)
            self._stop.wait(self._interval_s)


def start_ledger(cost_per_hour: float | None, read_status: Callable[[], object],
                 metrics_port: int | None = None, host: str = "0.0.0.0",
                 interval_s: float = 5.0) -> LedgerPoller:
    """A started LedgerPoller over a new ScalingLedger; with `metrics_port`, its registry is
    served at http://host:metrics_port/metrics (0: a free port, in poller.http_server)."""
    from prometheus_client import start_http_server

    poller = LedgerPoller(ScalingLedger(cost_per_hour), read_status, interval_s)
    if metrics_port is not None:
        poller.http_server, _ = start_http_server(metrics_port, addr=host,
                                                  registry=poller.ledger.registry)
        logger.info("autoscaler ledger: series at http://%s:%d/metrics", host,
                    poller.http_server.server_port)
    return poller.start()
