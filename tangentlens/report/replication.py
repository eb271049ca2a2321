"""Training seeds as the unit of replication: intervals and tests over per-seed numbers,
and Holm's correction across the claims of one summary.

A study's own intervals resample probe sequences at fixed weights, so they say nothing
about how much a number moves when the model is trained again with another seed, which is
the larger variation. Here each training seed contributes one point estimate and the
interval is Student's t over those points: mean ± t_{0.975, n−1}·sd/√n (sd with n − 1).
Two models trained on different seeds are independent samples, so a decoder is compared
with an encoder by Welch's interval for the difference of their means.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

__all__ = ["holm", "t_interval", "t_p_value", "welch_interval", "welch_p_value"]


def _finite(values: Sequence[float]) -> np.ndarray:
    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return x[np.isfinite(x)]


def t_interval(
    values: Sequence[float], *, level: float = 0.95
) -> tuple[float, float, float] | None:
    """(mean, low, high): mean ± t_{(1+level)/2, n−1}·sd/√n over the finite values; None
    with fewer than two (one seed has no spread to estimate)."""
    x = _finite(values)
    if x.size < 2:
        return None
    mean = float(x.mean())
    se = float(x.std(ddof=1)) / math.sqrt(x.size)
    half = float(stats.t.ppf((1 + level) / 2, x.size - 1)) * se
    return mean, mean - half, mean + half


def t_p_value(values: Sequence[float], line: float) -> float | None:
    """Two-sided one-sample t-test of the mean against ``line`` (None with fewer than two
    values; 0 or 1 when the values do not vary, as the interval then has no width)."""
    x = _finite(values)
    if x.size < 2:
        return None
    sd = float(x.std(ddof=1))
    if sd == 0:
        return 1.0 if float(x.mean()) == line else 0.0
    t = (float(x.mean()) - line) / (sd / math.sqrt(x.size))
    return float(2 * stats.t.sf(abs(t), x.size - 1))


def _welch(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """Difference of means, its standard error and Welch–Satterthwaite degrees of freedom."""
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    se = math.sqrt(va + vb)
    if se == 0:
        return float(a.mean() - b.mean()), 0.0, math.inf
    df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))
    return float(a.mean() - b.mean()), se, float(df)


def welch_interval(
    a: Sequence[float], b: Sequence[float], *, level: float = 0.95
) -> tuple[float, float, float] | None:
    """(mean a − mean b, low, high) by Welch's t; None unless both have two finite values."""
    x, y = _finite(a), _finite(b)
    if x.size < 2 or y.size < 2:
        return None
    diff, se, df = _welch(x, y)
    half = float(stats.t.ppf((1 + level) / 2, df)) * se if se > 0 else 0.0
    return diff, diff - half, diff + half


def welch_p_value(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided Welch test of equal means (None unless both have two finite values)."""
    x, y = _finite(a), _finite(b)
    if x.size < 2 or y.size < 2:
        return None
    diff, se, df = _welch(x, y)
    if se == 0:
        return 1.0 if diff == 0 else 0.0
    return float(2 * stats.t.sf(abs(diff / se), df))


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (None stays None and does not count as a test):
    sort the m p-values, multiply the i-th smallest by m − i (i from 0), carry the running
    maximum, cap at 1. A claim is decided at family-wise level α when its adjusted p < α,
    which controls the chance of any false verdict among the claims at α."""
    tested = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    out: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (len(tested) - rank) * p))
        out[i] = running
    return out
