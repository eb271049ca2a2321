"""Would stacking the per-site eigendecompositions of `results()` into one batched call
pay? Site after site against one stacked ``torch.linalg.eigvalsh`` / ``eigh`` over the
sites, interleaved, with the spread over repeats.

    .venv/bin/python benchmarks/bench_batched_eigh.py [--sites 30] [--d 576] [--repeat 5]

The matrices are d×d float64 PSD, as the tests decompose them (d = 576: SmolLM2-135M).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, default=30)
    ap.add_argument("--d", type=int, default=576)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(args.sites, args.d, args.d, generator=gen, dtype=torch.float64)
    stack = z @ z.mT / args.d
    for name, fn in (("eigvalsh", torch.linalg.eigvalsh), ("eigh", torch.linalg.eigh)):
        fn(stack[0]), fn(stack)  # warm-up: LAPACK workspaces, thread pools
        ratios = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            for m in stack:
                fn(m)
            loop = time.perf_counter() - start
            start = time.perf_counter()
            fn(stack)
            ratios.append((time.perf_counter() - start) / loop)
        print(
            f"{name} of {args.sites} sites at d={args.d}, {torch.get_num_threads()} threads: "
            f"stacked / site after site = {statistics.median(ratios):.2f} "
            f"(spread {min(ratios):.2f}-{max(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
