"""Ratio intervals on the log scale: positive whatever the spread, and named gaps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tangentlens.core.uncertainty import jackknife_interval, share_intervals
from tangentlens.hooks.sites import Site
from tangentlens.probes.residual import amplification_rows


def test_log_scale_interval_is_the_exponentiated_interval_of_the_log() -> None:
    loo = [0.5, 3.0, 1.2, 9.0, 0.8]
    low, high = jackknife_interval(loo, 1.5, log_scale=True)
    want = jackknife_interval(np.log(loo), math.log(1.5))
    assert (low, high) == pytest.approx(tuple(math.exp(v) for v in want))
    assert jackknife_interval(loo, 1.5)[0] < 0 < low < 1.5 < high  # plain one runs negative
    assert jackknife_interval([-1.0, 2.0], 1.0, log_scale=True) == jackknife_interval(
        [-1.0, 2.0], 1.0
    )  # not all positive: the plain interval


def test_ratio_intervals_stay_positive_on_noisy_groups() -> None:
    gen = torch.Generator().manual_seed(0)
    total = torch.rand(6, generator=gen, dtype=torch.float64) * 10 + 1
    tangent = total * torch.rand(6, generator=gen, dtype=torch.float64) ** 4  # very uneven
    acts = torch.stack([total * 0.1, total], 1)
    cis = share_intervals(torch.stack([tangent, total], 1), k=2, d=16, activation_sums=acts)
    for name in ("share_ratio", "energy_ratio", "normalized_ratio"):
        assert cis[name][0] > 0, name


def test_amplification_interval_is_positive_and_a_gap_is_named() -> None:
    gen = torch.Generator().manual_seed(1)

    def sums() -> torch.Tensor:
        total = torch.rand(8, generator=gen, dtype=torch.float64) + 0.5
        return torch.stack(
            [total * torch.rand(8, generator=gen, dtype=torch.float64) ** 3, total], 1
        )

    groups = {Site(layer, "resid_pre"): sums() for layer in (0, 1, 3)}

    def ratio(site: Site, tangent: float, total: float) -> float:
        return tangent / total * 8

    with pytest.warns(UserWarning, match=r"blocks.3.hook_resid_pre over layer 1.*\[2\] have no"):
        rows = amplification_rows("residual", "share_amplification", groups, ratio)
    assert [r["layer"] for r in rows] == [1, 3]
    assert all(r["ci_low"] > 0 and r["ci_low"] <= r["value"] <= r["ci_high"] for r in rows)
