"""Fixed costs per site, in units of one top-k eigendecomposition at the same d (no model).

    .venv/bin/python benchmarks/bench_fixed_costs.py [--d 576,1024,2048] [--repeat 3]
        [--rank 16] [--controls 1000]

For each d, random statistics stand in for a site: activation `Moments` (two halves of
4096 vectors with a decaying spectrum) and gradient `Moments`. Each repeat times,
interleaved:

- ``eigh``: one top-(k+1) ``scipy.linalg.eigh(subset_by_index)`` of the covariance
  (`compute.top_eigh`, what `TangentBasis.fit` calls): the unit;
- ``fit``: `TangentBasis.fit` on the pooled moments (covariance, one top_eigh, signs);
- ``split-half``: `split_half_overlap` of the two halves (two more fits, as `fit_bases`
  runs it for its diagnostic);
- ``tests``: `significance.tangent_tests` with ``--controls`` controls and the
  activation moments (what `results()` runs per gradient site).

Printed: each as a multiple of ``eigh`` (median over repeats, min–max), and eigh's own
time. Timing on a shared machine is noisy: read the ratios; the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from _timing import timed

from tangentlens.core.compute import top_eigh
from tangentlens.core.significance import tangent_tests
from tangentlens.core.stats import Moments
from tangentlens.core.subspace import TangentBasis, split_half_overlap


def _moments(d: int, n: int, gen: torch.Generator) -> Moments:
    """n vectors with spectrum ∝ 1/i (a few strong directions, a long tail)."""
    scales = 1.0 / torch.arange(1, d + 1, dtype=torch.float64).sqrt()
    x = torch.randn(n, d, generator=gen, dtype=torch.float64) * scales
    rotation = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64)).Q
    return Moments().update(x @ rotation.T + 0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", default="576,1024,2048")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--controls", type=int, default=1000)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()}, {torch.get_num_threads()} threads", flush=True)
    k = args.rank
    rows = []
    for d in (int(x) for x in args.d.split(",")):
        gen = torch.Generator().manual_seed(d)
        halves = [_moments(d, 4096, gen) for _ in range(2)]
        pooled = Moments.merged(halves)
        grads = _moments(d, 4096, gen)
        basis = TangentBasis.fit(pooled, rank=k)
        cov = pooled.covariance()
        times: dict[str, list[float]] = {}
        for _ in range(args.repeat):
            t = {
                "eigh": timed(lambda c=cov: top_eigh(c.clone(), k + 1)),
                "fit": timed(lambda p=pooled: TangentBasis.fit(p, rank=k)),
                "split-half": timed(lambda h=halves: split_half_overlap(*h, k)),
                "tests": timed(
                    lambda g=grads, b=basis, p=pooled: tangent_tests(
                        g, b, n_controls=args.controls, activation_moments=p
                    )
                ),
            }
            for name, value in t.items():
                times.setdefault(name, []).append(value)
            times.setdefault("unit", []).append(t["eigh"])
        unit = statistics.median(times["unit"])
        line = [f"d={d:5d}  eigh {1e3 * unit:8.1f} ms"]
        for name in ("fit", "split-half", "tests"):
            ratios = [v / u for v, u in zip(times[name], times["unit"], strict=True)]
            line.append(
                f"{name} {statistics.median(ratios):5.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            )
        rows.append("  ".join(line))
        print(rows[-1], flush=True)
    print(f"\nrank {k}, {args.controls} controls, repeats {args.repeat}; load {os.getloadavg()}")


if __name__ == "__main__":
    main()
