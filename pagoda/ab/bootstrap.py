"""Percentile-bootstrap intervals for relative differences between two samples: pure numpy.

A draw is a whole resample (with replacement) of the requests; its statistic is computed on
every row of a (draws, n) matrix at once, in blocks of about `_BLOCK_ELEMENTS` values so that
memory stays bounded. Paired samples (a[i] and b[i] are the same request) share each row's
indices; unpaired samples are drawn on their own. Pooled statistics (every ITL gap of every
request) draw whole requests and read each draw's percentile off per-request histograms on
shared bins. The interval of statistic(b) / statistic(a) - 1 is the `confidence` central
range of the draws' ratios (the percentile bootstrap, invariant to monotone transforms).

*Clustered* draws (`clusters`: a label per value, e.g. the block of a replay a request ran
in) pick whole clusters with replacement, as many as there are, and weigh each value by how
often its cluster was drawn: requests that ran in the same minutes share that minute's
machine (other load, a cache warming), so they are not independent and drawing them one by
one would make the interval too narrow. A weighted draw's percentile is the lower nearest
rank of the weighted values (its mean, the weighted mean).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

ITL_BINS = 1024
"""Equal-count bins of the pooled-gap histograms."""
_BLOCK_ELEMENTS = 2_000_000
"""Draws are made in blocks of about this many values, to bound memory."""


def _percent(statistic: str) -> float | None:
    """'median' -> 50, 'p95' -> 95, 'mean' -> None."""
    if statistic == "mean":
        return None
    if statistic == "median":
        return 50.0
    if statistic.startswith("p"):
        try:
            value = float(statistic[1:])
        except ValueError:
            value = -1.0
        if 0 <= value <= 100:
            return value
    raise ValueError(f"unknown statistic {statistic!r}; use mean, median or pNN (e.g. p95)")


def _row_statistic(sorted_rows: np.ndarray, statistic: str) -> np.ndarray:
    """The statistic of each row of an array sorted along its last axis (numpy's linear
    percentile)."""
    q = _percent(statistic)
    if q is None:
        return sorted_rows.mean(axis=-1)
    n = sorted_rows.shape[-1]
    h = q / 100.0 * (n - 1)
    lo = math.floor(h)
    hi = min(lo + 1, n - 1)
    return sorted_rows[..., lo] + (h - lo) * (sorted_rows[..., hi] - sorted_rows[..., lo])


def _draw_blocks(n: int, resamples: int, rng: np.random.Generator, rows: int | None = None):
    """Index matrices (rows, n) of draws with replacement, `resamples` rows in all."""
    rows = rows or max(1, _BLOCK_ELEMENTS // max(n, 1))
    for start in range(0, resamples, rows):
        yield rng.integers(0, n, size=(min(rows, resamples - start), n))


def _side_statistics(values: np.ndarray, statistics: Sequence[str], draws) -> dict:
    out = {s: [] for s in statistics}
    for idx in draws:
        rows = np.sort(values[idx], axis=1)
        for s in statistics:
            out[s].append(_row_statistic(rows, s))
    return {s: np.concatenate(v) for s, v in out.items()}


def cluster_weights(clusters: Sequence, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """(resamples, n) float32: how often each of the n values is drawn when as many whole
    clusters as there are are drawn with replacement; `clusters` labels each value (any
    hashable labels)."""
    numbers: dict = {}
    inverse = np.array([numbers.setdefault(label, len(numbers)) for label in clusters],
                       dtype=np.int64)
    m = len(numbers)
    idx = rng.integers(0, m, size=(resamples, m))
    offsets = (np.arange(resamples) * m)[:, None]
    counts = np.bincount((idx + offsets).ravel(), minlength=resamples * m).reshape(resamples, m)
    return counts[:, inverse].astype(np.float32)


def _weighted_statistic(sorted_values: np.ndarray, weights: np.ndarray,
                        statistic: str) -> np.ndarray:
    """Each row's statistic of `sorted_values` (ascending) weighted by that row of
    `weights` (in the same order); percentiles by the lower nearest rank."""
    total = weights.sum(axis=1)
    q = _percent(statistic)
    if q is None:
        with np.errstate(divide="ignore", invalid="ignore"):
            return (weights @ sorted_values) / total
    cumulative = np.cumsum(weights, axis=1)
    target = np.maximum(q / 100.0 * total, 1e-9)  # q = 0: the first value drawn
    k = np.minimum((cumulative < target[:, None]).sum(axis=1), len(sorted_values) - 1)
    return sorted_values[k]


def _clustered_statistics(a: np.ndarray, b: np.ndarray, statistics: Sequence[str],
                          paired: bool, resamples: int, rng: np.random.Generator,
                          clusters: tuple[Sequence, Sequence]) -> tuple[dict, dict]:
    """The draws of bootstrap_statistics, drawing whole clusters (module docstring)."""
    order_a, order_b = np.argsort(a), np.argsort(b)
    sorted_a, sorted_b = a[order_a], b[order_b]
    draws_a, draws_b = {s: [] for s in statistics}, {s: [] for s in statistics}
    rows = max(1, _BLOCK_ELEMENTS // max(len(a), len(b), 1))
    for start in range(0, resamples, rows):
        count = min(rows, resamples - start)
        weights_a = cluster_weights(clusters[0], count, rng)
        weights_b = weights_a if paired else cluster_weights(clusters[1], count, rng)
        for s in statistics:
            draws_a[s].append(_weighted_statistic(sorted_a, weights_a[:, order_a], s))
            draws_b[s].append(_weighted_statistic(sorted_b, weights_b[:, order_b], s))
    return ({s: np.concatenate(v) for s, v in draws_a.items()},
            {s: np.concatenate(v) for s, v in draws_b.items()})


def bootstrap_statistics(a: Sequence[float], b: Sequence[float], statistics: Sequence[str],
                         paired: bool, resamples: int, rng: np.random.Generator,
                         clusters: tuple[Sequence, Sequence] | None = None) -> dict:
    """{statistic: (stat(a), stat(b), draws of stat(a), draws of stat(b))}. `clusters`:
    (labels of a's values, labels of b's values) to draw whole clusters (paired: a's
    labels serve both)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if paired and len(a) != len(b):
        raise ValueError(f"paired samples must have the same length, got {len(a)} and {len(b)}")
    if clusters is not None:
        draws_a, draws_b = _clustered_statistics(a, b, statistics, paired, resamples, rng,
                                                 clusters)
    elif paired:
        draws_a, draws_b = {s: [] for s in statistics}, {s: [] for s in statistics}
        for idx in _draw_blocks(len(a), resamples, rng):
            rows_a, rows_b = np.sort(a[idx], axis=1), np.sort(b[idx], axis=1)
            for s in statistics:
                draws_a[s].append(_row_statistic(rows_a, s))
                draws_b[s].append(_row_statistic(rows_b, s))
        draws_a = {s: np.concatenate(v) for s, v in draws_a.items()}
        draws_b = {s: np.concatenate(v) for s, v in draws_b.items()}
    else:
        draws_a = _side_statistics(a, statistics, _draw_blocks(len(a), resamples, rng))
        draws_b = _side_statistics(b, statistics, _draw_blocks(len(b), resamples, rng))
    sorted_a, sorted_b = np.sort(a), np.sort(b)
    return {s: (float(_row_statistic(sorted_a, s)), float(_row_statistic(sorted_b, s)),
                draws_a[s], draws_b[s]) for s in statistics}


def interval(samples: np.ndarray, confidence: float) -> tuple[float, float] | None:
    finite = samples[np.isfinite(samples)]
    if len(finite) < 0.99 * len(samples) or not len(finite):
        return None  # too many draws with a zero baseline: no honest interval
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(finite, [tail, 1.0 - tail])
    return float(low), float(high)


def _normal_quantile(p: float) -> float:
    """The standard normal's quantile (bisection on erf: no scipy needed)."""
    low, high = -10.0, 10.0
    for _ in range(100):
        mid = (low + high) / 2.0
        if 0.5 * (1.0 + math.erf(mid / math.sqrt(2.0))) < p:
            low = mid
        else:
            high = mid
    return (low + high) / 2.0


def few_clusters_widening(num_clusters: int, confidence: float) -> float:
    """How much wider a clustered interval is drawn than the bootstrap gives it: drawing m
    clusters underestimates the spread by (m - 1) / m in variance, and a mean of m cluster
    means follows Student's t with m - 1 degrees of freedom, not the normal (the quantile
    from the Cornish-Fisher series in 1/dof). 12 clusters at 95%: ~1.18."""
    if num_clusters < 3:
        return math.inf
    z = _normal_quantile(0.5 + confidence / 2.0)
    dof = num_clusters - 1
    t = z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)
    return math.sqrt(num_clusters / dof) * t / z


def widened(draws: np.ndarray, point: float, factor: float) -> np.ndarray:
    """The draws moved to center on the point estimate (their median on it: a weighted
    draw's nearest-rank percentile sits a little off the interpolated point) and spread
    `factor` times farther from it."""
    finite = draws[np.isfinite(draws)]
    center = float(np.median(finite)) if len(finite) else point
    return point + (draws - center) * factor


def relative_draws(numerator, denominator):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(numerator, dtype=np.float64) / denominator - 1.0


def bootstrap_ratio_ci(a: Sequence[float], b: Sequence[float], statistic: str, paired: bool,
                       confidence: float = 0.95, resamples: int = 2000,
                       rng: np.random.Generator | None = None
                       ) -> tuple[float | None, float | None, float | None]:
    """statistic(b) / statistic(a) - 1 and its percentile-bootstrap interval, as
    (point, low, high). `statistic`: 'mean', 'median' or 'pNN'. Paired: a[i] and b[i] are
    the same request, drawn together; unpaired: each side drawn on its own. (None, None,
    None) when a side has fewer than two values or statistic(a) is zero."""
    rng = rng if rng is not None else np.random.default_rng(0)
    if len(a) < 2 or len(b) < 2:
        return None, None, None
    stat_a, stat_b, draws_a, draws_b = bootstrap_statistics(
        a, b, [statistic], paired, resamples, rng)[statistic]
    if stat_a == 0:
        return None, None, None
    bounds = interval(relative_draws(draws_b, draws_a), confidence)
    low, high = bounds if bounds else (None, None)
    return stat_b / stat_a - 1.0, low, high


def pooled_bootstrap(clusters_a: Sequence[Sequence[float]], clusters_b: Sequence[Sequence[float]],
                     statistics: Sequence[str], paired: bool, resamples: int,
                     rng: np.random.Generator,
                     labels: tuple[Sequence, Sequence] | None = None) -> dict:
    """Like bootstrap_statistics for statistics of pooled values (every ITL gap), drawing
    whole clusters (requests; with `labels`, a label per request as bootstrap_statistics'
    `clusters`: whole groups of requests). Each draw's percentile is read off per-cluster
    histograms on shared equal-count bins: counts (rows, clusters) @ histograms (clusters,
    bins)."""
    pooled_a = np.concatenate([np.asarray(c, dtype=np.float64) for c in clusters_a] or [[]])
    pooled_b = np.concatenate([np.asarray(c, dtype=np.float64) for c in clusters_b] or [[]])
    edges = np.unique(np.quantile(np.concatenate([pooled_a, pooled_b]),
                                  np.linspace(0.0, 1.0, ITL_BINS + 1)))
    if len(edges) < 2:
        edges = np.array([edges[0], edges[0] + 1e-12])

    def prepare(clusters):
        num_bins = len(edges) - 1
        hist = np.zeros((len(clusters), num_bins), dtype=np.float32)
        sums = np.zeros(len(clusters))
        for i, c in enumerate(clusters):
            c = np.asarray(c, dtype=np.float64)
            bins = np.clip(np.searchsorted(edges, c, side="right") - 1, 0, num_bins - 1)
            hist[i] = np.bincount(bins, minlength=num_bins)
            sums[i] = c.sum()
        return hist, sums

    def statistics_of(weights, hist, sums):  # weights: (rows, clusters) draw counts
        counts = weights @ hist                                  # (rows, bins)
        total = counts.sum(axis=1)
        cumulative = np.cumsum(counts, axis=1)
        out = {}
        for s in statistics:
            q = _percent(s)
            if q is None:
                with np.errstate(divide="ignore", invalid="ignore"):
                    out[s] = (weights @ sums) / total
                continue
            target = q / 100.0 * total
            k = np.minimum((cumulative < target[:, None]).sum(axis=1), counts.shape[1] - 1)
            rows = np.arange(len(k))
            before = np.where(k > 0, cumulative[rows, np.maximum(k - 1, 0)], 0.0)
            with np.errstate(divide="ignore", invalid="ignore"):
                inside = np.clip((target - before) / counts[rows, k], 0.0, 1.0)
            out[s] = edges[k] + np.nan_to_num(inside) * (edges[k + 1] - edges[k])
        return out

    def weights_of(idx, n):
        offsets = (np.arange(idx.shape[0]) * n)[:, None]
        return np.bincount((idx + offsets).ravel(), minlength=idx.shape[0] * n).reshape(
            idx.shape[0], n).astype(np.float32)

    hist_a, sums_a = prepare(clusters_a)
    hist_b, sums_b = prepare(clusters_b)
    draws_a: dict[str, list] = {s: [] for s in statistics}
    draws_b: dict[str, list] = {s: [] for s in statistics}
    n_a, n_b = len(clusters_a), len(clusters_b)
    rows = max(1, _BLOCK_ELEMENTS // max(n_a, n_b, ITL_BINS))
    blocks_a = _draw_blocks(n_a, resamples, rng, rows)
    blocks_b = None if paired else _draw_blocks(n_b, resamples, rng, rows)
    for idx_a in blocks_a:
        idx_b = idx_a if paired else next(blocks_b)
        if labels is None:
            weights_a, weights_b = weights_of(idx_a, n_a), weights_of(idx_b, n_b)
        else:
            weights_a = cluster_weights(labels[0], len(idx_a), rng)
            weights_b = weights_a if paired else cluster_weights(labels[1], len(idx_a), rng)
        for draws, weights, hist, sums in ((draws_a, weights_a, hist_a, sums_a),
                                           (draws_b, weights_b, hist_b, sums_b)):
            for s, v in statistics_of(weights, hist, sums).items():
                draws[s].append(v)
    out = {}
    for s in statistics:
        exact = [float(pooled.mean()) if _percent(s) is None
                 else float(np.percentile(pooled, _percent(s))) for pooled in (pooled_a, pooled_b)]
        out[s] = (exact[0], exact[1], np.concatenate(draws_a[s]), np.concatenate(draws_b[s]))
    return out
