"""Where the numbers are computed: thread limits for small dense linear algebra,
independent per-site work side by side, and a partial symmetric eigendecomposition that
lets them run side by side.

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

`top_eigh` computes only the top eigenpairs (LAPACK's MRRR, ``dsyevr``, from scipy's own
LAPACK). scipy's Python wrapper holds the GIL for the whole call, so two workers would
take turns; the same routine called through scipy's Cython LAPACK table via `ctypes`
releases it, and `fit_bases` runs its sites' decompositions side by side.
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
from threadpoolctl import threadpool_limits
from torch import Tensor

__all__ = ["site_map", "threads", "top_eigh"]

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
    thread-safe: torch releases the GIL inside its kernels, `top_eigh` inside LAPACK."""
    workers = min(torch.get_num_threads(), len(items))
    with threads(1):
        if workers <= 1:
            yield from map(fn, items)
            return
        with ThreadPoolExecutor(workers) as pool:
            yield from pool.map(fn, items)


@cache
def _dsyevr() -> Any:
    """LAPACK's ``dsyevr`` from scipy's Cython table, callable with the GIL released."""
    capsule = scipy.linalg.cython_lapack.__pyx_capi__["dsyevr"]
    name = ctypes.pythonapi.PyCapsule_GetName
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    pointer = ctypes.pythonapi.PyCapsule_GetPointer
    pointer.restype, pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 21)(pointer(capsule, name(capsule)))


def top_eigh(matrix: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The ``n`` largest eigenvalues of the symmetric float64 ``matrix``, descending, and
    their eigenvectors ``(d, n)``; ``matrix`` is overwritten. CPU tensors take
    ``dsyevr`` for those ``n`` pairs only (about half a full ``eigh`` at d = 576, the
    tridiagonal reduction being what is left), other devices a full ``torch.linalg.eigh``."""
    if matrix.device.type != "cpu":
        evals, evecs = torch.linalg.eigh(matrix)
        return evals.flip(0)[:n], evecs.flip(1)[:, :n]
    d = matrix.shape[0]
    a = matrix.contiguous().numpy()  # symmetric: its row order is LAPACK's column order
    w, z, support = np.empty(d), np.empty((n, d)), np.empty(2 * n, np.intc)
    found, info, bound = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_double(0.0)

    def call(work: np.ndarray, iwork: np.ndarray, lwork: int, liwork: int) -> None:
        ints = [ctypes.c_int(v) for v in (d, d, d - n + 1, d, d, lwork, liwork)]
        ref = [ctypes.byref(i) for i in ints]
        _dsyevr()(
            b"V", b"I", b"U", ref[0], a.ctypes.data, ref[1],
            ctypes.byref(bound), ctypes.byref(bound), ref[2], ref[3],  # vl, vu, il, iu
            ctypes.byref(bound), ctypes.byref(found), w.ctypes.data,  # abstol 0: default
            z.ctypes.data, ref[4], support.ctypes.data, work.ctypes.data, ref[5],
            iwork.ctypes.data, ref[6], ctypes.byref(info),
        )  # fmt: skip
        if info.value != 0:
            raise RuntimeError(f"LAPACK dsyevr failed (info={info.value}) on a {d}x{d} matrix.")

    work, iwork = np.empty(1), np.empty(1, np.intc)
    call(work, iwork, -1, -1)  # workspace query
    work, iwork = np.empty(int(work[0])), np.empty(int(iwork[0]), np.intc)
    call(work, iwork, work.size, iwork.size)
    # z's rows are LAPACK's columns: eigenvectors, ascending; flip to descending
    return torch.from_numpy(w[:n][::-1].copy()), torch.from_numpy(z[::-1].T.copy())
