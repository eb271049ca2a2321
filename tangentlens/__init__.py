"""tangentlens: tangent-subspace probes and anisotropy statistics for language transformers.

Heavy modules load on first use (PEP 562 ``__getattr__``), so ``import tangentlens``
and the CLI start without torch; the package root sits above every layer.
"""

from __future__ import annotations

import importlib
from typing import Any

from .version import __version__ as __version__

_LAZY = {
    "Moments": "tangentlens.stats",
    "TangentBasis": "tangentlens.subspace",
    "normal_controls": "tangentlens.subspace",
    "energy_test": "tangentlens.significance",
    "isotropy_test": "tangentlens.significance",
    "BasisSet": "tangentlens.probes",
    "fit_bases": "tangentlens.probes",
    "probe": "tangentlens.probes",
    "run": "tangentlens.probes",
    "DepthProfile": "tangentlens.depth",
    "head_arrays": "tangentlens.heads",
    "plot_heads": "tangentlens.heads",
    "text_batches": "tangentlens.batches",
    "Site": "tangentlens.hooks.sites",
    "CheckpointSeries": "tangentlens.checkpoints",
    "Study": "tangentlens.study",
    "StudyConfig": "tangentlens.study",
}
_SUBMODULES = {
    "errors",
    "catalogue",
    "files",
    "validation",
    "stats",
    "metrics",
    "subspace",
    "significance",
    "uncertainty",
    "decompose",
    "hooks",
    "probes",
    "results",
    "batches",
    "depth",
    "heads",
    "embedding_geometry",
    "corpus",
    "train",
    "checkpoints",
    "models",
    "study",
    "report",
    "workflows",
    "distributed",
}

__all__ = sorted([*_LAZY, *_SUBMODULES, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"tangentlens.{name}")
    raise AttributeError(f"module 'tangentlens' has no attribute {name!r}")
