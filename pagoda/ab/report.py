"""The report of an A/B run: the terminal summary (markdown tables ending with the verdict)
and one self-contained HTML page (inline SVG charts, inline CSS, no scripts, nothing
fetched: it opens offline).

Both read `result` (pagoda bench ab's JSON: endpoints and raw requests) and `analysis`
(pagoda/ab/stats.py's `analyze()`); they compute nothing statistical themselves. The
tables hold one column per endpoint and one per candidate against the baseline: the
relative difference and its interval, marked * where a decisive metric differs (the
verdict's rule). Every string that comes from the result is escaped in the HTML.
"""

from __future__ import annotations

import html
import json
import textwrap

from pagoda.ab.verdict import format_change
from pagoda.bench.metrics import time_per_output_token
from pagoda.bench.report import markdown_table
from pagoda.bench.svg_chart import Series, cdf_series, chart

LATENCY_SECTIONS = (("TTFT", "ttft", "ttft_s", 1), ("TPOT", "tpot", "tpot_s", 2),
                    ("ITL", "itl", "itl_s", 2), ("E2E latency", "e2el", "e2el_s", 1))
STATISTICS = (("mean", "mean"), ("P50", "median"), ("P95", "p95"), ("P99", "p99"))
CDF_PLOTS = (("TTFT", "ttft"), ("TPOT", "tpot"), ("E2E latency", "latency"))
DIFFERS_NOTE = ("* a decisive metric that differs: its interval at the Bonferroni level over "
                "the decisive metrics excludes zero and the difference is at least 2%")


# ---- the tables, shared by text and HTML -------------------------------------------------------


def _ms(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value * 1000:.{digits}f}"


def _row_cell(row: dict | None, confidence: float) -> str:
    """A comparison row as '-38% (-44 to -31%) *' (latencies) or '1.90x (1.62–2.21x)'."""
    if row is None or row["difference"] is None:
        return "-"
    text = format_change({**row, "name": ""}, confidence, inline=True).strip()
    text = text.replace(f", {confidence * 100:g}% CI ", " (")
    if row["low"] is not None:
        text += ")"
    return text + (" *" if row["significant"] else "")


def _lookup(comparison: dict, metric: str, statistic: str) -> dict | None:
    return next((r for r in comparison["metrics"]
                 if r["metric"] == metric and r["statistic"] == statistic), None)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def sections(analysis: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for each table of the report."""
    endpoints, comparisons = analysis["endpoints"], analysis["comparisons"]
    confidence = analysis["confidence"]
    header = ["metric", *(e["name"] for e in endpoints),
              *(f"{c['candidate']} vs {c['baseline']} ({confidence * 100:g}% CI)"
                for c in comparisons)]

    def errors(e: dict) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(e["errors_by_kind"].items()))
        return f"{e['failed']}" + (f" ({kinds})" if kinds else "")

    def error_difference(c: dict) -> str:
        er = c["error_rate"]
        if er["difference"] is None:
            return "-"
        text = f"{er['difference'] * 100:+.1f} points"
        if er["low"] is not None:
            text += f" ({er['low'] * 100:+.1f} to {er['high'] * 100:+.1f})"
        return text + (f" worse: {er['worse']}" if er["worse"] else "")

    def agreement(c: dict) -> str:
        a = c["output_agreement"]
        return "-" if not a["pairs"] else f"{a['share']:.0%} of {a['pairs']}"

    def money(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    rows = [
        ["requests", *(str(e["num_requests"]) for e in endpoints), *("" for _ in comparisons)],
        ["failed", *(errors(e) for e in endpoints), *map(error_difference, comparisons)],
        ["duration s", *(f"{e['duration_s']:.2f}" for e in endpoints), *("" for _ in comparisons)],
        ["output tokens", *(str(e["total_output_tokens"]) for e in endpoints),
         *("" for _ in comparisons)],
        ["output tok/s", *(f"{e['output_throughput']:.1f}" for e in endpoints),
         *(_ratio(c["output_throughput_ratio"]) for c in comparisons)],
    ]
    if analysis.get("slo_s"):
        bounds = ", ".join(f"{k}<={v * 1000:g}ms" for k, v in analysis["slo_s"].items())
        rows.append([f"goodput req/s [{bounds}]",
                     *("-" if e["goodput"] is None else f"{e['goodput']:.3g}" for e in endpoints),
                     *(_row_cell(_lookup(c, "goodput", "rate"), confidence)
                       for c in comparisons)])
    rows += [
        ["cost per hour", *(money(e["cost_per_hour"]) for e in endpoints),
         *("" for _ in comparisons)],
        ["cost per million output tokens",
         *(money(e["cost_per_million_output_tokens"]) for e in endpoints),
         *(_ratio(c["cost_per_million_output_tokens_ratio"]) for c in comparisons)],
        ["greedy outputs identical", *("" for _ in endpoints), *map(agreement, comparisons)],
    ]
    out = [("Requests, throughput and cost", header, rows)]
    for title, metric, key, digits in LATENCY_SECTIONS:
        rows = [[f"{label} ms", *(_ms(e[key][stat], digits) for e in endpoints),
                 *(_row_cell(_lookup(c, metric, stat), confidence) for c in comparisons)]
                for label, stat in STATISTICS]
        out.append((title, header, rows))
    return out


def _pairing(analysis: dict) -> list[str]:
    lines = []
    for c in analysis["comparisons"]:
        how = (f"paired by request over {c['num_pairs']} pairs" if c["paired"]
               else f"unpaired ({c['num_pairs']} pairs, too few to pair)")
        if c.get("resampled") == "blocks":
            how += (f", drawn in whole blocks ({c['num_blocks']} per endpoint; intervals "
                    "widened for their number)")
        lines.append(f"{c['candidate']} vs {c['baseline']}: {how}; "
                     f"{analysis['resamples']} bootstrap resamples, seed {analysis['seed']}.")
    return lines


# ---- terminal ----------------------------------------------------------------------------------


def format_text(result: dict, analysis: dict) -> str:
    """The terminal summary: endpoints, a markdown table per metric, the verdict last."""
    lines = [(f"pagoda bench ab: {', '.join(e['name'] for e in analysis['endpoints'])} "
             f"(baseline {analysis['baseline']})"), ""]
    endpoint_rows = [[e["name"], e.get("url") or "-", e.get("label") or "-",
                      _hardware_text(e.get("hardware"))] for e in analysis["endpoints"]]
    lines += [markdown_table(["endpoint", "URL", "label", "hardware"], endpoint_rows), ""]
    for title, header, rows in sections(analysis):
        lines += [f"{title}:", markdown_table(header, rows), ""]
    lines += [DIFFERS_NOTE + ".", *_pairing(analysis), ""]
    lines.append(textwrap.fill("Verdict: " + analysis["verdict"], width=100))
    return "\n".join(lines)


def _hardware_text(hardware) -> str:
    if not hardware:
        return "-"
    if isinstance(hardware, dict):
        return ", ".join(f"{k}: {v if isinstance(v, (str, int, float)) else json.dumps(v)}"
                         for k, v in hardware.items())
    return str(hardware)


# ---- HTML --------------------------------------------------------------------------------------

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
.verdict { background: #f3f7ff; border-left: 5px solid #1f77b4; padding: 0.8em 1.2em;
           font-size: 1.1em; line-height: 1.5; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
td.text { text-align: left; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; }
.note { color: #555; font-size: 0.9em; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
"""


def _table(header: list[str], rows: list[list[str]], text_columns: int = 1) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f'<td{" class=text" if i < text_columns else ""}>{esc(c)}</td>'
                         for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _charts(result: dict, names: list[str]) -> str:
    requests = [r for r in result.get("requests") or [] if r.get("success")]

    def value(r: dict, key: str) -> float | None:
        if key == "tpot":  # recomputed as the analysis does, from the fields it comes from
            return time_per_output_token(r.get("latency"), r.get("ttft"), r.get("output_tokens"))
        return r.get(key)

    def values(name: str, key: str) -> list[float]:
        return [value(r, key) * 1000 for r in requests
                if r.get("endpoint") == name and isinstance(value(r, key), (int, float))]

    svgs = [chart([cdf_series(n, values(n, key)) for n in names], f"{title} CDF",
                  f"{title} (ms)", "fraction of requests", y_range=(0.0, 1.0))
            for title, key in CDF_PLOTS]
    over_time = []
    for n in names:
        points = [(r["start"], r["ttft"] * 1000) for r in requests if r.get("endpoint") == n
                  and isinstance(r.get("start"), (int, float))
                  and isinstance(r.get("ttft"), (int, float))]
        over_time.append(Series(n, [p[0] for p in points], [p[1] for p in points]))
    svgs.append(chart(over_time, "TTFT over the run", "request start (s after the run began)",
                      "TTFT (ms)", kind="scatter"))
    return '<div class="charts">' + "".join(svgs) + "</div>"


def _errors_html(result: dict, names: list[str]) -> str:
    failed = [r for r in result.get("requests") or [] if not r.get("success")]
    if not failed:
        return "<p>No request failed.</p>"
    firsts: dict[tuple[str, str], dict] = {}
    counts: dict[tuple[str, str], int] = {}
    for r in failed:
        group = (str(r.get("endpoint")), str(r.get("error_kind") or "unknown"))
        counts[group] = counts.get(group, 0) + 1
        firsts.setdefault(group, r)
    order = sorted(firsts, key=lambda g: (names.index(g[0]) if g[0] in names else len(names), g[1]))
    rows = [[name, kind, str(counts[(name, kind)]), str(firsts[(name, kind)].get("key")),
             str(firsts[(name, kind)].get("http_status") or "-"),
             str(firsts[(name, kind)].get("error") or "")[:300]] for name, kind in order]
    return ("<p>The first failure of each kind, per endpoint:</p>"
            + _table(["endpoint", "kind", "count", "first key", "HTTP status", "error"], rows,
                     text_columns=6))


def render_html(result: dict, analysis: dict) -> str:
    """The whole page as one string: verdict, endpoints, tables with intervals, CDFs of
    TTFT, TPOT and E2E latency, TTFT over the run, errors, and how it was measured."""
    esc = html.escape
    names = [e["name"] for e in analysis["endpoints"]]
    title = f"pagoda bench ab: {' vs '.join(names)}"
    endpoint_rows = [[e["name"], e.get("label") or "-", e.get("url") or "-",
                      _hardware_text(e.get("hardware")),
                      "-" if e.get("cost_per_hour") is None else f"{e['cost_per_hour']:g}/h"]
                     for e in analysis["endpoints"]]
    setup = {"config": result.get("config"), "host": result.get("host"),
             "confidence": analysis["confidence"], "resamples": analysis["resamples"],
             "seed": analysis["seed"], "rules": analysis.get("rules")}
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        (f'<p class="note">{esc(str(result.get("date") or ""))} '
        f'baseline: {esc(analysis["baseline"])}</p>'),
        f'<div class="verdict"><strong>Verdict.</strong> {esc(analysis["verdict"])}</div>',
        "<h2>Endpoints</h2>",
        _table(["endpoint", "label", "URL", "hardware", "cost"], endpoint_rows, text_columns=5),
    ]
    for section_title, header, rows in sections(analysis):
        parts += [f"<h2>{esc(section_title)}</h2>", _table(header, rows)]
    parts += [(f'<p class="note">{esc(DIFFERS_NOTE)}. '
              f'{esc(" ".join(_pairing(analysis)))}</p>'),
              "<h2>Latency distributions and over time</h2>", _charts(result, names),
              "<h2>Errors</h2>", _errors_html(result, names),
              "<h2>How it was measured</h2>",
              f"<pre>{esc(json.dumps(setup, indent=1, default=str))}</pre>", "</body></html>"]
    return "\n".join(parts)
