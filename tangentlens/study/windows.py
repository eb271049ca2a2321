"""Window summaries with intervals: the numbers the paper's dynamics claims turn on.

For each gradient object (``gradient``: ∂L/∂h at the residual sites; ``weight_gradient``:
Σ G Gᵀ at ``attn_in``/``mlp_in``) and rank, the mean of ``energy_ratio`` over the sites and
checkpoints of the early and of the late window, their difference (late − early), and for
the activation gradient the mean IsoScore* excess of removing Q_T over removing a normal
control (``delta_iso_tangent − delta_iso_normal``), and for the weight gradient its
``normalized_ratio`` (the energy ratio over the same ratio of the site's activations: the
random-backprop null, under which a subspace fitted on the activations would still show a
weight-gradient energy ratio far above 1). Each comes with a delete-a-group jackknife
interval: the groups of probe batches are the same at every checkpoint, so leaving group g
out of every row gives one leave-one-out value of the window mean. For the normalised
ratio, leaving g out drops it from both sums, S = Σ G Gᵀ and the activations' second
moment, since both are kept per group of the same sequences. Q_T itself is fitted on those
sequences' early activations, so each leave-one-group-out value uses Q_T refitted without
that group (`refit_bases`): the interval covers the basis's sampling noise too.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..core.significance import delta_iso_tangent, energy_ratio
from ..core.stats import Moments
from ..core.subspace import TangentBasis, tangent_share
from ..core.uncertainty import jackknife_interval

__all__ = ["WindowSummary", "refit_bases"]


@dataclass
class _Series:
    """Point values and their leave-one-group-out values, one entry per row."""

    values: list[float] = field(default_factory=list)
    leave_one_out: list[list[float]] = field(default_factory=list)

    def add(self, value: float, loo: list[float]) -> None:
        self.values.append(value)
        self.leave_one_out.append(loo)

    def mean(self) -> tuple[float, list[float]] | None:
        if not self.values or any(len(v) != len(self.leave_one_out[0]) for v in self.leave_one_out):
            return None
        n = len(self.values)
        loo = [sum(v[g] for v in self.leave_one_out) / n for g in range(len(self.leave_one_out[0]))]
        return sum(self.values) / n, loo


class WindowSummary:
    """Collects per-row values and leave-one-out values by (statistic, rank, window)."""

    def __init__(self) -> None:
        self._series: dict[tuple[str, int, str], _Series] = defaultdict(_Series)

    def activation_gradient(
        self,
        window: str,
        rank: int,
        groups: list[Moments],
        basis: TangentBasis,
        tests: dict[str, float],
        zeta: float,
        reference: Tensor,
        refits: list[TangentBasis] | None = None,
    ) -> None:
        """One residual site at one checkpoint (``groups``: its gradient Moments per group;
        ``refits``: Q_T refitted without each group, see `refit_bases`)."""
        seen = [g for g, m in enumerate(groups) if m.count]  # the same at every row
        if window not in ("early", "late") or len(seen) < 2:
            return
        total = Moments.merged(groups)
        rest = {g: total - groups[g] for g in seen}
        loo = {g: refits[g] if refits else basis for g in seen}
        ratio = [energy_ratio(tangent_share(rest[g], loo[g]), basis.k, basis.d) for g in seen]
        self._series["gradient_energy_ratio", rank, window].add(tests["energy_ratio"], ratio)
        if "delta_iso_normal" in tests:
            normal = tests["delta_iso_normal"]  # the controls' mean: held fixed
            iso = [
                delta_iso_tangent(rest[g], loo[g], zeta=zeta, reference=reference) - normal
                for g in seen
            ]
            excess = tests["delta_iso_tangent"] - normal
            self._series["gradient_delta_iso_excess", rank, window].add(excess, iso)

    def weight_gradient(
        self,
        window: str,
        rank: int,
        groups: list[Tensor],
        basis: TangentBasis,
        ratio: float,
        act_groups: list[Moments] | None = None,
        normalized: float | None = None,
        refits: list[TangentBasis] | None = None,
    ) -> None:
        """One input site at one checkpoint (``groups``: its S = Σ G Gᵀ per group;
        ``act_groups``: the site's activation Moments per group, the same groups, and
        ``normalized`` the row's ``normalized_ratio``, for that ratio's interval;
        ``refits``: Q_T refitted without each group)."""
        if window not in ("early", "late"):
            return
        seen = [g for g, m in enumerate(groups) if float(torch.trace(m)) > 0]  # same every row
        if len(seen) < 2:
            return
        total = sum(groups[g] for g in seen)
        without = {g: refits[g] if refits else basis for g in seen}
        ratios = [energy_ratio(tangent_share(total - groups[g], without[g]), basis.k, basis.d)
                  for g in seen]  # fmt: skip
        self._series["weight_gradient_energy_ratio", rank, window].add(ratio, ratios)
        if normalized is None or act_groups is None or len(act_groups) != len(groups):
            return
        acts = Moments.merged(act_groups)
        loo = []
        for g, r in zip(seen, ratios, strict=True):
            rest = acts - act_groups[g]
            if rest.count < 1:
                return
            act_ratio = energy_ratio(tangent_share(rest, without[g]), basis.k, basis.d)
            loo.append(r / act_ratio if act_ratio > 0 else math.nan)
        self._series["weight_gradient_normalized_ratio", rank, window].add(normalized, loo)

    def values(self) -> list[dict[str, Any]]:
        """``(statistic, rank, window, value, ci_low, ci_high)`` records: each window's mean
        and, where both windows exist, ``{statistic}_late_minus_early``."""
        out = []
        means = {key: s.mean() for key, s in self._series.items()}
        for (stat, rank, window), mean in sorted(means.items()):
            if mean is None:
                continue
            low, high = jackknife_interval(mean[1], mean[0])
            out.append(_record(stat, rank, window, mean[0], low, high))
        for (stat, rank, window), late in sorted(means.items()):
            early = means.get((stat, rank, "early"))
            if window != "late" or late is None or early is None:
                continue
            diff = late[0] - early[0]
            loo = [b - a for a, b in zip(early[1], late[1], strict=True)]
            low, high = jackknife_interval(loo, diff)
            out.append(_record(f"{stat}_late_minus_early", rank, "late-early", diff, low, high))
        return out


def refit_bases(
    early: list[list[Moments]], rank: int, provenance: dict[str, Any] | None = None
) -> list[TangentBasis] | None:
    """Q_T fitted as the study fits it, from the pooled early-window activations, once
    without each group of sequences: ``early[t][g]`` is group g's `Moments` at early
    checkpoint t. A leave-one-group-out value computed with the refit of its own group
    carries Q_T's sampling noise (the basis is fitted on the same probe sequences it is
    tested on) into the jackknife interval. None when a group saw no vectors."""
    n_groups = len(early[0])
    pooled = Moments.merged([m for groups in early for m in groups])
    out = []
    for g in range(n_groups):
        without = Moments.merged([groups[g] for groups in early])
        if without.count == 0 or pooled.count - without.count < 2:
            return None
        out.append(TangentBasis.fit(pooled - without, rank, provenance=provenance))
    return out


def _record(stat: str, rank: int, window: str, value: float, low: float, high: float) -> dict:
    return {"statistic": stat, "rank": rank, "window": window, "value": value,
            "ci_low": low, "ci_high": high}  # fmt: skip
