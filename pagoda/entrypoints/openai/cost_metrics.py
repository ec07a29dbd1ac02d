"""Cost series on /metrics (`pagoda serve --cost-per-hour USD`): a collector in the server's
own registry, computed at each scrape from the hourly price, the time since the server
started and the served models' token counters (the arithmetic: pagoda/cost.py).

    pagoda:cost_per_hour                          gauge    USD an hour of this server, as given
    pagoda:replica_hours_total                    counter  hours this server (one replica) has
                                                           run; summed over replicas (Ray
                                                           Serve's, data-parallel servers'),
                                                           replica-hours
    pagoda:cost_usd_total                         counter  cost_per_hour * replica hours
    pagoda:cost_per_million_input_tokens          gauge    cost_usd_total / prompt tokens * 1e6
    pagoda:cost_per_million_output_tokens         gauge    cost_usd_total / generated tokens * 1e6
    pagoda:cost_per_million_tokens                gauge    ... / (prompt + generated) * 1e6

The three per-million gauges average over the server's whole life, idle time included (what
was really paid), and are absent until the server has that kind of token; a dashboard's
windowed figure divides the rates instead, e.g.
`sum(rate(pagoda:cost_usd_total[5m])) / sum(rate(pagoda:generation_tokens_total[5m])) * 1e6`.
Token counts are every served model's totals: samples with a `replica` label (a
data-parallel server's per-replica copies of its totals) are skipped so none counts twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from pagoda.cost import check_cost_per_hour, cost_usd, per_million
from pagoda.engine.stats.metrics import PREFIX

_PROMPT = PREFIX + "prompt_tokens_total"
_GENERATION = PREFIX + "generation_tokens_total"


def token_totals(registries: Iterable[CollectorRegistry]) -> tuple[float, float]:
    """(prompt tokens, generated tokens) over every registry's totals (no `replica` label)."""
    prompt = generated = 0.0
    for registry in registries:
        for family in registry.collect():
            for sample in family.samples:
                if "replica" in sample.labels:
                    continue
                if sample.name == _PROMPT:
                    prompt += sample.value
                elif sample.name == _GENERATION:
                    generated += sample.value
    return prompt, generated


class CostCollector:
    """Register in the server's registry (never in a registry it reads: that would recurse).
    `model_registries` returns the served models' registries at scrape time (models load and
    unload while the server runs); `clock` is seconds, monotonic."""

    def __init__(self, cost_per_hour: float,
                 model_registries: Callable[[], Iterable[CollectorRegistry]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cost_per_hour = check_cost_per_hour(cost_per_hour)
        self._model_registries = model_registries
        self._clock = clock
        self._started = clock()

    def collect(self) -> Iterator[Metric]:
        seconds = self._clock() - self._started
        cost = cost_usd(self.cost_per_hour, seconds)
        prompt, generated = token_totals(self._model_registries())
        yield GaugeMetricFamily(PREFIX + "cost_per_hour", "USD an hour of this server "
                                "(--cost-per-hour).", value=self.cost_per_hour)
        yield CounterMetricFamily(PREFIX + "replica_hours", "Hours this server (one replica) "
                                  "has run.", value=seconds / 3600.0)
        yield CounterMetricFamily(PREFIX + "cost_usd", "USD spent on this server so far "
                                  "(cost_per_hour times its hours).", value=cost)
        for name, tokens, what in (("input_tokens", prompt, "prompt"),
                                   ("output_tokens", generated, "generated"),
                                   ("tokens", prompt + generated, "prompt and generated")):
            figure = per_million(cost, tokens)
            if figure is not None:
                yield GaugeMetricFamily(
                    PREFIX + f"cost_per_million_{name}",
                    f"USD per million {what} tokens over the server's life (the whole cost "
                    "charged to them).", value=figure)

    def describe(self) -> list[Metric]:
        return []  # nothing collected at registration (the models may not be there yet)


def served_model_registries(state) -> list[CollectorRegistry]:
    """The metrics registries of a ServerState's served models (server_state.py; duck-typed to
    keep this module free of the server's imports)."""
    registry = state.registry
    if registry is None:
        return []
    return [model.metrics.registry for model in registry.all_models()
            if model.metrics is not None]
