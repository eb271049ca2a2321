"""energy_test and isotropy_test: brute force, planted truth, closed forms, calibration,
bad input."""

import warnings

import numpy as np
import pytest
import torch

from tangentlens.core import controls as C
from tangentlens.core import metrics as M
from tangentlens.core.errors import ExchangeabilityWarning, UsageError
from tangentlens.core.significance import (
    delta_iso_tangent,
    energy_ratio,
    energy_test,
    isotropy_test,
    matrix_tests,
    tangent_tests,
)
from tangentlens.core.stats import Moments
from tangentlens.core.subspace import TangentBasis, complement, normal_controls

pytestmark = pytest.mark.filterwarnings("ignore::tangentlens.core.errors.ExchangeabilityWarning")


def _basis(d, k, gen):
    return TangentBasis(torch.linalg.qr(torch.randn(d, k, generator=gen, dtype=torch.float64))[0])


def _grads(n, d, gen, scales=None):
    g = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return g * scales if scales is not None else g


def _explicit_controls(site, frames):
    """The controls `controls.SiteFrames` works with, as explicit (n, d, k) frames: uniform W F
    and normal U B L⁻ᵀ (LLᵀ = BᵀB)."""
    k, frames, u = site.k, frames.double(), site.complement_basis()
    uniform = torch.cat([site.q_t, u], 1) @ frames
    b = frames[:, k:]
    chol = torch.linalg.cholesky(b.mT @ b)
    normal = u @ torch.linalg.solve_triangular(chol, b.mT, upper=False).mT
    return uniform, normal


@pytest.mark.parametrize("reduction", ["tridiagonal", "eigen"])
def test_site_frames_equal_explicit_projection(reduction, monkeypatch):
    """The arrow algebra gives, frame by frame, what projecting onto the frames gives,
    for uniform frames and for normal ones (orthonormal, in the complement of Q_T); with
    the CPU's tridiagonal reduction and with the eigendecomposition other devices use."""
    if reduction == "eigen":
        monkeypatch.setattr(C, "_reduce", C._Eigen)
    gen = torch.Generator().manual_seed(0)
    d, k, n = 14, 3, 9
    b = _basis(d, k, gen)
    x = _grads(300, d, gen, torch.linspace(0.1, 2, d, dtype=torch.float64)) + 0.4
    m = Moments().update(x)
    s, mu = m.covariance(), m.mean
    site = C.SiteFrames(s, b.basis_, rank_one=mu)
    draws = site.null(n, 5, normal=True, squares=True)
    uniform, normal = _explicit_controls(site, C.control_frames(d, k, n, 5).frames)
    eye = torch.eye(k, dtype=torch.float64).expand(n, k, k)
    torch.testing.assert_close(normal.mT @ normal, eye)
    torch.testing.assert_close(b.basis_.T @ normal, torch.zeros(n, k, k, dtype=torch.float64))
    for suffix, f in (("", uniform), ("_normal", normal)):
        fsf = f.mT @ s @ f
        expected = {
            "tr": fsf.diagonal(dim1=1, dim2=2).sum(1),
            "tr2": (f.mT @ s @ s @ f).diagonal(dim1=1, dim2=2).sum(1),
            "frob": fsf.pow(2).sum((1, 2)),
            "m": (f.mT @ mu).pow(2).sum(1),
        }
        for key, value in expected.items():
            # float32 traces (controls.NULL_DTYPE)
            torch.testing.assert_close(draws[key + suffix], value, rtol=2e-6, atol=1e-6)


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
        point = delta_iso_tangent(Moments().update(x), b, zeta=0.3, reference=reference)
        assert point == r.delta_tangent


def test_energy_null_matches_explicit_controls_in_distribution():
    gen = torch.Generator().manual_seed(2)
    d, k = 20, 2
    b = _basis(d, k, gen)
    m = Moments().update(_grads(2000, d, gen, torch.linspace(0.1, 3, d, dtype=torch.float64)))
    r = energy_test(m, b, n_controls=4000, seed=0, controls="normal")
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
    r = energy_test(m_grad, b, n_controls=20, activation_moments=m_act)
    assert r.normalized_ratio == pytest.approx(r.ratio / r.activation_ratio)
    assert r.normalized_ratio == pytest.approx(1.0, abs=1e-12)  # closed form: exactly 1
    s_act = float(torch.trace(b.basis_.T @ m_act.second_moment() @ b.basis_)) / float(
        m_act.trace_second_moment()
    )
    assert r.activation_ratio == pytest.approx(s_act / ((1 - s_act) * k / (d - k)), rel=1e-12)


def test_energy_ratio_is_the_closed_form_and_the_normal_control_mean_converges_to_it():
    gen = torch.Generator().manual_seed(8)
    d, k = 40, 5
    b = _basis(d, k, gen)
    scales = torch.linspace(0.2, 3, d, dtype=torch.float64)
    g = _grads(3000, d, gen, scales) + 0.5 * torch.randn(3000, k, dtype=torch.float64) @ b.basis_.T
    m = Moments().update(g)
    h = m.second_moment()
    s = float(torch.trace(b.basis_.T @ h @ b.basis_) / torch.trace(h))
    closed = s / ((1 - s) * k / (d - k))
    ratios = []
    for controls in ("uniform", "normal"):
        for n, seed in ((5, 0), (2000, 3)):
            r = energy_test(m, b, n_controls=n, seed=seed, controls=controls)
            assert r.tangent_share == pytest.approx(s, abs=1e-12)
            ratios.append(r.ratio)
            assert abs(r.ratio - closed) < 1e-9  # whatever the controls, their number or seed
    assert energy_ratio(s, k, d) == pytest.approx(closed, rel=1e-12)
    null = energy_test(m, b, n_controls=20_000, seed=1, controls="normal").null_shares
    se = float(null.std()) / np.sqrt(null.numel())
    assert abs(float(null.mean()) - (1 - s) * k / (d - k)) < 4 * se
    assert energy_ratio(1.0, k, d) == float("inf")


def _calibration(d, k, trials=400, n=2048, **options):
    """Rejection rates at 0.05 of both default tests under an isotropic Gaussian null,
    a fresh basis and fresh gradients per trial."""
    gen = torch.Generator().manual_seed(d * 100 + k)
    ps = []
    for t in range(trials):
        m = Moments().update(_grads(n, d, gen))
        b = _basis(d, k, gen)
        ps.append(
            [
                energy_test(m, b, n_controls=99, seed=t, **options).p_value,
                isotropy_test(m, b, n_controls=99, seed=t, **options).p_value,
            ]
        )
    return np.mean(np.asarray(ps) <= 0.05, axis=0)


@pytest.mark.parametrize("d, k", [pytest.param(128, 16, marks=pytest.mark.slow), (64, 8)])
def test_default_p_values_are_calibrated_under_isotropy(one_thread, d, k):
    energy_rate, isotropy_rate = _calibration(d, k)
    assert 0.02 <= energy_rate <= 0.08
    assert 0.02 <= isotropy_rate <= 0.08


def test_normal_controls_are_calibrated_at_small_k_over_d(one_thread):
    energy_rate, _ = _calibration(96, 1, trials=200, n=200, controls="normal")
    assert 0.02 <= energy_rate <= 0.09


def test_reproducible_and_warns_once_for_normal_controls_at_large_k_over_d():
    gen = torch.Generator().manual_seed(5)
    m = Moments().update(_grads(100, 16, gen))
    b = _basis(16, 3, gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r1 = energy_test(m, b, n_controls=100, seed=7, controls="normal")
    assert [w.category for w in caught] == [ExchangeabilityWarning]
    assert caught[0].filename == __file__  # points at the caller
    r2 = energy_test(m, b, n_controls=100, seed=7, controls="normal")
    assert torch.equal(r1.null_shares, r2.null_shares)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither the default nor tangent_tests warns
        energy_test(m, b, n_controls=100)
        isotropy_test(m, b, n_controls=100)
        tangent_tests(m, b, n_controls=100)
    with pytest.warns(ExchangeabilityWarning):
        isotropy_test(m, b, n_controls=100, controls="normal")


def test_tangent_tests_reports_both_kinds_of_controls():
    gen = torch.Generator().manual_seed(9)
    d, k = 24, 4
    b = _basis(d, k, gen)
    m = Moments().update(_grads(400, d, gen, torch.linspace(0.5, 2, d, dtype=torch.float64)))
    acts = Moments().update(_grads(400, d, gen))
    out = tangent_tests(m, b, n_controls=200, seed=3, zeta=0.2, activation_moments=acts)
    assert set(out) == {
        "tangent_share",
        "chance_share",
        "energy_ratio",
        "p_value",
        "p_value_normal",
        "normalized_ratio",
        "delta_iso_tangent",
        "delta_iso_normal",
        "iso_statistic",
        "isotropy_p_value",
        "isotropy_p_value_normal",
    }
    assert all(isinstance(v, float) for v in out.values())
    uniform = energy_test(m, b, n_controls=200, seed=3, activation_moments=acts)
    normal = energy_test(m, b, n_controls=200, seed=3, controls="normal")
    iso = isotropy_test(m, b, n_controls=200, seed=3, zeta=0.2)
    iso_normal = isotropy_test(m, b, n_controls=200, seed=3, zeta=0.2, controls="normal")
    assert out["p_value"] == uniform.p_value and out["p_value_normal"] == normal.p_value
    assert out["energy_ratio"] == uniform.ratio == normal.ratio
    assert out["normalized_ratio"] == uniform.normalized_ratio
    assert out["isotropy_p_value"] == iso.p_value and out["iso_statistic"] == iso.statistic
    assert out["delta_iso_tangent"] == iso.delta_tangent == iso_normal.delta_tangent
    assert out["delta_iso_normal"] == iso_normal.delta_normal
    assert out["isotropy_p_value_normal"] == iso_normal.p_value
    # no normal control fits when 2k > d: those entries are left out
    wide = tangent_tests(m, _basis(d, 13, gen), n_controls=20)
    assert "p_value_normal" not in wide and "delta_iso_normal" not in wide
    assert "normalized_ratio" not in wide and wide["p_value"] > 0


def test_control_frames_are_drawn_once_and_reused_across_sites():
    gen = torch.Generator().manual_seed(10)
    d, k = 32, 4
    draw = C.control_frames(d, k, 300, 11)
    frames = draw.frames
    assert C.control_frames(d, k, 300, 11) is draw
    rows = draw.rows(0, 300)  # the row products the band sums read
    torch.testing.assert_close(rows.sq, frames.pow(2).sum(-1))
    torch.testing.assert_close(
        rows.lag1, torch.einsum("nik,nik->ni", frames[:, :-1], frames[:, 1:])
    )
    torch.testing.assert_close(
        rows.lag2, torch.einsum("nik,nik->ni", frames[:, :-2], frames[:, 2:])
    )
    eye = torch.eye(k, dtype=torch.float64).expand(300, k, k)
    torch.testing.assert_close(frames.double().mT @ frames.double(), eye, atol=1e-6, rtol=0)
    # two sites, one draw: each site's null is its own matrix over the same frames
    for _ in range(2):
        m = Moments().update(_grads(200, d, gen, torch.rand(d, generator=gen) + 0.1))
        b = _basis(d, k, gen)
        r = energy_test(m, b, n_controls=300, seed=11)
        site = C.SiteFrames(m.covariance(), b.basis_, rank_one=m.mean)
        uniform, _ = _explicit_controls(site, frames)
        h = m.second_moment()
        expected = (uniform.mT @ h @ uniform).diagonal(dim1=1, dim2=2).sum(1) / torch.trace(h)
        torch.testing.assert_close(r.null_shares, expected, rtol=2e-6, atol=1e-7)
    # two float32 (10, 8, 2) sets, with their rows' squares and products (lags 1 and 2)
    cache = C.FrameCache(max_bytes=2 * 4 * (10 * 8 * 2 + 10 * 8 + 10 * 7 + 10 * 6))
    a = cache(8, 2, 10, 0)
    cache(8, 2, 10, 1)
    assert cache(8, 2, 10, 0) is a  # a hit refreshes the entry...
    cache(8, 2, 10, 2)  # ...so seed 1, the least recently used, goes
    assert cache(8, 2, 10, 0) is a and list(cache._sets) == [(8, 2, 10, 2), (8, 2, 10, 0)]
    b = cache._sets[(8, 2, 10, 2)]
    b.normal()  # normal controls' rows count once built: seed 2, now the newest, stays...
    assert list(cache._sets) == [(8, 2, 10, 2)] and b.nbytes > cache.max_bytes / 2
    a.normal()  # ...and a set evicted meanwhile changes nothing
    assert list(cache._sets) == [(8, 2, 10, 2)]


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
        (lambda m, b: energy_test(m, b, n_controls=2.5), "n_controls"),
        (lambda m, b: energy_test(m, b, controls="random"), "controls"),
        (
            lambda m, b: energy_test(m, TangentBasis(torch.eye(8)[:, :5]), controls="normal"),
            "normal controls",
        ),
        (lambda m, b: energy_test(Moments().update(torch.zeros(3, 8)), b), "zero"),
        (lambda m, b: isotropy_test(m, b, zeta=1.5), "zeta"),
        (lambda m, b: isotropy_test(m, b, reference=torch.eye(3)), "reference"),
        (lambda m, b: delta_iso_tangent(m, TangentBasis(torch.eye(5)[:, :2])), "d=5"),
        (lambda m, b: energy_ratio(0.5, 8, 8), r"k (must be|\d+ is too large)"),
    ],
)
def test_bad_input(call, match):
    m = Moments().update(torch.randn(50, 8))
    b = TangentBasis(torch.eye(8)[:, :2])
    with pytest.raises(UsageError, match=match):
        call(m, b)


@pytest.mark.parametrize(
    "call",
    [
        lambda m, b: energy_test(m.covariance(), b),
        lambda m, b: isotropy_test(m, b.basis_),
        lambda m, b: energy_test(m, b, 10),  # options are keyword-only
    ],
)
def test_wrong_types(call):
    m = Moments().update(torch.randn(50, 8))
    with pytest.raises(TypeError):
        call(m, TangentBasis(torch.eye(8)[:, :2]))


def test_normal_controls_at_half_the_dimension():
    """2k = d: the complement rows of a uniform frame are often nearly rank-deficient; the
    normal controls still come out orthonormal and exact (regression: float32 Cholesky)."""
    gen = torch.Generator().manual_seed(12)
    d, k, n = 8, 4, 5000
    b = _basis(d, k, gen)
    m = Moments().update(_grads(300, d, gen, torch.linspace(0.2, 2, d, dtype=torch.float64)))
    site = C.SiteFrames(m.covariance(), b.basis_, rank_one=m.mean)
    draws = site.null(n, 0, normal=True, squares=True)
    assert all(bool(torch.isfinite(v).all()) for v in draws.values())
    _, normal = _explicit_controls(site, C.control_frames(d, k, n, 0).frames)
    fsf = normal.mT @ m.covariance() @ normal
    torch.testing.assert_close(
        draws["tr_normal"], fsf.diagonal(dim1=1, dim2=2).sum(1), rtol=1e-4, atol=1e-6
    )


def test_controls_move_only_at_rounding_level_with_more_samples_than_d():
    """More samples than d: a rounding-level change of M (what another BLAS or thread
    count would make) moves every control's traces only at rounding level. (With fewer,
    the reduction's last coordinates inside M's range are ill-conditioned and the traces
    may move further: another Haar realisation, see `controls.SiteFrames`.)"""
    gen = torch.Generator().manual_seed(22)
    d, k, n = 64, 8, 512
    b = _basis(d, k, gen)
    m = Moments().update(_grads(n, d, gen, torch.linspace(0.1, 3, d, dtype=torch.float64)) + 0.05)
    cov, mu = m.covariance(), m.mean
    z = torch.randn(d, d, generator=gen, dtype=torch.float64)
    nudged = cov + 1e-16 * float(cov.abs().max()) * (z + z.T)
    draws = [
        C.SiteFrames(s, b.basis_, rank_one=mu).null(300, 3, normal=True, squares=True)
        for s in (cov, nudged)
    ]
    for key, value in draws[0].items():
        torch.testing.assert_close(draws[1][key], value, rtol=1e-5, atol=0)


def test_controls_do_not_see_the_null_space_basis():
    """Fewer samples than d: M has a null space, where the reduction's basis is left to
    rounding. Noise at 1e-13 there (what another BLAS or thread count would do) leaves
    every control's traces as they were: the mean, which the energy test adds, is put in
    the first complement coordinate, and nothing else reads the null space."""
    gen = torch.Generator().manual_seed(21)
    d, k, n = 40, 4, 12
    b = _basis(d, k, gen)
    m = Moments().update(_grads(n, d, gen) + 0.3)
    cov, mu = m.covariance(), m.mean
    z = torch.randn(d, d, generator=gen, dtype=torch.float64)
    noisy = cov + 1e-13 * float(cov.norm()) * (z @ z.T) / d
    draws = [
        C.SiteFrames(s, b.basis_, rank_one=mu).null(200, 3, normal=True, squares=True)
        for s in (cov, noisy)
    ]
    for key, value in draws[0].items():
        torch.testing.assert_close(
            draws[1][key], value, rtol=1e-5, atol=1e-9 * float(value.abs().max())
        )


def test_ties_count_as_extreme_and_the_tests_name_their_limits() -> None:
    """An isotropic H gives every frame the share k/d exactly: p = 1 although the controls'
    traces are float32 (compared at their precision). At 2k = d every normal control spans
    the complement itself: those statistics are left out, with a warning. At k = d − 1 no
    IsoScore* is left to measure: a UsageError names the rank."""
    d, k = 32, 4
    q = TangentBasis(torch.linalg.qr(torch.randn(d, k, dtype=torch.float64))[0])
    assert matrix_tests(torch.eye(d, dtype=torch.float64) * 3.7, q, n_controls=99)["p_value"] == 1
    x = torch.cat([torch.eye(d), -torch.eye(d)]).double() * 5.0  # covariance ∝ I
    tied = tangent_tests(Moments().update(x), q, n_controls=99)
    assert tied["p_value"] == tied["isotropy_p_value"] == 1
    g = torch.Generator().manual_seed(0)
    m = Moments().update(torch.randn(200, 8, generator=g, dtype=torch.float64))
    half = TangentBasis(torch.linalg.qr(torch.randn(8, 4, generator=g, dtype=torch.float64))[0])
    with pytest.warns(UserWarning, match="2k >= d"):
        found = tangent_tests(m, half, n_controls=20)
    assert "p_value_normal" not in found and "p_value" in found
    most = TangentBasis(torch.linalg.qr(torch.randn(8, 7, generator=g, dtype=torch.float64))[0])
    with pytest.raises(UsageError, match="rank <= 6"):
        tangent_tests(m, most, n_controls=20)
    assert 0 < energy_test(m, most, n_controls=20).p_value <= 1  # the energy test has no limit
