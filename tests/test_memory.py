"""Memory per site, and ``memory="compact"`` (float32 state) against ``"full"``.

The 7B-class footprint (d = 4096, 128 sites) is computed from the probes' own state, sized
on the meta device (`Probe.state_bytes`): nothing that large is allocated here. A small
probe fed real data checks that the meta count equals the bytes actually held.
"""

from __future__ import annotations

import pytest
import torch
from models import tl_bridge, tokens

from tangentlens.core.subspace import TangentBasis
from tangentlens.hooks import Site
from tangentlens.probes import ActivationProbe, GradientProbe, fit_bases, run
from tangentlens.probes.base import BASES_KEY, Observation

KINDS = ("resid_pre", "resid_mid", "resid_post")
GB = 1e9


def _sites(n: int) -> list[Site]:
    return [Site(layer, kind) for layer in range(n // 3 + 1) for kind in KINDS][:n]


def _basis(d: int, k: int = 16) -> TangentBasis:
    return TangentBasis(torch.eye(d, k, dtype=torch.float64))


def test_7b_class_statistics_fit_in_16_gb_in_compact_mode():
    """d = 4096, 128 sites, n_groups = 10: the gradient probe's state (what its tests read)
    is 8.6 GB compact, 17 GB full; the activation probe's (what fit_bases reads) 8.6 GB."""
    d, n_sites, n_groups = 4096, 128, 10
    basis = _basis(d)  # one basis object shared by every site: 0.5 MB, not 64 MB
    bases = {s: basis for s in _sites(n_sites)}
    per_site = 4 * d * d + 8 * d + 8 * 4 * n_groups  # float32 scatter, float64 mean, sums
    compact = GradientProbe(bases, n_groups=n_groups, memory="compact").state_bytes(d)
    assert compact == n_sites * per_site
    assert compact < 16 * GB
    full = GradientProbe(bases, n_groups=n_groups).state_bytes(d)
    assert full == n_sites * (8 * d * d + 8 * d + 8 * 4 * n_groups) > 16 * GB
    sites = list(bases)
    act = ActivationProbe(sites, memory="compact").state_bytes(d)
    assert act == n_sites * (4 * d * d + 8 * d) < 16 * GB


@pytest.mark.parametrize("memory", ["full", "compact"])
def test_state_bytes_counts_what_is_held(memory):
    d, groups = 24, 3
    bases = {s: _basis(d, 4) for s in _sites(2)}
    probe = GradientProbe(bases, n_groups=groups, memory=memory)
    planned = probe.state_bytes(d)
    for i, site in enumerate(bases):
        probe.update(Observation(site, torch.randn(2, 5, d), group=i))
        probe.update_gradient(Observation(site, torch.randn(2, 5, d), group=i))
    state = probe.state_dict()
    assert state.pop(BASES_KEY).shape == (32,)  # the bases' digest, not statistics
    held = sum(t.nbytes for k, t in state.items() if not k.endswith("/count"))
    assert planned == probe.state_bytes(d) == held


def test_compact_mode_matches_full_on_a_model():
    """The same rows in both modes: shares and ratios within 1e-6 relative, ΔIso* within
    1e-6 absolute (float32 state), p-values equal (same frames, same statistic)."""
    model = tl_bridge("llama")
    batches = [tokens("llama", batch=2, pos=12, seed=s) for s in range(3)]
    bases = fit_bases(model, batches, rank=4, progress=False)
    compact_bases = fit_bases(model, batches, rank=4, progress=False, memory="compact")
    for name, b in bases.items():
        assert (b.basis_.T @ compact_bases[name].basis_).pow(2).sum() / b.k > 1 - 1e-6
    opts = {"n_controls": 50, "progress": False}
    tables = {
        m: run(model, batches, bases, ("residual", "gradient"), memory=m, **opts)
        .results(progress=False)
        .set_index(["probe", "hook", "statistic"])["value"]
        for m in ("full", "compact")
    }
    full, compact = tables["full"].sort_index(), tables["compact"].sort_index()
    assert full.index.equals(compact.index)
    stat = full.index.get_level_values("statistic")
    for name in ("tangent_share", "energy_ratio", "normalized_ratio", "share_ratio"):
        a, b = full[stat == name], compact[stat == name]
        assert len(a) and ((a - b).abs() / a.abs()).max() < 1e-6, name
    for name in ("delta_iso_tangent", "delta_iso_normal", "iso_statistic"):
        assert (full[stat == name] - compact[stat == name]).abs().max() < 1e-6, name
    session = run(model, batches, bases, ("gradient",), memory="compact", **opts)
    assert session.activation_moments == {}  # the gradient probe keeps no activation Moments
