"""Fixed costs per site, in units of one top-k eigendecomposition at the same d (no model).

    .venv/bin/python benchmarks/bench_fixed_costs.py [--d 576,1024,2048,4096] [--repeat 3]
        [--rank 16] [--controls 1000] [--old REV]

For each d, random statistics stand in for a site: activation `Moments` (two halves of
4096 vectors with a spectrum ∝ 1/i and a mean) and gradient `Moments` of another 4096.
Everything runs on one thread, as `compute.site_map` runs each site, and is timed in CPU
seconds of that thread (on a shared machine, without the time spent waiting for a core).
Each repeat times, interleaved:

- ``eigh``: one top-(k+1) ``scipy.linalg.eigh(subset_by_index)`` of the covariance
  (`compute.top_eigh`, what `TangentBasis.fit` calls): the unit;
- ``fit``: `TangentBasis.fit` on the pooled moments; ``split-half``: `split_half_overlap`
  of the two halves; ``fit+diag``: their sum, what `fit_bases` pays per distinct site;
- ``probe tests``: what the gradient probe's `results()` runs per site, its ΔIsoScore*
  reference (`pooled_shape` of the site's own moments, `reference_at`) and
  `tangent_tests` with ζ = 0.1;
- ``study tests``: `tangent_tests` as a study's analysis runs it, with the activation
  moments and a reference pooled over two checkpoints (not a multiple of the covariance:
  ΔIsoScore* gets a reduction of its own);
- ``matrix tests``: `matrix_tests` of a second moment, what the weight-gradient probe runs.

The controls are drawn once per (d, k, n, seed) and cached for every later site; that
draw (``draw``, with the normal controls' rows) is timed once per d, before the repeats.
``--old REV`` times the same calls of git revision ``REV``'s numerical core beside this
tree's (`_former.py`), interleaved, and prints both.

Printed: each as a multiple of ``eigh`` (median over repeats, min–max), and eigh's own
time. ``--profile N`` adds, per d and implementation, the N functions with the most own
CPU time in one call of the probe's tests (cProfile). Timing on a shared machine is noisy:
read the ratios; the load average is printed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time
import types
from collections.abc import Callable

import torch
from _timing import cpu_timed as timed

import tangentlens.core as core
from tangentlens.core import compute, controls, significance, subspace
from tangentlens.core.stats import Moments

ZETA = 0.1


def _moments(d: int, n: int, gen: torch.Generator) -> Moments:
    """n vectors with spectrum ∝ 1/i (a few strong directions, a long tail)."""
    scales = 1.0 / torch.arange(1, d + 1, dtype=torch.float64).sqrt()
    x = torch.randn(n, d, generator=gen, dtype=torch.float64) * scales
    rotation = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64)).Q
    return Moments().update(x @ rotation.T + 0.1)


def _calls(
    impl: types.SimpleNamespace, stats: dict, basis: object, n_controls: int
) -> dict[str, Callable[[], object]]:
    """The timed calls of one implementation (this tree's modules or a former revision's)."""
    sig, sub = impl.significance, impl.subspace
    halves, pooled, grads, other = (stats[key] for key in ("halves", "pooled", "grads", "other"))
    k = basis.k
    study_shape = sig.pooled_shape([grads, other])

    def probe_tests() -> object:
        reference = sig.reference_at(sig.pooled_shape([grads]), grads)
        return sig.tangent_tests(
            grads, basis, n_controls=n_controls, zeta=ZETA, reference=reference
        )

    def study_tests() -> object:
        reference = sig.reference_at(study_shape, grads)
        return sig.tangent_tests(
            grads,
            basis,
            n_controls=n_controls,
            zeta=ZETA,
            reference=reference,
            activation_moments=pooled,
        )

    second = grads.second_moment()
    return {
        "fit": lambda: sub.TangentBasis.fit(pooled, rank=k),
        "split-half": lambda: sub.split_half_overlap(*halves, k),
        "probe tests": probe_tests,
        "study tests": study_tests,
        "matrix tests": lambda: sig.matrix_tests(
            second, basis, n_controls=n_controls, activation_moments=pooled
        ),
    }


def _draw_time(impl: types.SimpleNamespace, d: int, k: int, n: int) -> float:
    """Seconds to draw one set of controls with the normal controls' rows (uncached)."""
    ctl = impl.controls
    return timed(lambda: ctl.ControlSet(ctl.draw_frames(d, k, n, 0)).normal())


def _report(name: str, times: dict[str, list[float]], unit: list[float]) -> str:
    cells = []
    times = dict(times)
    times["fit+diag"] = [a + b for a, b in zip(times["fit"], times["split-half"], strict=True)]
    for key in ("fit", "split-half", "fit+diag", "probe tests", "study tests", "matrix tests"):
        ratios = [v / u for v, u in zip(times[key], unit, strict=True)]
        spread = f"({min(ratios):.2f}-{max(ratios):.2f})"
        cells.append(f"{key} {statistics.median(ratios):5.2f}x {spread}")
    return f"  {name:4s} " + "  ".join(cells)


def _profile(name: str, fn: Callable[[], object], top: int) -> None:
    """The ``top`` functions by own CPU time in one call of ``fn``."""
    profiler = cProfile.Profile(time.process_time)
    profiler.runcall(fn)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    rows = [line for line in out.getvalue().splitlines() if line.strip()]
    print(f"  {name}: probe tests, by own CPU time")
    print("\n".join(f"    {line}" for line in rows[-top - 1 :]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", default="576,1024,2048,4096")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--controls", type=int, default=1000)
    ap.add_argument("--old", default=None, help="git revision to time beside this tree")
    ap.add_argument("--profile", type=int, default=0, help="top N functions of the probe tests")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()}; one thread", flush=True)
    impls = {"new": types.SimpleNamespace(significance=significance, subspace=subspace)}
    impls["new"].controls = controls
    if args.old:
        from _former import basis as former_basis
        from _former import former_core

        impls["old"] = former_core(args.old)
    k, n = args.rank, args.controls
    with compute.threads(1):
        for d in (int(x) for x in args.d.split(",")):
            gen = torch.Generator().manual_seed(d)
            halves = [_moments(d, 4096, gen) for _ in range(2)]
            stats = {
                "halves": halves,
                "pooled": Moments.merged(halves),
                "grads": _moments(d, 4096, gen),
                "other": _moments(d, 4096, gen),
            }
            fitted = core.subspace.TangentBasis.fit(stats["pooled"], rank=k)
            bases = {"new": fitted}
            if args.old:
                bases["old"] = former_basis(impls["old"], fitted)
            calls = {name: _calls(impl, stats, bases[name], n) for name, impl in impls.items()}
            cov = stats["pooled"].covariance()
            draws = {name: _draw_time(impl, d, k, n) for name, impl in impls.items()}
            for name, impl in impls.items():  # the cached draw every site reuses
                impl.significance.tangent_tests(stats["grads"], bases[name], n_controls=n)
            unit: list[float] = []
            times: dict[str, dict[str, list[float]]] = {name: {} for name in impls}
            for r in range(args.repeat):
                unit.append(timed(lambda c=cov: compute.top_eigh(c.clone(), k + 1)))
                order = list(impls) if r % 2 == 0 else list(reversed(impls))
                for key in calls["new"]:
                    for name in order:
                        times[name].setdefault(key, []).append(timed(calls[name][key]))
            eigh = statistics.median(unit)
            draw = "  ".join(f"{name} {v / eigh:.2f}x" for name, v in draws.items())
            print(f"d={d:5d}  eigh {1e3 * eigh:8.1f} ms  (draw of the controls, once: {draw})")
            for name in reversed(list(impls)):
                print(_report(name, times[name], unit), flush=True)
            for name in reversed(list(impls)) if args.profile else ():
                _profile(name, calls[name]["probe tests"], args.profile)
    print(f"\nrank {k}, {n} controls, repeats {args.repeat}; load {os.getloadavg()}")


if __name__ == "__main__":
    main()
