"""`fit_bases`' decompositions on two cores: the top-k eigenpairs of many sites through
`compute.top_eigh` (scipy's ``dsyevr``, which holds the GIL, so two workers take turns)
against the LAPACK paths that would let two workers overlap or one call use both cores.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_eigh_workers.py [--d 576,1024]
        [--sites 8] [--repeat 5]

No model: ``--sites`` covariances with a spectrum ∝ 1/i at each d, k = 17 (rank 16 and
the eigengap). Each way decomposes every site; the ways are interleaved, their order
rotating, ``--repeat`` times. Printed per d: milliseconds per site (median, min–max) and
the ratio to `compute.top_eigh` site after site on one thread:

- ``top_eigh, 1 thread``: what `fit_bases` calls, site after site;
- ``top_eigh, site_map``: the same through `compute.site_map` on two workers (as
  `fit_bases` runs it): the GIL makes them take turns;
- ``dsyevr, 2 BLAS threads``: one call at a time, each on both cores (the bases then
  depend on the thread count, at rounding level);
- ``numpy eigh, site_map`` and ``torch eigh, site_map``: all d pairs (``dsyevd``) on two
  workers; both release the GIL.

The largest distance between each way's top-k subspace and `top_eigh`'s is printed too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import scipy.linalg
import torch
from threadpoolctl import threadpool_limits

from tangentlens.core import compute

K = 17


def sites(d: int, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(d)
    out = []
    for _ in range(n):
        x = torch.randn(d, 2 * d, generator=gen, dtype=torch.float64)
        x *= torch.arange(1, 2 * d + 1, dtype=torch.float64).rsqrt()
        out.append(x @ x.T)
    return out


def _numpy(a: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.linalg.eigh(a.numpy())[1][:, ::-1][:, :K].copy())


def _torch(a: torch.Tensor) -> torch.Tensor:
    return torch.linalg.eigh(a)[1].flip(1)[:, :K]


def _two_threads(a: torch.Tensor) -> torch.Tensor:
    d = a.shape[0]
    with threadpool_limits(2, user_api="blas"):
        return torch.from_numpy(
            scipy.linalg.eigh(a.numpy(), subset_by_index=[d - K, d - 1], driver="evr")[1]
        ).flip(1)


def ways() -> dict[str, Callable[[list[torch.Tensor]], list[torch.Tensor]]]:
    one = lambda a: compute.top_eigh(a.clone(), K)[1]  # noqa: E731

    def on_workers(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
        def run(items: list[torch.Tensor]) -> list[torch.Tensor]:
            torch.set_num_threads(2)  # two workers, one thread each (site_map's own limit)
            return list(compute.site_map(fn, items))

        return run

    return {
        "top_eigh, 1 thread": lambda items: [one(a) for a in items],
        "top_eigh, site_map": on_workers(one),
        "dsyevr, 2 BLAS threads": lambda items: [_two_threads(a) for a in items],
        "numpy eigh, site_map": on_workers(_numpy),
        "torch eigh, site_map": on_workers(_torch),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", default="576,1024")
    ap.add_argument("--sites", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    for d in (int(v) for v in args.d.split(",")):
        items, table = sites(d, args.sites), ways()
        reference = table["top_eigh, 1 thread"](items)
        seconds: dict[str, list[float]] = {name: [] for name in table}
        far = {}
        for name, fn in table.items():  # warm-up and the subspaces' distance
            got = fn(items)
            far[name] = max(
                float(torch.linalg.matrix_norm(r @ r.T - g @ g.T, ord=2))
                for r, g in zip(reference, got, strict=True)
            )
        names = list(table)
        for rep in range(args.repeat):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                start = time.perf_counter()
                table[name](items)
                seconds[name].append((time.perf_counter() - start) / args.sites)
        base = statistics.median(seconds["top_eigh, 1 thread"])
        print(f"\nd = {d}, {args.sites} sites, k = {K}, {args.repeat} repeats")
        print("| way | ms a site | over top_eigh, 1 thread | subspace distance |")
        print("|---|---|---|---|")
        for name, t in seconds.items():
            med = statistics.median(t)
            print(
                f"| {name} | {1e3 * med:.1f} ({1e3 * min(t):.1f}–{1e3 * max(t):.1f}) "
                f"| {med / base:.2f}× | {far[name]:.1e} |"
            )
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
