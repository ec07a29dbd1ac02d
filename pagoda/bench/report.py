"""Tables for the terminal and for BENCHMARKS.md, and the JSON result files.

Result files share one envelope: {"kind": "serve" | "throughput" | "latency", "engine",
"date", "host", "config", ...}; a serve result holds "runs" (one per request rate or
concurrency of a sweep), each with its "summary" and raw "requests"; the offline kinds hold
one "summary". `bench compare` reads any mix of them. A serve run's summary has
"spec_decode" (pagoda/bench/server_metrics.py) only when the server reported drafts, and
"ttft_by_turn_s" / "ttft_later_turns_s" (pagoda/bench/metrics.py) only for conversations of
more than one turn.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
from collections.abc import Sequence

STAT_KEYS = ("mean", "median", "p90", "p95", "p99")
LATENCY_ROWS = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E latency", "e2el_s"))


def host_info() -> dict:
    import pagoda

    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "pagoda": pagoda.__version__,
            "load_average_at_start": _load_average(), "git": _git_revision()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return info


def _load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: on a shared machine, a sign of contention."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # not on every platform
        return None


def _git_revision() -> str | None:
    """The checkout's commit, with '+dirty' for uncommitted changes; None outside git."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def envelope(kind: str, engine: str, config: dict) -> dict:
    return {"kind": kind, "engine": engine,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "host": host_info(), "config": config}


def write_json(path: str, result: dict) -> None:
    if isinstance(result.get("host"), dict):
        result["host"]["load_average_at_end"] = _load_average()
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, allow_nan=False)
            f.write("\n")
    except OSError as e:
        raise ValueError(f"--output {path}: cannot write it ({e.strerror})") from None


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(result, dict) or result.get("kind") not in ("serve", "throughput", "latency"):
        raise ValueError(f"{path}: not a result of `pagoda bench` (no kind serve/throughput/latency)")
    return result


def rate_label(rate: float | str) -> str:
    return "inf" if rate in ("inf", math.inf) else f"{float(rate):g}"


def run_label(run: dict) -> str:
    """'rate=4', 'conc=16' or 'rate=inf' for one run of a serve result."""
    if run.get("max_concurrency"):
        label = f"conc={run['max_concurrency']}"
        if run.get("request_rate") not in (None, "inf"):
            label += f" rate={rate_label(run['request_rate'])}"
        return label
    return f"rate={rate_label(run.get('request_rate', 'inf'))}"


# ---- terminal ----------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_serve_summary(summary: dict, title: str) -> str:
    width = 60
    lines = [f" {title} ".center(width, "=")]

    def row(name: str, value) -> None:
        lines.append(f"{name:<44}{value:>16}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    if summary["errors_by_kind"]:
        row("  by kind:", ", ".join(f"{k} {v}" for k, v in sorted(summary["errors_by_kind"].items())))
    row("Benchmark duration (s):", f"{summary['duration_s']:.2f}")
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", f"{summary['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{summary['output_throughput']:.1f}")
    row("Total token throughput (tok/s):", f"{summary['total_token_throughput']:.1f}")
    if "goodput" in summary:
        bounds = ", ".join(f"{k}<={v * 1000:g}ms" for k, v in summary["slo_s"].items())
        row(f"Goodput (req/s) [{bounds}]:", f"{summary['goodput']:.2f}")
    if summary.get("num_missing_usage"):
        row("Responses without usage (counted 0 tokens):", summary["num_missing_usage"])
    for model, counts in summary.get("requests_by_model", {}).items():
        row(f"  model {model}:", f"{counts['completed']}/{counts['requests']} req")
    if "cost" in summary:
        cost = summary["cost"]
        row(f"Cost per hour (USD, {cost['source']}):", f"{cost['cost_per_hour']:.4g}")
        row("Cost of the run (USD):", f"{cost['cost_usd']:.4g}")
        for name, key in (("input", "per_million_input_tokens"),
                          ("output", "per_million_output_tokens")):
            if cost[key] is not None:
                row(f"Cost per million {name} tokens (USD):", f"{cost[key]:.4g}")
    if "spec_decode" in summary:
        row("Spec decode acceptance rate:", f"{summary['spec_decode']['acceptance_rate']:.1%}")
        row("Mean accepted length:", f"{summary['spec_decode']['mean_accepted_length']:.2f}")
    lines.append("-" * width)
    lines.append(f"{'Latency (ms)':<12}" + "".join(f"{k:>9}" for k in STAT_KEYS))
    for name, key in LATENCY_ROWS:
        stats = summary[key]
        lines.append(f"{name:<12}" + "".join(f"{_ms(stats[k]):>9}" for k in STAT_KEYS))
    if "ttft_by_turn_s" in summary:
        lines.append("-" * width)
        lines.extend(format_ttft_by_turn(summary))
    lines.append("=" * width)
    return "\n".join(lines)


TURN_STAT_KEYS = ("mean", "median", "p95")


def format_ttft_by_turn(summary: dict) -> list[str]:
    """Lines of the per-turn TTFT table (multi-turn workloads): a row per turn number, then
    one for every turn from the second on."""
    lines = [f"{'TTFT by turn (ms)':<24}{'n':>9}" + "".join(f"{k:>9}" for k in TURN_STAT_KEYS)]
    rows = [(f"turn {t['turn']}", t) for t in summary["ttft_by_turn_s"]]
    later = summary.get("ttft_later_turns_s")
    if later is not None:
        count = sum(t["requests"] for t in summary["ttft_by_turn_s"][1:])
        rows.append(("turns >= 2", {"requests": count, **later}))
    for name, stats in rows:
        lines.append(f"{name:<24}{stats['requests']:>9}"
                     + "".join(f"{_ms(stats[k]):>9}" for k in TURN_STAT_KEYS))
    return lines


def format_sweep(runs: Sequence[dict]) -> str:
    header = ["run", "ok", "failed", "req/s", "out tok/s", "TTFT med ms", "TTFT p99 ms",
              "TPOT med ms", "TPOT p99 ms", "E2E med ms"]
    has_goodput = any("goodput" in r["summary"] for r in runs)
    if has_goodput:
        header.append("goodput req/s")
    has_spec_decode = any("spec_decode" in r["summary"] for r in runs)
    if has_spec_decode:
        header.append("accepted len")
    has_turns = any("ttft_later_turns_s" in r["summary"] for r in runs)
    if has_turns:
        header.append("TTFT p95 turns>=2 ms")
    rows = []
    for run in runs:
        s = run["summary"]
        row = [run_label(run), str(s["completed"]), str(s["failed"]),
               f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
               _ms(s["ttft_s"]["median"]), _ms(s["ttft_s"]["p99"]),
               _ms(s["tpot_s"]["median"]), _ms(s["tpot_s"]["p99"]), _ms(s["e2el_s"]["median"])]
        if has_goodput:
            row.append(f"{s['goodput']:.2f}" if "goodput" in s else "-")
        if has_spec_decode:
            row.append(f"{s['spec_decode']['mean_accepted_length']:.2f}"
                       if "spec_decode" in s else "-")
        if has_turns:
            row.append(_ms((s.get("ttft_later_turns_s") or {}).get("p95")))
        rows.append(row)
    return markdown_table(header, rows)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in rows)])


def format_error_examples(records: Sequence[dict]) -> str:
    """The first failed request of each kind, one line each."""
    failed = [r for r in records if not r["success"]]
    firsts: dict[str, dict] = {}
    for r in failed:
        firsts.setdefault(r["error_kind"], r)
    lines = [f"  request {r['index']}: [{r['error_kind']}] {r['error']}" for r in firsts.values()]
    if len(failed) > len(firsts):
        lines.append(f"  ... {len(failed) - len(firsts)} more failed (all in --output)")
    return "\n".join(lines)


# ---- compare -------------------------------------------------------------------------------------

# (row name, how to read it from a column, digits). Columns are flattened runs (see columns()).
COMPARE_ROWS: list[tuple[str, tuple[str, ...], int]] = [
    ("requests/s", ("request_throughput",), 2),
    ("output tokens/s", ("output_throughput",), 1),
    ("total tokens/s", ("total_token_throughput",), 1),
    ("mean batch size", ("mean_batch_size",), 1),
    ("failed requests", ("failed",), 0),
    ("goodput req/s", ("goodput",), 2),
    ("TTFT mean ms", ("ttft_s", "mean"), 1),
    ("TTFT median ms", ("ttft_s", "median"), 1),
    ("TTFT P99 ms", ("ttft_s", "p99"), 1),
    ("TPOT mean ms", ("tpot_s", "mean"), 2),
    ("TPOT median ms", ("tpot_s", "median"), 2),
    ("TPOT P99 ms", ("tpot_s", "p99"), 2),
    ("ITL P99 ms", ("itl_s", "p99"), 2),
    ("E2E mean ms", ("e2el_s", "mean"), 1),
    ("E2E P99 ms", ("e2el_s", "p99"), 1),
    ("decode tokens/s", ("decode_tokens_per_s", "mean"), 1),
    ("spec acceptance rate", ("spec_decode", "acceptance_rate"), 3),
    ("mean accepted length", ("spec_decode", "mean_accepted_length"), 2),
    ("USD per 1M input tokens", ("cost", "per_million_input_tokens"), 4),
    ("USD per 1M output tokens", ("cost", "per_million_output_tokens"), 4),
]
_MS_ROWS = {"ttft_s", "tpot_s", "itl_s", "e2el_s"}


def columns(results: Sequence[tuple[str, dict]]) -> list[tuple[str, dict, str | None]]:
    """One (label, summary, run key) per offline result and per run of a serve result, grouped
    by run key ('conc=4', 'rate=2', ...; None for offline results) in order of first
    appearance, files in their given order within a group. Offline summaries are mapped onto
    the serve names (requests_per_s -> request_throughput, ...)."""
    flat: list[tuple[str, dict, str | None]] = []
    for label, result in results:
        if result["kind"] == "serve":
            runs = result["runs"]
            for run in runs:
                key = run_label(run)
                name = label if len(runs) == 1 else f"{label} {key}"
                flat.append((name, run["summary"], key))
            continue
        s = dict(result["summary"])
        s.setdefault("request_throughput", s.get("requests_per_s"))
        s.setdefault("output_throughput", s.get("output_tokens_per_s"))
        s.setdefault("total_token_throughput", s.get("total_tokens_per_s"))
        flat.append((label, s, None))
    keys = list(dict.fromkeys(key for _, _, key in flat))
    return [col for key in keys for col in flat if col[2] == key]


def _lookup(summary: dict, path: tuple[str, ...]) -> float | None:
    value = summary
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value if isinstance(value, (int, float)) else None


def turn_compare_rows(summaries: Sequence[dict]) -> list[tuple[str, list[float | None]]]:
    """(row name, value in seconds per summary) of the per-turn TTFT rows: mean, median and
    P95 of every turn number any summary has, then the P95 of the turns from the second on.
    Empty when no summary has per-turn figures."""
    turns = max((len(s.get("ttft_by_turn_s") or []) for s in summaries), default=0)
    rows = []
    for t in range(turns):
        for key, label in (("mean", "mean"), ("median", "median"), ("p95", "P95")):
            values = []
            for s in summaries:
                by_turn = s.get("ttft_by_turn_s") or []
                values.append(by_turn[t][key] if t < len(by_turn) else None)
            rows.append((f"TTFT turn {t + 1} {label} ms", values))
    if turns:
        rows.append(("TTFT turns>=2 P95 ms", [_lookup(s, ("ttft_later_turns_s", "p95"))
                                               for s in summaries]))
    return rows


def compare_table(results: Sequence[tuple[str, dict]]) -> str:
    """Markdown: a row per metric any run has, a column per run, each value with its ratio to
    its reference: the first column of the same run key (the same concurrency or rate, so
    that a sweep is compared point by point), or the first column where there is none.
    Reference columns show no ratio. ×1.00 = the same; for latencies lower is better.
    Multi-turn runs add their per-turn TTFT rows (turn_compare_rows) after the others."""
    cols = columns(results)
    references = []
    for i, (_, _, key) in enumerate(cols):
        same_key = next(j for j, col in enumerate(cols) if col[2] == key)
        references.append(same_key if same_key != i else (0 if key is None and i else None))
    header = ["metric"] + [label for label, _, _ in cols]
    summaries = [summary for _, summary, _ in cols]
    metrics = [(name, [_lookup(summary, path) for summary in summaries], digits,
                1000.0 if path[0] in _MS_ROWS else 1.0)
               for name, path, digits in COMPARE_ROWS]
    metrics += [(name, values, 1, 1000.0) for name, values in turn_compare_rows(summaries)]
    rows = []
    for name, values, digits, scale in metrics:
        if all(v is None for v in values):
            continue
        cells = [name]
        for v, ref in zip(values, references):
            if v is None:
                cells.append("-")
                continue
            cell = f"{v * scale:.{digits}f}"
            base = values[ref] if ref is not None else None
            if base:
                cell += f" (×{v / base:.2f})"
            cells.append(cell)
        rows.append(cells)
    return markdown_table(header, rows)
