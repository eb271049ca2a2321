"""The weight-gradient probe alone, this tree's against a former one, in one process.

    .venv/bin/python benchmarks/bench_weight_gradient.py --old 7171fd7 [--layers all]
        [--batches 2] [--shape 4x128] [--repeat 4] [--tables] [--folds N,...] [--threads 1]

On SmolLM2-135M with the default bases of `fit_bases` (rank 16) at the ``attn_in`` and
``mlp_in`` sites, each repeat times B bare forward+backward passes, then the same passes
with this tree's `WeightGradientProbe` and with the one in git revision ``--old`` (loaded
from its source; the order alternates between repeats): what each adds per batch over
the bare passes, and the bytes of its state. The passes are a caller's own
``loss.backward()``, which computes every weight's gradient. ``--tables``: instead, the
results tables of both (1000 controls) against a reference that folds every pass from X
and Δ with every product in float64 (`gram_dtype` forced to float64, no weight's gradient
read), as the largest relative difference per statistic. ``--folds N,...``:
instead, the fold of one layer alone (both sites, random X and Δ of SmolLM2's shapes) at
N tokens a pass, the former revision's (each map's `weight_gram`) against this tree's
(`pooled_weight_gram`) and G Gᵀ from the weights' gradients (this tree's `gradient_gram`,
and the former revision's where it has `core/weight_grams.py`), with no model running
beside it, on one thread and timed in CPU seconds of that thread (steadier than wall time
on a busy machine), or on ``--threads`` threads in wall time. Timing on a shared
machine is noisy: read the ratios of one run; the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
import warnings

import numpy as np
import torch
from _former import former_core, former_probe

import tangentlens.core.weight_grams as weight_grams
import tangentlens.probes.weight_gradient as wg
from tangentlens import models
from tangentlens.core.compute import threads
from tangentlens.hooks import INPUT_KINDS, get_backend
from tangentlens.probes import fit_bases, lm_loss, probe


def _worst(ref, other) -> dict[str, str]:
    out = {}
    for statistic in ("tangent_share", "energy_ratio", "normalized_ratio", "p_value"):
        rows = (ref["statistic"] == statistic).to_numpy()
        worst = 0.0
        for col in ("value", "ci_low", "ci_high"):
            x, y = ref[col].to_numpy(float)[rows], other[col].to_numpy(float)[rows]
            both = np.isnan(x) & np.isnan(y)
            rel = np.where(both, 0.0, np.abs(x - y) / np.maximum(np.abs(x), 1e-300))
            worst = max(worst, float(np.nanmax(rel)) if rel.size else 0.0)
        out[statistic] = f"{worst:.1e}"
    return out


def _folds(old: type, rev: str, tokens: list[int], repeat: int, n_threads: int) -> None:
    """Seconds per layer of the former fold (each map's G Gᵀ), this tree's fold of X and
    Δ, and G Gᵀ from the weights' own gradients (as a caller's backward hands them to the
    probe's weight hooks: (out, in), contiguous), also by ``rev``'s `gradient_gram` where
    it has one; on ``n_threads`` threads, in CPU seconds of the thread on one."""
    former = old._fold.__globals__["weight_gram"]
    try:
        former_grams = former_core(rev, ("stats", "compute", "weight_grams")).weight_grams
    except subprocess.CalledProcessError:  # no core/weight_grams.py at ``rev``
        former_grams = None
    clock = time.thread_time if n_threads == 1 else time.perf_counter
    d, sites = 576, ((576, 192, 192), (1536, 1536))  # attn_in: W_Q, W_K, W_V; mlp_in: gate, up
    gen = torch.Generator().manual_seed(0)
    for n in tokens:
        data = []
        for outs in sites:
            x = torch.randn(n, d, generator=gen) + torch.randn(d, generator=gen)
            data.append((x, [torch.randn(n, o, generator=gen) * 1e-3 for o in outs]))
        grads = [[(x.T @ t).T.contiguous() for t in ts] for x, ts in data]
        folds = {
            "old": lambda data=data: [sum(former(x, t) for t in ts) for x, ts in data],
            "new": lambda data=data: [weight_grams.pooled_weight_gram(x, ts) for x, ts in data],
            "weights": lambda grads=grads: [
                sum(weight_grams.gradient_gram(g.T, torch.float32) for g in gs) for gs in grads
            ],
        }
        if former_grams is not None:
            folds["weights, old"] = lambda grads=grads: [
                sum(former_grams.gradient_gram(g.T, torch.float32) for g in gs) for gs in grads
            ]
        times: dict[str, list[float]] = {name: [] for name in folds}
        with threads(n_threads):
            for r in range(repeat + 1):  # the first round warms up
                for name in list(folds) if r % 2 == 0 else list(folds)[::-1]:
                    start = clock()
                    folds[name]()
                    if r:
                        times[name].append(clock() - start)
        forms = [weight_grams.fold_form(n, d, sum(outs)) for outs in sites]
        old_s, new_s, w_s = (statistics.median(times[k]) for k in ("old", "new", "weights"))
        former_w = ""
        if "weights, old" in times:
            same = all(
                torch.equal(a, b)
                for a, b in zip(folds["weights"](), folds["weights, old"](), strict=True)
            )
            w_old = times["weights, old"]
            former_w = (
                f", by {rev}'s gradient_gram {statistics.median(w_old) * 1e3:.0f} ms"
                f" ({min(w_old) * 1e3:.0f}-{max(w_old) * 1e3:.0f}; bit for bit equal: {same})"
            )
        print(
            f"n = {n}: old {old_s * 1e3:.0f} ms, new {new_s * 1e3:.0f} ms a layer "
            f"({old_s / new_s:.2f}x; forms {', '.join(forms)}); from the weights' gradients "
            f"{w_s * 1e3:.0f} ms ({min(times['weights']) * 1e3:.0f}-"
            f"{max(times['weights']) * 1e3:.0f}; {new_s / w_s:.2f}x faster than new)"
            f"{former_w}; load {os.getloadavg()[0]:.1f}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="git revision of the former probe")
    ap.add_argument("--layers", default="all")
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--shape", default="4x128", help="sequences x tokens of a batch")
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--tables", action="store_true")
    ap.add_argument("--folds", default="", help="token counts: time the fold alone")
    ap.add_argument("--threads", type=int, default=1, help="threads of --folds")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    print(f"load average {os.getloadavg()}", flush=True)
    kinds = {
        "old": former_probe(args.old, "weight_gradient", "WeightGradientProbe", "def _input_sites"),
        "new": wg.WeightGradientProbe,
    }
    if args.folds:
        tokens = [int(n) for n in args.folds.split(",")]
        _folds(kinds["old"], args.old, tokens, args.repeat, args.threads)
        return
    bridge, tok = models.load("smollm2-135m")
    backend = get_backend(bridge)
    layers = None if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    gen = torch.Generator().manual_seed(0)
    fit = [torch.randint(0, len(tok), (4, 128), generator=gen) for _ in range(2)]
    shape = tuple(int(n) for n in args.shape.split("x"))
    data = [torch.randint(0, len(tok), shape, generator=gen) for _ in range(args.batches)]
    bases = fit_bases(bridge, fit, rank=16, layers=layers, progress=False)
    inputs = {s: b for s, b in bases.by_site().items() if s.kind in INPUT_KINDS}

    def fb() -> None:
        for ids in data:
            lm_loss(bridge, ids).backward()
            bridge.zero_grad(set_to_none=True)

    def probed(cls: type):
        p = cls(inputs, backend, n_controls=1000, n_groups=10)
        with probe(bridge, None, [p], layers=layers) as session:
            start = time.perf_counter()
            fb()
            return p, session, time.perf_counter() - start

    if args.tables:
        tables = {}
        for name in ("float64", "old", "new"):
            keep = wg.gram_dtype, weight_grams.gram_dtype, wg._will_execute
            if name == "float64":  # every pass folded from X and Δ, every product float64
                wg.gram_dtype = weight_grams.gram_dtype = lambda x: torch.float64
                wg._will_execute = None
            try:
                _, session, _ = probed(kinds.get(name, wg.WeightGradientProbe))
            finally:
                wg.gram_dtype, weight_grams.gram_dtype, wg._will_execute = keep
            tables[name] = session.results(progress=False)
        for name in ("old", "new"):
            print(
                f"{name} vs float64, max rel. difference:", _worst(tables["float64"], tables[name])
            )
        return
    adds: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(args.repeat):
        start = time.perf_counter()
        fb()
        bare = time.perf_counter() - start
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            p, _, t = probed(kinds[name])
            adds[name].append(t / bare - 1)
            nbytes = sum(t.nbytes for t in p.state_dict().values())
            print(
                f"repeat {r} {name}: adds {t / bare - 1:.2f}x of bare ({bare:.1f} s), "
                f"state {nbytes / 2**20:.0f} MiB, load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    for name, values in adds.items():
        print(
            f"{name}: adds {statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"
        )
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
