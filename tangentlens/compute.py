"""Where the numbers are computed: thread limits for small dense linear algebra,
independent per-site work side by side, and the two symmetric reductions the sites need
(top eigenpairs, a tridiagonal form), called so that they can run side by side.

Threads that outnumber free cores make d × d eigendecompositions at d ≤ ~1,000 far slower
and make results depend on scheduling. `benchmarks/bench_threads.py` measures `results()`
on SmolLM2 (d = 576, 30 sites) on this 2-core machine: on a quiet machine two threads
(two sites at a time) beat one (1.7 s against 2.8–3.5 s); on a machine busy with other
work one thread was the faster by far. The study runs on one thread
(`StudyConfig.num_threads`), sessions leave the threads as they are unless asked
(`ProbeSession.results(threads=1)`).

`site_map` runs independent per-site tests on as many workers as torch has threads, each
single-threaded: a d × d tridiagonalisation is memory-bound and scales poorly across
threads, while two sites on two cores run side by side. Each site's numbers are then
those of one thread, whatever the scheduling.

`top_eigh` computes only the top eigenpairs (LAPACK's MRRR, ``dsyevr``) for `fit_bases`;
`tridiagonalize` and `tridiagonal_apply` (``dsytrd``, ``dormtr``) give the coordinates of
the controls (`tangentlens.controls`). All three come from scipy's own LAPACK, but not
through its Python wrappers, which hold the GIL for the whole call, so two workers would
take turns: through scipy's Cython LAPACK table via `ctypes`, which releases it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import cache
from typing import Any, TypeVar

import numpy as np
import scipy.linalg.cython_lapack
import torch
from threadpoolctl import ThreadpoolController, threadpool_limits
from torch import Tensor

__all__ = ["site_map", "threads", "top_eigh", "tridiagonal_apply", "tridiagonalize"]

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
    thread-safe: torch releases the GIL inside its kernels, this module's LAPACK calls
    inside LAPACK."""
    workers = min(torch.get_num_threads(), len(items))
    with threads(1):
        if workers <= 1:
            yield from map(fn, items)
            return
        with ThreadPoolExecutor(workers) as pool:
            yield from pool.map(fn, items)


@cache
def _lapack(name: str) -> Any:
    """LAPACK routine ``name`` from scipy's Cython table, called with the GIL released.
    Arguments are passed as pointers (`ctypes`), in LAPACK's column-major convention."""
    capsule = scipy.linalg.cython_lapack.__pyx_capi__[name]
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    pointer = ctypes.pythonapi.PyCapsule_GetPointer
    pointer.restype, pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    n_args = get_name(capsule).count(b"*")  # every argument is a pointer
    return ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * n_args)(pointer(capsule, get_name(capsule)))


@cache
def _blas() -> ThreadpoolController:
    """The BLAS libraries loaded once scipy's LAPACK is (read once: 30 µs a limit)."""
    _lapack("dsytrd")
    return ThreadpoolController()


def _call(name: str, *args: Any) -> None:
    """Call LAPACK ``name`` with ``args``: bytes (characters), ints, numpy arrays (their
    buffers), and its ``info`` last; raise on a nonzero ``info``. On one BLAS thread:
    these reductions are memory-bound, and OpenBLAS's threads on a busy core made a
    reduction at d = 576 ten times slower (measured: ~1 s against 0.1 s a site)."""
    info = ctypes.c_int(0)
    held = [ctypes.c_int(a) if isinstance(a, int) else a for a in args]
    with _blas().limit(limits=1, user_api="blas"):
        _lapack(name)(
            *(a if isinstance(a, bytes) else a.ctypes.data if isinstance(a, np.ndarray)
              else ctypes.byref(a) for a in held),
            ctypes.byref(info),
        )  # fmt: skip
    if info.value != 0:
        raise RuntimeError(f"LAPACK {name} failed (info={info.value}).")


def _buffer(matrix: Tensor) -> np.ndarray:
    """``matrix``'s own float64 buffer when it has one (so LAPACK overwrites it), else a
    float64 copy's."""
    return matrix.detach().to(torch.float64).contiguous().numpy()


def _with_workspace(name: str, *args: Any, integer: bool = False) -> None:
    """Call ``name`` twice: a workspace query (sizes -1), then with the sizes it asked
    for. ``args`` ends with the workspace arrays' places: ``work, lwork`` (and
    ``iwork, liwork`` with ``integer``), which this fills."""
    query = [np.empty(1), -1] + ([np.empty(1, np.intc), -1] if integer else [])
    _call(name, *args, *query)
    sizes = [np.empty(int(query[0][0])), int(query[0][0])]
    if integer:
        sizes += [np.empty(int(query[2][0]), np.intc), int(query[2][0])]
    _call(name, *args, *sizes)


def top_eigh(matrix: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The ``n`` largest eigenvalues of the symmetric float64 ``matrix``, descending, and
    their eigenvectors ``(d, n)``; ``matrix`` is overwritten. CPU tensors take
    ``dsyevr`` for those ``n`` pairs only (about half a full ``eigh`` at d = 576, the
    tridiagonal reduction being what is left), other devices a full ``torch.linalg.eigh``."""
    if matrix.device.type != "cpu":
        evals, evecs = torch.linalg.eigh(matrix)
        return evals.flip(0)[:n], evecs.flip(1)[:, :n]
    d = matrix.shape[0]
    a = _buffer(matrix)  # symmetric: its row order is LAPACK's column order
    w, z = np.empty(d), np.empty((n, d))  # z row-major (n, d) is LAPACK's (d, n)
    bound, found = ctypes.c_double(0.0), ctypes.c_int(0)  # vl, vu, abstol (0: default)
    args = (b"V", b"I", b"U", d, a, d, bound, bound, d - n + 1, d, bound, found, w, z, d)
    _with_workspace("dsyevr", *args, np.empty(2 * n, np.intc), integer=True)
    # z's rows are LAPACK's columns: eigenvectors, ascending; flip to descending
    return torch.from_numpy(w[:n][::-1].copy()), torch.from_numpy(z[::-1].T.copy())


def tridiagonalize(matrix: Tensor) -> tuple[Tensor, Tensor, tuple[np.ndarray, np.ndarray]]:
    """``(α, β, reduction)`` with QᵀAQ tridiagonal (diagonal α, off-diagonal β) for the
    symmetric float64 CPU ``matrix`` A, by Householder reflections (LAPACK ``dsytrd``,
    about half a full eigendecomposition). Q keeps the first coordinate: Q e₁ = e₁.
    ``reduction`` (the reflectors, in ``matrix``'s overwritten buffer, and their scalars)
    is what `tridiagonal_apply` reads."""
    n = matrix.shape[0]
    a = _buffer(matrix)  # lower in LAPACK's column order: e₁ stays fixed
    alpha, beta, tau = np.empty(n), np.empty(max(n - 1, 0)), np.empty(max(n - 1, 1))
    _with_workspace("dsytrd", b"L", n, a, n, alpha, beta, tau)
    return torch.from_numpy(alpha), torch.from_numpy(beta), (a, tau)


def tridiagonal_apply(reduction: tuple[np.ndarray, np.ndarray], c: Tensor) -> Tensor:
    """``c @ Q`` for the Q of a `tridiagonalize` ``reduction`` and a float64 CPU ``c``
    ``(m, n)`` (LAPACK ``dormtr``)."""
    a, tau = reduction
    n = a.shape[0]
    # a copy (LAPACK overwrites it); row-major c is LAPACK's cᵀ
    out = c.detach().to(torch.float64, memory_format=torch.contiguous_format, copy=True).numpy()
    if n > 1 and out.size:
        _with_workspace("dormtr", b"L", b"L", b"T", n, out.shape[0], a, n, tau, out, n)
    return torch.from_numpy(out)
