"""Where the numbers are computed: thread limits for small dense linear algebra, and
independent per-site work side by side.

Threads that outnumber free cores make d × d eigendecompositions at d ≤ ~1,000 far slower
and make results depend on scheduling. `benchmarks/bench_threads.py` measures `results()`
on SmolLM2 (d = 576, 30 sites) on this 2-core machine: on a quiet machine two threads
(two sites at a time) beat one (1.7 s against 2.8–3.5 s); on a machine busy with other
work one thread was the faster by far. The study runs on one thread
(`StudyConfig.num_threads`), sessions leave the threads as they are unless asked
(`ProbeSession.results(threads=1)`).

`site_map` runs independent per-site tests on as many workers as torch has threads, each
single-threaded: a d × d tridiagonalisation is memory-bound and scales poorly across
threads, while two sites on two cores run side by side. Each site's numbers are then
those of one thread, whatever the scheduling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch
from threadpoolctl import threadpool_limits

__all__ = ["site_map", "threads"]

T = TypeVar("T")
R = TypeVar("R")


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


def site_map(fn: Callable[[T], R], items: Sequence[T]) -> Iterator[R]:
    """``fn`` over ``items``, results in order, on ``torch.get_num_threads()`` workers of one
    thread each (plain ``map`` with one thread or one item). ``fn`` must be thread-safe:
    torch releases the GIL inside its kernels."""
    workers = min(torch.get_num_threads(), len(items))
    if workers <= 1:
        yield from map(fn, items)
        return
    with threads(1), ThreadPoolExecutor(workers) as pool:
        yield from pool.map(fn, items)
