"""Uncertainty for every number a report compares: paired percentile bootstrap over evaluation windows.

The unit resampled is one held-out window (ctx tokens scored against the same window's float logits): tokens
inside a window are not independent, windows nearly are. Two twins scored on the same windows are compared
*paired*: each resample draws the same windows for both, so the interval of their difference reflects only
how the difference varies from window to window, not how hard each window is. scipy's `bootstrap` would do
the resampling too, but it is not a dependency and the statistics here (ratios of means, exp of mean
differences, the max over heads of per-head means) are a few lines of numpy each.

A verdict is given only where the 95% interval excludes "no difference"; otherwise the difference is "not
resolved", whatever its point estimate.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

LEVEL = 0.95
RESAMPLES = 2000
SEED = 0  # the bootstrap's own seed: the same numbers give the same interval on every run
# Below this many windows (or points) no interval is given, so no verdict: in benchmarks/results/interval_width.json
# the 8-window interval of a delta-perplexity difference excluded both the 16- and the 256-window estimates (8 units
# give the bootstrap few distinct resamples). An interval covers the spread between the scored windows, not the
# choice of text: that file's prefixes of 128 windows (few files) excluded the 256-window ratio in 2 of 3 schemes,
# which is why evaluation spreads its windows over the whole split (calib_data.splits.eval_windows).
MIN_UNITS = 16

NOT_RESOLVED = "not resolved"


def resamples(n: int, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """[resamples, n] indices into n units, drawn with replacement (the same for every statistic of one run)."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def interval(stat: Callable[..., np.ndarray], *arrays: np.ndarray, level: float = LEVEL,
             n_resamples: int = RESAMPLES, seed: int = SEED) -> list[float] | None:
    """Percentile bootstrap interval of `stat(*arrays)`, all arrays resampled along axis 0 with the same indices
    (paired). `stat` takes arrays with a leading resample axis: [R, n, ...] -> [R]. None below MIN_UNITS units:
    no interval, so no verdict."""
    arrays = tuple(np.asarray(a, dtype=np.float64) for a in arrays)
    n = len(arrays[0])
    if n < MIN_UNITS or any(len(a) != n for a in arrays):
        return None
    idx = resamples(n, n_resamples, seed)
    values = np.asarray(stat(*(a[idx] for a in arrays)), dtype=np.float64)
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    tail = 100 * (1 - level) / 2
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))]


def interval_unpaired(stat: Callable[..., np.ndarray], a: tuple, b: tuple, level: float = LEVEL,
                      n_resamples: int = RESAMPLES, seed: int = SEED) -> list[float] | None:
    """As `interval`, for two groups of units that do not pair (two models that tokenized the text differently):
    each group is resampled on its own. `stat(*a_resampled, *b_resampled)`."""
    a = tuple(np.asarray(x, dtype=np.float64) for x in a)
    b = tuple(np.asarray(x, dtype=np.float64) for x in b)
    if min(len(a[0]), len(b[0])) < MIN_UNITS:
        return None
    ia, ib = resamples(len(a[0]), n_resamples, seed), resamples(len(b[0]), n_resamples, seed + 1)
    values = np.asarray(stat(*(x[ia] for x in a), *(x[ib] for x in b)), dtype=np.float64)
    values = values[np.isfinite(values)]
    tail = 100 * (1 - level) / 2
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))] if len(values) else None


def mean_interval(x) -> list[float] | None:
    return interval(lambda a: a.mean(axis=1), x)


def ratio_of_means(num, den) -> tuple[float, list[float] | None]:
    """mean(num) / mean(den), paired by unit."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    point = float(num.mean() / den.mean()) if den.mean() > 0 else float("nan")
    return point, interval(lambda a, b: a.mean(axis=1) / b.mean(axis=1), num, den)


def delta_ppl_pct(nll, ref_nll) -> tuple[float, list[float] | None]:
    """100 * (ppl / ref_ppl - 1) from per-window mean NLLs (windows hold equal token counts, so the mean of window
    means is the token mean): exp of the mean NLL difference."""
    d = np.asarray(nll, dtype=np.float64) - np.asarray(ref_nll, dtype=np.float64)
    return float(100 * np.expm1(d.mean())), interval(lambda a: 100 * np.expm1(a.mean(axis=1)), d)


def direction(ci: list[float] | None, null: float) -> int:
    """+1 when the interval lies above `null`, -1 below, 0 when it holds it (or is missing)."""
    if ci is None:
        return 0
    return 1 if ci[0] > null else -1 if ci[1] < null else 0


def resolved(ci: list[float] | None, null: float, below: str, above: str) -> str:
    """The verdict an interval supports: `below` when it lies below `null`, `above` when above, else not resolved."""
    d = direction(ci, null)
    return below if d < 0 else above if d > 0 else NOT_RESOLVED


def correlation_intervals(x, y) -> dict:
    """Pearson and Spearman correlation of paired points, each with a bootstrap interval over points."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)

    def pearson(a, b):
        a, b = a - a.mean(axis=-1, keepdims=True), b - b.mean(axis=-1, keepdims=True)
        den = np.sqrt((a * a).sum(axis=-1) * (b * b).sum(axis=-1))
        with np.errstate(invalid="ignore", divide="ignore"):
            return (a * b).sum(axis=-1) / den

    def ranks(a):  # average ranks, so ties (a resample repeats points) rank alike: O(n^2), n is a few dozen
        below = (a[..., None, :] < a[..., :, None]).sum(axis=-1)
        equal = (a[..., None, :] == a[..., :, None]).sum(axis=-1)
        return below + (equal + 1) / 2.0

    return {"pearson": float(pearson(x, y)), "pearson_ci95": interval(pearson, x, y),
            "spearman": float(pearson(ranks(x), ranks(y))),
            "spearman_ci95": interval(lambda a, b: pearson(ranks(a), ranks(b)), x, y), "n": int(len(x))}


def across_seeds(values) -> dict:
    """Mean, spread and a t interval of one number measured once per seed (the seeds are the units here)."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=np.float64)
    out = {"n": int(len(v)), "values": v.tolist()}
    if not len(v):
        return out
    out |= {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max())}
    if len(v) >= 2:
        from math import sqrt
        half = T_975[min(len(v) - 1, len(T_975)) - 1] * float(v.std(ddof=1)) / sqrt(len(v))
        out |= {"sd": float(v.std(ddof=1)), "ci95": [out["mean"] - half, out["mean"] + half]}
    return out


# Student t 97.5% quantiles for 1..10 degrees of freedom (then 10's, a slight overstatement beyond)
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def cell_intervals(per_window: dict) -> dict:
    """95% intervals of one scored artifact's KLD, delta perplexity (%) and top-1 agreement, over its windows."""
    return {"kld_mean_ci95": mean_interval(per_window["kld"]),
            "delta_ppl_pct_ci95": delta_ppl_pct(per_window["nll"], per_window["ref_nll"])[1],
            "top1_agreement_ci95": mean_interval(per_window["top1"])}
