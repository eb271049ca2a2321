"""tangentlens: tangent-subspace probes and anisotropy statistics for language transformers.

Heavy modules load on first use, so ``import tangentlens`` and the CLI start fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Moments": "tangentlens.stats",
    "TangentBasis": "tangentlens.subspace",
    "normal_controls": "tangentlens.subspace",
    "energy_test": "tangentlens.significance",
    "isotropy_test": "tangentlens.significance",
    "BasisSet": "tangentlens.probes.session",
    "fit_bases": "tangentlens.probes.session",
    "probe": "tangentlens.probes.session",
    "DepthProfile": "tangentlens.probes.depth",
    "Site": "tangentlens.hooks.sites",
    "CheckpointSeries": "tangentlens.checkpoints",
    "Study": "tangentlens.study",
    "StudyConfig": "tangentlens.study",
}
_SUBMODULES = {
    "stats",
    "metrics",
    "subspace",
    "significance",
    "hooks",
    "probes",
    "checkpoints",
    "corpus",
    "embedding",
    "train",
    "study",
    "report",
    "models",
    "io",
}

__all__ = sorted([*_LAZY, *_SUBMODULES, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"tangentlens.{name}")
    raise AttributeError(f"module 'tangentlens' has no attribute {name!r}")
