"""Where the numbers are computed: thread limits for small dense linear algebra,
independent per-site work side by side, and the two symmetric reductions the sites need
(top eigenpairs, a tridiagonal form), through scipy's and torch's LAPACK wrappers.

Threads that outnumber free cores make the d × d eigendecompositions of small models far
slower and make results depend on scheduling. `benchmarks/bench_threads.py` times
`results()` on SmolLM2 with one and two threads (docs/PERFORMANCE.md): on a quiet machine
two threads (two sites at a time) beat one; on a machine busy with other work one thread
can be the faster. The study runs on one thread (`StudyConfig.num_threads`), sessions
leave the threads as they are unless asked (`ProbeSession.results(threads=1)`).

`site_map` runs independent per-site tests on as many workers as torch has threads, each
single-threaded: a d × d tridiagonalisation is memory-bound and scales poorly across
threads, while two sites on two cores run side by side (all but their scipy calls,
below). Each site's numbers are then those of one thread, whatever the scheduling.

`top_eigh` computes only the top eigenpairs (LAPACK's MRRR, ``dsyevr``) for `fit_bases`;
`tridiagonalize` and `tridiagonal_apply` (``dsytrd``, then the reflectors applied by
``torch.ormqr``) give the coordinates of the controls (`tangentlens.core.controls`). They are
called through scipy's and torch's own wrappers, which are maintained and tested with
those libraries, rather than through pointer code of this package's own. scipy's wrappers
hold the GIL for the whole call, so two workers' ``dsyevr`` or ``dsytrd`` take turns; the
rest of a site's work (torch) runs side by side.

`syrk` is the symmetric sum of products Σ A Aᵀ, exactly symmetric (BLAS ``?syrk`` through
scipy on one torch thread, torch's product otherwise); the weight-gradient probe forms its
per-pass Grams with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import cache
from typing import TypeVar

import numpy as np
import scipy.linalg
import scipy.linalg.blas
import scipy.linalg.lapack
import torch
from threadpoolctl import ThreadpoolController, threadpool_limits
from torch import Tensor

__all__ = [
    "site_map",
    "syrk",
    "threads",
    "top_eigh",
    "tridiagonal_apply",
    "tridiagonalize",
]

T = TypeVar("T")
R = TypeVar("R")


@contextmanager
def threads(n: int | None) -> Iterator[None]:
    """Torch and numpy's BLAS (threadpoolctl) limited to ``n`` threads inside the block;
    ``None`` leaves both as they are."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with threadpool_limits(n):
            yield
    finally:
        torch.set_num_threads(before)


def site_map(fn: Callable[[T], R], items: Sequence[T]) -> Iterator[R]:
    """``fn`` over ``items``, results in order, on ``torch.get_num_threads()`` workers of one
    thread each (one worker: a plain ``map``, still on one thread). ``fn`` must be
    thread-safe. Torch releases the GIL inside its kernels, so those run side by side;
    scipy's LAPACK wrappers (`top_eigh`, `tridiagonalize`) hold it, so those take turns."""
    workers = min(torch.get_num_threads(), len(items))
    with threads(1):
        if workers <= 1:
            yield from map(fn, items)
            return
        with ThreadPoolExecutor(workers) as pool:
            yield from pool.map(fn, items)


@cache
def _blas() -> ThreadpoolController:
    """The loaded BLAS libraries (scipy's among them: imported above), read once; a fresh
    `threadpool_limits` would read them again at every call."""
    return ThreadpoolController()


def syrk(blocks: Sequence[Tensor]) -> Tensor:
    """Σ_b A_b A_bᵀ over the 2-D ``blocks`` (one dtype, float32 or float64, same row
    count), symmetric bit for bit. With one torch thread on CPU, BLAS ``?syrk`` (scipy,
    one BLAS thread): one triangle, half the flops. With more threads, or on another
    device, torch's full product: on two threads it is the faster of the two at the
    weight-gradient fold's sizes, and BLAS threads of scipy's own would contend with
    torch's pool for the cores (`benchmarks/bench_syrk.py`, docs/PERFORMANCE.md)."""
    one_thread = blocks[0].device.type == "cpu" and torch.get_num_threads() == 1
    return _mirrored(_blas_syrk(blocks) if one_thread else _product(blocks))


def _product(blocks: Sequence[Tensor]) -> Tensor:
    """Σ A Aᵀ by torch's matrix product, both triangles."""
    first = blocks[0]
    out = first @ first.T
    for a in blocks[1:]:
        out.addmm_(a, a.T)
    return out


def _blas_syrk(blocks: Sequence[Tensor]) -> Tensor:
    """Σ A Aᵀ's upper triangle by BLAS ``?syrk`` on one BLAS thread (the other undefined)."""
    blas = scipy.linalg.blas
    update = blas.dsyrk if blocks[0].dtype == torch.float64 else blas.ssyrk
    c = None
    with _blas().limit(limits=1, user_api="blas"):
        for a in blocks:
            # BLAS wants Fortran order: A itself (a transposed view, as of a weight's
            # gradient, is one without a copy) or Aᵀ's buffer with its transpose's product
            if a.T.is_contiguous():
                rows, trans = a.T.numpy().T, 0
            else:
                rows, trans = a.contiguous().numpy().T, 1
            if c is None:
                c = update(1.0, rows, trans=trans)
            else:
                c = update(1.0, rows, beta=1.0, c=c, trans=trans, overwrite_c=1)
    return torch.from_numpy(c)


def _mirrored(square: Tensor) -> Tensor:
    """The upper triangle of ``square`` and its mirror: a product need not round (i, j)
    and (j, i) alike, and BLAS leaves the lower triangle undefined."""
    upper = square.triu_()
    full = upper + upper.T
    full.diagonal().sub_(upper.diagonal())  # 2x − x: exact
    return full


def _fortran(matrix: Tensor) -> np.ndarray:
    """The symmetric ``matrix`` as a Fortran-ordered float64 array: its own buffer
    transposed when it has one (so LAPACK overwrites it in place), else a copy's."""
    return matrix.detach().to(torch.float64).contiguous().numpy().T


def top_eigh(matrix: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The ``n`` largest eigenvalues of the symmetric float64 ``matrix``, descending, and
    their eigenvectors ``(d, n)``; ``matrix`` may be overwritten. CPU tensors take LAPACK's
    ``dsyevr`` for those ``n`` pairs only (`scipy.linalg.eigh`, on one BLAS thread),
    other devices a full ``torch.linalg.eigh``."""
    if matrix.device.type != "cpu":
        evals, evecs = torch.linalg.eigh(matrix)
        return evals.flip(0)[:n], evecs.flip(1)[:, :n]
    d = matrix.shape[0]
    with _blas().limit(limits=1, user_api="blas"):
        w, z = scipy.linalg.eigh(
            _fortran(matrix),
            lower=False,  # the Fortran view's upper triangle: the buffer's lower one
            subset_by_index=[d - n, d - 1],
            driver="evr",
            overwrite_a=True,
            check_finite=False,
        )
    # ascending: flip to descending
    return torch.from_numpy(w[::-1].copy()), torch.from_numpy(z[:, ::-1].copy())


def tridiagonalize(matrix: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """``(α, β, reduction)`` with QᵀAQ tridiagonal (diagonal α, off-diagonal β) for the
    symmetric float64 CPU ``matrix`` A, by Householder reflections (LAPACK ``dsytrd``
    through scipy, on one BLAS thread: about half a full eigendecomposition); ``matrix``
    may be overwritten. Q = H₁⋯H_{d−1} keeps the first coordinate: Q e₁ = e₁.
    ``reduction`` is what `tridiagonal_apply` reads: the reflectors of Q's last d − 1
    coordinates in LAPACK's QR form (Hᵢ = I − τᵢvᵢvᵢᵀ, vᵢ's first entry 1, stored below
    the diagonal) and their scalars τ."""
    n = matrix.shape[0]
    if n == 0:  # scipy's wrapper takes no empty matrix
        empty = torch.empty(0, dtype=torch.float64, device="cpu")
        return empty, empty, (empty.new_empty(0, 0), empty)
    a = _fortran(matrix)  # lower: the reflectors act below the first row, e₁ stays fixed
    with _blas().limit(limits=1, user_api="blas"):
        lwork, info = scipy.linalg.lapack.dsytrd_lwork(n, lower=1)
        if info == 0:
            a, alpha, beta, tau, info = scipy.linalg.lapack.dsytrd(
                a, lower=1, lwork=max(int(lwork), 1), overwrite_a=1
            )
    if info != 0:
        raise RuntimeError(f"LAPACK dsytrd failed (info={info}).")
    # column i's reflector acts on coordinates i + 1, …: below the subdiagonal (lower),
    # so Q = diag(1, Q') with Q' the QR-form Q of a[1:, :-1]
    reflectors = torch.from_numpy(a)[1:, :-1]
    return torch.from_numpy(alpha), torch.from_numpy(beta), (reflectors, torch.from_numpy(tau))


def tridiagonal_apply(reduction: tuple[Tensor, Tensor], c: Tensor) -> Tensor:
    """``c @ Q`` for the Q of a `tridiagonalize` ``reduction`` and a float64 CPU ``c``
    ``(m, n)``: c's first column as it is, the rest times Q' (``torch.ormqr``, which
    applies the reflectors without forming Q')."""
    reflectors, tau = reduction
    out = c.detach().to(torch.float64, copy=True)
    if reflectors.shape[0] and out.shape[0]:
        out[:, 1:] = torch.ormqr(reflectors, tau, out[:, 1:], left=False, transpose=False)
    return out
