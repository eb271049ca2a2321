"""The controls' fast paths against their slow references: the complement block as one
rank-(2k + 2) update against applying Q_T's reflectors to M, the cache-sized K·B groups
against one dense product, the covariance's controls reused for a reference that is a
multiple of it against explicit projection, and the shares read from `Moments`."""

from __future__ import annotations

import pytest
import torch

from tangentlens.core import controls as C
from tangentlens.core import significance as S
from tangentlens.core.errors import UsageError
from tangentlens.core.metrics import _cov_arg, isoscore_from_cov
from tangentlens.core.stats import Moments
from tangentlens.core.subspace import TangentBasis, tangent_share


def _moments(n: int, d: int, seed: int, mean: float = 0.3) -> Moments:
    gen = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.1, 2, d, dtype=torch.float64)
    return Moments().update(torch.randn(n, d, generator=gen, dtype=torch.float64) * scales + mean)


def _frame(d: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(d, k, generator=gen, dtype=torch.float64)).Q


def _arrow_by_reflectors(m, q, r):
    """The reference: HᵀMH by applying the k reflectors from both sides (`torch.ormqr`),
    symmetrised, then the reflection that maps Cᵀr onto e₁ applied explicitly."""
    k = q.shape[1]
    a, tau = torch.geqrf(q)
    mh = torch.ormqr(a, tau, torch.ormqr(a, tau, m, transpose=True).mT, transpose=True)
    mh = (mh + mh.mT) / 2
    block, x0 = mh[k:, k:], mh[:k, k:]
    r_c = torch.ormqr(a, tau, r[:, None], transpose=True)[k:, 0] if r is not None else None
    reflection = None if r_c is None else C._reflector(r_c)
    if reflection is not None:
        u, p = reflection
        h = torch.eye(len(u), dtype=u.dtype) - p * torch.outer(u, u)
        block, x0, r_c = h @ block @ h, x0 @ h, h @ r_c
    return block, x0, r_c


@pytest.mark.parametrize(
    ("d", "k", "n", "rank_one", "axis"),
    [
        (30, 4, 500, True, False),
        (30, 4, 500, False, False),
        (40, 6, 12, True, False),  # fewer samples than d: M has a null space
        (24, 3, 300, True, True),  # Q_T = the first axes: every τ of its QR is 0
        (9, 4, 100, True, False),  # 2k near d
    ],
)
def test_complement_arrow_equals_applying_the_reflectors(d, k, n, rank_one, axis):
    m = _moments(n, d, seed=d + k + n)
    cov = m.covariance()
    q = torch.eye(d, k, dtype=torch.float64) if axis else _frame(d, k, seed=n)
    r = m.mean if rank_one else None
    a, tau = torch.geqrf(q)
    block, x0, r_c, reflection = C._complement_arrow(cov, a, tau, r)
    want_block, want_x0, want_r = _arrow_by_reflectors(cov, q, r)
    scale = float(cov.norm())
    torch.testing.assert_close(block, want_block, rtol=0, atol=1e-13 * scale)
    torch.testing.assert_close(x0, want_x0, rtol=0, atol=1e-13 * scale)
    assert (reflection is None) == (not rank_one)
    if rank_one:
        torch.testing.assert_close(r_c, want_r, rtol=0, atol=1e-13 * float(r.norm()))
        assert float(r_c[1:].abs().max()) < 1e-13 * float(r.norm())  # r's part is on e₁
    v, t = C._compact_wy(a, tau)
    explicit = torch.ormqr(a, tau, torch.eye(d, dtype=torch.float64))
    torch.testing.assert_close(torch.eye(d, dtype=torch.float64) - v @ t @ v.T, explicit)


@pytest.mark.parametrize(("n", "step"), [(1, 4), (10, 4), (37, 8), (5, 64)])
def test_banded_gram_equals_the_dense_product(n, step):
    gen = torch.Generator().manual_seed(n)
    rows, k = 23, 3
    b = torch.randn(n, rows, k, generator=gen)
    alpha, beta = torch.randn(rows, generator=gen), torch.randn(rows - 1, generator=gen)
    dense = torch.diag(alpha) + torch.diag(beta, 1) + torch.diag(beta, -1)
    work = torch.empty(min(step, n), rows, k)
    got = C._banded_gram(b, alpha, beta, work)
    want = (b.double().mT @ dense.double() @ b.double()).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, got.mT)


def test_covariance_controls_serve_a_reference_that_is_a_multiple_of_it():
    """A pool of one checkpoint makes the reference the covariance itself (to rounding):
    ΔIso* of each control, from the covariance's controls scaled, equals ΔIso* from
    projecting S onto the same frames, and the reference is detected only then."""
    d, k, n = 20, 3, 60
    m = _moments(400, d, seed=5)
    b = TangentBasis(_frame(d, k, seed=6))
    own = S.reference_at(S.pooled_shape([m]), m)
    pooled = S.reference_at(S.pooled_shape([m, _moments(400, d, seed=7, mean=-1.0)]), m)
    iso = S._IsoAfterRemoval(m, b, 0.1, own)
    assert iso.multiple == pytest.approx(1.0, rel=1e-12)
    assert S._IsoAfterRemoval(m, b, 0.1, pooled).multiple is None
    assert S._IsoAfterRemoval(m, b, 0.1, None).multiple == 1.0
    draws, scale = S._iso_draws(iso, m, b, n, 4, normal=True)
    site = C.SiteFrames(m.covariance(), b.basis_, rank_one=m.mean)  # the draws' coordinates
    frames = C.control_frames(d, k, n, 4).frames.double()
    uniform = torch.cat([site.q_t, site.complement_basis()], 1) @ frames
    for f, suffix in ((uniform, ""), (None, "_normal")):
        if f is None:
            bb = frames[:, k:]
            chol = torch.linalg.cholesky(bb.mT @ bb)
            g = torch.linalg.solve_triangular(chol, bb.mT, upper=False).mT
            f = site.complement_basis() @ g
        powers = (("tr", 1), ("tr2", 2), ("frob", 2))
        null = iso.after(*(draws[key + suffix] * scale**p for key, p in powers)) - iso.before
        want = torch.tensor([iso.delta(fi) for fi in f.unbind()], dtype=torch.float64)
        torch.testing.assert_close(null, want, rtol=0, atol=1e-6)


def test_tangent_tests_with_a_multiple_reference_reads_the_same_controls_as_without():
    """ζ = 0 makes S the covariance bit for bit: the reference's ΔIso* null is then the
    one without a reference, control by control."""
    d, k = 24, 3
    m = _moments(300, d, seed=8)
    b = TangentBasis(_frame(d, k, seed=9))
    reference = S.reference_at(S.pooled_shape([m]), m)
    with_ref = S.isotropy_test(m, b, n_controls=200, seed=2, reference=reference)
    without = S.isotropy_test(m, b, n_controls=200, seed=2)
    torch.testing.assert_close(with_ref.null_deltas, without.null_deltas, rtol=0, atol=1e-12)
    assert with_ref.p_value == without.p_value


@pytest.mark.parametrize("n", [1, 7, 300])
def test_moments_share_equals_the_share_of_the_second_moment(n):
    d = 16
    m = _moments(n, d, seed=n)
    q = _frame(d, 4, seed=1)
    h = m.second_moment()
    want = float(torch.trace(q.T @ h @ q) / torch.trace(h))
    assert tangent_share(m, q) == pytest.approx(want, rel=1e-13)
    assert tangent_share(m, q) == pytest.approx(tangent_share(h, q), rel=1e-13)
    with pytest.raises(UsageError, match="no energy"):
        tangent_share(Moments().update(torch.zeros(3, d)), q)


def test_a_covariance_argument_with_nan_or_inf_is_refused_and_a_huge_one_is_not():
    c = torch.eye(4, dtype=torch.float64)
    for bad in (float("nan"), float("inf")):
        broken = c.clone()
        broken[1, 2] = bad
        with pytest.raises(UsageError, match="NaN or Inf"):
            isoscore_from_cov(broken)
    huge = torch.full((16, 16), 1e307, dtype=torch.float64)  # its sum overflows; no entry does
    assert _cov_arg(huge) is huge
