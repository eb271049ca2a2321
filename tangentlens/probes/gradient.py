"""Gradient probe: gradient `Moments` of the loss at residual sites, tested against Q_T.

Backward hooks collect, per site, the Moments of ∂loss/∂x (padding masked out). The
tests run on those d × d statistics (`tangentlens.significance`), so a thousand
matched-rank controls cost matrix algebra, not another pass:

- from `energy_test`: ``tangent_share`` (gradient energy in Q_T), ``chance_share``,
  ``energy_ratio`` (tangent share over the exact mean share of matched-rank normal
  controls), ``p_value`` (uniform controls with at least that share, add-one),
  ``p_value_normal`` (the paper's complement controls), ``normalized_ratio`` (energy
  ratio divided by Q_T's own activation-energy ratio, from the activation Moments
  this probe also collects at the site: the activations whose gradients are tested);
- from `isotropy_test`: ``delta_iso_tangent`` and ``delta_iso_normal`` (change of
  IsoScore* when Q_T, or a normal control, is projected out) and ``isotropy_p_value``.

Works on frozen models: the session makes the embedding output require grad.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import UsageError
from ..hooks.sites import RESIDUAL_KINDS, Site
from ..significance import tangent_tests
from ..stats import Moments
from ..subspace import TangentBasis
from ..validation import check_int
from .base import Observation, Probe, row

__all__ = ["GradientProbe"]


class GradientProbe(Probe):
    """Gradient `Moments` per residual site and their tests against the site's basis."""

    name = "gradient"

    def __init__(
        self, bases: Mapping[Site, TangentBasis], *, n_controls: int = 1000, seed: int = 0
    ) -> None:
        super().__init__()
        for site in bases:
            if site.kind not in RESIDUAL_KINDS:
                raise UsageError(
                    f"the gradient probe reads residual sites {RESIDUAL_KINDS}; got {site}."
                )
        self.bases = dict(bases)
        self.n_controls = check_int(n_controls, "n_controls", minimum=1)
        self.seed = check_int(seed, "seed", minimum=0)
        for site in self.bases:
            self.add_state(f"act/{site.hook_name}", Moments)
            self.add_state(f"grad/{site.hook_name}", Moments)

    @property
    def forward_sites(self) -> list[Site]:
        return list(self.bases)

    @property
    def backward_sites(self) -> list[Site]:
        return list(self.bases)

    def update(self, obs: Observation) -> None:
        self.state(f"act/{obs.site.hook_name}").add_batch(*obs.statistics())

    def update_gradient(self, obs: Observation) -> None:
        self.state(f"grad/{obs.site.hook_name}").add_batch(*obs.statistics())

    def moments(self, kind: str = "grad") -> dict[Site, Moments]:
        """Site → `Moments` of the gradients (``kind="grad"``) or activations (``"act"``)."""
        return {s: self.state(f"{kind}/{s.hook_name}") for s in self.bases}

    def rows(self) -> list[dict[str, Any]]:
        out = []
        acts = self.moments("act")
        for site, grads in self.moments("grad").items():
            if grads.count == 0:
                continue
            values = tangent_tests(
                grads,
                self.bases[site],
                n_controls=self.n_controls,
                seed=self.seed,
                activation_moments=acts[site] if acts[site].count else None,
            )
            values["n_tokens"] = float(grads.count)
            out += [row(self.name, site, k, v) for k, v in values.items()]
        return out
