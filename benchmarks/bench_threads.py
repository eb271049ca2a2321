"""`results()` on one thread against two, on the same closed session.

    .venv/bin/python benchmarks/bench_threads.py

SmolLM2-135M, bases at every third layer (resid_pre/mid/post), one probed step of 4 × 128
tokens; `results(threads=n)` alternated twice per n. Which is faster depends on how busy
the machine is (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import time
import warnings

import torch

from tangentlens import models
from tangentlens.probes import fit_bases, lm_loss, probe


def main() -> None:
    warnings.simplefilter("ignore")
    bridge, tok = models.load("smollm2-135m")
    gen = torch.Generator().manual_seed(0)
    fit = [torch.randint(0, len(tok), (4, 128), generator=gen) for _ in range(2)]
    ids = torch.randint(0, len(tok), (4, 128), generator=gen)
    sites = lambda name: name.endswith(("hook_resid_pre", "hook_resid_mid", "hook_resid_post"))  # noqa: E731
    bases = fit_bases(bridge, fit, rank=16, layers=range(0, 30, 3), sites=sites, progress=False)
    with probe(bridge, bases, ("residual", "gradient")) as session:
        lm_loss(bridge, ids).backward()
    bridge.zero_grad(set_to_none=True)
    for n in (2, 1, 2, 1):
        start = time.perf_counter()
        session.results(threads=n, progress=False)
        print(f"results(threads={n}): {time.perf_counter() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()
