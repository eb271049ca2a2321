"""Where the numbers are computed: thread limits for small dense linear algebra.

On a CPU, d × d eigendecompositions and matrix products at d ≤ ~1,000 run fastest on one
thread, and far faster when the machine is busy: `results()` of a probe session on
SmolLM2 (d = 576) took 8.6 s on one thread against 45 s on two on this 2-core machine
(`benchmarks/bench_end_to_end.py`). Threads that outnumber free cores also make results
depend on scheduling; one thread keeps them bit-reproducible.
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
