"""energy_test and isotropy_test: brute force, planted truth, calibration, bad input."""

import numpy as np
import pytest
import torch

from tangentlens import metrics as M
from tangentlens.significance import _ControlAlgebra, energy_test, isotropy_test
from tangentlens.stats import Moments
from tangentlens.subspace import TangentBasis, complement, normal_controls

pytestmark = pytest.mark.filterwarnings("ignore:k/d")


def _basis(d, k, gen):
    return TangentBasis(torch.linalg.qr(torch.randn(d, k, generator=gen, dtype=torch.float64))[0])


def _grads(n, d, gen, scales=None):
    g = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return g * scales if scales is not None else g


def test_control_algebra_equals_explicit_projection():
    """The Gram trick gives, frame by frame, what projecting onto the frames gives."""
    gen = torch.Generator().manual_seed(0)
    d, k = 12, 3
    b = _basis(d, k, gen)
    x = _grads(500, d, gen, torch.linspace(0.1, 2, d, dtype=torch.float64)) + 0.3
    s = Moments().update(x).covariance(ddof=1)
    frames = normal_controls(b, 7, seed=1)
    alg = _ControlAlgebra(s, b.basis_, "normal")
    c = complement(b)
    _, u = torch.linalg.eigh((c.T @ s @ c + (c.T @ s @ c).T) / 2)
    g = u.T @ (c.T @ frames)  # the same frames in the algebra's coordinates
    qsq = frames.transpose(1, 2) @ s @ frames
    torch.testing.assert_close(alg.trace(g), torch.diagonal(qsq, dim1=1, dim2=2).sum(1))
    sq = s @ s
    torch.testing.assert_close(
        alg.trace_sq(g), torch.diagonal(frames.transpose(1, 2) @ sq @ frames, dim1=1, dim2=2).sum(1)
    )
    torch.testing.assert_close(alg.frob_sq(g), qsq.pow(2).sum((1, 2)))


def test_isotropy_test_matches_brute_force_isoscore_star():
    gen = torch.Generator().manual_seed(1)
    d, k = 16, 2
    b = _basis(d, k, gen)
    x = _grads(800, d, gen, torch.linspace(0.2, 3, d, dtype=torch.float64))
    ref = torch.eye(d, dtype=torch.float64) * 2
    c = complement(b)
    for reference in (None, ref):
        r = isotropy_test(Moments().update(x), b, n_controls=50, zeta=0.3, reference=reference)
        before = float(M.isoscore_star(x, zeta=0.3, reference=reference))
        after = float(
            M.isoscore_star(x @ c, zeta=0.3, reference=None if reference is None else c.T @ ref @ c)
        )
        assert r.iso_before == pytest.approx(before, abs=1e-12)
        assert r.delta_tangent == pytest.approx(after - before, abs=1e-12)
        assert r.statistic == pytest.approx(r.delta_tangent - r.delta_normal)


def test_energy_null_matches_explicit_controls_in_distribution():
    gen = torch.Generator().manual_seed(2)
    d, k = 20, 2
    b = _basis(d, k, gen)
    m = Moments().update(_grads(2000, d, gen, torch.linspace(0.1, 3, d, dtype=torch.float64)))
    r = energy_test(m, b, n_controls=4000, seed=0)
    h = m.second_moment()
    frames = normal_controls(b, 4000, seed=9)
    brute = torch.einsum("nji,jl,nlk->nik", frames, h, frames).diagonal(dim1=1, dim2=2).sum(1)
    brute = brute / torch.trace(h)
    se = float(brute.std()) / np.sqrt(4000)
    assert abs(float(r.null_shares.mean()) - float(brute.mean())) < 5 * se * np.sqrt(2)
    assert float(r.null_shares.std()) == pytest.approx(float(brute.std()), rel=0.08)
    assert r.tangent_share == pytest.approx(
        float(b.basis_.T.mm(h).mm(b.basis_).trace() / h.trace())
    )


def test_planted_energy_gives_smallest_p_and_ratio_above_one():
    gen = torch.Generator().manual_seed(3)
    d, k = 32, 4
    b = _basis(d, k, gen)
    g = (
        _grads(1000, d, gen) * 0.1
        + torch.randn(1000, k, generator=gen, dtype=torch.float64) @ b.basis_.T
    )
    r = energy_test(Moments().update(g), b, n_controls=500)
    assert r.p_value == pytest.approx(1 / 501)
    assert r.ratio > 1
    assert r.chance_share == k / d
    iso = isotropy_test(Moments().update(g), b, n_controls=200)
    assert iso.delta_tangent > iso.delta_normal and iso.p_value == pytest.approx(1 / 201)


def test_normalized_ratio_divides_out_activation_share():
    gen = torch.Generator().manual_seed(4)
    d, k = 24, 3
    b = _basis(d, k, gen)
    acts = torch.randn(3000, d, generator=gen, dtype=torch.float64)
    m_act = Moments().update(acts)
    m_grad = Moments().update(acts)  # gradients with the activations' own geometry
    r = energy_test(m_grad, b, n_controls=2000, activation_moments=m_act)
    assert r.normalized_ratio == pytest.approx(r.ratio / r.activation_ratio)
    assert r.normalized_ratio == pytest.approx(1.0, abs=0.03)


def _calibration(d, k, controls, test=energy_test, trials=200, n=200):
    gen = torch.Generator().manual_seed(d * 100 + k)
    ps = []
    for t in range(trials):
        m = Moments().update(_grads(n, d, gen))
        ps.append(test(m, _basis(d, k, gen), n_controls=99, seed=t, controls=controls).p_value)
    return float(np.mean(np.asarray(ps) <= 0.05))


@pytest.mark.parametrize(
    "d, k, controls", [(16, 3, "uniform"), (64, 8, "uniform"), (96, 1, "normal")]
)
def test_energy_p_values_are_calibrated_under_isotropy(d, k, controls):
    assert 0.02 <= _calibration(d, k, controls) <= 0.09


def test_isotropy_p_values_are_calibrated_with_uniform_controls():
    assert 0.02 <= _calibration(16, 3, "uniform", test=isotropy_test) <= 0.09


def test_reproducible_and_warns_for_large_k_over_d():
    gen = torch.Generator().manual_seed(5)
    m = Moments().update(_grads(100, 16, gen))
    b = _basis(16, 3, gen)
    with pytest.warns(UserWarning, match="anti-conservative"):
        r1 = energy_test(m, b, n_controls=100, seed=7)
    r2 = energy_test(m, b, n_controls=100, seed=7)
    assert torch.equal(r1.null_shares, r2.null_shares)


def test_ten_thousand_controls_are_practical():
    gen = torch.Generator().manual_seed(6)
    d, k = 128, 8
    m = Moments().update(_grads(500, d, gen))
    r = energy_test(m, _basis(d, k, gen), n_controls=10_000)
    assert r.null_shares.shape == (10_000,)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m, b: energy_test(Moments(), b), "empty"),
        (lambda m, b: energy_test(m, TangentBasis(torch.eye(5)[:, :2])), "d=5"),
        (lambda m, b: energy_test(m, b, n_controls=0), "n_controls"),
        (lambda m, b: energy_test(m, b, controls="random"), "controls"),
        (lambda m, b: energy_test(m, TangentBasis(torch.eye(8)[:, :5])), "k <= d - k"),
        (lambda m, b: energy_test(Moments().update(torch.zeros(3, 8)), b), "zero"),
        (lambda m, b: isotropy_test(m, b, zeta=1.5), "zeta"),
        (lambda m, b: isotropy_test(m, b, reference=torch.eye(3)), "reference"),
        (lambda m, b: energy_test(m.covariance(), b), "Moments"),
    ],
)
def test_bad_input(call, match):
    m = Moments().update(torch.randn(50, 8))
    b = TangentBasis(torch.eye(8)[:, :2])
    with pytest.raises((ValueError, TypeError), match=match):
        call(m, b)
