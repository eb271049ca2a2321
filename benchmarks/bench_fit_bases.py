"""`fit_bases` with its forward stopped after the deepest layer it reads, against the
whole forward (logits included), as multiples of the bare forwards, in one process.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_fit_bases.py [--batches 4] [--repeat 3]
        [--layers all,0-5] [--old REV]

On SmolLM2-135M (30 layers, vocabulary 49,152), batches of 4 × 128 tokens, rank 16. For
each layer set in ``--layers`` (``all``, or ``a-b`` for layers a to b), each repeat times
the B bare forwards (no gradient, the whole model), then `fit_bases` as it runs and
`fit_bases` with the stop turned off (`driver._stopped_forward` made a no-op), their
order alternating between repeats. The bases of both are compared first (bit for bit).
``--old REV`` adds `fit_bases` (stopped) with the per-batch statistics of revision REV
(its `stats.batch_statistics`, loaded by `_former.py`) and compares its bases to this
tree's (largest principal-angle sine).
Timing on a shared machine is noisy: read the ratios of one run; the load average is
printed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import warnings
from unittest import mock

import torch
from _former import former_core
from _timing import timed

from tangentlens import models
from tangentlens.core import stats
from tangentlens.probes import driver, fit_bases


def _layers(spec: str) -> list[int] | None:
    if spec == "all":
        return None
    first, last = (int(x) for x in spec.split("-"))
    return list(range(first, last + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", default="all,0-5", help="comma-separated: all, or a-b")
    ap.add_argument("--old", help="also time REV's per-batch statistics (a git revision)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    print(f"load average {os.getloadavg()}, {torch.get_num_threads()} threads", flush=True)
    bridge, tok = models.load("smollm2-135m")
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, len(tok), (4, 128), generator=gen) for _ in range(args.batches)]
    whole = mock.patch.object(driver, "_stopped_forward", lambda session: contextlib.nullcontext())

    patches = {"stopped": contextlib.nullcontext(), "whole forward": whole}
    if args.old:
        former = former_core(args.old, ("stats",)).stats
        patches["old"] = mock.patch.object(stats, "batch_statistics", former.batch_statistics)

    def fit(layers: list[int] | None, label: str):
        with patches[label]:
            return fit_bases(bridge, data, rank=16, layers=layers, progress=False)

    def bare() -> None:
        with torch.no_grad():
            for ids in data:
                bridge(ids)

    for spec in args.layers.split(","):
        layers = _layers(spec)
        labels = list(patches)
        a, b = fit(layers, "stopped"), fit(layers, "whole forward")
        same = all(torch.equal(a[s].basis_, b[s].basis_) for s in a)
        if args.old:
            c = fit(layers, "old")
            sine = max(
                float(
                    torch.linalg.matrix_norm(
                        a[s].basis_ - c[s].basis_ @ (c[s].basis_.T @ a[s].basis_), ord=2
                    )
                )
                for s in a
            )
            print(
                f"layers {spec}: largest sine between this tree's and {args.old}'s bases {sine:.1e}"
            )
        ratios: dict[str, list[float]] = {label: [] for label in labels}
        for r in range(args.repeat):
            t_bare = timed(bare)
            for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                t = timed(lambda label=label, layers=layers: fit(layers, label))
                ratios[label].append(t / t_bare)
        cells = [
            f"{k} {statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f})"
            for k, v in ratios.items()
        ]
        print(
            f"layers {spec}: {len(a)} bases, equal: {same}; over the bare forwards: "
            + "; ".join(cells),
            flush=True,
        )
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
