"""tangentlens: tangent-subspace probes and anisotropy statistics for language transformers.

The public names below load on first use (PEP 562 ``__getattr__``), so ``import
tangentlens`` and the CLI start without torch; the package root sits above every layer.
The subpackages are the map: `core` (statistics, files, no model code), `hooks` (the
backends), `models` (batches, loading), `probes`, `analysis`, `data` (corpus, training,
checkpoints), `study`, `report` and `cli`.
"""

from __future__ import annotations

import importlib
from typing import Any

from .version import __version__ as __version__

_LAZY = {
    # bases and probes
    "fit_bases": "tangentlens.probes",
    "probe": "tangentlens.probes",
    "run": "tangentlens.probes",
    "BasisSet": "tangentlens.probes",
    "TangentBasis": "tangentlens.core.subspace",
    "Moments": "tangentlens.core.stats",
    "normal_controls": "tangentlens.core.subspace",
    "energy_test": "tangentlens.core.significance",
    "isotropy_test": "tangentlens.core.significance",
    "text_batches": "tangentlens.models.batches",
    "load": "tangentlens.models",
    "Site": "tangentlens.hooks.sites",
    # analyses
    "DepthProfile": "tangentlens.analysis.depth",
    "head_arrays": "tangentlens.analysis.heads",
    "plot_heads": "tangentlens.analysis.heads",
    "layerwise_probe": "tangentlens.analysis.layerwise",
    "ablate": "tangentlens.analysis.interventions",
    "causal_effects": "tangentlens.analysis.interventions",
    "head_effects": "tangentlens.analysis.interventions",
    # training-dynamics studies
    "CheckpointSeries": "tangentlens.data.checkpoints",
    "Study": "tangentlens.study",
    "StudyConfig": "tangentlens.study",
}
_SUBMODULES = {"core", "hooks", "models", "probes", "analysis", "data", "study", "report", "cli"}

__all__ = sorted([*_LAZY, *_SUBMODULES, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"tangentlens.{name}")
    raise AttributeError(f"module 'tangentlens' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names, for tab completion (they load on first use)."""
    return __all__
