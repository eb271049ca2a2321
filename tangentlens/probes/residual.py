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

State is float64 sums and a count per site, so batch splits and merges give the same
numbers as one pass; no activation is kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..errors import UsageError
from ..hooks.sites import RESIDUAL_KINDS, WRITE_KINDS, Site
from ..subspace import TangentBasis, shares
from .base import Observation, Probe, Sum, row

__all__ = ["ResidualProbe", "energy_sums", "write_basis_site"]


@torch.no_grad()
def energy_sums(x: Tensor, basis: TangentBasis, mask: Tensor | None = None) -> Tensor:
    """``[Σ‖x‖², Σ‖x Q_T‖², n]`` over the rows of ``x (..., d)`` kept by ``mask``, float64,
    on x's device (no host sync per batch)."""
    if mask is not None:
        x = x[mask.to(x.device).bool()]
    rows = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
    coords = basis.coordinates(rows)
    return torch.stack(
        [
            rows.pow(2).sum(),
            coords.pow(2).sum(),
            torch.tensor(float(rows.shape[0]), dtype=torch.float64, device=rows.device),
        ]
    )


def write_basis_site(write: Site, bases: Mapping[Site, object], n_layers: int) -> Site | None:
    """The residual site whose basis measures ``write`` (see the module docstring)."""
    if write.kind not in WRITE_KINDS:
        raise UsageError(f"write must be an attn_out or mlp_out site; got {write}.")
    candidates = [Site(write.layer, "resid_post")]
    if write.kind == "attn_out":
        candidates.insert(0, Site(write.layer, "resid_mid"))
    if write.layer + 1 < n_layers:
        candidates.append(Site(write.layer + 1, "resid_pre"))
    return next((c for c in candidates if c in bases), None)


class ResidualProbe(Probe):
    """Accumulates `energy_sums` per site. ``bases`` maps each measured site (residual
    sites and writes) to the basis it is measured in."""

    name = "residual"

    def __init__(self, bases: Mapping[Site, TangentBasis]) -> None:
        super().__init__()
        for site in bases:
            if site.kind not in (*RESIDUAL_KINDS, *WRITE_KINDS):
                raise UsageError(
                    f"the residual probe measures residual sites and writes; got {site}."
                )
        self.bases = dict(bases)
        for site in self.bases:
            self.add_state(site.hook_name, lambda: Sum((3,)))

    @property
    def forward_sites(self) -> list[Site]:
        return list(self.bases)

    def update(self, obs: Observation) -> None:
        sums = energy_sums(obs.tensor, self.bases[obs.site], obs.mask)
        self.state(obs.site.hook_name).add(sums)

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for site, basis in self.bases.items():
            total, tangent, n = self.state(site.hook_name).value.tolist()
            if n == 0:
                continue
            values = {
                **shares(tangent, total, basis.k, basis.d),
                "mean_sq_norm": total / n,
                "n_tokens": n,
            }
            out += [row(self.name, site, stat, v) for stat, v in values.items()]
        return out
