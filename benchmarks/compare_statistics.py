"""This tree's statistics against a former revision's, on the same inputs (no model).

    .venv/bin/python benchmarks/compare_statistics.py --old REV [--d 64,576,1024]
        [--vectors 4096,300] [--controls 1000]

For each d and number of vectors n (the statistics of `bench_fixed_costs`: spectrum ∝ 1/i
and a mean), the calls `bench_fixed_costs` times, of this tree and of git revision
``REV``'s numerical core (`_former.py`): the gradient probe's `tangent_tests` (ΔIsoScore*'s
reference from its own checkpoint, ζ = 0.1), a study's (a reference pooled over two
checkpoints, the activation moments), `matrix_tests` and `split_half_overlap`. Printed per
call: the largest relative difference of the statistics that do not depend on the
controls, and for those that do (p-values, ``delta_iso_normal``, ``iso_statistic``) the
largest difference in units of its Monte-Carlo standard error: a p-value's
√(2·p(1 − p)/n) (floored at 1/n), a mean's √2·sd/√n over the controls (two independent
realisations differ by that much in standard deviation). 0 means equal bit for bit.
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
from _former import basis as former_basis
from _former import former_core
from bench_fixed_costs import _moments

from tangentlens.core import significance, subspace
from tangentlens.core.compute import threads
from tangentlens.core.stats import Moments

MONTE_CARLO = ("p_value", "p_value_normal", "isotropy_p_value", "isotropy_p_value_normal")
MEANS = {"delta_iso_normal": "normal", "iso_statistic": "uniform"}


def _calls(sig, sub, stats: dict, basis: object, n: int) -> dict:
    grads, other, pooled, halves = (stats[key] for key in ("grads", "other", "pooled", "halves"))
    own = sig.reference_at(sig.pooled_shape([grads]), grads)
    study = sig.reference_at(sig.pooled_shape([grads, other]), grads)
    return {
        "probe tests": lambda: sig.tangent_tests(
            grads, basis, n_controls=n, zeta=0.1, reference=own
        ),
        "study tests": lambda: sig.tangent_tests(
            grads, basis, n_controls=n, zeta=0.1, reference=study, activation_moments=pooled
        ),
        "matrix tests": lambda: sig.matrix_tests(
            grads.second_moment(), basis, n_controls=n, activation_moments=pooled
        ),
        "split-half": lambda: {"split_half_overlap": sub.split_half_overlap(*halves, basis.k)},
    }


def _null_sd(sig, stats: dict, basis: object, n: int, controls: str, study: bool) -> float:
    """The standard deviation of ΔIso* over the controls of one isotropy test."""
    grads = stats["grads"]
    pool = [grads, stats["other"]] if study else [grads]
    reference = sig.reference_at(sig.pooled_shape(pool), grads)
    test = sig.isotropy_test(
        grads, basis, n_controls=n, zeta=0.1, reference=reference, controls=controls
    )
    return float(test.null_deltas.std())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="git revision to compare with")
    ap.add_argument("--d", default="64,576,1024")
    ap.add_argument("--vectors", default="4096,300")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--controls", type=int, default=1000)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    old = former_core(args.old)
    n = args.controls
    with threads(1):
        for d in (int(x) for x in args.d.split(",")):
            k = min(args.rank, d // 4)
            for count in (int(x) for x in args.vectors.split(",")):
                gen = torch.Generator().manual_seed(d + count)
                halves = [_moments(d, count, gen) for _ in range(2)]
                stats = {
                    "halves": halves,
                    "pooled": Moments.merged(halves),
                    "grads": _moments(d, count, gen),
                    "other": _moments(d, count, gen),
                }
                basis = subspace.TangentBasis.fit(stats["pooled"], rank=k)
                was = _calls(old.significance, old.subspace, stats, former_basis(old, basis), n)
                now = _calls(significance, subspace, stats, basis, n)
                for name in now:
                    a, b = now[name](), was[name]()
                    exact = [
                        abs(a[s] - b[s]) / max(abs(b[s]), 1e-300)
                        for s in b
                        if s not in MONTE_CARLO and s not in MEANS
                    ]
                    cells = [f"deterministic {max(exact, default=0.0):.1e}"]
                    for s in (s for s in MONTE_CARLO if s in b):
                        se = math.sqrt(2 * max(b[s] * (1 - b[s]), 1 / n) / n)
                        cells.append(f"{s} {abs(a[s] - b[s]) / se:.2f} SE")
                    for s, controls in MEANS.items():
                        if s in b:
                            sd = _null_sd(old.significance, stats, former_basis(old, basis), n,
                                          controls, name == "study tests")  # fmt: skip
                            se = math.sqrt(2) * sd / math.sqrt(n)
                            cells.append(f"{s} {abs(a[s] - b[s]) / se:.2f} SE")
                    print(f"d={d:5d} n={count:5d} {name:13s} " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
