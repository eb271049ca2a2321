"""End to end: everything a person waits for, as ratios to a bare forward(+backward).

    .venv/bin/python benchmarks/bench_end_to_end.py [--repeat 3] [--layers all|0,5,10]

On SmolLM2-135M (30 layers, d = 576) with the default bases of `fit_bases` (resid_pre,
resid_mid, resid_post, attn_in, mlp_in; rank 16), 4 × 128 tokens and the default number
of controls (1000), each repeat measures, interleaved in one process:

- a bare forward+backward of the summed next-token loss;
- the probe pass (residual + attention + gradient) around the same step, and `results()`;
- `fit_bases` on two batches against two bare forwards;
- with ``--breakdown``, each probe alone: what its pass adds to the bare step, and its
  `results()`, each over the same bare forward+backward; what two options cost: the
  whole job without the head null (``head_null=0``), and `fit_bases` on the two batches
  as one (no split halves, so no ``split_half_overlap``); and two parts of `fit_bases`
  alone, over the two bare forwards: its exact top-k decompositions (the fit and the two
  halves of each distinct site, side by side as `fit_bases` runs them) and the
  ``weight_hash`` of its provenance (SHA-256 of the state dict).

Ratios are medians over repeats with their min–max spread; timing on a shared 2-core
machine is noisy, so compare ratios from one run, never absolute times across runs.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch
from _timing import timed

from tangentlens import models
from tangentlens.core.compute import site_map, top_eigh
from tangentlens.core.digests import tensor_hash
from tangentlens.probes import fit_bases, lm_loss, probe
from tangentlens.probes.base import first_equal

PROBES = ("residual", "attention", "gradient")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", default="all", help="all, or comma-separated layer indices")
    ap.add_argument("--breakdown", action="store_true", help="also each probe alone")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    bridge, tok = models.load("smollm2-135m")
    layers = None if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    gen = torch.Generator().manual_seed(0)
    fit = [torch.randint(0, len(tok), (4, 128), generator=gen) for _ in range(2)]
    ids = torch.randint(0, len(tok), (4, 128), generator=gen)

    def bare_fb() -> None:
        lm_loss(bridge, ids).backward()
        bridge.zero_grad(set_to_none=True)

    def bare_fwd() -> None:
        with torch.no_grad():
            for batch in fit:
                bridge(batch)

    one = [torch.cat(fit)]  # the same tokens as one batch: no split halves
    bases = fit_bases(bridge, fit, rank=16, layers=layers, progress=False)
    # one Moments per tensor, as fit_bases fits them: twins (resid_post = next resid_pre) once
    moments = list(bases.moments.values())
    first = set(first_equal(moments, lambda a, b: a.identical(b)))
    covariances = [moments[i].covariance() for i in sorted(first)] * 3  # the fit, two halves

    def decompositions() -> None:
        list(site_map(lambda c: top_eigh(c.clone(), 17), covariances))

    ratios: dict[str, list[float]] = {"pass": [], "results": [], "end_to_end": [], "fit": []}
    for _ in range(args.repeat):
        t_fb = timed(bare_fb)
        with probe(bridge, bases, PROBES, layers=layers) as session:
            t_pass = timed(bare_fb)
        t_res = timed(lambda s=session: s.results(progress=False))
        t_fwd = timed(bare_fwd)
        t_fit = timed(lambda: fit_bases(bridge, fit, rank=16, layers=layers, progress=False))
        ratios["pass"].append(t_pass / t_fb)
        ratios["results"].append(t_res / t_fb)
        ratios["end_to_end"].append((t_pass + t_res) / t_fb)
        ratios["fit"].append(t_fit / t_fwd)
        print(
            f"fwd+bwd {t_fb:.2f} s, pass {t_pass:.2f} s, results {t_res:.2f} s; "
            f"2 fwd {t_fwd:.2f} s, fit_bases {t_fit:.2f} s",
            flush=True,
        )
        for name in PROBES if args.breakdown else ():
            t_fb = timed(bare_fb)
            with probe(bridge, bases, (name,), layers=layers) as session:
                t_pass = timed(bare_fb)
            t_res = timed(lambda s=session: s.results(progress=False))
            ratios.setdefault(f"{name} pass adds", []).append(t_pass / t_fb - 1)
            ratios.setdefault(f"{name} results", []).append(t_res / t_fb)
        if args.breakdown:
            t_fb = timed(bare_fb)
            with probe(bridge, bases, PROBES, layers=layers, head_null=0) as session:
                t_pass = timed(bare_fb)
            t_res = timed(lambda s=session: s.results(progress=False))
            ratios.setdefault("no head null", []).append((t_pass + t_res) / t_fb)
            t_fwd = timed(bare_fwd)
            t_fit = timed(lambda: fit_bases(bridge, one, rank=16, layers=layers, progress=False))
            ratios.setdefault("fit, no split halves", []).append(t_fit / t_fwd)
            ratios.setdefault("fit: eigh alone", []).append(timed(decompositions) / t_fwd)
            t_hash = timed(lambda: tensor_hash(bridge.state_dict()))
            ratios.setdefault("fit: hash alone", []).append(t_hash / t_fwd)
    sites = len(bases)
    print(f"\nSmolLM2-135M, {sites} bases, layers={args.layers}, repeats={args.repeat}")
    for name, values in ratios.items():
        med = statistics.median(values)
        print(f"{name:>19}: {med:6.2f}x  (spread {min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
