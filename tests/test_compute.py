"""Where the numbers are computed: the partial eigendecomposition, the tridiagonal
reduction, the symmetric rank-k update and the site workers."""

from __future__ import annotations

import pytest
import torch
from threadpoolctl import threadpool_info

from tangentlens.core.compute import (
    site_map,
    syrk,
    top_eigh,
    tridiagonal_apply,
    tridiagonalize,
)


@pytest.mark.parametrize("n", [1, 5, 12])
def test_top_eigh_matches_the_full_eigendecomposition(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(40, 12, generator=gen, dtype=torch.float64) * torch.logspace(1, -1, 12)
    cov = x.T @ x / 40
    evals, evecs = torch.linalg.eigh(cov)
    top, vectors = top_eigh(cov.clone(), n)
    torch.testing.assert_close(top, evals.flip(0)[:n], rtol=0, atol=1e-13 * float(evals[-1]))
    assert top.shape == (n,) and vectors.shape == (12, n)
    want = evecs.flip(1)[:, :n]
    torch.testing.assert_close(
        vectors.T @ vectors, torch.eye(n, dtype=torch.float64), atol=1e-13, rtol=0
    )
    torch.testing.assert_close(
        (want.T @ vectors).abs(), torch.eye(n, dtype=torch.float64), atol=1e-10, rtol=0
    )


def _symmetric(d: int, samples: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, d, generator=gen, dtype=torch.float64) * torch.logspace(1, -1, d)
    return x.T @ x / samples


@pytest.mark.parametrize(("d", "n"), [(1, 1), (60, 17), (200, 1), (200, 200)])
def test_top_eigh_equals_the_top_of_torch_eigh(d, n):
    cov = _symmetric(d, 3 * d, seed=d + n)
    evals, evecs = torch.linalg.eigh(cov)
    top, vectors = top_eigh(cov.clone(), n)
    assert top.dtype == vectors.dtype == torch.float64
    assert top.shape == (n,) and vectors.shape == (d, n)
    assert bool((top[:-1] >= top[1:]).all())  # descending
    torch.testing.assert_close(top, evals.flip(0)[:n], rtol=1e-10, atol=0)
    want = evecs.flip(1)[:, :n]
    signs = torch.sign((want * vectors).sum(0))  # eigenvectors up to sign
    torch.testing.assert_close(vectors * signs, want, rtol=0, atol=1e-8)


@pytest.mark.parametrize(("d", "samples"), [(1, 3), (2, 5), (9, 30), (120, 400), (120, 40)])
def test_tridiagonal_reduction_and_its_q(d, samples):
    """QᵀAQ is tridiagonal with diagonal α and off-diagonal β, Q orthogonal with Q e₁ = e₁,
    and `tridiagonal_apply` is c @ Q for the Q built explicitly from the reflectors."""
    a = _symmetric(d, samples, seed=d)
    alpha, beta, reduction = tridiagonalize(a.clone())
    assert alpha.dtype == beta.dtype == torch.float64
    assert alpha.shape == (d,) and beta.shape == (d - 1,)
    reflectors, tau = reduction
    eye = torch.eye(d, dtype=torch.float64)
    q = eye.clone()  # Q = diag(1, Q'), Q' from the QR-form reflectors
    if d > 1:
        q[1:, 1:] = torch.linalg.householder_product(reflectors, tau)
    torch.testing.assert_close(q[:, 0], eye[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(q.T @ q, eye, rtol=0, atol=1e-13)
    t = torch.diag(alpha) + torch.diag(beta, 1) + torch.diag(beta, -1)
    scale = float(torch.linalg.matrix_norm(a))
    torch.testing.assert_close(q.T @ a @ q, t, rtol=0, atol=1e-10 * scale)
    c = torch.randn(7, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    applied = tridiagonal_apply(reduction, c)
    assert applied.dtype == torch.float64 and applied.shape == (7, d)
    torch.testing.assert_close(applied, c @ q, rtol=0, atol=1e-13 * float(c.abs().max()) * d)
    torch.testing.assert_close(applied[:, 0], c[:, 0], rtol=0, atol=0)  # e₁ kept
    torch.testing.assert_close(tridiagonal_apply(reduction, eye), q, rtol=0, atol=1e-14 * d)


def test_tridiagonal_apply_leaves_its_inputs():
    a = _symmetric(30, 60, seed=3)
    *_, reduction = tridiagonalize(a.clone())
    c = torch.randn(4, 30, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    kept = [c.clone(), reduction[0].clone(), reduction[1].clone()]
    first = tridiagonal_apply(reduction, c)
    for before, after in zip(kept, [c, *reduction], strict=True):
        assert torch.equal(before, after)
    assert torch.equal(tridiagonal_apply(reduction, c), first)
    assert tridiagonal_apply(reduction, c[:0]).shape == (0, 30)


def test_tridiagonalize_empty():
    alpha, beta, reduction = tridiagonalize(torch.empty(0, 0, dtype=torch.float64))
    assert alpha.shape == beta.shape == (0,)
    assert tridiagonal_apply(reduction, torch.empty(3, 0, dtype=torch.float64)).shape == (3, 0)


def test_top_eigh_side_by_side_equals_one_at_a_time():
    gen = torch.Generator().manual_seed(0)
    mats = [
        (lambda z: z.T @ z)(torch.randn(80, 60, generator=gen, dtype=torch.float64))
        for _ in range(6)
    ]
    alone = [top_eigh(m.clone(), 7) for m in mats]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        together = list(site_map(lambda m: top_eigh(m.clone(), 7), mats))
    finally:
        torch.set_num_threads(before)
    for (a, u), (b, v) in zip(alone, together, strict=True):
        assert torch.equal(a, b) and torch.equal(u, v)


def test_site_map_runs_one_thread_even_with_one_worker():
    def seen(_: int) -> tuple[int, set[int]]:
        return torch.get_num_threads(), {lib["num_threads"] for lib in threadpool_info()}

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert list(site_map(seen, [0])) == [(1, {1})]
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_syrk_is_the_symmetric_sum_of_products(dtype, threads):
    """BLAS ``?syrk`` (one torch thread) and torch's product (two) both give Σ A Aᵀ, both
    triangles equal bit for bit, and leave their inputs as they were."""
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randn(9, k, generator=gen, dtype=dtype) for k in (5, 1, 13)]
    kept = [b.clone() for b in blocks]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = syrk(blocks)
        copied, viewed = syrk([blocks[0].T.contiguous()]), syrk([blocks[0].T])
    finally:
        torch.set_num_threads(before)
    want = sum(b.double() @ b.double().T for b in blocks)
    assert got.dtype == dtype and torch.equal(got, got.T)
    tol = 1e-5 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tol * float(want.abs().max()))
    assert all(torch.equal(b, k) for b, k in zip(blocks, kept, strict=True))
    # a transposed view (a weight's gradient) goes to ?syrk without a copy, the same
    # sums; torch's product may take another kernel for the view, so round otherwise
    if threads == 1:
        assert torch.equal(copied, viewed)
    scale = tol * float(copied.abs().max())
    torch.testing.assert_close(copied, viewed, rtol=0, atol=scale)
