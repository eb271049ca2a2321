"""Every python block of docs/TUTORIAL.md runs as written, in order, in a fresh process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "TUTORIAL.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", TUTORIAL.read_text(encoding="utf-8"), flags=re.S)


def test_tutorial_has_python_blocks() -> None:
    assert len(_blocks()) >= 3, "docs/TUTORIAL.md lost its python blocks"


@pytest.mark.slow
def test_tutorial_python_blocks_run_in_order(tmp_path: Path) -> None:
    script = tmp_path / "tutorial.py"
    script.write_text("\n\n".join(_blocks()), encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
