"""Precision of the float32 per-batch products and of ``memory="compact"`` against the
all-float64 products, on SmolLM2-135M and on an adversarial stream.

    .venv/bin/python benchmarks/bench_accumulation.py [--layers all|0,5,10] [--batches 4]
    .venv/bin/python benchmarks/bench_accumulation.py --fit-timing 3   # time only
    .venv/bin/python benchmarks/bench_accumulation.py --gradient-products --layers 0,10,20,29

Three runs over the same tokens, bases and seed: the reference (every per-batch product
in float64: `tangentlens.core.stats.gram_dtype` forced to float64), the default (float32
products of the float32 activations, float64 state) and ``memory="compact"`` (float32
products and float32 state). For each statistic it prints the largest relative
difference from the reference over the sites, and for ``fit_bases`` 1 − the overlap of
the bases. Then a stream of mean 1e4 with unit spread (float32), where only the running
centre keeps float32 products accurate. Also the time of one batch's statistics at
d = 576, n = 512 in both dtypes (one thread; noisy on a shared machine). With
``--fit-timing N``: only `fit_bases` (2 batches of 4 × 128 tokens) with float32 against
float64 products, interleaved N times, as the ratio of the two with its spread. With
``--gradient-products``: only the gradient probe, its per-batch products of the gradients
in float32 (as the activations' are) against the float64 ones it takes, 4 × 128 tokens a
batch: what float32 would move.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from unittest import mock

import torch

from tangentlens import models
from tangentlens.core import stats, weight_grams
from tangentlens.core.subspace import subspace_overlap
from tangentlens.probes import fit_bases, run, session, weight_gradient

PROBES = ("residual", "gradient", "weight_gradient")
COMPARED = (
    "tangent_share",
    "energy_ratio",
    "normalized_ratio",
    "share_ratio",
    "delta_iso_tangent",
    "delta_iso_normal",
    "iso_statistic",
)


@contextlib.contextmanager
def _float64_products():
    """Every per-batch product in float64: the reference."""
    with (
        mock.patch.object(stats, "gram_dtype", lambda x: torch.float64),
        mock.patch.object(weight_gradient, "gram_dtype", lambda x: torch.float64),
        mock.patch.object(weight_grams, "gram_dtype", lambda x: torch.float64),
    ):
        yield


def _values(table):
    keyed = table.set_index(["probe", "hook", "statistic"])["value"]
    return keyed[keyed.index.get_level_values("statistic").isin((*COMPARED, "p_value"))]


def _report(name: str, got, ref) -> None:
    rel = ((got - ref).abs() / ref.abs().clip(lower=1e-300)).dropna()
    for stat, part in rel.groupby(level="statistic"):
        if stat != "p_value":
            print(f"  {name:>8} {stat:>18}: max rel diff {part.max():.1e} over {part.size} sites")
    p = (got - ref).abs().xs("p_value", level="statistic")
    print(f"  {name:>8} {'p_value':>18}: max abs diff {p.max():.1e} (MC step 1/1001)")


def _adversarial() -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(20_000, 576, generator=gen, dtype=torch.float64) + 1e4).float()
    fast, ref = stats.Moments(), stats.Moments()
    for chunk in x.split(512):
        fast.add_batch(*stats.batch_statistics(chunk, fast=True))
        ref.update(chunk)  # float64 products
    rel = ((fast.covariance() - ref.covariance()).norm() / ref.covariance().norm()).item()
    print(f"\nstream of mean 1e4, unit spread, d=576, 20,000 float32 vectors: cov rel {rel:.1e}")
    naive = x[:512].float()
    gram = (naive.T @ naive / 512).double() - torch.outer(
        x[:512].double().mean(0), x[:512].double().mean(0)
    )
    exact = stats.Moments().update(x[:512].double()).covariance()
    print(
        f"  (a float32 E[xxᵀ] − μμᵀ of one batch: rel {((gram - exact).norm() / exact.norm()):.1e})"
    )


def _timing() -> None:
    torch.set_num_threads(1)
    x = torch.randn(4, 128, 576)
    times = {"float64": [], "float32": []}
    for _ in range(15):
        start = time.perf_counter()
        stats.batch_statistics(x)
        times["float64"].append(time.perf_counter() - start)
        start = time.perf_counter()
        stats.batch_statistics(x, fast=True)
        times["float32"].append(time.perf_counter() - start)
    for name, t in times.items():
        lo, med, hi = (1e3 * v for v in (min(t), statistics.median(t), max(t)))
        print(f"batch_statistics (512, 576) {name}: {med:.1f} ms (spread {lo:.1f}-{hi:.1f})")


def _fit_timing(bridge, tok, layers, repeat: int) -> None:
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, len(tok), (4, 128), generator=gen) for _ in range(2)]
    ratios = []
    for _ in range(repeat):
        start = time.perf_counter()
        with _float64_products():
            fit_bases(bridge, batches, rank=16, layers=layers, progress=False)
        slow = time.perf_counter() - start
        start = time.perf_counter()
        fit_bases(bridge, batches, rank=16, layers=layers, progress=False)
        fast = time.perf_counter() - start
        ratios.append(fast / slow)
        print(f"fit_bases: float64 products {slow:.2f} s, float32 {fast:.2f} s", flush=True)
    lo, med, hi = min(ratios), statistics.median(ratios), max(ratios)
    print(f"float32 / float64 products: {med:.2f} (spread {lo:.2f}-{hi:.2f})")


def _gradient_products(bridge, tok, layers, n_batches: int) -> None:
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, len(tok), (4, 128), generator=gen) for _ in range(n_batches)]
    bases = fit_bases(bridge, batches[:2], rank=16, layers=layers, progress=False)
    opts = {"layers": layers, "progress": False}
    ref = _values(run(bridge, batches, bases, ("gradient",), **opts).results(progress=False))
    observation = session.Observation

    def float32_products(*args, **kwargs):
        kwargs["fast"] = True
        return observation(*args, **kwargs)

    with mock.patch.object(session, "Observation", float32_products):
        fast = run(bridge, batches, bases, ("gradient",), **opts).results(progress=False)
    print(f"SmolLM2-135M, {n_batches}x4x128 tokens, layers={layers}: gradient products")
    _report("float32", _values(fast), ref)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="all")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--fit-timing", type=int, default=0, help="only time fit_bases, N times")
    ap.add_argument(
        "--gradient-products", action="store_true", help="only float32 gradient products"
    )
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    bridge, tok = models.load("smollm2-135m")
    layers = None if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    if args.fit_timing:
        _fit_timing(bridge, tok, layers, args.fit_timing)
        return
    if args.gradient_products:
        _gradient_products(bridge, tok, layers, args.batches)
        return
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, len(tok), (1, 128), generator=gen) for _ in range(args.batches)]
    with _float64_products():
        bases = fit_bases(bridge, batches, rank=16, layers=layers, progress=False)
    fast = fit_bases(bridge, batches, rank=16, layers=layers, progress=False)
    gap = max(1 - subspace_overlap(bases[s], fast[s]) for s in bases)
    print(f"fit_bases, float32 products: max 1 − overlap with the float64 bases {gap:.1e}")
    opts = {"layers": layers, "progress": False}
    with _float64_products():
        ref = _values(run(bridge, batches, bases, PROBES, **opts).results(progress=False))
    default = _values(run(bridge, batches, bases, PROBES, **opts).results(progress=False))
    compact = run(bridge, batches, bases, PROBES, memory="compact", **opts)
    print(f"SmolLM2-135M, {args.batches}x128 tokens, layers={args.layers}, against float64:")
    _report("default", default, ref)
    _report("compact", _values(compact.results(progress=False)), ref)
    _adversarial()
    _timing()


if __name__ == "__main__":
    main()
