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
state: their share for ``normalized_ratio`` is the ratio of the group sums (an
activation `Moments` per site cost a float64 batch product per site and pass; the
``activation`` probe collects them where they are wanted).

``energy_amplification`` (energy_ratio[l] / energy_ratio[p], p the previous probed layer
of the site kind) comes with a joint jackknife over the same groups
(`tangentlens.probes.residual.amplification_rows`).

Works on frozen models: the session makes the embedding output require grad.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..core.compute import site_map
from ..core.errors import UsageError
from ..core.settings import N_CONTROLS, ZETA
from ..core.significance import energy_ratio, pooled_shape, reference_at, tangent_tests
from ..core.stats import Moments, state_dtype
from ..core.subspace import TangentBasis
from ..core.uncertainty import share_intervals
from ..core.validation import check_int
from ..hooks.sites import RESIDUAL_KINDS, Site
from .base import Observation, Probe, Sum, ci_columns, first_equal, row, sites_bar
from .registry import Plan, ProbeSpec, register
from .residual import amplification_rows, energy_sums

__all__ = ["GradientProbe"]


class GradientProbe(Probe):
    """Gradient `Moments` per residual site and their tests against the site's basis."""

    name = "gradient"

    def __init__(
        self,
        bases: Mapping[Site, TangentBasis],
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
        self.bases = dict(bases)
        self.n_controls = check_int(n_controls, "n_controls", minimum=1)
        if not (isinstance(zeta, int | float) and 0 <= zeta <= 1):
            raise UsageError(
                f"zeta (IsoScore* shrinkage) must be a number in [0, 1]; got {zeta!r}."
            )
        self.zeta = float(zeta)
        self.seed = check_int(seed, "seed", minimum=0)
        self.n_groups = check_int(n_groups, "n_groups", minimum=2)
        self.memory = memory
        for site in self.bases:
            self.add_state(f"grad/{site.hook_name}", lambda: Moments(dtype=dtype))
            # per group: gradient (tangent, total) energy, then the activations'
            self.add_state(f"groups/{site.hook_name}", lambda: Sum((self.n_groups, 4)))

    @property
    def forward_sites(self) -> list[Site]:
        return list(self.bases)

    @property
    def backward_sites(self) -> list[Site]:
        return list(self.bases)

    def update(self, obs: Observation) -> None:
        self._add_group(obs, 2)

    def update_gradient(self, obs: Observation) -> None:
        self.state(f"grad/{obs.site.hook_name}").add_batch(*obs.statistics())
        self._add_group(obs, 0)

    def _add_group(self, obs: Observation, column: int) -> None:
        total, tangent, _ = energy_sums(obs.tensor, self.bases[obs.site], obs.mask)
        sums = self.state(f"groups/{obs.site.hook_name}")
        update = torch.zeros_like(sums.value, device=total.device)
        update[obs.group % self.n_groups, column : column + 2] = torch.stack([tangent, total])
        sums.add(update)

    def moments(self) -> dict[Site, Moments]:
        """Site → `Moments` of the gradients."""
        return {s: self.state(f"grad/{s.hook_name}") for s in self.bases}

    def rows(self) -> list[dict[str, Any]]:
        out = []
        sites = [(s, g) for s, g in self.moments().items() if g.count]
        # two names of one tensor are tested once; distinct sites side by side
        first = first_equal(sites, self._same)
        order = sorted(set(first))

        def test(item: tuple[Site, Moments]) -> dict[str, float]:
            site, grads = item
            # ΔIsoScore*'s reference as a study's, from a pool of this one checkpoint
            reference = reference_at(pooled_shape([grads]), grads)
            return tangent_tests(
                grads,
                self.bases[site],
                n_controls=self.n_controls,
                seed=self.seed,
                zeta=self.zeta,
                reference=reference,
            )

        results = site_map(test, [sites[i] for i in order])
        tested = dict(zip(order, sites_bar(results, self, len(order)), strict=True))
        for (site, grads), j in zip(sites, first, strict=True):
            values = dict(tested[j])
            # the activations' share from the group sums
            tangent, total = self.state(f"groups/{site.hook_name}").value[:, 2:].sum(0).tolist()
            act = self._ratio(site, tangent, total)
            values["normalized_ratio"] = values["energy_ratio"] / act if act > 0 else math.nan
            values["n_tokens"] = float(grads.count)
            cis = self._intervals(site)
            out += [row(self.name, site, k, v, **ci_columns(cis.get(k))) for k, v in values.items()]
        groups = {s: self.state(f"groups/{s.hook_name}").value.cpu()[:, :2] for s in self.bases}
        return out + amplification_rows(self.name, "energy_amplification", groups, self._ratio)

    def _same(self, a: tuple[Site, Moments], b: tuple[Site, Moments]) -> bool:
        """Bit-identical gradients and basis: two names of one tensor (with the basis
        `fit_bases` relabels)."""
        return a[1].identical(b[1]) and torch.equal(
            self.bases[a[0]].basis_, self.bases[b[0]].basis_
        )

    def _ratio(self, site: Site, tangent: float, total: float) -> float:
        share = tangent / total if total > 0 else math.nan
        return energy_ratio(share, self.bases[site].k, self.bases[site].d)

    def _intervals(self, site: Site) -> dict[str, tuple[float, float]]:
        sums = self.state(f"groups/{site.hook_name}").value.cpu()
        seen = sums[(sums[:, 1] > 0) & (sums[:, 3] > 0)]
        if seen.shape[0] < 2:
            return {}
        basis = self.bases[site]
        return share_intervals(seen[:, :2], k=basis.k, d=basis.d, activation_sums=seen[:, 2:])


def _residual_sites(plan: Plan) -> dict[Site, TangentBasis]:
    return {s: b for s, b in plan.scoped.items() if s.kind in RESIDUAL_KINDS}


register(
    ProbeSpec("gradient", GradientProbe, _residual_sites, options=("n_controls", "zeta"), order=1)
)
