"""Every example runs end to end in its fast mode (a tiny model trained here)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(*args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, *args], cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_tl_run_with_hooks():
    out = _run("tl_run_with_hooks.py", "--fast")
    assert "exactly the hooks it had before" in out and "energy_ratio" in out


def test_nnsight_probe():
    out = _run("nnsight_probe.py", "--fast")
    # one batch of 4 sequences × 32 tokens (the tiny model's context)
    assert "blocks.1.hook_resid_post: 128 tokens" in out and "tangent_share" in out


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    printed = _run("checkpoint_study.py", "--fast", "--out", str(out))
    assert "early" in printed and "late" in printed
    return out / "study"


def test_checkpoint_study_and_reading_results(study_dir):
    assert (study_dir / "results.csv").is_file()
    out = _run("read_results.py", str(study_dir))
    assert "p-values: median" in out and "pearson_mean_all" in out
