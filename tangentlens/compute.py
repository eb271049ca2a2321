"""Where the numbers are computed: thread limits for small dense linear algebra.

Threads that outnumber free cores make d × d eigendecompositions at d ≤ ~1,000 far slower
and make results depend on scheduling. `benchmarks/bench_threads.py` measures `results()`
on SmolLM2 (d = 576, 30 sites) on this 2-core machine: on a quiet machine two threads beat
one (4.9 s against 6.4 s); on a machine busy with other work one thread was the faster by
far. The study runs on one thread (`StudyConfig.num_threads`), sessions leave the threads
as they are unless asked (`ProbeSession.results(threads=1)`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from threadpoolctl import threadpool_limits

__all__ = ["threads"]


@contextmanager
def threads(n: int | None) -> Iterator[None]:
    """Torch and numpy's BLAS (threadpoolctl) limited to ``n`` threads inside the block;
    ``None`` leaves both as they are."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with threadpool_limits(n):
            yield
    finally:
        torch.set_num_threads(before)
