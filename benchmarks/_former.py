"""The numerical core of a former git revision beside this tree's, in one process: the
benchmarks time both interleaved (one machine state for both) and compare their numbers.

Only the modules named are loaded from the revision (as ``tangentlens._former_core.*``);
every other core module is this tree's, so both share `Moments`, the errors and the
validation, and a former `TangentBasis` is built from this tree's with `basis`.
`former_probe` loads one probe class of a revision the same way, with the package modules
it names loaded from the revision too.
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


def former_probe(
    rev: str, module: str, name: str, stop: str, *, beside: tuple[str, ...] = ()
) -> type:
    """Probe class ``name`` of ``tangentlens/probes/{module}.py`` at git revision ``rev``,
    its source cut before ``stop`` so that it does not register itself a second time.
    ``beside``: package modules (dotted, e.g. ``core.decompose``) that it imports from
    ``rev`` too, in place of this tree's, each where ``rev`` has it."""
    saved: dict[str, types.ModuleType | None] = {}
    try:
        for dotted in beside:  # in order: a later one may import an earlier one
            path = f"tangentlens/{dotted.replace('.', '/')}.py"
            missing = ["git", "cat-file", "-e", f"{rev}:{path}"]
            if subprocess.run(missing, stderr=subprocess.DEVNULL).returncode:
                continue
            full = f"tangentlens.{dotted}"
            saved[full] = sys.modules.get(full)
            sys.modules[full] = _former_module(rev, path, full)
        probe = _former_module(rev, f"tangentlens/probes/{module}.py", None, stop)
    finally:  # this tree's modules back; the former ones live on in the probe's names
        for full, kept in saved.items():
            if kept is None:
                sys.modules.pop(full, None)
            else:
                sys.modules[full] = kept
    return getattr(probe, name)


def _former_module(
    rev: str, path: str, name: str | None, stop: str | None = None
) -> types.ModuleType:
    """The module at ``path`` of revision ``rev`` (cut before ``stop``), named ``name``
    (default: a private name beside it), its relative imports resolved in this tree."""
    src = subprocess.run(
        ["git", "show", f"{rev}:{path}"], check=True, capture_output=True, text=True
    ).stdout
    src = src if stop is None else src[: src.index(stop)]
    package = path.removesuffix(".py").replace("/", ".").rsplit(".", 1)[0]
    stem = path.rsplit("/", 1)[-1].removesuffix(".py")
    loaded = types.ModuleType(name or f"{package}._former_{stem}")
    loaded.__package__ = package
    exec(compile(src, f"{rev}:{stem}.py", "exec"), loaded.__dict__)
    return loaded
