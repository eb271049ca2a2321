"""Gradient probe: gradient `Moments` of the loss at residual sites, tested against Q_T.

Backward hooks collect, per site, the Moments of ∂loss/∂x (padding masked out). The
tests run on those d × d statistics (`tangentlens.significance`), so a thousand
matched-rank controls cost matrix algebra, not another pass:

- from `energy_test`: ``tangent_share`` (gradient energy in Q_T), ``chance_share``,
  ``energy_ratio`` (tangent share over the mean share of normal controls),
  ``p_value`` (controls with at least that share, add-one), ``normalized_ratio``
  (energy ratio divided by Q_T's own activation-energy ratio, from the activation
  Moments collected at the site in the same session: the activations whose gradients
  are tested);
- from `isotropy_test`: ``delta_iso_tangent`` and ``delta_iso_normal`` (change of
  IsoScore* when Q_T, or a normal control, is projected out) and ``isotropy_p_value``.

Works on frozen models: the session makes the embedding output require grad.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from ..hooks.sites import RESIDUAL_KINDS, Site
from ..stats import Moments, SharedBatch
from ..subspace import TangentBasis
from .residual import _row

__all__ = ["GradientProbe"]


class GradientProbe:
    """Gradient `Moments` per residual site and their tests against the site's basis."""

    name = "gradient"

    def __init__(
        self,
        bases: Mapping[Site, TangentBasis],
        n_controls: int = 1000,
        seed: int = 0,
        controls: str = "normal",
    ) -> None:
        for site in bases:
            if site.kind not in RESIDUAL_KINDS:
                raise ValueError(
                    f"the gradient probe reads residual sites {RESIDUAL_KINDS}; got {site}."
                )
        if not isinstance(n_controls, int) or n_controls < 1:
            raise ValueError(f"n_controls must be an int >= 1; got {n_controls!r}.")
        self.bases = dict(bases)
        self.n_controls = n_controls
        self.seed = seed
        if controls not in ("normal", "uniform"):
            raise ValueError(f"controls must be 'normal' or 'uniform'; got {controls!r}.")
        self.controls = controls
        self.moments: dict[Site, Moments] = {s: Moments() for s in bases}
        self._shared = SharedBatch()

    @property
    def sites(self) -> list[Site]:
        return list(self.bases)

    def update(self, site: Site, grad: Tensor, mask: Tensor | None = None) -> None:
        self.moments[site].add_batch(*self._shared(grad, mask))

    def rows(self, activation_moments: Mapping[Site, Moments] | None = None) -> list[dict]:
        from ..significance import tangent_tests

        out = []
        for site, grads in self.moments.items():
            if grads.count == 0:
                continue
            acts = (activation_moments or {}).get(site)
            values = tangent_tests(
                grads,
                self.bases[site],
                n_controls=self.n_controls,
                seed=self.seed,
                controls=self.controls,
                activation_moments=acts if acts is not None and acts.count else None,
            )
            values["n_tokens"] = float(grads.count)
            out += [_row(self.name, site, k, v) for k, v in values.items()]
        return out
