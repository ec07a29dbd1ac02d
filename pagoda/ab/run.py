"""`pagoda bench ab` once its flags are checked (pagoda/cli/bench_ab.py): the endpoints probed,
the traffic replayed (replay.py) or a proxy's record read (proxy_record.py), then the result
judged (stats.py) and written (report.py: the terminal summary, the JSON, the HTML page)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import replace

from tqdm import tqdm

from pagoda.ab.proxy_record import read_proxy_record
from pagoda.ab.replay import Endpoint, ReplayConfig, probe_hardware, run_ab
from pagoda.ab.report import format_text, render_html
from pagoda.ab.stats import analyze
from pagoda.bench import report
from pagoda.bench.serve import probe_server
from pagoda.traffic_record import TrafficEntry


def probed(endpoints: Sequence[Endpoint], api_key: str | None) -> list[Endpoint]:
    """Each endpoint with its model name (the server's first, unless given) and what it
    says it runs on; ValueError naming an endpoint that cannot be reached."""
    result = []
    for endpoint in endpoints:
        try:
            model = endpoint.model or probe_server(endpoint.url, api_key)
        except ValueError as e:
            raise ValueError(f"--endpoint {endpoint.name}: {e}") from None
        result.append(replace(endpoint, model=model,
                              hardware=probe_hardware(endpoint.url, api_key)))
    return result


def replay_result(endpoints: Sequence[Endpoint], entries: list[TrafficEntry],
                  config: ReplayConfig, api_key: str | None, progress: bool,
                  run_config: dict) -> dict:
    """The A/B result of replaying `entries` to every endpoint (each probed first), in
    report.envelope's shape; `run_config`: the run's settings, kept in the envelope."""
    endpoints = probed(endpoints, api_key)
    rows, duration = asyncio.run(_replay(endpoints, entries, config, api_key, progress))
    result = report.envelope("ab", "pagoda-bench", run_config)
    result.update(endpoints=[e.to_json() for e in endpoints], requests=rows, duration=duration)
    return result


def record_result(path: str) -> dict:
    """The A/B result of `pagoda ab-proxy --record`'s file, in report.envelope's shape."""
    result = read_proxy_record(path)
    result.update(report.envelope("ab", "pagoda-ab-proxy", {"from_record": path}))
    return result


def judge_and_report(result: dict, slo: dict[str, float] | None, confidence: float, resamples: int,
                     seed: int, output: str | None, html: str | None,
                     calibrate: bool | None = None) -> None:
    """Analyze `result` (kept in it as "analysis"), print the summary, and write the JSON to
    `output` and the HTML page to `html` where given. `calibrate`: stats.analyze's."""
    analysis = analyze(result, slo=slo, confidence=confidence, resamples=resamples, seed=seed,
                       calibrate=calibrate)
    result["analysis"] = analysis
    print(format_text(result, analysis))
    if output:
        report.write_json(output, result)
        print(f"wrote {output}", file=sys.stderr)
    if html:
        with open(html, "w", encoding="utf-8") as f:
            f.write(render_html(result, analysis))
        print(f"wrote {html}", file=sys.stderr)


async def _replay(endpoints, entries, config, api_key, progress):
    total = len(entries) * len(endpoints) * config.repeats
    with tqdm(total=total, desc="A/B requests", unit="req", disable=not progress) as bar:
        return await run_ab(endpoints, entries, config, api_key=api_key, progress=bar.update)
