"""Residual probe: how much of the residual stream, and of each block's write into it,
lies in the tangent subspace.

Per residual site with a basis Q_T (d × k):

- ``tangent_share`` = E‖x Q_T‖² / E‖x‖² (uncentred energy share over tokens),
- ``chance_share`` = k / d (the share of an isotropic vector),
- ``share_ratio`` = tangent_share / chance_share, ``mean_sq_norm`` = E‖x‖², ``n_tokens``.

A block's write (``attn_out``, ``mlp_out``) is measured in the basis of the residual
stream it writes into: the nearest residual site downstream that has a basis,
``resid_mid`` then ``resid_post`` of the same layer (a parallel block's attention
writes straight into ``resid_post``), then the next layer's ``resid_pre`` (the same
tensor as ``resid_post``). A write with a large ``share_ratio`` pushes the stream
further into Q_T: that is where the bias amplifies.

**Intervals.** The state is float64 sums (Σ‖x‖², Σ‖x Q_T‖², n) per site and per group of
whole sequences (forward pass i goes to group i mod ``n_groups``), so batch splits and
merges give the same numbers as one pass and no activation is kept; built on sites alone,
each group keeps its activations' `Moments` instead and `compute` forms those sums for
any basis (`group_energies`). ``tangent_share``
and ``share_ratio`` get a delete-a-group jackknife interval (`tangentlens.core.uncertainty`).

**Amplification.** ``share_amplification`` at a residual site of layer l is
share_ratio[l] / share_ratio[p], p the previous layer this probe measures at the same
site kind (l − 1 when every layer is probed; 3 for 6 with ``layers=[0, 3, 6]``); no row
at the first. Its interval is a *joint* jackknife: each left-out group is left out of
both layers at once, so the correlation between layers (the same tokens) is in it.
`amplification_rows` is the one implementation; the gradient probe uses it for
``energy_amplification``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise
from typing import Any

import torch
from torch import Tensor

from ..core.errors import UsageError
from ..core.stats import Moments, state_dtype
from ..core.subspace import TangentBasis, shares
from ..core.uncertainty import jackknife_interval, share_intervals
from ..core.validation import check_int
from ..hooks.sites import RESIDUAL_KINDS, WRITE_KINDS, Site, write_targets
from .base import MomentProbe, Observation, Sum, ci_columns, energy_sums, row
from .registry import Plan, ProbeSpec, register

__all__ = [
    "ResidualProbe",
    "amplification_rows",
    "check_finite",
    "energy_sums",
    "group_energies",
    "write_basis_site",
]


def write_basis_site(write: Site, bases: Mapping[Site, object], n_layers: int) -> Site | None:
    """The residual site whose basis measures ``write`` (see the module docstring)."""
    if write.kind not in WRITE_KINDS:
        raise UsageError(f"write must be an attn_out or mlp_out site; got {write}.")
    candidates = [c for c in write_targets(write) if c.layer < n_layers]
    return next((c for c in candidates if c in bases), None)


def amplification_rows(
    probe: str,
    statistic: str,
    group_sums: Mapping[Site, Tensor],
    ratio: Callable[[Site, float, float], float],
) -> list[dict[str, Any]]:
    """Rows ``statistic`` = ratio[l] / ratio[p] at each residual site but the first of its
    kind, p the previous measured layer of that kind, with a joint jackknife interval.

    ``group_sums[site]`` is ``(G, 2)``: (Σ tangent energy, Σ total energy) per group of
    sequences; ``ratio(site, tangent, total)`` the per-layer ratio from summed energies.
    Only groups seen at both layers count; with fewer than two the interval is omitted.
    The interval is the log ratio's, exponentiated (a ratio of ratios stays positive).
    A layer without a basis between two that have one, or a pair no group saw, is named
    in a warning: the amplification then spans more than one block."""
    by_kind: dict[str, list[Site]] = {}
    for site in sorted(group_sums, key=lambda s: s.layer):
        if site.kind in RESIDUAL_KINDS:
            by_kind.setdefault(site.kind, []).append(site)
    out = []
    gaps: list[str] = []
    for sites in by_kind.values():
        for prev, site in pairwise(sites):
            if site.layer - prev.layer > 1:
                gaps.append(
                    f"{site.hook_name} over layer {prev.layer} (layers "
                    f"{list(range(prev.layer + 1, site.layer))} have no basis)"
                )
            now, before = group_sums[site].cpu(), group_sums[prev].cpu()
            seen = (now[:, 1] > 0) & (before[:, 1] > 0)
            if not bool(seen.any()):
                gaps.append(f"{site.hook_name}: no tokens seen at both it and layer {prev.layer}")
                continue
            now, before = now[seen], before[seen]
            parts = [(now.sum(0), before.sum(0))]
            parts += [(parts[0][0] - a, parts[0][1] - b) for a, b in zip(now, before, strict=True)]
            values = [
                _over(ratio(site, *map(float, a)), ratio(prev, *map(float, b))) for a, b in parts
            ]
            ci = None
            if len(values) > 2:
                ci = jackknife_interval(values[1:], values[0], log_scale=True)
            out.append(row(probe, site, statistic, values[0], **ci_columns(ci)))
    if gaps:
        warnings.warn(
            f"{statistic} is a ratio between consecutive probed layers: {'; '.join(gaps)}. "
            "Fit bases at every layer to get one block at a time.",
            stacklevel=2,
        )
    return out


def _over(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN for 0 / 0 and inf for x / 0: no ZeroDivisionError."""
    if denominator == 0:
        return math.nan if numerator == 0 else math.inf
    return numerator / denominator


class ResidualProbe(MomentProbe):
    """Energy shares per measured site (residual sites and writes) and group of
    sequences. ``bases`` maps each site to the basis it is measured in: then each group
    keeps its `energy_sums` (3 floats). Or ``bases`` is just the sites: each group keeps
    the activations' `Moments` (basis-free, ``memory`` sets their dtype), and `compute`
    measures them against bases fitted afterwards (a study's)."""

    name = "residual"

    def __init__(
        self,
        bases: Mapping[Site, TangentBasis] | Sequence[Site],
        *,
        n_groups: int = 10,
        memory: str = "full",
    ) -> None:
        super().__init__()
        for site in bases:
            if site.kind not in (*RESIDUAL_KINDS, *WRITE_KINDS):
                raise UsageError(
                    f"the residual probe measures residual sites and writes; got {site}."
                )
        self._set_sites(bases)
        self.n_groups = check_int(n_groups, "n_groups", minimum=2)
        dtype = state_dtype(memory)
        for site in self.sites:
            if self.basis_free:
                for g in range(self.n_groups):
                    self.add_state(f"act/{g}/{site.hook_name}", lambda: Moments(dtype=dtype))
            else:
                self.add_state(site.hook_name, lambda: Sum((self.n_groups, 3)))

    @property
    def forward_sites(self) -> list[Site]:
        return list(self.sites)

    def update(self, obs: Observation) -> None:
        group = obs.group % self.n_groups
        if self.basis_free:
            n, mean, scatter = obs.statistics()
            check_finite(mean, obs.site)
            self.state(f"act/{group}/{obs.site.hook_name}").add_batch(n, mean, scatter)
            return
        sums = obs.energies(self.bases[obs.site])
        check_finite(sums, obs.site)
        state = self.state(obs.site.hook_name)
        update = torch.zeros_like(state.value, device=sums.device)
        update[group] = sums
        state.add(update)

    def group_moments(self, site: Site) -> list[Moments]:
        """The activations' `Moments` of each group at ``site`` (a basis-free state)."""
        return [self.state(f"act/{g}/{site.hook_name}") for g in range(self.n_groups)]

    def group_sums(self, bases: Mapping[Site, TangentBasis] | None = None) -> dict[Site, Tensor]:
        """Site → ``(G, 3)`` float64: (Σ‖x Q_T‖², Σ‖x‖², n) per group of sequences."""
        out = {}
        for site, basis in self.against(bases).items():
            if self.basis_free:
                groups = self.group_moments(site)
                counts = torch.tensor([[float(m.count)] for m in groups], dtype=torch.float64)
                out[site] = torch.cat([group_energies(groups, basis), counts], 1)
            else:
                out[site] = self.state(site.hook_name).value.cpu()[:, [1, 0, 2]]
        return out

    def compute(
        self, bases: Mapping[Site, TangentBasis] | None = None, **context: Any
    ) -> list[dict[str, Any]]:
        """``tangent_share``, ``chance_share``, ``share_ratio``, ``mean_sq_norm``,
        ``n_tokens`` per site, with jackknife intervals, and ``share_amplification``."""
        bases = self.against(bases)
        groups = self.group_sums(bases)

        def ratio(site: Site, tangent: float, total: float) -> float:
            return shares(tangent, total, bases[site].k, bases[site].d)["share_ratio"]

        out = []
        for site, basis in bases.items():
            tangent, total, n = groups[site].sum(0).tolist()
            if n == 0:
                continue
            seen = groups[site][groups[site][:, 1] > 0, :2]
            cis = share_intervals(seen, k=basis.k, d=basis.d) if seen.shape[0] >= 2 else {}
            values = {
                **shares(tangent, total, basis.k, basis.d),
                "mean_sq_norm": total / n,
                "n_tokens": n,
            }
            out += [row(self.name, site, k, v, **ci_columns(cis.get(k))) for k, v in values.items()]
        energies = {s: g[:, :2] for s, g in groups.items()}
        return out + amplification_rows(self.name, "share_amplification", energies, ratio)


def group_energies(groups: Sequence[Moments | Tensor], basis: TangentBasis) -> Tensor:
    """``(G, 2)`` float64: (Σ‖x Q_T‖², Σ‖x‖²) of each group's `Moments` (from its uncentred
    Σ x xᵀ), or (tr(Q_TᵀMQ_T), tr(M)) of each PSD matrix M; zeros for an empty group. What
    a state kept for one basis sums while collecting, from a basis-free state."""
    q = basis.basis_.to(torch.float64)
    out = torch.zeros(len(groups), 2, dtype=torch.float64)
    for g, m in enumerate(groups):
        if isinstance(m, Moments):
            if not m.count:
                continue
            m = m.gram
        m = m.to(torch.float64)
        qq = q.to(m.device)
        out[g, 0] = ((m @ qq) * qq).sum()
        out[g, 1] = torch.trace(m)
    return out


def check_finite(t: Tensor, site: Site) -> None:
    """A `UsageError` naming ``site`` when ``t`` (an activation's sums) holds NaN or Inf."""
    if not bool(torch.isfinite(t).all()):  # NaN would pass into every share silently
        raise UsageError(
            f"the activation at {site.hook_name} holds NaN or Inf; check the model's "
            "weights and dtype (overflow in float16?), or mask those positions with the "
            "attention mask."
        )


def _measured(plan: Plan) -> dict[Site, TangentBasis]:
    """Residual sites with a basis, and each write (attn_out, mlp_out) in scope whose
    residual basis exists (`write_basis_site`)."""
    measured = {s: b for s, b in plan.scoped.items() if s.kind in RESIDUAL_KINDS}
    available = set(plan.backend.sites())
    for layer in plan.layers:
        for kind in WRITE_KINDS:
            write = Site(layer, kind)
            target = write_basis_site(write, plan.bases, plan.backend.n_layers)
            if write in available and write in plan.in_scope and target is not None:
                measured[write] = plan.bases[target]
    return measured


register(ProbeSpec("residual", ResidualProbe, _measured, order=0))
