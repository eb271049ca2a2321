"""One site's tests against controls: what `results()` pays per distinct gradient site.

    .venv/bin/python benchmarks/bench_site_tests.py [--repeat 3]

`tangent_tests` (energy and IsoScore* tests, uniform and normal controls) and
`matrix_tests` (the energy test the weight gradients use) at d = 576, k = 16 (SmolLM2's
width, the default rank), 1,000 controls, on one thread as `compute.site_map` runs them,
with 512 and 4,096 gradient vectors (fewer and more than d). CPU time per site, best of
``--repeat`` rounds of 5 calls, after one call that draws the cached frames.
"""

from __future__ import annotations

import argparse
import time

import torch

from tangentlens.core.compute import threads
from tangentlens.core.significance import matrix_tests, tangent_tests
from tangentlens.core.stats import Moments
from tangentlens.core.subspace import TangentBasis


def per_call_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(5):
            fn()
        best = min(best, (time.process_time() - start) / 5)
    return 1e3 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    d, k = 576, 16
    with threads(1):
        for n in (512, 4096):
            g = torch.randn(n, d, generator=gen) * torch.linspace(0.1, 3, d) + 0.05
            m = Moments().update(g.double())
            q = torch.linalg.qr(torch.randn(d, k, dtype=torch.float64, generator=gen)).Q
            basis = TangentBasis(q)
            t_tests = per_call_ms(lambda m=m, b=basis: tangent_tests(m, b), args.repeat)
            h = m.second_moment()
            t_matrix = per_call_ms(lambda h=h, b=basis: matrix_tests(h, b), args.repeat)
            print(
                f"d={d}, k={k}, {n} vectors: tangent_tests {t_tests:.1f} ms, "
                f"matrix_tests {t_matrix:.1f} ms (one thread, CPU time per site)"
            )


if __name__ == "__main__":
    main()
