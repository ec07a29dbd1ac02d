"""One /metrics page from several Prometheus registries: the server process's and each served
model's (every model's EngineMetrics has its own registry, its samples labelled with its
`model_name`). Families of the same name are merged into one, as the text format requires."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric


class MergedRegistries:
    """A collector (what generate_latest reads) over the registries `registries()` gives at
    each scrape (models come and go)."""

    def __init__(self, registries: Callable[[], list[CollectorRegistry]]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries():
            for family in registry.collect():  # fresh Metric objects each call: ours to extend
                known = families.get(family.name)
                if known is None:
                    families[family.name] = family
                else:
                    known.samples.extend(family.samples)
        return iter(families.values())
