"""Statistics benchmarks, ratios measured in one run.

    .venv/bin/python benchmarks/bench_stats.py [--quick]

1. energy_test with 1000 controls (d=768, k=32) against the straightforward
   alternative: keep the (20,000 × 768) gradient matrix and project it onto each
   control frame (timed on a subset of controls and scaled, since the full run
   takes minutes).
2. isoscore on (20,000, 768) against the IsoScore package.
3. twonn_dimension against scikit-dimension on (2,000, 768).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from tangentlens.core import metrics
from tangentlens.core.significance import energy_test
from tangentlens.core.stats import Moments
from tangentlens.core.subspace import TangentBasis, normal_controls


def timed(fn, repeat=1):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = ap.parse_args()
    n, d, k, n_ctrl = (4000, 256, 16, 200) if args.quick else (20_000, 768, 32, 1000)
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(n, d, generator=gen) * torch.linspace(0.1, 2, d)
    basis = TangentBasis(torch.linalg.qr(torch.randn(d, k, generator=gen, dtype=torch.float64))[0])
    print(f"torch threads: {torch.get_num_threads()}; n={n}, d={d}, k={k}, controls={n_ctrl}")

    t_moments, m = timed(lambda: Moments().update(grads))
    t_ours, res = timed(lambda: energy_test(m, basis, n_controls=n_ctrl))
    sub = 20
    frames = normal_controls(basis, sub, seed=1).float()
    g = grads.float()

    def naive():
        total = float((g * g).sum())
        return [float((g @ f).pow(2).sum()) / total for f in frames]

    t_naive_sub, _ = timed(naive)
    t_frames, _ = timed(lambda: normal_controls(basis, sub, seed=1))
    t_naive = (t_naive_sub + t_frames) * n_ctrl / sub
    print(
        f"energy_test, {n_ctrl} controls: {t_ours:.2f} s (+ {t_moments:.2f} s to build the Moments)"
        f" | projection of the {n}x{d} matrix per control: {t_naive:.1f} s (scaled from {sub})"
        f" | speed-up {t_naive / (t_ours + t_moments):.0f}x; p = {res.p_value:.4f}"
    )

    from IsoScore import IsoScore as ref

    x = grads.double().numpy()
    t_iso, ours = timed(lambda: metrics.isoscore(x), repeat=3)
    t_ref, theirs = timed(lambda: float(ref.IsoScore(x)), repeat=3)
    print(
        f"isoscore ({n}x{d}): {t_iso:.3f} s vs IsoScore package {t_ref:.3f} s"
        f" -> {t_ref / t_iso:.1f}x; |diff| = {abs(ours - theirs):.1e}"
    )

    import skdim

    pts = (torch.randn(2000, 8, generator=gen) @ torch.randn(8, d, generator=gen)).double().numpy()
    t_two, ours = timed(lambda: metrics.twonn_dimension(pts))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_sk, theirs = timed(lambda: skdim.id.TwoNN().fit(pts).dimension_)
    print(
        f"twonn_dimension (2000x{d}): {t_two:.3f} s vs scikit-dimension {t_sk:.3f} s"
        f" -> {t_sk / t_two:.1f}x; {ours:.3f} vs {theirs:.3f}"
    )


if __name__ == "__main__":
    main()
