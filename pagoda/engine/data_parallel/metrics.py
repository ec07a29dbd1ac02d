"""/metrics of a data-parallel model: every engine series twice over, kept in the server
process.

    pagoda:prompt_tokens_total{model_name="m"}               the totals over all replicas
    pagoda:prompt_tokens_total{model_name="m",replica="0"}   replica 0's own
    pagoda:dp_replica_healthy{model_name="m",replica="0"}    1 while it takes requests
    pagoda:dp_replica_restarts_total{model_name="m",replica="0"}

The totals keep the single-engine names and labels (dashboards and `RemoteServer.metric`
read them unchanged); select one replica with `replica="i"`, the totals with `replica=""`
(summing over every label set counts everything twice).

Where the figures come from: latency histograms from the outputs the server relays (their
RequestMetrics carry the replica's timestamps, same clock), gauges and counters from the
snapshots each replica ships every SNAPSHOT_INTERVAL_S, made cumulative over restarts by
the engine (snapshots.py), so counters never go down.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric

from pagoda.engine.stats.metrics import PREFIX, EngineMetrics
from pagoda.engine.stats.snapshot import EngineSnapshot
from pagoda.outputs import RequestOutput


class _Registries:
    """A collector over several registries (the server's /metrics merges same-named
    families across collectors: entrypoints/openai/merged_metrics.py)."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self._registries = registries

    def collect(self) -> Iterator[Metric]:
        for registry in self._registries:
            yield from registry.collect()


class DataParallelMetrics:
    def __init__(self, model_name: str, num_replicas: int) -> None:
        self.model_name = model_name
        self.total = EngineMetrics(model_name)
        self.replicas = [EngineMetrics(model_name, extra_labels={"replica": str(i)})
                         for i in range(num_replicas)]
        states = CollectorRegistry()
        labels = ["model_name", "replica"]
        healthy = Gauge(PREFIX + "dp_replica_healthy",
                        "1 while the replica takes requests, 0 while it is down or restarting.",
                        labels, registry=states)
        restarts = Counter(PREFIX + "dp_replica_restarts",
                           "Times the replica was started again after it died.", labels,
                           registry=states)
        self._healthy = [healthy.labels(model_name, str(i)) for i in range(num_replicas)]
        self._restarts = [restarts.labels(model_name, str(i)) for i in range(num_replicas)]
        # Totals first: each family lists the totals' samples before the replicas'.
        self.registry = _Registries([self.total.registry,
                                     *(m.registry for m in self.replicas), states])

    def record_step(self, replica: int, outputs: Iterable[RequestOutput], now: float) -> None:
        outputs = list(outputs)
        self.replicas[replica].record_step(outputs, now)
        self.total.record_step(outputs, now)

    def forget(self, replica: int, request_id: str) -> None:
        self.replicas[replica].forget(request_id)
        self.total.forget(request_id)

    def update(self, replica: int, replica_snapshot: EngineSnapshot,
               total_snapshot: EngineSnapshot) -> None:
        """Both snapshots cumulative over restarts (their counters never go down)."""
        self.replicas[replica].update(replica_snapshot)
        self.total.update(total_snapshot)

    def set_healthy(self, replica: int, healthy: bool) -> None:
        self._healthy[replica].set(1 if healthy else 0)

    def restarted(self, replica: int) -> None:
        self._restarts[replica].inc()
