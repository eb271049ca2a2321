"""Where the numbers are computed: the partial eigendecomposition and the site workers."""

from __future__ import annotations

import pytest
import torch
from threadpoolctl import threadpool_info

from tangentlens.compute import site_map, top_eigh


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
