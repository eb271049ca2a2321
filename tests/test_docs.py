"""The documentation says what is, not how it came to be: no work-journal phrases in the
README, docs/, the package, the benchmarks or the examples; the README stays short, and
docs/PERFORMANCE.md's commands run scripts and options that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HISTORY = re.compile(
    r"previous round|this round|earlier round|before this change|when the issue was filed"
    r"|issue [0-9]+|issue #|as the brief|no GPU was lent",
    re.IGNORECASE,
)


def _documents() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted((ROOT / "tangentlens").rglob("*.py"))
    files += sorted((ROOT / "benchmarks").glob("*.py"))
    files += sorted((ROOT / "examples").glob("*.py"))
    return files


def test_the_documents_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _documents()}
    assert {"README.md", "docs/PERFORMANCE.md", "docs/TUTORIAL.md"} <= names
    assert any(n.startswith("tangentlens/") for n in names)
    assert any(n.startswith("benchmarks/") for n in names)


@pytest.mark.parametrize("path", _documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_history_phrases(path: Path) -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert not hits, "history phrases (say what is true now instead):\n" + "\n".join(hits)


def test_the_pattern_catches_the_phrases() -> None:
    for phrase in ("the Previous Round's run", "as the brief warned", "see issue 14", "issue #3"):
        assert HISTORY.search(phrase)
    assert not HISTORY.search("the previous layer present")


def test_readme_fits_in_200_lines() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


def test_performance_commands_name_real_scripts_and_options() -> None:
    """Each table of docs/PERFORMANCE.md names the command that made it: every script it
    runs exists, and every option it passes is one that script (or its shared helpers)
    defines."""
    text = (ROOT / "docs" / "PERFORMANCE.md").read_text(encoding="utf-8")
    helpers = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "benchmarks").glob("_*.py"))
    commands = re.findall(r"benchmarks/(\w+\.py)([^`|\n]*)", text)
    assert commands, "docs/PERFORMANCE.md names no benchmark command"
    for name, arguments in commands:
        script = ROOT / "benchmarks" / name
        assert script.is_file(), f"docs/PERFORMANCE.md runs benchmarks/{name}, which is missing"
        source = script.read_text(encoding="utf-8") + helpers
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", arguments):
            assert f'"{flag}"' in source, f"benchmarks/{name} defines no {flag}"
