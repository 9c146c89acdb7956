"""Uncertainty for every number a report compares: paired percentile bootstrap over documents (or windows).

The unit resampled is one held-out document: the windows cut from one text file (or one WikiText article, one
synthetic chain) share its style and difficulty, so they are not independent, and resampling them one by one
would give intervals too narrow. Each resample draws documents with replacement and keeps every window of each
drawn document (a cluster bootstrap; a masked array carries the unequal counts). Where the windows come from fewer
than MIN_UNITS documents (one long file), the units are blocks of consecutive windows instead (a block bootstrap),
and the report says which. Two twins scored on the same windows are compared *paired*: each resample draws the
same units for both, so the interval of their difference reflects only how the difference varies between units.
scipy's `bootstrap` would do the resampling too, but it is not a dependency and the statistics here (ratios of
means, exp of mean differences, the max over heads of per-head means) are a few lines of numpy each.

A verdict is given only where the interval excludes "no difference" and, over every verdict one report prints,
Holm's step-down correction keeps it (`holm`); otherwise the difference is "not resolved", whatever its point
estimate.
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


def units_of(groups, n: int) -> np.ndarray:
    """The unit each of n windows belongs to: its document where `groups` names at least MIN_UNITS of them, else
    MIN_UNITS blocks of consecutive windows (windows are in text order); with no groups, each window its own."""
    if groups is None:
        return np.arange(n)
    g = np.unique(np.asarray(groups), return_inverse=True)[1].reshape(-1)
    if len(np.unique(g)) >= MIN_UNITS or n < MIN_UNITS:
        return g
    return (np.arange(n) * MIN_UNITS) // n  # MIN_UNITS blocks of (nearly) equal size


def unit_name(groups, n: int) -> str:
    """What `units_of` resamples, in words (the report states it beside every interval)."""
    if groups is None:
        return "window"
    return "document" if len(set(np.asarray(groups).tolist())) >= MIN_UNITS or n < MIN_UNITS else \
        "block of consecutive windows (fewer documents than units)"


def _cluster_index(units: np.ndarray, n_resamples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """([R, L] window indices, [R, L] mask of padding): each row every window of len(units) units drawn with
    replacement, padded to the longest row."""
    members = [np.flatnonzero(units == u) for u in range(units.max() + 1)]
    draws = resamples(len(members), n_resamples, seed)
    rows = [np.concatenate([members[u] for u in row]) for row in draws]
    width = max(len(r) for r in rows)
    idx = np.zeros((n_resamples, width), dtype=np.int64)
    pad = np.ones((n_resamples, width), dtype=bool)
    for i, r in enumerate(rows):
        idx[i, :len(r)], pad[i, :len(r)] = r, False
    return idx, pad


def bootstrap(stat: Callable[..., np.ndarray], *arrays: np.ndarray, groups=None, n_resamples: int = RESAMPLES,
              seed: int = SEED) -> np.ndarray | None:
    """The finite values of `stat` over resamples of the units (documents, see units_of), every array resampled
    along axis 0 with the same draws (paired). `stat` takes arrays with a leading resample axis, [R, n, ...] -> [R]
    (masked where a resample holds fewer windows than the longest). None below MIN_UNITS units."""
    arrays = tuple(np.asarray(a, dtype=np.float64) for a in arrays)
    n = len(arrays[0])
    if n < MIN_UNITS or any(len(a) != n for a in arrays) or (groups is not None and len(groups) != n):
        return None
    units = units_of(groups, n)
    if units.max() + 1 < MIN_UNITS:
        return None
    if groups is None:
        values = stat(*(a[resamples(n, n_resamples, seed)] for a in arrays))
    else:
        idx, pad = _cluster_index(units, n_resamples, seed)
        views = []
        for a in arrays:
            mask = np.broadcast_to(pad.reshape(pad.shape + (1,) * (a.ndim - 1)), idx.shape + a.shape[1:])
            views.append(np.ma.masked_array(a[idx], mask=mask))
        values = stat(*views)
    values = np.ma.filled(np.ma.asarray(values, dtype=np.float64), np.nan)
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    return values if len(values) else None


def percentiles(values: np.ndarray | None, level: float) -> list[float] | None:
    if values is None:
        return None
    tail = 100 * (1 - level) / 2
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))]


def interval(stat: Callable[..., np.ndarray], *arrays: np.ndarray, level: float = LEVEL, groups=None,
             n_resamples: int = RESAMPLES, seed: int = SEED) -> list[float] | None:
    """Percentile bootstrap interval of `stat(*arrays)` (see `bootstrap`): None below MIN_UNITS units, so no
    verdict."""
    return percentiles(bootstrap(stat, *arrays, groups=groups, n_resamples=n_resamples, seed=seed), level)


def p_value(values: np.ndarray | None, null: float) -> float:
    """Two-sided percentile-bootstrap p-value of "the statistic equals `null`": twice the smaller share of
    resamples on either side of it (1.0 without resamples). The 95% interval excludes `null` exactly when this is
    below 0.05, so Holm's correction can act on it."""
    if values is None or not len(values):
        return 1.0
    below, above = float(np.mean(values <= null)), float(np.mean(values >= null))
    return min(1.0, 2 * min(below, above))


def bootstrap_test(stat: Callable[..., np.ndarray], *arrays: np.ndarray, null: float, groups=None,
         level: float = LEVEL) -> tuple[list[float] | None, float]:
    """(interval, p-value against `null`) from one set of resamples."""
    values = bootstrap(stat, *arrays, groups=groups)
    return percentiles(values, level), p_value(values, null)


def holm(pvalues: dict, alpha: float = 1 - LEVEL) -> dict:
    """Holm's step-down correction over one report's verdicts: key -> True where its "no difference" is rejected
    with the family-wise error rate held at `alpha` (sorted p_(i) <= alpha / (m - i), stopping at the first that
    is not)."""
    order = sorted(pvalues, key=lambda k: pvalues[k])
    m, out, going = len(order), {}, True
    for i, k in enumerate(order):
        going = going and pvalues[k] <= alpha / (m - i)
        out[k] = going
    return out


def interval_unpaired(stat: Callable[..., np.ndarray], a: tuple, b: tuple, level: float = LEVEL,
                      n_resamples: int = RESAMPLES, seed: int = SEED, groups: tuple = (None, None)) -> list[float] | None:
    """As `interval`, for two groups of units that do not pair (two models that tokenized the text differently):
    each group is resampled on its own. `stat(*a_resampled, *b_resampled)`."""
    values = bootstrap_unpaired(stat, a, b, n_resamples, seed, groups)
    return percentiles(values, level)


def bootstrap_unpaired(stat, a: tuple, b: tuple, n_resamples: int = RESAMPLES, seed: int = SEED,
                       groups: tuple = (None, None)) -> np.ndarray | None:
    a = tuple(np.asarray(x, dtype=np.float64) for x in a)
    b = tuple(np.asarray(x, dtype=np.float64) for x in b)
    if min(len(a[0]), len(b[0])) < MIN_UNITS:
        return None

    def draw(arrays, g, s):
        n = len(arrays[0])
        if g is None:
            i = resamples(n, n_resamples, s)
            return [x[i] for x in arrays]
        idx, pad = _cluster_index(units_of(g, n), n_resamples, s)
        return [np.ma.masked_array(x[idx], mask=np.broadcast_to(pad.reshape(pad.shape + (1,) * (x.ndim - 1)),
                                                                  idx.shape + x.shape[1:])) for x in arrays]

    values = stat(*draw(a, groups[0], seed), *draw(b, groups[1], seed + 1))
    values = np.asarray(np.ma.filled(np.ma.asarray(values, dtype=np.float64), np.nan), dtype=np.float64)
    values = values[np.isfinite(values)]
    return values if len(values) else None


def mean_interval(x, groups=None) -> list[float] | None:
    return interval(lambda a: a.mean(axis=1), x, groups=groups)


QUANTILE_RESAMPLES = 400  # a percentile of every token costs more than a mean of window means: fewer resamples


def quantile_interval(values, q: float, groups=None, n_resamples: int = QUANTILE_RESAMPLES,
                      seed: int = SEED) -> list[float] | None:
    """95% interval of the q-th percentile over every position of [windows, positions] `values` (a KLD's p99),
    resampling windows or their documents as `bootstrap` does; None below MIN_UNITS units."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 2 or len(v) < MIN_UNITS:
        return None
    units = units_of(groups, len(v))
    if units.max() + 1 < MIN_UNITS:
        return None
    members = [np.flatnonzero(units == u) for u in range(units.max() + 1)]
    draws = resamples(len(members), n_resamples, seed)
    stats = np.array([np.percentile(v[np.concatenate([members[u] for u in row])], q) for row in draws])
    return percentiles(stats, LEVEL)


def ratio_of_means(num, den, groups=None) -> tuple[float, list[float] | None]:
    """mean(num) / mean(den), paired by unit."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    point = float(num.mean() / den.mean()) if den.mean() > 0 else float("nan")
    return point, interval(lambda a, b: a.mean(axis=1) / b.mean(axis=1), num, den, groups=groups)


def delta_ppl_pct(nll, ref_nll, groups=None) -> tuple[float, list[float] | None]:
    """100 * (ppl / ref_ppl - 1) from per-window mean NLLs (windows hold equal token counts, so the mean of window
    means is the token mean): exp of the mean NLL difference."""
    d = np.asarray(nll, dtype=np.float64) - np.asarray(ref_nll, dtype=np.float64)
    return float(100 * np.expm1(d.mean())), interval(lambda a: 100 * np.expm1(a.mean(axis=1)), d, groups=groups)


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
            **dict(zip(("spearman_ci95", "spearman_p"), bootstrap_test(lambda a, b: pearson(ranks(a), ranks(b)), x, y, null=0.0))),
            "n": int(len(x))}


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


def t_test_p(values, null: float = 0.0) -> float:
    """Two-sided one-sample Student-t p-value of mean(values) = null (the seeds are the units): 1.0 below two
    values or with no spread. The t distribution's CDF in closed form for integer degrees of freedom (Abramowitz and
    Stegun 26.7.3-4), as scipy is not a dependency."""
    from math import atan, cos, pi, sin, sqrt
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=np.float64)
    if len(v) < 2 or float(v.std(ddof=1)) == 0.0:
        return 1.0
    nu = len(v) - 1
    t = abs(float(v.mean()) - null) / (float(v.std(ddof=1)) / sqrt(len(v)))
    th = atan(t / sqrt(nu))
    c2 = cos(th) ** 2
    if nu % 2:  # odd: A = (2/pi) (theta + sin cos (1 + 2/3 c2 + 2*4/(3*5) c2^2 + ...)), nu-3 powers
        term, acc = 1.0, 1.0 if nu > 1 else 0.0
        for k in range(1, (nu - 1) // 2):
            term *= (2 * k) / (2 * k + 1) * c2
            acc += term
        a = 2 / pi * (th + (sin(th) * cos(th) * acc if nu > 1 else 0.0))
    else:  # even: A = sin (1 + 1/2 c2 + 1*3/(2*4) c2^2 + ...), nu-2 powers
        term, acc = 1.0, 1.0
        for k in range(1, nu // 2):
            term *= (2 * k - 1) / (2 * k) * c2
            acc += term
        a = sin(th) * acc
    return float(min(1.0, max(0.0, 1.0 - a)))


# Student t 97.5% quantiles for 1..10 degrees of freedom (then 10's, a slight overstatement beyond)
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def cell_intervals(per_window: dict) -> dict:
    """95% intervals of one scored artifact's KLD, delta perplexity (%) and top-1 agreement, resampling its
    windows' documents (per_window["doc"]; windows one by one where a cell predates it)."""
    g = per_window.get("doc")
    return {"kld_mean_ci95": mean_interval(per_window["kld"], g),
            "delta_ppl_pct_ci95": delta_ppl_pct(per_window["nll"], per_window["ref_nll"], g)[1],
            "top1_agreement_ci95": mean_interval(per_window["top1"], g),
            "interval_unit": unit_name(g, len(per_window["kld"]))}
