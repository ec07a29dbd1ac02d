"""Figures of benchmark results (matplotlib, Agg backend: no display needed).

- `plot_serve`: CDFs of TTFT, TPOT, ITL and end-to-end latency, one line per run; for a
  sweep also output throughput against median and P99 latency, one point per run.
- `plot_compare`: output tokens/s of every run as bars, the TTFT and TPOT CDFs of every
  serving run, and throughput against mean TPOT per result file.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagoda.bench.report import columns, run_label

CDF_PANELS = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "latency"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _values_ms(requests: Sequence[dict], key: str) -> list[float]:
    values: list[float] = []
    for r in requests:
        if not r["success"]:
            continue
        v = r.get(key)
        if isinstance(v, list):
            values.extend(v)
        elif v is not None:
            values.append(v)
    return [v * 1000 for v in values]


def _cdf(ax, values: Sequence[float], label: str) -> None:
    if not values:
        return
    x = np.sort(np.asarray(values))
    y = np.arange(1, len(x) + 1) / len(x)
    x, y = np.concatenate([x[:1], x]), np.concatenate([[0.0], y])  # the curve starts at 0
    ax.step(x, y, where="post", label=label)


def _save(fig, path: str) -> None:
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise ValueError(f"--plot {path}: cannot write it ({e.strerror})") from None
    finally:
        _pyplot().close(fig)


def plot_serve(result: dict, path: str) -> None:
    plt = _pyplot()
    runs = result["runs"]
    sweep = len(runs) > 1
    ncols = 3 if sweep else 2
    fig, axes = plt.subplots(2, ncols, figsize=(5 * ncols, 8), squeeze=False)
    cdf_axes = [axes[0][0], axes[0][1], axes[1][0], axes[1][1]]
    for ax, (title, key) in zip(cdf_axes, CDF_PANELS):
        for run in runs:
            _cdf(ax, _values_ms(run["requests"], key), run_label(run))
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if key != "itl" else "fraction of gaps")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    if sweep:
        for ax, (title, key) in zip((axes[0][2], axes[1][2]),
                                    (("TTFT", "ttft_s"), ("TPOT", "tpot_s"))):
            x = [run["summary"]["output_throughput"] for run in runs]
            for stat, style in (("median", "o-"), ("p99", "s--")):
                y = [_ms_or_nan(run["summary"][key][stat]) for run in runs]
                ax.plot(x, y, style, label=f"{title} {stat}")
            for run, xi, yi in zip(runs, x, (_ms_or_nan(r["summary"][key]["median"]) for r in runs)):
                ax.annotate(run_label(run), (xi, yi), fontsize="x-small",
                            textcoords="offset points", xytext=(3, 3))
            ax.set_title(f"throughput vs {title}")
            ax.set_xlabel("output tokens/s")
            ax.set_ylabel("ms")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    config = result.get("config", {})
    fig.suptitle(f"pagoda bench serve: {config.get('model')} @ {config.get('base_url')}, "
                 f"dataset {config.get('dataset')}", fontsize="medium")
    fig.tight_layout()
    _save(fig, path)


def _ms_or_nan(value: float | None) -> float:
    return float("nan") if value is None else value * 1000


def plot_compare(results: Sequence[tuple[str, dict]], path: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    cols = columns(results)
    ax = axes[0][0]
    labels = [label for label, _, _ in cols]
    values = [s.get("output_throughput") or 0.0 for _, s, _ in cols]
    ax.barh(range(len(cols)), values)
    ax.set_yticks(range(len(cols)), labels, fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel("output tokens/s")
    ax.set_title("output throughput")
    ax.grid(alpha=0.3, axis="x")
    serve_runs = [(f"{label} {run_label(run)}" if len(result["runs"]) > 1 else label, run)
                  for label, result in results if result["kind"] == "serve"
                  for run in result["runs"]]
    for ax, (title, key) in zip((axes[0][1], axes[1][0]), (CDF_PANELS[0], CDF_PANELS[1])):
        for label, run in serve_runs:
            _cdf(ax, _values_ms(run["requests"], key), label)
        ax.set_title(f"{title} CDF (serving runs)")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
        if serve_runs:
            ax.legend(fontsize="x-small")
        else:
            ax.text(0.5, 0.5, "no serving runs", ha="center", transform=ax.transAxes)
    ax = axes[1][1]
    for label, result in results:
        if result["kind"] != "serve":
            continue
        runs = result["runs"]
        x = [run["summary"]["output_throughput"] for run in runs]
        y = [_ms_or_nan(run["summary"]["tpot_s"]["mean"]) for run in runs]
        ax.plot(x, y, "o-", label=label)
        for run, xi, yi in zip(runs, x, y):
            ax.annotate(run_label(run), (xi, yi), fontsize="x-small",
                        textcoords="offset points", xytext=(3, 3))
    ax.set_title("throughput vs mean TPOT (serving runs)")
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("ms")
    ax.grid(alpha=0.3)
    if serve_runs:
        ax.legend(fontsize="small")
    fig.tight_layout()
    _save(fig, path)
