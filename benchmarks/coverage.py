"""Where the intervals and p-values hold their nominal rates, and where they fall short.

    PYTHONPATH=. .venv/bin/python benchmarks/coverage.py [--repeat 1000]

Simulations with a known true value (one thread, seeded; minutes at the default):

- ``jackknife``: the delete-a-group jackknife intervals of `tangent_intervals` (95 %) for
  tangent_share, energy_ratio and normalized_ratio, on sequences of 32 AR(1) tokens
  (ρ = 0.8) with known covariances; ``gauss``: every sequence at one scale; ``skewed``:
  each sequence's vectors scaled by a lognormal factor (σ = 1), as gradient norms vary
  from sequence to sequence;
- ``seeds``: the between-seed t-interval (`report.replication.t_interval`) over normal
  and lognormal per-seed values;
- ``normal controls``: the rejection rate at 0.05 and 0.01 of ``p_value_normal`` (the
  paper's controls) and ``p_value`` (uniform controls) of `tangent_tests` under the null
  (a Haar-random Q_T; anisotropic gradients with a mean; the controls drawn from a seed
  of their own), by k/d.

Each line prints the rate and its Monte-Carlo standard error.
"""

from __future__ import annotations

import argparse
import math
import os
import warnings

import numpy as np
import torch

from tangentlens.core.significance import energy_ratio, tangent_tests
from tangentlens.core.stats import Moments
from tangentlens.core.subspace import TangentBasis
from tangentlens.core.uncertainty import tangent_intervals
from tangentlens.report.replication import t_interval

STATS = ("tangent_share", "energy_ratio", "normalized_ratio")


def _sequences(rng: np.random.Generator, n: int, scales: np.ndarray) -> np.ndarray:
    """``n`` sequences of 32 AR(1) tokens with per-dimension variances ``scales``."""
    length, rho = 32, 0.8
    e = rng.standard_normal((n, length, scales.size))
    x = np.empty_like(e)
    x[:, 0] = e[:, 0]
    for t in range(1, length):
        x[:, t] = rho * x[:, t - 1] + math.sqrt(1 - rho**2) * e[:, t]
    return x * np.sqrt(scales)


def jackknife(repeat: int) -> None:
    d, tangent = 16, [1, 6]
    sg, sx = np.logspace(0.5, -0.5, d), np.logspace(1, -1, d)
    q = np.zeros((d, 2))
    q[tangent, range(2)] = 1.0
    basis = TangentBasis(torch.as_tensor(q))
    share_g, share_x = sg[tangent].sum() / sg.sum(), sx[tangent].sum() / sx.sum()
    ratio = energy_ratio(share_g, 2, d)
    true = {"tangent_share": share_g, "energy_ratio": ratio,
            "normalized_ratio": ratio / energy_ratio(share_x, 2, d)}  # fmt: skip
    rng = np.random.default_rng(1)
    for skew, label in ((0.0, "gauss "), (1.0, "skewed")):
        for n, groups in ((40, 5), (40, 10), (40, 20), (10, 10)):
            covered = dict.fromkeys(STATS, 0)
            for _ in range(repeat):
                scale = np.exp(skew * rng.standard_normal((n, 1, 1)))  # one per sequence
                g, x = _sequences(rng, n, sg) * scale, _sequences(rng, n, sx) * scale
                parts = np.array_split(np.arange(n), groups)
                grads = [Moments().update(torch.as_tensor(g[p])) for p in parts]
                acts = [Moments().update(torch.as_tensor(x[p])) for p in parts]
                found = tangent_intervals(grads, basis, activation_groups=acts)
                for name in STATS:
                    low, high = found[name]
                    covered[name] += low <= true[name] <= high
            rates = " ".join(f"{s} {covered[s] / repeat:.3f}" for s in STATS)
            print(f"jackknife {label} {n} sequences, {groups} groups: {rates}")


def seeds(repeat: int) -> None:
    rng = np.random.default_rng(0)
    draws = {
        "normal": (lambda n: rng.normal(2.0, 1.0, n), 2.0),
        "lognormal": (lambda n: rng.lognormal(0.0, 1.0, n), math.exp(0.5)),
    }
    for name, (draw, mean) in draws.items():
        rates = []
        for n in (3, 5, 10):
            hits = 0
            for _ in range(10 * repeat):  # cheap: ten times the repeats
                _, low, high = t_interval(draw(n))
                hits += low <= mean <= high
            rates.append(f"{n} seeds {hits / (10 * repeat):.3f}")
        print(f"seeds {name}: {', '.join(rates)}")


def normal_controls(repeat: int) -> None:
    for d, k in ((80, 4), (32, 4), (200, 2)):
        scales = torch.logspace(0, -2, d, dtype=torch.float64)
        mean = torch.zeros(d, dtype=torch.float64)
        mean[0] = 3.0
        counts = {("p_value", 0.05): 0, ("p_value", 0.01): 0,
                  ("p_value_normal", 0.05): 0, ("p_value_normal", 0.01): 0}  # fmt: skip
        for r in range(repeat):
            g = torch.Generator().manual_seed(r)
            x = torch.randn(500, d, generator=g, dtype=torch.float64) * scales + mean
            q = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))[0]
            basis, seed = TangentBasis(q), 10**6 + r  # the controls' own seed
            found = tangent_tests(Moments().update(x), basis, n_controls=99, seed=seed)
            for name, level in counts:
                counts[name, level] += found[name] <= level
        rates = ", ".join(f"{n} at {lv}: {c / repeat:.3f}" for (n, lv), c in counts.items())
        print(f"normal controls k/d = {k}/{d} = {k / d:.3f}: {rates}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.simplefilter("ignore")  # the exchangeability warning, expected here
    r = args.repeat
    print(f"{r} repeats: Monte-Carlo SE {math.sqrt(0.95 * 0.05 / r):.3f} at 0.95, "
          f"{math.sqrt(0.05 * 0.95 / r):.3f} at 0.05, {math.sqrt(0.01 * 0.99 / r):.4f} at 0.01; "
          f"seeds: {math.sqrt(0.95 * 0.05 / (10 * r)):.4f}")  # fmt: skip
    jackknife(r)
    seeds(r)
    normal_controls(r)


if __name__ == "__main__":
    main()
