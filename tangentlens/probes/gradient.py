"""Gradient probe: gradient `Moments` of the loss at residual sites, tested against Q_T.

Backward hooks collect, per site, the Moments of ∂loss/∂x (padding masked out). The
tests run on those d × d statistics (`tangentlens.core.significance`), so a thousand
matched-rank controls cost matrix algebra, not another pass:

- from `energy_test`: ``tangent_share`` (gradient energy in Q_T), ``chance_share``,
  ``energy_ratio`` (tangent share over the exact mean share of matched-rank normal
  controls), ``p_value`` (uniform controls with at least that share, add-one),
  ``p_value_normal`` (the paper's complement controls), ``normalized_ratio`` (energy
  ratio divided by Q_T's own activation-energy ratio E‖xQ_T‖²/E‖x‖², from energy sums
  of the activations whose gradients are tested);
- from `isotropy_test`: ``delta_iso_tangent`` and ``delta_iso_normal`` (change of
  IsoScore* when Q_T, or a normal control, is projected out) and ``isotropy_p_value``.
  IsoScore* is shrunk by ``zeta`` toward the reference a study uses
  (`tangentlens.core.significance.pooled_shape`), from a pool of this one checkpoint: the
  reference is then the gradients' own covariance, so a probe session and a study of
  one checkpoint give one number (ζ has no effect there).

Intervals: ``ci_low``/``ci_high`` (95 %) for ``tangent_share``, ``energy_ratio`` and
``normalized_ratio`` come from a delete-a-group jackknife (`tangentlens.core.uncertainty`)
over ``n_groups`` groups of whole sequences (forward pass i goes to group i mod G). Per
site and group it keeps four float64 sums, Σ‖gQ_T‖², Σ‖g‖² and the same of the
activations: 4·G floats, whatever d. With fewer than two groups seen the interval is NaN.

Memory per site: the gradient `Moments`, float64 (``memory="full"``, 8d² + 8d bytes) or
float32 (``"compact"``, 4d² + 8d), and the group sums. The activations need no d × d
state: their share for ``normalized_ratio`` is the ratio of the group sums.

Built on the sites alone (no basis yet), each group keeps the gradients' and the
activations' `Moments` instead, 2·G·(8d² + 8d) bytes per site: `compute` forms the same
sums from them for any basis (`tangentlens.probes.residual.group_energies`), and gives
``delta_iso_tangent`` its jackknife interval too. This is how a study collects.

``energy_amplification`` (energy_ratio[l] / energy_ratio[p], p the previous probed layer
of the site kind) comes with a joint jackknife over the same groups
(`tangentlens.probes.residual.amplification_rows`).

Works on frozen models: the session makes the embedding output require grad.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..core.compute import site_map
from ..core.errors import UsageError
from ..core.settings import N_CONTROLS, ZETA
from ..core.significance import energy_ratio, pooled_shape, reference_at, tangent_tests
from ..core.stats import Moments, state_dtype
from ..core.subspace import TangentBasis
from ..core.uncertainty import share_intervals, tangent_intervals
from ..core.validation import check_int, check_seed
from ..hooks.sites import RESIDUAL_KINDS, Site
from .base import MomentProbe, Observation, Sum, ci_columns, first_equal, row, sites_bar
from .registry import Plan, ProbeSpec, register
from .residual import amplification_rows, group_energies

__all__ = ["GradientProbe"]


class GradientProbe(MomentProbe):
    """Gradient `Moments` per residual site and their tests against the site's basis.

    ``bases`` maps each site to its Q_T, or is just the sites: then each group of
    sequences keeps its gradients' and activations' `Moments` (basis-free; a study
    collects this way and computes once Q_T is fitted), and `compute` also gives
    ``delta_iso_tangent`` an interval (it needs each group's whole covariance)."""

    name = "gradient"

    def __init__(
        self,
        bases: Mapping[Site, TangentBasis] | Sequence[Site],
        *,
        n_controls: int = N_CONTROLS.default,
        zeta: float = ZETA.default,
        seed: int = 0,
        n_groups: int = 10,
        memory: str = "full",
    ) -> None:
        super().__init__()
        dtype = state_dtype(memory)
        for site in bases:
            if site.kind not in RESIDUAL_KINDS:
                raise UsageError(
                    f"the gradient probe reads residual sites {RESIDUAL_KINDS}; got {site}."
                )
        self._set_sites(bases)
        self.n_controls = check_int(n_controls, "n_controls", minimum=1)
        if not (isinstance(zeta, int | float) and 0 <= zeta <= 1):
            raise UsageError(
                f"zeta (IsoScore* shrinkage) must be a number in [0, 1]; got {zeta!r}."
            )
        self.zeta = float(zeta)
        self.seed = check_seed(seed)
        self.n_groups = check_int(n_groups, "n_groups", minimum=2)
        self.memory = memory
        for site in self.sites:
            if self.basis_free:
                for g in range(self.n_groups):
                    for kind in ("grad", "act"):
                        key = f"{kind}/{g}/{site.hook_name}"
                        self.add_state(key, lambda: Moments(dtype=dtype))
                continue
            self.add_state(f"grad/{site.hook_name}", lambda: Moments(dtype=dtype))
            # per group: gradient (tangent, total) energy, then the activations'
            self.add_state(f"groups/{site.hook_name}", lambda: Sum((self.n_groups, 4)))

    @property
    def forward_sites(self) -> list[Site]:
        return list(self.sites)

    @property
    def backward_sites(self) -> list[Site]:
        return list(self.sites)

    def update(self, obs: Observation) -> None:
        self._add(obs, "act", 2)

    def update_gradient(self, obs: Observation) -> None:
        if not self.basis_free:
            self.state(f"grad/{obs.site.hook_name}").add_batch(*obs.statistics())
        self._add(obs, "grad", 0)

    def _add(self, obs: Observation, kind: str, column: int) -> None:
        group = obs.group % self.n_groups
        if self.basis_free:
            self.state(f"{kind}/{group}/{obs.site.hook_name}").add_batch(*obs.statistics())
            return
        total, tangent, _ = obs.energies(self.bases[obs.site])
        sums = self.state(f"groups/{obs.site.hook_name}")
        update = torch.zeros_like(sums.value, device=total.device)
        update[group, column : column + 2] = torch.stack([tangent, total])
        sums.add(update)

    def group_moments(self, site: Site, kind: str = "grad") -> list[Moments]:
        """``kind`` (``"grad"`` or ``"act"``) `Moments` of each group at ``site`` (a
        basis-free state)."""
        return [self.state(f"{kind}/{g}/{site.hook_name}") for g in range(self.n_groups)]

    def moments(self) -> dict[Site, Moments]:
        """Site → `Moments` of the gradients."""
        if self.basis_free:
            return {s: Moments.merged(self.group_moments(s)) for s in self.sites}
        return {s: self.state(f"grad/{s.hook_name}") for s in self.sites}

    def group_sums(self, bases: Mapping[Site, TangentBasis] | None = None) -> dict[Site, Tensor]:
        """Site → ``(G, 4)`` float64 per group: the gradients' (Σ‖gQ_T‖², Σ‖g‖²), then
        the activations'."""
        out = {}
        for site, basis in self.against(bases).items():
            if self.basis_free:
                grads = group_energies(self.group_moments(site, "grad"), basis)
                acts = group_energies(self.group_moments(site, "act"), basis)
                out[site] = torch.cat([grads, acts], 1)
            else:
                out[site] = self.state(f"groups/{site.hook_name}").value.cpu()
        return out

    def compute(
        self,
        bases: Mapping[Site, TangentBasis] | None = None,
        *,
        references: Mapping[Site, Tensor] | None = None,
        **context: Any,
    ) -> list[dict[str, Any]]:
        """The tests of each site's gradients against its basis, with intervals, and
        ``energy_amplification``. ``references``: site → ΔIsoScore*'s reference shape
        (`pooled_shape`; a study's pools every checkpoint); by default each site's own
        gradients' (a pool of this one state)."""
        bases = self.against(bases)
        merged = self.moments()
        sites = [(s, merged[s]) for s in bases if merged[s].count]
        for site, grads in sites:
            _check_testable(site, grads, bases[site])
        # two names of one tensor are tested once; distinct sites side by side
        first = first_equal(sites, lambda a, b: _same(a, b, bases))
        order = sorted(set(first))

        def reference(site: Site, grads: Moments) -> Tensor:
            shape = (references or {}).get(site)
            return reference_at(pooled_shape([grads]) if shape is None else shape, grads)

        def test(item: tuple[Site, Moments]) -> dict[str, float]:
            site, grads = item
            return tangent_tests(
                grads,
                bases[site],
                n_controls=self.n_controls,
                seed=self.seed,
                zeta=self.zeta,
                reference=reference(site, grads),
            )

        results = site_map(test, [sites[i] for i in order])
        tested = dict(zip(order, sites_bar(results, self, len(order)), strict=True))
        groups = self.group_sums(bases)
        out = []
        for (site, grads), j in zip(sites, first, strict=True):
            basis, sums = bases[site], groups[site]
            values = dict(tested[j])
            # the activations' share from the group sums: the random-backprop null
            tangent, total = sums[:, 2:].sum(0).tolist()
            act = energy_ratio(tangent / total if total > 0 else math.nan, basis.k, basis.d)
            values["normalized_ratio"] = values["energy_ratio"] / act if act > 0 else math.nan
            values["n_tokens"] = float(grads.count)
            cis = self._intervals(site, basis, sums, reference(site, grads))
            out += [row(self.name, site, k, v, **ci_columns(cis.get(k))) for k, v in values.items()]

        def ratio(site: Site, tangent: float, total: float) -> float:
            share = tangent / total if total > 0 else math.nan
            return energy_ratio(share, bases[site].k, bases[site].d)

        energies = {s: g[:, :2] for s, g in groups.items()}
        return out + amplification_rows(self.name, "energy_amplification", energies, ratio)

    def _intervals(
        self, site: Site, basis: TangentBasis, sums: Tensor, reference: Tensor
    ) -> dict[str, tuple[float, float]]:
        seen = (sums[:, 1] > 0) & (sums[:, 3] > 0)
        if int(seen.sum()) < 2:
            return {}
        cis = share_intervals(sums[seen, :2], k=basis.k, d=basis.d, activation_sums=sums[seen, 2:])
        if self.basis_free:  # ΔIsoScore* left one group out needs that group's covariance
            kept = [m for m, s in zip(self.group_moments(site), seen.tolist(), strict=True) if s]
            iso = tangent_intervals(kept, basis, zeta=self.zeta, reference=reference)
            cis["delta_iso_tangent"] = iso["delta_iso_tangent"]
        return cis


def _same(
    a: tuple[Site, Moments], b: tuple[Site, Moments], bases: Mapping[Site, TangentBasis]
) -> bool:
    """Bit-identical gradients and basis: two names of one tensor (with the basis
    `fit_bases` relabels)."""
    return a[1].identical(b[1]) and torch.equal(bases[a[0]].basis_, bases[b[0]].basis_)


def _residual_sites(plan: Plan) -> dict[Site, TangentBasis]:
    return {s: b for s, b in plan.scoped.items() if s.kind in RESIDUAL_KINDS}


register(
    ProbeSpec("gradient", GradientProbe, _residual_sites, options=("n_controls", "zeta"), order=1)
)


def _check_testable(site: Site, grads: Moments, basis: TangentBasis) -> None:
    """Refuse, naming the site, what `tangent_tests` cannot test: a covariance needs two
    vectors, and ΔIsoScore* an isotropy of at least two dimensions besides Q_T."""
    if grads.count < 2:
        raise UsageError(
            f"{site.hook_name}: one gradient vector; its tests need at least 2: probe more "
            "tokens (more sequences, or longer ones)."
        )
    if basis.d - basis.k < 2:
        raise UsageError(
            f"{site.hook_name}: rank {basis.k} leaves {basis.d - basis.k} dimension of "
            f"d={basis.d} outside Q_T, where ΔIsoScore* needs 2: fit with rank <= "
            f"{basis.d - 2}, or drop the gradient probe."
        )
