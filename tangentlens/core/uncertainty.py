"""Confidence intervals over tokens: a delete-a-group jackknife over groups of sequences.

Tokens of one sequence are correlated, so an error bar that counts tokens as independent
draws is too narrow. Split the sequences into G disjoint groups of whole sequences and
keep one set of statistics per group; the jackknife recomputes a statistic with each
group left out in turn, and the spread of those G values estimates the sampling variance
of the whole, correlation within sequences included. The interval is

    θ̂ ± t_{G−1, (1+level)/2} · sqrt((G − 1)/G · Σ_g (θ_(g) − θ̄)²),

θ̂ the statistic of all groups, θ_(g) without group g, θ̄ their mean; G = 10 to 20 is
typical (the t quantile pays for a small G). Ratios (``energy_ratio``,
``normalized_ratio``, the amplifications) take the interval of their logarithm,
exponentiated, so it stays positive; ``tangent_share`` that of its logit, so it stays in
(0, 1), and ``share_ratio`` (the share times d/k) the share's interval times d/k, so the
two never disagree.

Memory per site: G × the statistics' memory for `Moments` groups (`tangent_intervals`;
G float64 d×d matrices, 47 MB for G = 10 at d = 768); the scalar-sum path
(`share_intervals`) costs G × 2 floats per site, for probes that know Q_T while they
stream and keep only Σ‖xᵀQ_T‖² and Σ‖x‖² per group.

Beside the intervals, `two_sided_p_value`: a value against null draws (the attention
probe's per-head frames), exact when they are exchangeable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from scipy import special, stats
from torch import Tensor

from .errors import UsageError
from .significance import delta_iso_tangent, energy_ratio
from .stats import Moments
from .subspace import TangentBasis, shares, tangent_share
from .validation import check_int, check_rank

__all__ = ["jackknife_interval", "share_intervals", "tangent_intervals", "two_sided_p_value"]


def jackknife_interval(
    leave_one_out: Sequence[float],
    estimate: float,
    *,
    level: float = 0.95,
    log_scale: bool = False,
    logit_scale: bool = False,
) -> tuple[float, float]:
    """``estimate`` ± t_{G−1} · jackknife standard error from the G leave-one-group-out
    values. NaN bounds when a value is not finite (e.g. an infinite ratio).

    ``log_scale``: for a ratio, the interval of its logarithm, exponentiated. A ratio is
    positive and its sampling error multiplicative, so the interval stays positive and
    asymmetric where a symmetric one would run below zero. Applies where the estimate
    and every leave-one-out value are positive; otherwise the plain interval.
    ``logit_scale``: for a share, the interval of its logit, mapped back, so it stays in
    (0, 1) where a symmetric one would run past either end. Applies where the estimate and
    every leave-one-out value lie strictly between 0 and 1; otherwise the plain interval."""
    values = np.asarray(leave_one_out, dtype=np.float64)
    if values.ndim != 1 or values.size < 2:
        raise UsageError(
            f"the jackknife needs at least 2 leave-one-out values (G >= 2 groups); "
            f"got shape {values.shape}."
        )
    if not 0 < level < 1:
        raise UsageError(f"level must be in (0, 1); got {level}.")
    if not (np.isfinite(values).all() and math.isfinite(estimate)):
        return math.nan, math.nan
    if log_scale and estimate > 0 and bool((values > 0).all()):
        low, high = jackknife_interval(np.log(values), math.log(estimate), level=level)
        return math.exp(low), math.exp(high)
    if logit_scale and 0 < estimate < 1 and bool(((values > 0) & (values < 1)).all()):
        low, high = jackknife_interval(special.logit(values), special.logit(estimate), level=level)
        return float(special.expit(low)), float(special.expit(high))
    g = values.size
    se = math.sqrt((g - 1) / g * float(((values - values.mean()) ** 2).sum()))
    half = float(stats.t.ppf((1 + level) / 2, g - 1)) * se
    return estimate - half, estimate + half


def _leave_one_out(groups: Sequence[Moments], name: str) -> tuple[Moments, list[Moments]]:
    """The merge of all groups, and the merge of all but group g for each g."""
    groups = list(groups)
    if len(groups) < 2:
        raise UsageError(f"{name} needs at least 2 groups of sequences; got {len(groups)}.")
    for g in groups:
        if not isinstance(g, Moments):
            raise TypeError(f"{name} must hold Moments; got {type(g).__name__}.")
        if g.count == 0:
            raise UsageError(f"{name} holds an empty group; give every group some sequences.")
    total = Moments.merged(groups)
    return total, [total - g for g in groups]


def tangent_intervals(
    gradient_groups: Sequence[Moments],
    basis: TangentBasis,
    *,
    activation_groups: Sequence[Moments] | None = None,
    zeta: float = 0.0,
    reference: Any | None = None,
    level: float = 0.95,
) -> dict[str, tuple[float, float]]:
    """Jackknife intervals for ``tangent_share``, ``energy_ratio``, ``delta_iso_tangent``
    and, with ``activation_groups`` (the same groups of sequences, in the same order),
    ``normalized_ratio``: the statistics of `significance.tangent_tests` on the merge of
    the groups, whose point values they contain.

    Each group is the `Moments` of a disjoint set of whole sequences; ``zeta`` and
    ``reference`` are those of `significance.delta_iso_tangent` (a fixed ``reference``
    stays fixed across the leave-one-out fits).
    """
    if not isinstance(basis, TangentBasis):
        raise TypeError(f"basis must be a TangentBasis; got {type(basis).__name__}.")
    k, d = basis.k, basis.d
    total, rest = _leave_one_out(gradient_groups, "gradient_groups")
    share, share_loo = tangent_share(total, basis), [tangent_share(m, basis) for m in rest]
    ratio, ratio_loo = energy_ratio(share, k, d), [energy_ratio(s, k, d) for s in share_loo]
    iso = [delta_iso_tangent(m, basis, zeta=zeta, reference=reference) for m in (total, *rest)]
    out = {
        "tangent_share": jackknife_interval(share_loo, share, level=level, logit_scale=True),
        "energy_ratio": jackknife_interval(ratio_loo, ratio, level=level, log_scale=True),
        "delta_iso_tangent": jackknife_interval(iso[1:], iso[0], level=level),
    }
    if activation_groups is not None:
        act_total, act_rest = _leave_one_out(activation_groups, "activation_groups")
        if len(act_rest) != len(rest):
            raise UsageError(
                f"activation_groups has {len(act_rest)} groups, gradient_groups {len(rest)}; "
                "pass the same groups of sequences for both."
            )
        act = [energy_ratio(tangent_share(m, basis), k, d) for m in (act_total, *act_rest)]
        normalized = [r / a for r, a in zip((ratio, *ratio_loo), act, strict=True)]
        out["normalized_ratio"] = jackknife_interval(
            normalized[1:], normalized[0], level=level, log_scale=True
        )
    return out


def _sums(group_sums: Tensor | Any, name: str) -> Tensor:
    sums = torch.as_tensor(group_sums, dtype=torch.float64)
    if sums.ndim != 2 or sums.shape[1] != 2:
        raise UsageError(
            f"{name} must have shape (G, 2): (tangent energy, total energy) per group; "
            f"got {tuple(sums.shape)}."
        )
    return sums


def share_intervals(
    group_sums: Tensor | Any,
    *,
    k: int,
    d: int,
    activation_sums: Tensor | Any | None = None,
    level: float = 0.95,
) -> dict[str, tuple[float, float]]:
    """Jackknife intervals for the ratio-of-sums ``tangent_share``, ``share_ratio`` and
    ``energy_ratio`` from per-group sums: ``group_sums[g] = (Σ‖xᵀQ_T‖², Σ‖x‖²)`` over the
    tokens of group g, shape ``(G, 2)``. The same intervals as `tangent_intervals` gives
    for the share, at 2 floats per group instead of a d×d matrix. With
    ``activation_sums`` (the same sums of the activations, per group) also
    ``normalized_ratio``: the energy ratio over the activations' own."""
    sums = _sums(group_sums, "group_sums")
    d = check_int(d, "d", minimum=2)
    k = check_rank(k, d, name="k")
    total = sums.sum(0)
    rows = [shares(float(t), float(e), k, d) for t, e in (total, *(total - sums))]
    out = {}
    share = [r["tangent_share"] for r in rows]
    out["tangent_share"] = jackknife_interval(share[1:], share[0], level=level, logit_scale=True)
    out["share_ratio"] = tuple(v * d / k for v in out["tangent_share"])  # the share's, scaled
    ratios = [energy_ratio(r["tangent_share"], k, d) for r in rows]
    out["energy_ratio"] = jackknife_interval(ratios[1:], ratios[0], level=level, log_scale=True)
    if activation_sums is not None:
        acts = _sums(activation_sums, "activation_sums")
        if acts.shape != sums.shape:
            raise UsageError("activation_sums must have the shape of group_sums.")
        a_total = acts.sum(0)
        a_rows = [shares(float(t), float(e), k, d) for t, e in (a_total, *(a_total - acts))]
        norm = [
            r / energy_ratio(a["tangent_share"], k, d) for r, a in zip(ratios, a_rows, strict=True)
        ]
        out["normalized_ratio"] = jackknife_interval(norm[1:], norm[0], level=level, log_scale=True)
    return out


def two_sided_p_value(value: Tensor, null: Tensor) -> Tensor:
    """(1 + #{j: |null_j − m| ≥ |value − m|})/(n + 1) for each entry of ``value`` against
    the n rows of ``null`` (``(n, *value.shape)``), m the mean of the value and its n null
    values together; float64, NaN where any of them is NaN.

    Centring on that pooled mean, not on the null's own, keeps the statistic a symmetric
    function of all n + 1 values, so when they are exchangeable the p-value is exact at
    every n (P(p ≤ α) ≤ α; ties count as extreme). Its floor is 1/(n + 1): a p-value of
    0.01 needs 99 null values."""
    null = torch.as_tensor(null, dtype=torch.float64)
    value = torch.as_tensor(value).to(null)
    if null.ndim < 1 or null.shape[1:] != value.shape or len(null) < 1:
        raise UsageError(
            f"null must be (n, *value.shape) with n >= 1 and value.shape = "
            f"{tuple(value.shape)}; got {tuple(null.shape)}."
        )
    centre = (value + null.sum(0)) / (len(null) + 1)
    extreme = ((null - centre).abs() >= (value - centre).abs()).sum(0)
    p = (1 + extreme).to(null) / (len(null) + 1)
    return torch.where(value.isnan() | null.isnan().any(0), torch.nan, p)
