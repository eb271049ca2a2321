"""TangentBasis: fit, exact split, controls, save/load, bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tangentlens.stats import Moments
from tangentlens.subspace import TangentBasis, complement, normal_controls, uniform_controls


def _random_basis(d, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TangentBasis(torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))[0])


def test_fit_recovers_planted_subspace():
    g = torch.Generator().manual_seed(0)
    d, k = 20, 3
    q = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))[0]
    x = torch.randn(5000, k, generator=g, dtype=torch.float64) * 10 @ q.T
    x = x + 0.01 * torch.randn(5000, d, generator=g, dtype=torch.float64) + 7
    m = Moments()
    for chunk in x.split(700):
        m.update(chunk)
    b = TangentBasis.fit(m, rank=k)
    # principal angles all ~0: ‖Q_Tᵀ q‖_F² == k
    assert (b.basis_.T @ q).pow(2).sum().item() == pytest.approx(k, abs=1e-5)
    torch.testing.assert_close(b.mean_, x.mean(0))
    assert b.explained_variance_ratio_.sum().item() > 0.999
    assert TangentBasis.fit(m, variance=0.99).k == k


@settings(max_examples=50, deadline=None)
@given(
    d=st.integers(2, 12),
    seed=st.integers(0, 9999),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_split_is_exact(d, seed, scale, dtype):
    k = max(1, d // 3)
    b = _random_basis(d, k, seed)
    x = (torch.randn(5, 3, d, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
    tangent, normal = b.split(x)
    assert torch.equal(tangent + normal, x.double())
    assert torch.equal((tangent + normal).to(dtype), x)
    # the tangent part lies in Q_T, the normal part is orthogonal to it (to rounding)
    tol = 1e-2 * scale if dtype != torch.float32 else 1e-5 * scale
    assert (normal @ b.basis_).abs().max().item() < tol * d


def test_split_float64_is_exact_to_rounding():
    b = _random_basis(16, 4)
    x = torch.randn(100, 16, dtype=torch.float64)
    t, n = b.split(x)
    torch.testing.assert_close(t + n, x, rtol=0, atol=1e-15)


@settings(max_examples=25, deadline=None)
@given(d=st.integers(3, 20), seed=st.integers(0, 999), n=st.integers(1, 8))
def test_controls_orthonormal_and_orthogonal(d, seed, n):
    k = max(1, d // 4)
    b = _random_basis(d, k, seed)
    c = normal_controls(b, n, seed=seed)
    assert c.shape == (n, d, k)
    eye = torch.eye(k, dtype=torch.float64)
    torch.testing.assert_close(c.transpose(1, 2) @ c, eye.expand(n, k, k), atol=1e-12, rtol=0)
    assert (b.basis_.T @ c).abs().max().item() < 1e-12
    torch.testing.assert_close(normal_controls(b, n, seed=seed), c)  # reproducible
    u = uniform_controls(d, k, n, seed=seed)
    torch.testing.assert_close(u.transpose(1, 2) @ u, eye.expand(n, k, k), atol=1e-12, rtol=0)


def test_complement_spans_the_rest():
    b = _random_basis(10, 3)
    c = complement(b)
    full = torch.cat([b.basis_, c], 1)
    torch.testing.assert_close(
        full.T @ full, torch.eye(10, dtype=torch.float64), atol=1e-12, rtol=0
    )


def test_save_load_round_trip(tmp_path):
    m = Moments().update(torch.randn(300, 8) * torch.arange(1, 9))
    b = TangentBasis.fit(m, rank=2, provenance={"model": "x", "site": "blocks.0.hook_resid_pre"})
    path = b.save(tmp_path / "basis.safetensors")
    b2 = TangentBasis.load(path)
    assert torch.equal(b2.basis_, b.basis_)
    assert torch.equal(b2.mean_, b.mean_)
    assert b2.provenance == b.provenance
    assert not list(tmp_path.glob("*.tmp"))


def test_corrupt_file_is_a_clear_error(tmp_path):
    p = tmp_path / "basis.safetensors"
    _random_basis(6, 2).save(p)
    p.write_bytes(p.read_bytes()[:40])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        TangentBasis.load(p)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: TangentBasis(torch.randn(5, 2)), "orthonormal"),
        (lambda: TangentBasis(torch.eye(4)), "1 <= k < d"),
        (lambda: TangentBasis(torch.ones(4)), r"\(d, k\)"),
        (lambda: TangentBasis.fit(Moments().update(torch.randn(9, 4)), rank=4), "rank"),
        (lambda: TangentBasis.fit(Moments().update(torch.randn(9, 4)), rank=0), "rank"),
        (lambda: TangentBasis.fit(Moments(), rank=1), "at least 2"),
        (lambda: TangentBasis.fit(Moments().update(torch.randn(9, 4))), "exactly one"),
        (lambda: _random_basis(6, 2).split(torch.randn(3, 5)), r"\(\.\.\., 6\)"),
        (lambda: normal_controls(_random_basis(6, 4), 3), "does not fit"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_atomic_files_get_ordinary_permissions(tmp_path):
    import os

    from tangentlens.io import write_text

    path = write_text(tmp_path / "report.html", "<html></html>")
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
