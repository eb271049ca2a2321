"""Metrics against the reference packages, known values and the Moments forms."""

import warnings

import numpy as np
import pytest
import torch

from tangentlens.core import metrics as M
from tangentlens.core.errors import UsageError
from tangentlens.core.stats import Moments


def _anisotropic(n=4000, d=24, seed=0):
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    return (rng.normal(size=(n, d)) * np.geomspace(0.05, 4, d)) @ q + 3.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_isoscore_matches_reference_package(seed):
    from IsoScore import IsoScore as ref

    x = _anisotropic(seed=seed)
    assert M.isoscore(x) == pytest.approx(float(ref.IsoScore(x)), abs=1e-6)
    assert M.isoscore(Moments().update(torch.as_tensor(x))) == pytest.approx(
        M.isoscore(x), abs=1e-12
    )


@pytest.mark.parametrize("zeta", [0.0, 0.2, 0.7])
def test_isoscore_star_matches_reference_package(zeta):
    from IsoScore import IsoScore as ref

    x = _anisotropic(seed=3)
    d = x.shape[1]
    rng = np.random.default_rng(1)
    a = rng.normal(size=(d, d))
    reference = a @ a.T / d + np.eye(d)
    ours = float(M.isoscore_star(x, zeta=zeta, reference=reference))
    theirs = float(ref.IsoScore_star(x, torch.as_tensor(reference), zeta))
    assert ours == pytest.approx(theirs, abs=1e-6)
    # default reference: the scale-matched identity tr(C)/d I
    c = np.cov(x.T)
    scaled = np.eye(d) * np.trace(c) / d
    assert float(M.isoscore_star(x, zeta=zeta)) == pytest.approx(
        float(ref.IsoScore_star(x, torch.as_tensor(scaled), zeta)), abs=1e-6
    )


def test_isoscore_star_zero_zeta_is_isoscore_and_scale_free():
    x = _anisotropic(seed=4)
    assert float(M.isoscore_star(x, zeta=0.0)) == pytest.approx(M.isoscore(x), abs=1e-12)
    a = float(M.isoscore_star(x, zeta=0.4))
    assert float(M.isoscore_star(x * 1000.0, zeta=0.4)) == pytest.approx(a, abs=1e-10)


def test_isoscore_star_is_differentiable():
    x = torch.randn(200, 6, dtype=torch.float64, requires_grad=True)
    M.isoscore_star(x * torch.arange(1, 7), zeta=0.1).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize("k, n", [(1, 10), (3, 10), (5, 20), (20, 20)])
def test_isoscore_known_value(k, n):
    """k equal-variance directions of n dims, randomly rotated: (k − 1)/(n − 1)."""
    rng = np.random.default_rng(k)
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    cov = q[:, :k] @ q[:, :k].T
    assert M.isoscore_from_cov(cov) == pytest.approx((k - 1) / (n - 1), abs=1e-12)
    pts = rng.normal(size=(200_000, k)) @ q[:, :k].T
    assert M.isoscore(pts) == pytest.approx((k - 1) / (n - 1), abs=0.01)


def test_effective_rank_known_values():
    rng = np.random.default_rng(0)
    assert M.effective_rank(rng.normal(size=(20_000, 10))) == pytest.approx(10, rel=0.01)
    rank1 = np.outer(rng.normal(size=300), rng.normal(size=10))
    assert M.effective_rank(rank1) == pytest.approx(1.0, abs=1e-6)
    x = rng.normal(size=(500, 8)) * np.arange(1, 9)
    assert M.effective_rank(Moments().update(torch.as_tensor(x))) == pytest.approx(
        M.effective_rank(x), rel=1e-9
    )


def test_participation_ratio_and_spectral_anisotropy():
    cov = np.diag([4.0, 1.0, 1.0, 0.0])
    assert M.participation_ratio_from_cov(cov) == pytest.approx(36 / 18)
    assert M.spectral_anisotropy_from_cov(cov) == pytest.approx(4 / 6)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 5)) + np.array([10.0, 0, 0, 0, 0])
    assert M.spectral_anisotropy(x) > 0.9  # the mean dominates raw energy
    assert M.spectral_anisotropy(x, centered=True) < 0.4
    m = Moments().update(torch.as_tensor(x))
    assert M.spectral_anisotropy(m) == pytest.approx(M.spectral_anisotropy(x), rel=1e-9)
    assert M.participation_ratio(m) == pytest.approx(M.participation_ratio(x), rel=1e-9)


def test_mean_cosine_equals_brute_force():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(257, 7)) + 0.5
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = u @ u.T
    brute = (s.sum() - np.trace(s)) / (len(x) * (len(x) - 1))
    assert M.mean_cosine(x) == pytest.approx(brute, abs=1e-12)
    m = Moments().update(torch.as_tensor(u))
    assert M.mean_cosine(m) == pytest.approx(brute, abs=1e-10)


def test_twonn_matches_skdim_and_recovers_planted_dimension():
    import skdim

    rng = np.random.default_rng(0)
    latent = rng.normal(size=(2000, 5))
    x = latent @ rng.normal(size=(5, 50))
    ours = M.twonn_dimension(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = skdim.id.TwoNN().fit(x).dimension_
    assert ours == pytest.approx(theirs, rel=0.03)
    assert ours == pytest.approx(5, rel=0.1)
    # duplicates are removed, not allowed to zero r1
    assert M.twonn_dimension(np.vstack([x, x[:200]])) == pytest.approx(ours, rel=1e-9)


def _sequences_on_curves(n_seq=200, length=20, seed=0):
    """Each sequence: ``length`` points along a tiny curve segment at its own anchor; the
    anchors fill a 5-dim Gaussian in R^30. Returns the points and their sequence labels."""
    rng = np.random.default_rng(seed)
    embed = np.linalg.qr(rng.normal(size=(30, 5)))[0]
    anchors = rng.normal(size=(n_seq, 5)) @ embed.T
    u, v = (rng.normal(size=(2, n_seq, 30)) / np.sqrt(30))[:, :, None]
    t = np.sort(rng.uniform(size=(n_seq, length)), axis=1)[..., None]
    x = anchors[:, None] + 1e-3 * (t * u + t**2 * v)
    return x.reshape(-1, 30), np.repeat(np.arange(n_seq), length)


def test_grouped_twonn_measures_the_dimension_across_sequences():
    x, groups = _sequences_on_curves()
    assert M.twonn_dimension(x) == pytest.approx(1.0, abs=0.2)  # each sequence's curve
    assert 3.5 <= M.twonn_dimension(x, groups) <= 6.5  # the 5-dim cloud of sequences
    # each row its own group is the ungrouped estimate
    assert M.twonn_dimension(x[:500], np.arange(500)) == pytest.approx(
        M.twonn_dimension(x[:500]), rel=1e-12
    )


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: M.twonn_dimension(np.random.rand(9, 2), [0, 1, 2] * 2), "one integer label"),
        (lambda: M.twonn_dimension(np.random.rand(6, 2), np.ones(6) / 2), "one integer label"),
        (lambda: M.twonn_dimension(np.random.rand(6, 2), [0, 0, 0, 1, 1, 1]), "3 distinct"),
        (lambda: M.twonn_dimension(np.random.rand(6, 2), None, 0.1), "positional"),
        (lambda: M.twonn_dimension(np.eye(10)), "equally far"),  # every μ = 1: no slope
    ],
)
def test_twonn_groups_bad_input(call, match):
    with pytest.raises((UsageError, TypeError), match=match):
        call()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: M.isoscore(np.ones(5)), "n_samples, d"),
        (lambda: M.isoscore(np.array([[1.0, np.nan], [0, 1]])), "NaN"),
        (lambda: M.isoscore(np.ones((10, 3))), "zero"),
        (lambda: M.isoscore_star(np.random.rand(10, 3), zeta=2), "zeta"),
        (lambda: M.isoscore_star(np.random.rand(10, 3), 0.5, np.eye(4)), "reference"),
        (lambda: M.mean_cosine(np.zeros((3, 2))), "zero rows"),
        (lambda: M.twonn_dimension(np.ones((10, 3))), "distinct"),
        (lambda: M.isoscore_from_cov(np.ones((2, 3))), "square"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(UsageError, match=match):
        call()
