"""The weight-gradient fold's symmetric products, both ways `compute.syrk` forms them:
torch's full product against BLAS ``?syrk`` through scipy on one BLAS thread, and a third
way that keeps torch's threads and skips a third of the flops: ``triangle``, the products
of row blocks on and above the diagonal (6 of 9), mirrored.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_syrk.py [--repeat 11] [--model]

No model: Σ A Aᵀ at the shapes of SmolLM2-135M's fold at 4 × 128 tokens a pass (the token
Gram K at ``mlp_in`` and ``attn_in``, G_mG_mᵀ of W_Q and of a gate map), on one torch
thread and on two, both interleaved; the median milliseconds per call with min–max.
``--model``: then, with all 30 layers and all four default probes (head null off), two
batches of 4 × 128 tokens a pass, every pass folded from X and Δ (the weights' own
gradients left unread), the seconds spent in `pooled_weight_gram` with each and the pass
over the bare forward+backward, interleaved per repeat (4 repeats).
Timing on a shared machine is noisy: read the ratios of one run; the load average is
printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings
from collections import Counter
from collections.abc import Sequence
from unittest import mock

import torch
from _timing import timed
from bench_curve import STEPS, _timers
from torch import Tensor

import tangentlens.core.weight_grams as weight_grams
import tangentlens.probes.weight_gradient as wg
from tangentlens.core.compute import _blas_syrk, _mirrored, _product

FOLD = next(label for label, (_, name) in STEPS.items() if name == "pooled_weight_gram")
SHAPES = {
    "K at mlp_in (2 × 512×1536)": [(512, 1536), (512, 1536)],
    "K at attn_in (512×576,192,192)": [(512, 576), (512, 192), (512, 192)],
    "G Gᵀ of W_Q (576×576)": [(576, 576)],
    "G Gᵀ of a gate (576×1536)": [(576, 1536)],
}


def product(blocks: Sequence[Tensor]) -> Tensor:
    return _mirrored(_product(blocks))


def blas_syrk(blocks: Sequence[Tensor]) -> Tensor:
    return _mirrored(_blas_syrk(blocks))


def triangle(blocks: Sequence[Tensor], parts: int = 3) -> Tensor:
    """Σ A Aᵀ from the products of row blocks on and above the diagonal only (``parts`` = 3:
    6 of 9 blocks, two thirds of the flops), each through torch's product, mirrored."""
    a = torch.cat(list(blocks), dim=1)
    n = a.shape[0]
    step = -(-n // parts)
    out = a.new_empty(n, n)
    rows = [slice(i, min(i + step, n)) for i in range(0, n, step)]
    for i, r in enumerate(rows):
        for c in rows[i:]:
            block = a[r] @ a[c].T
            out[r, c] = block
            if c != r:
                out[c, r] = block.T
    return out


def isolated(repeat: int) -> None:
    gen = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    for n_threads in (1, 2):
        torch.set_num_threads(n_threads)
        print(f"\n{n_threads} torch thread(s); ms per call, median (min-max)")
        for label, shapes in SHAPES.items():
            blocks = [torch.randn(s, generator=gen) for s in shapes]
            assert torch.allclose(product(blocks), blas_syrk(blocks), rtol=1e-4, atol=1e-3)
            assert torch.allclose(product(blocks), triangle(blocks), rtol=1e-4, atol=1e-3)
            times: dict[str, list[float]] = {"product": [], "BLAS syrk": [], "triangle": []}
            for _ in range(repeat):
                times["product"].append(timed(lambda b=blocks: product(b)) * 1e3)
                times["BLAS syrk"].append(timed(lambda b=blocks: blas_syrk(b)) * 1e3)
                times["triangle"].append(timed(lambda b=blocks: triangle(b)) * 1e3)
            cells = [
                f"{k} {statistics.median(v):6.2f} ({min(v):.2f}-{max(v):.2f})"
                for k, v in times.items()
            ]
            print(f"{label:>32}: " + "   ".join(cells))
    torch.set_num_threads(before)


def in_model() -> None:
    from tangentlens import models
    from tangentlens.probes import fit_bases, lm_loss, probe

    warnings.simplefilter("ignore")
    bridge, tok = models.load("smollm2-135m")
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, len(tok), (4, 128), generator=gen) for _ in range(3)]
    bases = fit_bases(bridge, data[:1], rank=16, progress=False)
    names = ("residual", "attention", "gradient", "weight_gradient")

    def fb() -> None:
        for ids in data[1:]:
            lm_loss(bridge, ids).backward()
            bridge.zero_grad(set_to_none=True)

    out: dict[str, list[tuple[float, float]]] = {"product": [], "BLAS syrk": []}
    fb()
    for r in range(4):
        bare = timed(fb)
        for label in ("product", "BLAS syrk") if r % 2 == 0 else ("BLAS syrk", "product"):
            spent: Counter = Counter()
            chosen = product if label == "product" else blas_syrk
            with (
                mock.patch.object(weight_grams, "syrk", chosen),
                mock.patch.object(wg, "_will_execute", None),
                _timers(spent),
                probe(bridge, bases, names, head_null=0),
            ):
                t = timed(fb)
            out[label].append((spent[FOLD], t / bare))
        print(f"repeat {r}: bare {bare:.1f} s; load {os.getloadavg()[0]:.1f}", flush=True)
    print("\nin the pass (2 batches, all layers): fold seconds; pass over bare fwd+bwd")
    for label, rows in out.items():
        folds, ratios = [a for a, _ in rows], [b for _, b in rows]
        print(
            f"{label:>10}: fold {statistics.median(folds):.2f} s ({min(folds):.2f}-"
            f"{max(folds):.2f}); pass {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f})"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=11)
    ap.add_argument("--model", action="store_true", help="also inside a probe pass")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()}")
    isolated(args.repeat)
    if args.model:
        in_model()
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
