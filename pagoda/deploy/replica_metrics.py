"""Every PagodaEngine replica's metrics, each scrapable on its own, and the Prometheus
file-based service discovery (file_sd) that finds them.

Through Ray Serve's proxy, GET /metrics reaches one replica picked by the router, so
Prometheus scraping the proxy would see one random replica's pagoda:* series per scrape.
Instead:

    replica (engine_replica.py)                     driver (launch.py, --metrics-targets-file)
    ──────────────────────────                      ───────────────────────────────────────────
    serve its registry (the page GET /metrics       every POLL_INTERVAL_S seconds:
    gives) on http://<node ip>:<free port>/metrics    endpoints = the KV entries
    publish ReplicaEndpoint in Ray's internal KV      replicas  = Serve's replica list (controller)
      (namespace KV_NAMESPACE, key                    write [endpoints of replicas Serve still
       "<application>/<deployment>/<replica id>")       has] to the file, atomically, if changed
    on graceful shutdown: delete it, stop serving     delete entries of replicas Serve no longer
                                                        has (crashed: nobody deleted them)

The file is Prometheus' file_sd format (deploy/prometheus/prometheus.yml reads it in job
"pagoda"): one group per replica, its target "ip:port" and labels application, deployment and
serve_replica (Ray Serve's replica id, the value of the `replica` label on Ray Serve's own
ray_serve_* series). Not `replica`: a data-parallel server inside a replica already labels its
per-engine copies `replica="0"...` and its totals `replica=""`, which the alert rules select.

Why not Ray's own metrics agent (ray.util.metrics, as vLLM's Ray stat logger does): Ray
renames every series with a `ray_` prefix, so the rules and dashboard would need a second set
of names, and Pagoda's registry computes some series at scrape time (cost, KV tiers), which
Ray's push-style metrics do not model. A port per replica keeps the one exposition of
`pagoda serve`, unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

KV_NAMESPACE = "pagoda_metrics"
POLL_INTERVAL_S = 5.0
LIVE_STATES = frozenset({"STARTING", "UPDATING", "RECOVERING", "RUNNING", "STOPPING",
                         "PENDING_MIGRATION"})
"""Replica states (Ray Serve's ReplicaState) whose metrics are worth scraping: the actor is
up. A STOPPING replica is draining and its last counts still matter."""


@dataclass(frozen=True)
class ReplicaEndpoint:
    """Where one replica serves its metrics; what the replica publishes in the KV."""

    application: str
    deployment: str
    replica: str
    """Ray Serve's replica id (ReplicaID.unique_id)."""
    address: str
    """"host:port" of its metrics server."""

    @property
    def key(self) -> str:
        return f"{self.application}/{self.deployment}/{self.replica}"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ReplicaEndpoint:
        return cls(**json.loads(raw))

    def sd_group(self) -> dict:
        """This replica as one target group of a file_sd file."""
        return {"targets": [self.address],
                "labels": {"application": self.application, "deployment": self.deployment,
                           "serve_replica": self.replica}}


# -- replica side -----------------------------------------------------------------------

class ReplicaMetricsServer:
    """The replica's registry on its own port, published for the driver. `collector`: what
    generate_latest reads (the server's MergedRegistries); `kv_put`/`kv_del` default to Ray's
    internal KV."""

    def __init__(self, collector, endpoint_of: Callable[[str], ReplicaEndpoint],
                 host: str, kv_put: Callable[[str, bytes], object] | None = None,
                 kv_del: Callable[[str], object] | None = None) -> None:
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(0, addr=host, registry=collector)
        self.endpoint = endpoint_of(f"{_url_host(host)}:{self._server.server_port}")
        self._kv_put = kv_put or _ray_kv_put
        self._kv_del = kv_del or _ray_kv_del
        try:
            self._kv_put(self.endpoint.key, self.endpoint.to_json())
        except BaseException:
            self._server.shutdown()
            self._server.server_close()
            raise
        logger.info("replica %s: metrics at http://%s/metrics", self.endpoint.replica,
                    self.endpoint.address)

    def close(self) -> None:
        """Withdraw the endpoint (the driver drops the target) and stop serving."""
        try:
            self._kv_del(self.endpoint.key)
        except Exception as e:  # noqa: BLE001 - the driver deletes it once the replica is gone
            logger.warning("replica %s: could not withdraw its metrics endpoint (%s)",
                           self.endpoint.replica, e)
        self._server.shutdown()
        self._server.server_close()


def serve_replica_metrics(collector) -> ReplicaMetricsServer | None:
    """Inside a Ray Serve replica: serve `collector` on a free port of this node's IP and
    publish it; None outside a replica (nothing to discover) or when that failed (logged:
    metrics are no reason to refuse serving)."""
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        context = serve.get_replica_context()
    except RayServeException:
        return None
    app, deployment = context.app_name, context.deployment
    replica = context.replica_id.unique_id
    try:
        return ReplicaMetricsServer(
            collector, lambda address: ReplicaEndpoint(app, deployment, replica, address),
            host=ray.util.get_node_ip_address())
    except Exception as e:  # noqa: BLE001 - a port or the KV: serve anyway, say so
        logger.warning("replica %s: its metrics port could not be published (%s: %s); "
                       "Prometheus will not find it", replica, type(e).__name__, e)
        return None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _ray_kv_put(key: str, value: bytes) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, value, overwrite=True, namespace=KV_NAMESPACE)


def _ray_kv_del(key: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(key, namespace=KV_NAMESPACE)


# -- driver side ------------------------------------------------------------------------

def live_replica_keys(details: dict) -> set[str]:
    """{"application/deployment/replica id"} of the replicas whose actor is up, from the Serve
    controller's instance details (the dict behind `serve status` and the dashboard's
    /api/serve/applications/)."""
    keys = set()
    for app_name, app in (details.get("applications") or {}).items():
        for name, deployment in (app.get("deployments") or {}).items():
            for replica in deployment.get("replicas") or ():
                if replica.get("state") in LIVE_STATES:
                    keys.add(f"{app_name}/{name}/{replica['replica_id']}")
    return keys


def sd_file_text(endpoints: Iterable[ReplicaEndpoint]) -> str:
    """The file_sd JSON for these endpoints (sorted, so an unchanged set gives the same
    text)."""
    groups = [e.sd_group() for e in sorted(endpoints, key=lambda e: e.key)]
    return json.dumps(groups, indent=2) + "\n"


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` in one rename: Prometheus, watching the file, never reads
    half of it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class TargetsFileWriter:
    """Keeps `path` listing the metrics endpoints of the replicas Serve has now.

    `read_endpoints()`: the published endpoints (Ray's KV); `read_details()`: the Serve
    controller's instance details; `forget(key)`: delete a dead replica's KV entry. sync()
    does one round; start() runs it every `interval_s` seconds on a daemon thread."""

    def __init__(self, path: Path, read_endpoints: Callable[[], list[ReplicaEndpoint]],
                 read_details: Callable[[], dict], forget: Callable[[str], object],
                 interval_s: float = POLL_INTERVAL_S) -> None:
        self.path = Path(path)
        self._read_endpoints = read_endpoints
        self._read_details = read_details
        self._forget = forget
        self._interval_s = interval_s
        self._written: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagoda-metrics-targets",
                                        daemon=True)

    def sync(self) -> list[ReplicaEndpoint]:
        """One round; returns the endpoints written. The KV is read before the replica
        list, so a replica that publishes in between is only missed until the next round,
        never taken for dead (Serve lists a replica from its start, before it publishes)."""
        endpoints = self._read_endpoints()
        live = live_replica_keys(self._read_details())
        listed = []
        for endpoint in endpoints:
            if endpoint.key in live:
                listed.append(endpoint)
            else:
                logger.info("metrics targets: replica %s is gone; dropping %s",
                            endpoint.key, endpoint.address)
                self._forget(endpoint.key)
        self.write(listed)
        return listed

    def write(self, endpoints: Iterable[ReplicaEndpoint]) -> None:
        text = sd_file_text(endpoints)
        if text != self._written:
            write_atomically(self.path, text)
            self._written = text
            logger.info("metrics targets: %s lists %d replicas", self.path,
                        len(json.loads(text)))

    def start(self) -> TargetsFileWriter:
        self.write([])  # the file exists from the start, valid for Prometheus
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling and empty the file (the application is gone: no targets left to
        scrape, rather than dead ones that read as servers down)."""
        self._stop.set()
        self._thread.join(timeout=self._interval_s + 5)
        self.write([])

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as e:  # noqa: BLE001 - a monitor must outlive a bad read
                logger.warning("metrics targets: polling the replicas failed (%s: %s)",
                               type(e).__name__, e)
            self._stop.wait(self._interval_s)


def ray_kv_endpoints() -> list[ReplicaEndpoint]:
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

    endpoints = []
    for key in _internal_kv_list("", namespace=KV_NAMESPACE):
        raw = _internal_kv_get(key, namespace=KV_NAMESPACE)
        if raw is not None:  # deleted since the listing
            endpoints.append(ReplicaEndpoint.from_json(raw))
    return endpoints


def serve_details() -> dict:
    """The Serve controller's instance details (what `serve.status()` reads, with each
    replica's id and state)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return client.get_serve_details() if client is not None else {}


def start_targets_file(path: str | Path) -> TargetsFileWriter:
    """In the driver, once Ray is connected: a started writer over Ray's KV and Serve."""
    return TargetsFileWriter(Path(path), ray_kv_endpoints, serve_details, _ray_kv_del).start()
