"""What a benchmark run cost: `pagoda bench serve --cost-per-hour USD`, or else the hourly
cost the server itself reports (`pagoda serve --cost-per-hour`: its /metrics gauge
pagoda:cost_per_hour, summed over the page's samples).

The run's summary gets "cost" (the arithmetic and its caveat: pagoda/cost.py):

    source                      "flag" or "server"
    cost_per_hour, hours, cost_usd                      the run's wall time at that price
    per_million_input_tokens, per_million_output_tokens, per_million_tokens

Never an error: a server without /metrics or without the gauge gives no cost (None).
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from pagoda.bench.server_metrics import scrape_metrics_text
from pagoda.cost import cost_figures

COST_PER_HOUR = "pagoda:cost_per_hour"


def parse_cost_per_hour(text: str) -> float | None:
    """The sum of the page's pagoda:cost_per_hour samples; None without any (or bad text)."""
    try:
        values = [sample.value for family in text_string_to_metric_families(text)
                  for sample in family.samples
                  if sample.name == COST_PER_HOUR and math.isfinite(sample.value)]
    except (ValueError, IndexError, TypeError):
        return None
    return sum(values) if values else None


async def scrape_cost_per_hour(base_url: str, api_key: str | None = None,
                               timeout: float = 10.0) -> float | None:
    """The server's pagoda:cost_per_hour (summed over its models), or None."""
    text = await scrape_metrics_text(base_url, api_key, timeout)
    return None if text is None else parse_cost_per_hour(text)


def run_cost(summary: dict, cost_per_hour: float, source: str) -> dict:
    """The "cost" entry of one run's summary (metrics.summarize's figures)."""
    return {"source": source, **cost_figures(
        cost_per_hour, summary["duration_s"], summary["total_input_tokens"],
        summary["total_output_tokens"])}
