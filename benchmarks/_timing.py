"""Shared by the benchmarks (run as scripts, so their folder is on ``sys.path``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def timed(fn: Callable[[], Any]) -> float:
    """Wall-clock seconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cpu_timed(fn: Callable[[], Any]) -> float:
    """CPU seconds of this process over one call of ``fn``: on a machine shared with other
    work, the cost of single-threaded code without the time spent waiting for a core."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def device_timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall-clock seconds of one call of ``fn`` with the work it queued on ``device``: an
    accelerator runs kernels after the call returns, so its queue is waited for before
    and after (on the CPU this is `timed`)."""
    if device.type == "cpu":
        return timed(fn)
    sync = getattr(torch, device.type).synchronize
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start
