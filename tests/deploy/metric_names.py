"""Metric names for the checks of deploy/: the names a PromQL expression reads (parsed by
promql-parser), and the names Ray Serve exports, read from the installed Ray's source."""

from __future__ import annotations

import re
from pathlib import Path

import promql_parser

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"

GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
"""Grafana's built-in interval variables, replaced by a duration before parsing (a custom
variable such as $model only appears inside label matcher strings)."""

PROMETHEUS_OWN = {"up"}
"""Series Prometheus writes itself for every scrape target."""

_RAY_METRIC = re.compile(
    r"\b(Counter|Gauge|Histogram)\(\s*(?:name=)?f?\"(serve_[a-z_{}]+)\"")


def parse(expr: str):
    """The expression's syntax tree; promql_parser raises ValueError on bad PromQL."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return promql_parser.parse(expr)


def selected_names(expr: str) -> set[str]:
    """Every metric name the expression selects."""
    names: set[str] = set()
    stack = [parse(expr)]
    while stack:
        node = stack.pop()
        kind = type(node).__name__
        if kind == "VectorSelector":
            assert node.name, f"a selector without a metric name in {expr!r}"
            names.add(node.name)
        elif kind == "MatrixSelector":
            stack.append(node.vector_selector)
        elif kind == "Call":
            stack.extend(node.args)
        elif kind == "BinaryExpr":
            stack += [node.lhs, node.rhs]
        elif kind in ("AggregateExpr", "ParenExpr", "UnaryExpr", "SubqueryExpr"):
            stack.append(node.expr)
            if kind == "AggregateExpr" and node.param is not None:
                stack.append(node.param)
        elif kind not in ("NumberLiteral", "StringLiteral"):
            raise AssertionError(f"unknown PromQL node {kind} in {expr!r}")
    return names


def ray_serve_metric_names() -> set[str]:
    """What Ray's metrics agent exports for every ray.util.metrics metric Ray Serve defines:
    `ray_` + name, counters with `_total` (ray/_private/metrics_agent.py), histograms as
    _bucket, _sum and _count. f-string names are expanded for HTTP and gRPC."""
    import importlib.util

    spec = importlib.util.find_spec("ray")  # its files only: importing ray.serve is slow
    assert spec is not None and spec.submodule_search_locations, "ray is not installed"
    serve = Path(spec.submodule_search_locations[0]) / "serve"
    names = set()
    for path in serve.rglob("*.py"):
        for kind, name in _RAY_METRIC.findall(path.read_text(encoding="utf-8")):
            for protocol in ("http", "grpc"):
                base = "ray_" + name.replace("{protocol_name}", protocol)
                if kind == "Counter":
                    names.add(base if base.endswith("_total") else base + "_total")
                elif kind == "Histogram":
                    names |= {base + "_bucket", base + "_sum", base + "_count"}
                else:
                    names.add(base)
    return names


def sample_names(text: str) -> set[str]:
    """The sample names of a Prometheus text page (histograms as _bucket, _sum, _count)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.name for family in text_string_to_metric_families(text)
            for sample in family.samples}


def pagoda_metric_names() -> set[str]:
    """Every series name Pagoda can export, from its metric classes in this process: one
    engine's (after a speculative-decoding step, whose per-position counter appears then, and
    with KV tiers, whose series appear only where they are on),
    the cost collector's, a data-parallel server's and the autoscaler ledger's (with a cost).
    tests/deploy/test_scraped_metric_names.py checks a real server's /metrics against these."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pagoda.deploy.scaling_ledger import DeploymentView, ScalingLedger
    from pagoda.engine.data_parallel.metrics import DataParallelMetrics
    from pagoda.engine.stats.metrics import EngineMetrics
    from pagoda.engine.stats.snapshot import EngineSnapshot, KVOffloadTotals, SpecDecodeTotals
    from pagoda.entrypoints.openai.cost_metrics import CostCollector

    engine = EngineMetrics("m")
    engine.update(EngineSnapshot(num_prompt_tokens=8, num_generation_tokens=4,
                                 spec_decode=SpecDecodeTotals(1, 2, 1, (1, 0)),
                                 kv_offload=KVOffloadTotals(host_bytes=1)))
    cost = CollectorRegistry()
    cost.register(CostCollector(1.0, lambda: [engine.registry]))
    ledger = ScalingLedger(cost_per_hour=1.0)
    ledger.observe({"app/d": DeploymentView(running=1)})
    names = set()
    for registry in (engine.registry, cost, DataParallelMetrics("m", 2).registry,
                     ledger.registry):
        names |= sample_names(generate_latest(registry).decode())
    return names
