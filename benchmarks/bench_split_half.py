"""The split-half diagnostic's second fit: one exact top-k decomposition against block
Krylov–Rayleigh–Ritz warm-started from the first half's basis (no model).

    .venv/bin/python benchmarks/bench_split_half.py [--d 576,1024,2048] [--rank 16]
        [--tol 1e-10] [--extra 0,8]

`split_half_overlap` fits both halves exactly, so `fit_bases` runs three top-k
decompositions per distinct site (the fit and the two halves). This measures the
alternative for the second half, on the statistics of `bench_fixed_costs` (spectrum ∝ 1/i,
two halves of 4096 vectors), one thread, CPU time: a block of the first half's top k
eigenvectors (and ``--extra`` random columns) is expanded by the residuals of its Ritz
vectors, with Rayleigh–Ritz on the whole space each step, until ‖R‖_F ≤ ``tol``·(θ_k −
θ_{k+1}) (a sin Θ bound for the top-k Ritz space, with the Ritz gap standing for the
eigengap) or half the dimension is spanned. Printed per d: the time as a multiple of
one exact top-k decomposition, the steps, the columns and the overlap's difference from
the exact one.
"""

from __future__ import annotations

import argparse
import os

import torch
from _timing import cpu_timed
from bench_fixed_costs import _moments

from tangentlens.core.compute import threads, top_eigh


def krylov_top(c: torch.Tensor, start: torch.Tensor, k: int, tol: float) -> tuple:
    """``(top-k Ritz vectors or None, steps, columns)`` of the symmetric ``c``."""
    v = torch.linalg.qr(start).Q
    vs, ws = [v], [c @ v]
    block, steps = v.shape[1], 0
    while True:
        steps += 1
        basis, image = torch.cat(vs, 1), torch.cat(ws, 1)
        h = basis.T @ image
        theta, y = torch.linalg.eigh((h + h.T) / 2)
        theta, y = theta.flip(0), y.flip(1)
        u = basis @ y[:, :k]
        residual = float((image @ y[:, :k] - u * theta[:k]).norm())
        gap = float(theta[k - 1] - theta[k]) if len(theta) > k else 0.0
        if residual <= tol * gap:
            return u, steps, basis.shape[1]
        if basis.shape[1] + block > c.shape[0] // 2:
            return None, steps, basis.shape[1]
        ritz = basis @ y[:, :block]
        new = image @ y[:, :block] - ritz * theta[:block]
        for _ in range(2):  # orthogonal to the space so far, twice for rounding
            new = new - basis @ (basis.T @ new)
        new = torch.linalg.qr(new).Q
        vs.append(new)
        ws.append(c @ new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", default="576,1024,2048")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tol", type=float, default=1e-10)
    ap.add_argument("--extra", default="0,8")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()}; one thread, CPU time", flush=True)
    k = args.rank
    with threads(1):
        for d in (int(x) for x in args.d.split(",")):
            gen = torch.Generator().manual_seed(d)
            ca, cb = (_moments(d, 4096, gen).covariance() for _ in range(2))
            qa = top_eigh(ca.clone(), k + 1)[1]
            exact_b: list[torch.Tensor] = []
            unit = cpu_timed(lambda c=cb, o=exact_b: o.append(top_eigh(c.clone(), k)[1]))
            exact = float((qa[:, :k].T @ exact_b[0]).pow(2).sum()) / k
            for extra in (int(x) for x in args.extra.split(",")):
                noise = torch.randn(d, max(extra - 1, 0), generator=gen, dtype=torch.float64)
                start = torch.cat([qa[:, : k + (extra > 0)], noise], 1)
                out: list[tuple] = []
                t = cpu_timed(lambda c=cb, s=start, o=out: o.append(krylov_top(c, s, k, args.tol)))
                u, steps, cols = out[0]
                diff = "not certified"
                if u is not None:
                    diff = f"{abs(float((qa[:, :k].T @ u).pow(2).sum()) / k - exact):.1e}"
                print(
                    f"d={d:5d} extra {extra:2d}: {t / unit:5.2f}x one exact fit "
                    f"({1e3 * unit:.0f} ms), {steps} steps, {cols} columns, overlap {diff}",
                    flush=True,
                )
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
