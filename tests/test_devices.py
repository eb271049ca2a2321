"""The numerical core takes every tensor's device from its inputs, checked without an
accelerator.

With ``torch.set_default_device("meta")`` a tensor made without a device (``torch.eye(d)``,
``torch.arange(k)``, ``torch.as_tensor(t)`` of a CPU tensor) is a meta tensor, and reading a
number from one raises. The inputs stay on the CPU. So a path that runs under that default
and gives the numbers it gives without it makes each tensor on its inputs' device, or on the
CPU where it names it (the controls' frames and traces), as it must for CUDA inputs.
`benchmarks/bench_gpu.py` runs the probes and their tests on a CUDA device where there is
one, and skips where there is none.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tangentlens.core import controls as C
from tangentlens.core import significance as S
from tangentlens.core.stats import Moments
from tangentlens.core.subspace import TangentBasis, split_half_overlap, tangent_share

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def meta_default() -> Iterator[Callable[[Callable[[], Any]], Any]]:
    """Calls a function with "meta" as the default device, and restores the CPU after."""

    def call(fn: Callable[[], Any]) -> Any:
        torch.set_default_device("meta")
        try:
            return fn()
        finally:
            torch.set_default_device(None)

    yield call
    torch.set_default_device(None)


def _moments(n: int, d: int, seed: int) -> Moments:
    gen = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.2, 2, d, dtype=torch.float64)
    return Moments().update(torch.randn(n, d, generator=gen, dtype=torch.float64) * scales + 0.3)


def _numbers(out: Any) -> Any:
    """The numbers of a test result (its dataclass fields or dict), tensors as lists."""
    if hasattr(out, "to_dict"):
        out = {**out.to_dict(), **{k: v for k, v in vars(out).items() if torch.is_tensor(v)}}
    if isinstance(out, dict):
        return {k: v.tolist() if torch.is_tensor(v) else v for k, v in out.items()}
    if isinstance(out, TangentBasis):
        return out.basis_.tolist(), out.explained_variance_.tolist(), out.eigengap_
    return out


def test_the_core_takes_its_devices_from_its_inputs(meta_default):
    d, k = 30, 4
    halves = [_moments(200, d, seed) for seed in (1, 2)]
    pooled = Moments.merged(halves)
    grads, other = _moments(300, d, 3), _moments(300, d, 4)
    basis = TangentBasis.fit(pooled, rank=k)
    own = S.reference_at(S.pooled_shape([grads]), grads)
    study = S.reference_at(S.pooled_shape([grads, other]), grads)
    calls = {
        "fit": lambda: TangentBasis.fit(pooled, rank=k),
        "fit by variance": lambda: TangentBasis.fit(pooled, variance=0.5),
        "split-half": lambda: split_half_overlap(*halves, k),
        "share": lambda: tangent_share(grads, basis),
        "tests": lambda: S.tangent_tests(grads, basis, n_controls=50, activation_moments=pooled),
        "tests, own reference": lambda: S.tangent_tests(
            grads, basis, n_controls=50, zeta=0.1, reference=own
        ),
        "tests, pooled reference": lambda: S.tangent_tests(
            grads, basis, n_controls=50, zeta=0.1, reference=study
        ),
        "matrix tests": lambda: S.matrix_tests(grads.second_moment(), basis, n_controls=50),
        "normal energy test": lambda: S.energy_test(grads, basis, n_controls=50, controls="normal"),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, call in calls.items():
            assert _numbers(meta_default(call)) == _numbers(call()), name


def test_controls_are_drawn_on_the_cpu_whatever_the_default_device(meta_default):
    frames = meta_default(lambda: C.draw_frames(12, 3, 20, seed=31))
    assert frames.device.type == "cpu"
    assert torch.equal(frames, C.draw_frames(12, 3, 20, seed=31))
    normal = meta_default(lambda: C.ControlSet(frames).normal())
    assert all(t.device.type == "cpu" for t in normal.tensors)


def test_gpu_benchmark_skips_without_a_cuda_device():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: bench_gpu.py runs for real")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert "skipped: no CUDA device" in done.stdout
