"""Jackknife intervals over groups of sequences: known values, coverage on correlated
tokens with a known answer, width against token count, agreement with tangent_tests."""

import math

import numpy as np
import pytest
import torch
from scipy import special, stats

from tangentlens.core import metrics as M
from tangentlens.core.errors import UsageError
from tangentlens.core.significance import tangent_tests
from tangentlens.core.stats import Moments
from tangentlens.core.subspace import TangentBasis, complement
from tangentlens.core.uncertainty import jackknife_interval, share_intervals, tangent_intervals

D, K, RHO, GROUPS = 16, 3, 0.8, 10


def _problem():
    """A planted anisotropic second moment Σ (zero mean) and a basis near its top directions."""
    gen = torch.Generator().manual_seed(0)
    rot = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64))[0]
    sigma = rot @ torch.diag(torch.logspace(-0.7, 0.6, D, dtype=torch.float64)) @ rot.T
    noise = 0.15 * torch.randn(D, K, generator=gen, dtype=torch.float64)
    basis = TangentBasis(torch.linalg.qr(rot[:, -K:] + noise)[0])
    return torch.linalg.cholesky(sigma), sigma, basis


ROOT, SIGMA, BASIS = _problem()


def _sequences(n_seq, length, gen):
    """AR(1) tokens within each sequence, marginally N(0, Σ): tokens are not independent."""
    x = torch.empty(n_seq, length, D, dtype=torch.float64)
    x[:, 0] = torch.randn(n_seq, D, generator=gen, dtype=torch.float64) @ ROOT.T
    for t in range(1, length):
        eps = torch.randn(n_seq, D, generator=gen, dtype=torch.float64) @ ROOT.T
        x[:, t] = RHO * x[:, t - 1] + (1 - RHO**2) ** 0.5 * eps
    return x


def _groups(gen, per_group=8, length=32):
    """GROUPS groups of whole sequences: tokens of group g, shape (GROUPS, tokens, D)."""
    return _sequences(GROUPS * per_group, length, gen).reshape(GROUPS, -1, D)


def _moments(x):
    return [Moments().update(xg) for xg in x]


def _covers(interval, truth):
    return interval[0] <= truth <= interval[1]


def test_jackknife_of_a_mean_is_the_t_interval():
    x = np.random.default_rng(0).normal(size=12)
    loo = [(x.sum() - v) / (x.size - 1) for v in x]
    lo, hi = jackknife_interval(loo, x.mean(), level=0.9)
    half = stats.t.ppf(0.95, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)
    assert lo == pytest.approx(x.mean() - half, rel=1e-12)
    assert hi == pytest.approx(x.mean() + half, rel=1e-12)
    assert all(np.isnan(jackknife_interval([1.0, float("inf")], 1.0)))


def test_intervals_are_centred_on_the_tangent_tests_values():
    gen = torch.Generator().manual_seed(1)
    grads, acts = _moments(_groups(gen)), _moments(_groups(gen) + 0.3)
    reference = torch.eye(D, dtype=torch.float64) * 2
    total, act_total = Moments(), Moments()
    for g, a in zip(grads, acts, strict=True):
        total.merge(g)
        act_total.merge(a)
    point = tangent_tests(
        total, BASIS, n_controls=9, zeta=0.2, reference=reference, activation_moments=act_total
    )
    iv = tangent_intervals(
        grads, BASIS, activation_groups=acts, zeta=0.2, reference=reference, level=0.9
    )
    assert set(iv) == {"tangent_share", "energy_ratio", "normalized_ratio", "delta_iso_tangent"}
    for name, (lo, hi) in iv.items():
        assert lo < point[name] < hi
        # ratios are centred on the log scale (positive intervals), the share on its logit
        # (inside (0, 1)), ΔIso* plainly
        if name in ("energy_ratio", "normalized_ratio"):
            centre = math.sqrt(lo * hi)
        elif name == "tangent_share":
            centre = float(special.expit((special.logit(lo) + special.logit(hi)) / 2))
        else:
            centre = (lo + hi) / 2
        assert centre == pytest.approx(point[name], rel=1e-12)
    assert "normalized_ratio" not in tangent_intervals(grads, BASIS)
    same = tangent_intervals(grads, BASIS, activation_groups=grads)["normalized_ratio"]
    assert same == pytest.approx((1.0, 1.0), abs=1e-12)


def test_coverage_with_correlated_tokens(one_thread):
    """Nominal 95 % intervals cover the analytic truth ≥ 90 % of the time over 200
    replications; groups of shuffled tokens (the independence assumption) do not."""
    gen = torch.Generator().manual_seed(2)
    q = BASIS.basis_
    share = float(torch.trace(q.T @ SIGMA @ q) / torch.trace(SIGMA))
    ratio = share / ((1 - share) * K / (D - K))
    c = complement(BASIS)
    delta_iso = M.isoscore_from_cov(c.T @ SIGMA @ c) - M.isoscore_from_cov(SIGMA)
    hits = np.zeros(4)
    reps = 200
    for r in range(reps):
        x = _groups(gen)
        iv = tangent_intervals(_moments(x), BASIS)
        shuffled = x.reshape(-1, D)[torch.randperm(x.shape[0] * x.shape[1], generator=gen)]
        naive = tangent_intervals(_moments(shuffled.reshape(GROUPS, -1, D)), BASIS)
        hits += [
            _covers(iv["tangent_share"], share),
            _covers(iv["energy_ratio"], ratio),
            _covers(iv["delta_iso_tangent"], delta_iso),
            _covers(naive["tangent_share"], share),
        ]
        if r < 5:  # the scalar-sum path gives the same intervals
            sums = torch.stack([torch.stack([(xg @ q).pow(2).sum(), xg.pow(2).sum()]) for xg in x])
            scalar = share_intervals(sums, k=K, d=D)
            for name in ("tangent_share", "energy_ratio"):
                assert scalar[name] == pytest.approx(iv[name], rel=1e-10)
            low, high = scalar["share_ratio"]  # the share's interval, times d/k
            assert (low, high) == pytest.approx(tuple(v * D / K for v in iv["tangent_share"]))
            assert 0 < iv["tangent_share"][0] < iv["tangent_share"][1] < 1
    share_rate, ratio_rate, iso_rate, naive_rate = hits / reps
    assert share_rate >= 0.90
    assert ratio_rate >= 0.90
    assert iso_rate >= 0.88  # IsoScore of a sample covariance is biased at n ≈ 2,500
    assert naive_rate < 0.85


def test_four_times_the_tokens_halves_the_width(one_thread):
    gen = torch.Generator().manual_seed(3)

    def mean_width(per_group):
        widths = []
        for _ in range(20):
            x = _groups(gen, per_group=per_group)
            lo, hi = tangent_intervals(_moments(x), BASIS)["tangent_share"]
            total = Moments().update(x)
            assert (
                lo
                < float(torch.trace(BASIS.basis_.T @ total.second_moment() @ BASIS.basis_))
                / (total.trace_second_moment())
                < hi
            )
            widths.append(hi - lo)
        return np.mean(widths)

    assert 0.3 <= mean_width(32) / mean_width(8) <= 0.75


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda g: jackknife_interval([1.0], 1.0), "at least 2"),
        (lambda g: jackknife_interval([1.0, 2.0], 1.0, level=1.0), "level"),
        (lambda g: tangent_intervals(g[:1], BASIS), "at least 2 groups"),
        (lambda g: tangent_intervals([*g, Moments()], BASIS), "empty group"),
        (lambda g: tangent_intervals(g, BASIS, activation_groups=g[:2]), "same groups"),
        (lambda g: share_intervals(torch.ones(4, 3), k=K, d=D), r"\(G, 2\)"),
        (lambda g: share_intervals(torch.ones(4, 2), k=D, d=D), r"k (must be|\d+ is too large)"),
    ],
)
def test_bad_input(call, match):
    groups = _moments(_groups(torch.Generator().manual_seed(4), per_group=1, length=4))
    with pytest.raises(UsageError, match=match):
        call(groups)
