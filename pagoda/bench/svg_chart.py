"""Small inline SVG charts for self-contained HTML reports: CDF step lines and scatter plots
with axes, ticks and a legend. No dependencies, no scripts, no external references.

The SVG is meant to sit inside an HTML5 page (no XML namespace needed there). Every string
that reaches the SVG (titles, labels, series names) is escaped here.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf",
          "#7f7f7f")
WIDTH, HEIGHT = 560, 330
_LEFT, _RIGHT, _TOP, _BOTTOM = 60, 16, 30, 70
MAX_POINTS = 4000
"""Per series: longer ones are thinned evenly (a CDF keeps its shape, a scatter its trend)."""


@dataclass
class Series:
    name: str
    xs: Sequence[float]
    ys: Sequence[float]


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low]
    raw = (high - low) / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks, t = [], first
    while t <= high + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    return ticks


def _label(value: float) -> str:
    return f"{value:g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.1e}"


def _thin(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    if len(xs) <= MAX_POINTS:
        return list(xs), list(ys)
    step = len(xs) / MAX_POINTS
    picks = sorted({int(i * step) for i in range(MAX_POINTS)} | {len(xs) - 1})
    return [xs[i] for i in picks], [ys[i] for i in picks]


def chart(series: Sequence[Series], title: str, x_label: str, y_label: str,
          kind: str = "line", y_range: tuple[float, float] | None = None) -> str:
    """One <svg>: kind 'line' (a step line per series, for CDFs) or 'scatter'."""
    if kind not in ("line", "scatter"):
        raise ValueError(f"kind must be 'line' or 'scatter', got {kind!r}")
    esc = html.escape
    all_x = [x for s in series for x in s.xs if math.isfinite(x)]
    all_y = [y for s in series for y in s.ys if math.isfinite(y)]
    parts = [(f'<svg class="chart" width="{WIDTH}" height="{HEIGHT}" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{esc(title)}">'),
             (f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="14" '
             f'font-weight="bold">{esc(title)}</text>')]
    if not all_x:
        parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" '
                     'font-size="13">no data</text></svg>')
        return "".join(parts)
    x_low, x_high = min(0.0, min(all_x)), max(all_x)
    y_low, y_high = y_range or (min(0.0, min(all_y)), max(all_y))
    x_high = x_high if x_high > x_low else x_low + 1.0
    y_high = y_high if y_high > y_low else y_low + 1.0
    plot_w, plot_h = WIDTH - _LEFT - _RIGHT, HEIGHT - _TOP - _BOTTOM

    def px(x: float) -> float:
        return _LEFT + (x - x_low) / (x_high - x_low) * plot_w

    def py(y: float) -> float:
        return _TOP + plot_h - (y - y_low) / (y_high - y_low) * plot_h

    parts.append(f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" '
                 'fill="none" stroke="#999"/>')
    for t in nice_ticks(x_low, x_high):
        parts.append(f'<line x1="{px(t):.1f}" y1="{_TOP}" x2="{px(t):.1f}" '
                     f'y2="{_TOP + plot_h}" stroke="#eee"/>'
                     f'<text x="{px(t):.1f}" y="{_TOP + plot_h + 14}" text-anchor="middle" '
                     f'font-size="11">{_label(t)}</text>')
    for t in nice_ticks(y_low, y_high):
        parts.append(f'<line x1="{_LEFT}" y1="{py(t):.1f}" x2="{_LEFT + plot_w}" '
                     f'y2="{py(t):.1f}" stroke="#eee"/>'
                     f'<text x="{_LEFT - 5}" y="{py(t) + 4:.1f}" text-anchor="end" '
                     f'font-size="11">{_label(t)}</text>')
    parts.append(f'<text x="{_LEFT + plot_w / 2}" y="{_TOP + plot_h + 32}" '
                 f'text-anchor="middle" font-size="12">{esc(x_label)}</text>'
                 f'<text x="14" y="{_TOP + plot_h / 2}" text-anchor="middle" font-size="12" '
                 f'transform="rotate(-90 14 {_TOP + plot_h / 2})">{esc(y_label)}</text>')
    for i, s in enumerate(series):
        color = COLORS[i % len(COLORS)]
        xs, ys = _thin(s.xs, s.ys)
        if kind == "line" and xs:
            points = [f"{px(xs[0]):.1f},{py(y_low):.1f}"]
            for j, (x, y) in enumerate(zip(xs, ys)):
                previous = ys[j - 1] if j else y_low
                points.append(f"{px(x):.1f},{py(previous):.1f} {px(x):.1f},{py(y):.1f}")
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" '
                         f'points="{" ".join(points)}"/>')
        elif kind == "scatter":
            parts.append(f'<g fill="{color}" fill-opacity="0.55">' + "".join(
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2"/>'
                for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)) + "</g>")
        legend_x = _LEFT + 8 + 130 * (i % 4)
        legend_y = HEIGHT - 20 + 14 * (i // 4) - (14 if len(series) > 4 else 0)
        parts.append(f'<rect x="{legend_x}" y="{legend_y - 9}" width="12" height="10" '
                     f'fill="{color}"/><text x="{legend_x + 16}" y="{legend_y}" '
                     f'font-size="12">{esc(s.name[:18])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def cdf_series(name: str, values: Sequence[float]) -> Series:
    """The empirical CDF of `values` as a step line's corners."""
    xs = sorted(v for v in values if math.isfinite(v))
    return Series(name, xs, [(i + 1) / len(xs) for i in range(len(xs))])
