"""What is measured at a site: residual, attention, gradient and activation probes.

`probe` (context manager), `run` (driver with a progress bar) and `fit_bases` work on
any model with a backend (`tangentlens.hooks.get_backend`).
"""

from __future__ import annotations

import importlib
from typing import Any

from .session import PROBES, BasisSet, ProbeSession, fit_bases, lm_loss, probe, run

__all__ = [
    "PROBES",
    "BasisSet",
    "DepthProfile",
    "ProbeSession",
    "fit_bases",
    "lm_loss",
    "probe",
    "run",
]


def __getattr__(name: str) -> Any:
    if name == "DepthProfile":
        return importlib.import_module("tangentlens.probes.depth").DepthProfile
    raise AttributeError(f"module 'tangentlens.probes' has no attribute {name!r}")
