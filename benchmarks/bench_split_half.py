"""The split-half diagnostic without two more exact decompositions: iterative top-k fits
of the two halves against `split_half_overlap`'s two exact ones (no model, or SmolLM2).

    .venv/bin/python benchmarks/bench_split_half.py [--d 576,1024,2048] [--rank 16]
        [--tol 1e-8] [--extra 16] [--smollm2 0,10,20,29 [--batches 8]]

`split_half_overlap` fits both halves exactly (`compute.top_eigh`), so `fit_bases` runs
three top-k decompositions per distinct site (the fit and the two halves). Two
alternatives, each run until ‖R‖_F ≤ ``tol``·(θ_k − θ_{k+1}) (a sin Θ bound for the top-k
Ritz space, with the Ritz gap standing for the eigengap):

- ``subspace``: subspace iteration with Rayleigh–Ritz at every step on k + ``extra``
  columns, warm-started for each half from the full fit's top k + 1 eigenvectors (which
  `fit_bases` has) and ``extra`` − 1 random columns;
- ``krylov``: the first half fitted exactly, the second by block Krylov–Rayleigh–Ritz
  warm-started from it (the residuals of its Ritz vectors expand the space each step, until
  certified or half the dimension is spanned).

Halves: two samples of 4096 vectors from one population (spectrum ∝ 1/i about a mean, one
rotation), or with ``--smollm2`` the even and the odd batches of SmolLM2-135M's
``resid_pre``, ``attn_in``, ``resid_mid`` and ``mlp_in`` at those layers (random tokens,
4 × 128 a batch). One thread, CPU time, one call of each. Printed per site: each method's
time for the two halves as a multiple of the two exact fits, its steps, and its overlap's
difference from the exact one.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
from _timing import cpu_timed

from tangentlens import models
from tangentlens.core.compute import threads, top_eigh
from tangentlens.core.stats import Moments
from tangentlens.core.subspace import subspace_overlap
from tangentlens.hooks.sites import Site
from tangentlens.probes import run

MAX_STEPS = 1000


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


def subspace_top(c: torch.Tensor, start: torch.Tensor, k: int, tol: float) -> tuple:
    """``(top-k Ritz vectors or None, steps)`` of the symmetric ``c`` by subspace iteration
    on the block ``start``, Rayleigh–Ritz at every step."""
    v = torch.linalg.qr(start).Q
    for step in range(1, MAX_STEPS + 1):
        image = c @ v
        h = v.T @ image
        theta, y = torch.linalg.eigh((h + h.T) / 2)
        theta, y = theta.flip(0), y.flip(1)
        u, image = v @ y, image @ y
        residual = float((image[:, :k] - u[:, :k] * theta[:k]).norm())
        if residual <= tol * float(theta[k - 1] - theta[k]):
            return u[:, :k], step
        v = torch.linalg.qr(image).Q
    return None, MAX_STEPS


def _population_halves(d: int, gen: torch.Generator) -> list[Moments]:
    """Two samples of 4096 vectors from one population: spectrum ∝ 1/i, one rotation, a
    mean."""
    scales = 1.0 / torch.arange(1, d + 1, dtype=torch.float64).sqrt()
    rotation = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64)).Q
    return [
        Moments().update(
            (torch.randn(4096, d, generator=gen, dtype=torch.float64) * scales) @ rotation.T + 0.1
        )
        for _ in range(2)
    ]


def _smollm2_halves(layers: list[int], batches: int) -> dict[str, list[Moments]]:
    """The even and the odd batches' `Moments` at four site kinds of those layers."""
    warnings.simplefilter("ignore")
    bridge, tok = models.load("smollm2-135m")
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, len(tok), (4, 128), generator=gen) for _ in range(batches)]

    def wanted(name: str) -> bool:
        site = Site.from_hook_name(name)
        return site.layer in layers and site.kind in ("resid_pre", "attn_in", "resid_mid", "mlp_in")

    halves = [
        run(bridge, part, None, ("activation",), sites=wanted, progress=False).activation.moments
        for part in (data[0::2], data[1::2])
    ]
    return {s.hook_name: [halves[0][s], halves[1][s]] for s in halves[0]}


def _compare(name: str, halves: list[Moments], k: int, tol: float, extra: int) -> None:
    """One site: both alternatives against the two exact fits, printed as one line."""
    gen = torch.Generator().manual_seed(0)
    covs = [h.covariance() for h in halves]
    d = covs[0].shape[0]
    warm = top_eigh(Moments.merged(halves).covariance(), k + 1)[1]
    exact: list[torch.Tensor] = []
    unit = cpu_timed(lambda: exact.extend(top_eigh(c.clone(), k)[1] for c in covs))
    reference = subspace_overlap(*exact)
    cells = []

    def subspace() -> list[tuple]:
        noise = [torch.randn(d, extra - 1, generator=gen, dtype=torch.float64) for _ in covs]
        return [
            subspace_top(c, torch.cat([warm, z], 1), k, tol)
            for c, z in zip(covs, noise, strict=True)
        ]

    def krylov() -> list[tuple]:
        first = top_eigh(covs[0].clone(), k + 1)[1]
        u, steps, _ = krylov_top(covs[1], first, k, tol)
        return [(first[:, :k], 0), (u, steps)]

    for method, fn in (("subspace", subspace), ("krylov", krylov)):
        out: list[tuple] = []
        t = cpu_timed(lambda fn=fn, o=out: o.extend(fn()))
        (ua, sa), (ub, sb) = out
        diff = "not certified"
        if ua is not None and ub is not None:
            diff = f"{abs(subspace_overlap(ua, ub) - reference):.1e}"
        cells.append(f"{method} {t / unit:5.2f}x ({sa}+{sb} steps, overlap {diff})")
    print(f"{name} (d={d}, two exact fits {1e3 * unit:.0f} ms): " + "; ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", default="576,1024,2048")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tol", type=float, default=1e-8)
    ap.add_argument("--extra", type=int, default=16)
    ap.add_argument("--smollm2", default=None, help="comma-separated layers: SmolLM2's halves")
    ap.add_argument("--batches", type=int, default=8)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()}; one thread, CPU time", flush=True)
    if args.smollm2:
        sites = _smollm2_halves([int(x) for x in args.smollm2.split(",")], args.batches)
    else:
        sites = {
            f"spectrum 1/i, seed {d}": _population_halves(d, torch.Generator().manual_seed(d))
            for d in (int(x) for x in args.d.split(","))
        }
    with threads(1):
        for name, halves in sites.items():
            _compare(name, halves, args.rank, args.tol, args.extra)
    print(f"rank {args.rank}, tol {args.tol}, extra {args.extra}; load {os.getloadavg()}")


if __name__ == "__main__":
    main()
