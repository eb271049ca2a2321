"""The numerical core of a former git revision beside this tree's, in one process: the
benchmarks time both interleaved (one machine state for both) and compare their numbers.

Only the modules named are loaded from the revision (as ``tangentlens._former_core.*``);
every other core module is this tree's, so both share `Moments`, the errors and the
validation, and a former `TangentBasis` is built from this tree's with `basis`.
`former_probe` loads one probe class of a revision the same way, `former_probes_module` a
whole module of ``tangentlens/probes``.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
from pathlib import Path

import tangentlens.core

PACKAGE = "tangentlens._former_core"
NUMERICAL = ("compute", "controls", "metrics", "subspace", "significance")


def former_core(rev: str, modules: tuple[str, ...] = NUMERICAL) -> types.SimpleNamespace:
    """The ``modules`` of ``tangentlens/core`` at git revision ``rev``, by name."""
    root = Path(tangentlens.core.__file__).parent
    package = types.ModuleType(PACKAGE)
    package.__path__ = []
    sys.modules[PACKAGE] = package
    for path in root.glob("*.py"):  # this tree's modules, unless loaded from ``rev``
        name = path.stem
        if name != "__init__" and name not in modules:
            sys.modules[f"{PACKAGE}.{name}"] = importlib.import_module(f"tangentlens.core.{name}")
    loaded = {}
    for name in modules:  # in order: a module's relative imports are loaded before it
        src = subprocess.run(
            ["git", "show", f"{rev}:tangentlens/core/{name}.py"],
            check=True,
            capture_output=True,
            text=True,
            cwd=root,
        ).stdout
        module = types.ModuleType(f"{PACKAGE}.{name}")
        module.__package__ = PACKAGE
        sys.modules[module.__name__] = module
        exec(compile(src, f"{rev}:{name}.py", "exec"), module.__dict__)
        loaded[name] = module
    return types.SimpleNamespace(**loaded)


def basis(core: types.SimpleNamespace, new_basis: object) -> object:
    """This tree's `TangentBasis` as ``core``'s (the same Q_T and spectrum)."""
    return core.subspace.TangentBasis(
        new_basis.basis_,
        explained_variance=new_basis.explained_variance_,
        mean=new_basis.mean_,
        total_variance=new_basis.total_variance_,
        eigengap=new_basis.eigengap_,
    )


def former_probe(rev: str, module: str, name: str, stop: str) -> type:
    """Probe class ``name`` of ``tangentlens/probes/{module}.py`` at git revision ``rev``,
    its source cut before ``stop`` so that it does not register itself a second time."""
    return getattr(former_probes_module(rev, module, stop), name)


def former_probes_module(rev: str, module: str, stop: str | None = None) -> types.ModuleType:
    """``tangentlens/probes/{module}.py`` at git revision ``rev`` (cut before ``stop``),
    its relative imports resolved in this tree."""
    src = subprocess.run(
        ["git", "show", f"{rev}:tangentlens/probes/{module}.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    src = src if stop is None else src[: src.index(stop)]
    loaded = types.ModuleType(f"tangentlens.probes._former_{module}")
    loaded.__package__ = "tangentlens.probes"
    exec(compile(src, f"{rev}:{module}.py", "exec"), loaded.__dict__)
    return loaded
