"""The attention probe's head null: what 4 and 99 frames cost, as ratios to a bare
forward+backward timed in the same process.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_head_null.py [--repeat 7] [--threads 1]
        [--large | --smollm2 LAYERS | --checkpoint DIR] [--old REV] [--chunks 1,6]

Model: a TransformerLens native bridge with random weights in the demo decoder's shape
(d_model 128, 4 layers, 4 heads of 32, vocab 4096), one batch of 8 × 64 tokens (the
study's head pass: ``head_sequences`` 8 at ``seq_len`` 64); ``--large``: d_model 256, 8
heads, 8 × 128 tokens; ``--smollm2 0,15,29``: SmolLM2-135M (30 layers, 9 heads of 64 on 3
key/value heads, rotary), 4 × 128 tokens, the attention inputs of those layers;
``--checkpoint DIR``: a local Hugging Face folder (a demo checkpoint, e.g.
``runs/demo/encoder/seed0/checkpoints/step256``), 8 × 64 tokens, its masked-token loss if
it is an encoder. Bases of rank 16 at the attention inputs (`fit_bases`).

Each repeat times a bare forward+backward of the summed next-token loss, then a forward
(no grad) inside `probe` with the attention probe alone at ``head_null`` = 0, 4 and 99,
in an order that rotates between repeats; ``--old REV`` adds git revision REV's probe
(loaded from its source, with REV's `core/decompose.py` and `probes/attention_stats.py`
where it has them) at 4 and 99 frames; ``--chunks 1,6`` adds 99 frames with at most that
many frames a batched product (`attention_stats.FRAMES_PER_CHUNK`) for each value given.
Each time is divided by that repeat's bare forward+backward: the median over repeats and
the min–max are printed, with the cost of one frame ((t₉₉ − t₀)/99 and (t₄ − t₀)/4).
Times are the process's CPU time: with one torch thread (the default, as the study runs)
that is the work done, and other jobs on a shared machine move it far less than the wall
clock, which is printed too. Compare ratios from one run, never seconds across runs; the
load average is printed.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time
import warnings
from collections.abc import Callable
from unittest import mock

import torch
from _former import former_probe
from bench_probes import build  # the native bridge the probe benchmarks share

from tangentlens import models
from tangentlens.hooks import get_backend
from tangentlens.hooks.families import is_causal
from tangentlens.hooks.sites import Site
from tangentlens.probes import AttentionProbe, attention_stats, fit_bases, lm_loss, mlm_loss, probe
from tangentlens.probes.base import Probe


def clocked(fn: Callable[[], None]) -> tuple[float, float]:
    """CPU and wall-clock seconds of one call of ``fn``."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def summary(values: list[float], digits: int = 2) -> str:
    """Median (min–max)."""
    med, low, high = statistics.median(values), min(values), max(values)
    return f"{med:6.{digits}f}×  ({low:.{digits}f}–{high:.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--large", action="store_true", help="d_model 256, 8 heads, 8 × 128")
    ap.add_argument("--smollm2", default=None, help="SmolLM2-135M at these layers, 4 × 128")
    ap.add_argument("--checkpoint", default=None, help="a local HF folder, 8 × 64")
    ap.add_argument("--old", default=None, help="also this git revision's probe")
    ap.add_argument("--chunks", default=None, help="also 99 frames at these FRAMES_PER_CHUNK")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    d, batch, pos = (256, 8, 128) if args.large else (128, 8, 64)
    layers_of = None if args.smollm2 is None else [int(v) for v in args.smollm2.split(",")]
    if args.checkpoint:
        model, tok = models.load(args.checkpoint)
        vocab, shape = len(tok), args.checkpoint
    elif layers_of is None:
        model, vocab = build(d, 4, pos), 4096
        shape = f"native bridge d_model={d}, 4 layers, {d // 32} heads"
    else:
        (model, tok), batch, pos = models.load("smollm2-135m"), 4, 128
        vocab, shape = len(tok), f"SmolLM2-135M, layers {args.smollm2}"
    loss = lm_loss if is_causal(model) else mlm_loss
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, pos), generator=gen)
    fit = [torch.randint(0, vocab, (batch, pos), generator=gen) for _ in range(2)]
    is_input = lambda name: Site.from_hook_name(name).kind == "attn_in"  # noqa: E731
    bases = fit_bases(model, fit, rank=16, sites=is_input, layers=layers_of, progress=False)
    backend = get_backend(model)
    layers = {s: (bases[s], backend.attention_params(s.layer)) for s in map(Site.parse, bases)}

    def bare() -> None:
        model.zero_grad(set_to_none=True)
        loss(model, ids).backward()

    def chunked(size: int, call: Callable[[], None]) -> Callable[[], None]:
        """``call`` with at most ``size`` frames a batched product."""

        def run() -> None:
            with mock.patch.object(attention_stats, "FRAMES_PER_CHUNK", size):
                call()

        return run

    def probed(made: Probe) -> Callable[[], None]:
        def call() -> None:
            with torch.no_grad(), probe(model, {}, [made]):
                model(ids)

        return call

    # one probe is called again and again: its null must see every call's sequences, not
    # just the first `head_null_sequences`, to time the frames per batch
    runs = {
        f"head_null={n}": probed(AttentionProbe(layers, head_null=n, head_null_sequences=None))
        for n in (0, 4, 99)
    }
    for size in [] if args.chunks is None else [int(v) for v in args.chunks.split(",")]:
        runs[f"head_null=99, chunks of {size}"] = chunked(
            size, probed(AttentionProbe(layers, head_null=99, head_null_sequences=None))
        )
    if args.old:
        # with that revision's score split and statistics (chunk plan included) too
        same = ("core.decompose", "probes.attention_stats")
        former = former_probe(args.old, "attention", "AttentionProbe", "def _inputs", beside=same)
        every = (
            {"head_null_sequences": None}
            if "head_null_sequences" in inspect.signature(former).parameters
            else {}
        )
        for n in (4, 99):
            runs[f"{args.old} head_null={n}"] = probed(former(layers, head_null=n, **every))
    for fn in (bare, *runs.values()):
        fn()  # warm-up
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    wall: dict[str, list[float]] = {name: [] for name in runs}
    bare_s: list[float] = []
    names = list(runs)
    load = os.getloadavg()[0]
    for r in range(args.repeat):
        bare_cpu, bare_wall = clocked(bare)
        bare_s.append(bare_cpu)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t_cpu, t_wall = clocked(runs[name])
            cpu[name].append(t_cpu / bare_cpu)
            wall[name].append(t_wall / bare_wall)
    print(
        f"torch threads {torch.get_num_threads()}; {shape}; batch {batch} × {pos}; "
        f"rank 16 at {len(layers)} attention inputs; "
        f"{args.repeat} repeats; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after; "
        f"bare forward+backward {statistics.median(bare_s) * 1e3:.0f} ms CPU"
    )
    print(f"{'attention probe, forward only':<30} {'CPU over bare (min–max)':<26} wall clock")
    for name in runs:
        print(f"{name:<30} {summary(cpu[name]):<26} {summary(wall[name])}")
    for prefix in ("", f"{args.old} ") if args.old else ("",):
        for n in (4, 99):
            pairs = zip(cpu[f"{prefix}head_null={n}"], cpu["head_null=0"], strict=True)
            per = [(a - b) / n for a, b in pairs]
            print(f"{f'{prefix}one frame of {n} (CPU)':<30} {summary(per, 3)}")


if __name__ == "__main__":
    main()
