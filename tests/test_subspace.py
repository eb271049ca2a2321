"""TangentBasis: fit, exact split, controls, save/load, shares, overlaps, bad input."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from tangentlens.core.controls import draw_frames
from tangentlens.core.errors import CorruptFileError, UsageError
from tangentlens.core.files import load_tensors, save_tensors
from tangentlens.core.stats import Moments
from tangentlens.core.subspace import (
    TangentBasis,
    chance_overlap,
    complement,
    normal_controls,
    shares,
    split_half_overlap,
    subspace_overlap,
    tangent_share,
    uniform_controls,
)
from tangentlens.hooks.sites import Site
from tangentlens.probes.bases import BasisSet


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
    # one sampler: the tests' float32 controls are these frames, rounded
    torch.testing.assert_close(draw_frames(d, k, n, seed), u.float(), atol=1e-5, rtol=0)


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
    assert b2.eigengap_ == b.eigengap_ > 1
    assert not list(tmp_path.glob("*.tmp"))
    # files written before the eigengap existed load with eigengap_ = None
    meta = b.to_dict()
    del meta["eigengap"]
    old = save_tensors(tmp_path / "old.safetensors", b.tensors(), {"tangentlens": json.dumps(meta)})
    assert TangentBasis.load(old).eigengap_ is None
    flat = Moments().update(torch.randn(50, 2) @ torch.eye(2, 4))  # only 2 directions vary
    inf_gap = TangentBasis.fit(flat, rank=2).save(tmp_path / "inf.safetensors")
    assert TangentBasis.load(inf_gap).eigengap_ == math.inf


def test_fit_records_the_eigengap():
    # ±a_i e_i: the covariance is exactly diag(a_i² / 4), so the gaps are known
    a = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.5], dtype=torch.float64)
    x = torch.cat([torch.diag(a), -torch.diag(a)])
    m = Moments().update(x)
    for k in range(1, 5):
        assert TangentBasis.fit(m, rank=k).eigengap_ == pytest.approx(a[k - 1] ** 2 / a[k] ** 2)
    degenerate = Moments().update(x[:, :5] @ torch.eye(5, 7, dtype=torch.float64))
    assert TangentBasis.fit(degenerate, rank=5).eigengap_ == math.inf
    assert math.isnan(TangentBasis.fit(degenerate, rank=6).eigengap_)  # not even k vary
    with pytest.raises(UsageError, match="rank 3 needs at least 4 vectors"):
        TangentBasis.fit(Moments().update(x[:3]), rank=3)  # 3 vectors: 2 directions at most
    with pytest.raises(UsageError, match="zero variance"):
        TangentBasis.fit(Moments().update(torch.ones(4, 5, dtype=torch.float64)), rank=2)
    assert _random_basis(6, 2).eigengap_ is None


@pytest.mark.parametrize("d", [2, 9, 40])
def test_fit_by_rank_matches_the_full_eigendecomposition(d):
    # rank= computes only the top rank + 1 eigenpairs: the same numbers as a full eigh
    gen = torch.Generator().manual_seed(d)
    spread = torch.logspace(1, -1, d, dtype=torch.float64)
    m = Moments().update(torch.randn(300, d, generator=gen, dtype=torch.float64) * spread + 3)
    evals, evecs = torch.linalg.eigh(m.covariance())
    evals, evecs = evals.flip(0).clamp_min(0), evecs.flip(1)
    for k in range(1, d):
        b = TangentBasis.fit(m, rank=k)
        q = evecs[:, :k]
        torch.testing.assert_close(b.projector(), q @ q.T, rtol=0, atol=1e-11)
        # eigenvalues to rounding relative to the largest, whatever the algorithm
        top = float(evals[0])
        torch.testing.assert_close(b.explained_variance_, evals[:k], rtol=0, atol=1e-14 * top)
        assert b.total_variance_ == pytest.approx(float(evals.sum()), rel=1e-12)
        assert b.eigengap_ == pytest.approx(float(evals[k - 1] / evals[k]), rel=1e-10)
        pivots = b.basis_.gather(0, b.basis_.abs().argmax(0, keepdim=True))
        assert bool((pivots > 0).all())  # the sign convention
        assert torch.equal(b.basis_, TangentBasis.fit(m, rank=k).basis_)  # deterministic


def test_tangent_share_is_the_trace_ratio():
    gen = torch.Generator().manual_seed(3)
    d, k = 10, 3
    b = _random_basis(d, k, 3)
    x = torch.randn(400, d, generator=gen, dtype=torch.float64) * torch.arange(1, d + 1) + 2
    m = Moments().update(x)
    direct = float((x @ b.basis_).pow(2).sum() / x.pow(2).sum())  # uncentred: E‖xQ‖²/E‖x‖²
    assert tangent_share(m, b) == pytest.approx(direct, rel=1e-12)
    assert tangent_share(m.second_moment(), b.basis_) == pytest.approx(direct, rel=1e-12)
    cov = m.covariance()
    assert tangent_share(cov, b) == pytest.approx(
        float(torch.trace(b.basis_.T @ cov @ b.basis_) / torch.trace(cov)), rel=1e-12
    )
    out = shares(float((x @ b.basis_).pow(2).sum()), float(x.pow(2).sum()), k, d)
    assert out["tangent_share"] == pytest.approx(direct, rel=1e-12)
    assert out["chance_share"] == k / d
    assert out["share_ratio"] == pytest.approx(direct * d / k, rel=1e-12)
    assert math.isnan(shares(0.0, 0.0, k, d)["tangent_share"])


def test_subspace_overlap_identical_random_and_split_half():
    d, k = 24, 4
    b = _random_basis(d, k, 0)
    assert subspace_overlap(b, b) == pytest.approx(1.0, abs=1e-12)
    assert subspace_overlap(b, complement(b)[:, :k]) == pytest.approx(0.0, abs=1e-12)
    random = torch.tensor([subspace_overlap(b, _random_basis(d, k, s)) for s in range(1, 401)])
    se = float(random.std()) / 20
    assert abs(float(random.mean()) - chance_overlap(k, d)) < 4 * se
    assert chance_overlap(k, d) == k / d
    gen = torch.Generator().manual_seed(1)

    def halves(planted):
        x = torch.randn(2, 1000, d, generator=gen, dtype=torch.float64)
        if planted:
            x = x + 5 * torch.randn(2, 1000, k, generator=gen, dtype=torch.float64) @ b.basis_.T
        return [Moments().update(h) for h in x]

    assert split_half_overlap(*halves(True), k) > 0.99
    noise = torch.tensor([split_half_overlap(*halves(False), k) for _ in range(20)])
    assert abs(float(noise.mean()) - k / d) < 0.08


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
        (lambda: tangent_share(torch.zeros(6, 6), _random_basis(6, 2)), "no energy"),
        (lambda: tangent_share(torch.eye(5), _random_basis(6, 2)), r"\(6, 6\)"),
        (lambda: subspace_overlap(_random_basis(6, 2), _random_basis(6, 3)), "same"),
        (lambda: shares(1.0, 2.0, 6, 6), r"k (must be|\d+ is too large)"),
        (lambda: chance_overlap(0, 6), r"k (must be|\d+ is too large)"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(UsageError, match=match):
        call()


def test_unreadable_basis_files_are_corrupt_file_errors(tmp_path):
    b = _random_basis(6, 2)
    no_meta = save_tensors(tmp_path / "a.safetensors", b.tensors(), {})
    with pytest.raises(CorruptFileError, match="metadata"):
        TangentBasis.load(no_meta)
    bent = {**b.tensors(), "basis": b.basis_ * 2}
    bad = save_tensors(tmp_path / "b.safetensors", bent, {"tangentlens": json.dumps(b.to_dict())})
    with pytest.raises(CorruptFileError, match="orthonormal"):
        TangentBasis.load(bad)


def test_atomic_files_get_ordinary_permissions(tmp_path):
    import os

    from tangentlens.core.files import write_text

    path = write_text(tmp_path / "report.html", "<html></html>")
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_basis_file_resaved_without_its_hash_is_refused(tmp_path):
    b = TangentBasis.fit(Moments().update(torch.randn(300, 8) * torch.arange(1, 9)), rank=2)
    path = b.save(tmp_path / "basis.safetensors")
    tensors, meta = load_tensors(path)
    save_file({k: t.float() for k, t in tensors.items()}, tmp_path / "edited.safetensors", meta)
    with pytest.raises(CorruptFileError, match=r"edited\.safetensors"):
        TangentBasis.load(tmp_path / "edited.safetensors")
    bases = BasisSet({Site(0, "resid_pre"): b})
    tensors, meta = load_tensors(bases.save(tmp_path / "set.safetensors"))
    save_file(tensors, tmp_path / "set_edited.safetensors", meta)
    with pytest.raises(CorruptFileError, match=r"set_edited\.safetensors"):
        BasisSet.load(tmp_path / "set_edited.safetensors")
