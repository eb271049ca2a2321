"""LAPACK through scipy's and torch's wrappers (`tangentlens.core.compute`) against the
`ctypes` layer on scipy's Cython LAPACK table, which releases the GIL (written out below
as the alternative measured; the package does not use it).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_lapack.py

No model. For d = 576 and 1024: `top_eigh(·, 17)` and `tridiagonalize` followed by
`tridiagonal_apply` on a (17, d) block, each on one thread (one site) and through
`site_map` over 4 sites on 2 workers. Old and new are interleaved in one process (their
order alternating), ``REPEATS`` times; the table gives min–max milliseconds per call of the
whole step (one site, or the 4 sites) and the ratio of the minima (old / new: below 1, the
new path is the slower). Both paths' results are compared first; the load average is
printed before and after (other work on the cores moves every number here).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
import scipy.linalg.cython_lapack
import torch
from threadpoolctl import ThreadpoolController

from tangentlens.core import compute

REPEATS = 7
SITES = 4
K = 17

# ---- the alternative: a ctypes layer on scipy's Cython LAPACK table (GIL released) ----


@cache
def _lapack(name: str) -> Any:
    capsule = scipy.linalg.cython_lapack.__pyx_capi__[name]
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    pointer = ctypes.pythonapi.PyCapsule_GetPointer
    pointer.restype, pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    n_args = get_name(capsule).count(b"*")
    return ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * n_args)(pointer(capsule, get_name(capsule)))


@cache
def _blas() -> ThreadpoolController:
    _lapack("dsytrd")
    return ThreadpoolController()


def _call(name: str, *args: Any) -> None:
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


def _buffer(matrix: torch.Tensor) -> np.ndarray:
    return matrix.detach().to(torch.float64).contiguous().numpy()


def _with_workspace(name: str, *args: Any, integer: bool = False) -> None:
    query = [np.empty(1), -1] + ([np.empty(1, np.intc), -1] if integer else [])
    _call(name, *args, *query)
    sizes = [np.empty(int(query[0][0])), int(query[0][0])]
    if integer:
        sizes += [np.empty(int(query[2][0]), np.intc), int(query[2][0])]
    _call(name, *args, *sizes)


def old_top_eigh(matrix: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = matrix.shape[0]
    a = _buffer(matrix)
    w, z = np.empty(d), np.empty((n, d))
    bound, found = ctypes.c_double(0.0), ctypes.c_int(0)
    args = (b"V", b"I", b"U", d, a, d, bound, bound, d - n + 1, d, bound, found, w, z, d)
    _with_workspace("dsyevr", *args, np.empty(2 * n, np.intc), integer=True)
    return torch.from_numpy(w[:n][::-1].copy()), torch.from_numpy(z[::-1].T.copy())


def old_tridiagonalize(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
    n = matrix.shape[0]
    a = _buffer(matrix)
    alpha, beta, tau = np.empty(n), np.empty(max(n - 1, 0)), np.empty(max(n - 1, 1))
    _with_workspace("dsytrd", b"L", n, a, n, alpha, beta, tau)
    return torch.from_numpy(alpha), torch.from_numpy(beta), (a, tau)


def old_tridiagonal_apply(reduction: Any, c: torch.Tensor) -> torch.Tensor:
    a, tau = reduction
    n = a.shape[0]
    out = c.detach().to(torch.float64, memory_format=torch.contiguous_format, copy=True).numpy()
    if n > 1 and out.size:
        _with_workspace("dormtr", b"L", b"L", b"T", n, out.shape[0], a, n, tau, out, n)
    return torch.from_numpy(out)


# ---- end of the alternative ----


def problems(d: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``SITES`` (covariance, block) pairs: a full-rank d × d covariance of 2d
    samples and a (K, d) block to rotate."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(SITES):
        x = torch.randn(2 * d, d, generator=gen, dtype=torch.float64)
        out.append((x.T @ x / (2 * d), torch.randn(K, d, generator=gen, dtype=torch.float64)))
    return out


def steps(eigh: Callable, tri: Callable, apply: Callable) -> dict[str, Callable]:
    return {
        f"top_eigh(k={K})": lambda p: eigh(p[0].clone(), K),
        "tridiagonalize + apply": lambda p: apply(tri(p[0].clone())[2], p[1]),
    }


OLD = steps(old_top_eigh, old_tridiagonalize, old_tridiagonal_apply)
NEW = steps(compute.top_eigh, compute.tridiagonalize, compute.tridiagonal_apply)


def check(d: int) -> None:
    """Both paths' numbers agree (α, β and eigenvalues to rounding, c·Q to 1e-12)."""
    a, c = problems(d, 1)[0]
    (w0, v0), (w1, v1) = old_top_eigh(a.clone(), K), compute.top_eigh(a.clone(), K)
    torch.testing.assert_close(w1, w0, rtol=1e-12, atol=0)
    torch.testing.assert_close(
        (v0.T @ v1).abs(), torch.eye(K, dtype=torch.float64), atol=1e-8, rtol=0
    )
    (al0, be0, r0), (al1, be1, r1) = (
        old_tridiagonalize(a.clone()),
        compute.tridiagonalize(a.clone()),
    )
    same = torch.equal(al0, al1) and torch.equal(be0, be1)
    diff = float((old_tridiagonal_apply(r0, c) - compute.tridiagonal_apply(r1, c)).abs().max())
    print(f"d={d}: α, β bitwise equal: {same}; max |c·Q old − new| = {diff:.1e}")
    assert diff < 1e-12 * float(c.abs().max()) * d


def run(step: Callable, items: list, mode: str) -> float:
    start = time.perf_counter()
    if mode == "one thread":
        with compute.threads(1):
            step(items[0])
    else:
        torch.set_num_threads(2)
        list(compute.site_map(step, items))
    return time.perf_counter() - start


def main() -> None:
    before = torch.get_num_threads()
    modes = ("one thread", f"site_map, {SITES} sites, 2 workers")
    rows = []
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    try:
        for d in (576, 1024):
            check(d)
            items = problems(d, 0)
            for name in OLD:
                for mode in modes:
                    times: dict[str, list[float]] = {"old": [], "new": []}
                    run(OLD[name], items, mode), run(NEW[name], items, mode)  # warm-up
                    for rep in range(REPEATS):
                        order = ("old", "new") if rep % 2 == 0 else ("new", "old")
                        for which in order:
                            step = (OLD if which == "old" else NEW)[name]
                            times[which].append(run(step, items, mode))
                    rows.append((d, name, mode, times["old"], times["new"]))
                    print(_row(rows[-1]), flush=True)
    finally:
        torch.set_num_threads(before)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print()
    print("| d | step | how | ctypes (old), ms | scipy/torch (new), ms | old/new (min) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(_row(row))


def _row(row: tuple) -> str:
    d, name, mode, old, new = row
    span = lambda t: f"{1e3 * min(t):.1f}–{1e3 * max(t):.1f}"  # noqa: E731
    return f"| {d} | {name} | {mode} | {span(old)} | {span(new)} | {min(old) / min(new):.2f} |"


if __name__ == "__main__":
    main()
