"""The study's cost per checkpoint, as a ratio to a bare forward+backward over its probe set.

    .venv/bin/tangentlens demo --out runs/demo      # once: a trained series
    .venv/bin/python benchmarks/bench_study.py [--checkpoints runs/demo/decoder/seed0/checkpoints]
                                               [--repeat 3] [--index -1]

For one checkpoint of the series (the last by default), interleaved in one process:

- a bare pass: load the checkpoint, then the summed next-token (or masked-token) loss and
  its backward over the study's probe set (256 sequences × 64 tokens by default), batch by
  batch as the study feeds it;
- the study's collection for that checkpoint (`study.collect`: the same load, forward and
  backward, with every probe of the study: residual and write Moments per group, gradient
  Moments, the weight gradients' Σ G Gᵀ, the token sample for TwoNN).

The analysis (tests and intervals over all checkpoints) comes after the collection; a
finished study's own phase timings (``manifest.json`` beside the checkpoints) are printed
too. Ratios are medians over repeats with their min–max spread; compare ratios from one
run, never seconds across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from tangentlens.cli.workflows import study_config
from tangentlens.hooks.families import is_causal
from tangentlens.models import quiet_transformers
from tangentlens.probes.driver import lm_loss, mlm_loss
from tangentlens.study import collect
from tangentlens.study.config import open_series, threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", default="runs/demo/decoder/seed0/checkpoints")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--index", type=int, default=-1, help="which checkpoint (default: last)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    cfg = study_config(args.checkpoints)
    series = open_series(cfg.checkpoints)
    index = range(len(series))[args.index]
    with tempfile.TemporaryDirectory() as tmp:
        tokens, _ = collect.probe_set(cfg, series, Path(tmp))
    batches = list(tokens.split(cfg.batch_size))

    def bare() -> None:
        with quiet_transformers():
            loaded = series.load(index, backend=cfg.backend)
        loss = lm_loss if is_causal(loaded.model) else mlm_loss
        for batch in batches:
            loss(loaded.backend_model, batch).backward()

    def study() -> None:
        collect.collect_part(cfg, collect.load_checkpoint(cfg, series, index), tokens, 0, 1)

    ratios, times = [], {"bare": [], "study": []}
    with threads(cfg.num_threads):
        bare()  # warm-up: file cache, lazy imports
        for _ in range(args.repeat):
            for name, fn in (("bare", bare), ("study", study)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
            ratios.append(times["study"][-1] / times["bare"][-1])
            print(f"bare {times['bare'][-1]:.2f} s, study {times['study'][-1]:.2f} s", flush=True)
    print(
        f"{series[index].source} ({tokens.shape[0]} × {tokens.shape[1]} tokens, batches of "
        f"{cfg.batch_size}): study collection per checkpoint {statistics.median(ratios):.2f}× "
        f"a bare load + forward + backward (spread {min(ratios):.2f}–{max(ratios):.2f})"
    )
    manifest = Path(args.checkpoints).parent / "manifest.json"
    if manifest.is_file():
        timings = json.loads(manifest.read_text()).get("timings", {})
        print(f"the finished study's own timings (s): {timings}")


if __name__ == "__main__":
    main()
