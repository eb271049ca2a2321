"""The `tangentlens` command: help on every command, fast start without torch, one-line
errors with exit code 2 for a person's mistakes, and the commands end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from models import hf_folder

from tangentlens.cli import demo as demo_module
from tangentlens.cli import main, workflows
from tangentlens.core.errors import ResumeRefusedError, UsageError
from tangentlens.report import Claim
from tangentlens.report.claims import VERDICTS
from tangentlens.report.page import is_report

COMMANDS = ("demo", "probe", "train", "study", "report")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ENV.pop("TANGENTLENS_DEBUG", None)


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_on_every_command(command: str | None, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--help"] if command is None else [command, "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: tangentlens")
    if command is None:
        assert all(c in text for c in COMMANDS)


def test_help_is_fast_and_does_not_import_torch() -> None:
    code = (
        "import sys\nfrom tangentlens.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'pandas', 'matplotlib', 'transformers') "
        "if m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert run.returncode == 0 and run.stdout.strip().endswith("[]"), run.stdout + run.stderr
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "tangentlens", "--help"], capture_output=True,
                         text=True, env=ENV)  # fmt: skip
    elapsed = time.perf_counter() - start
    assert run.returncode == 0 and "demo" in run.stdout
    assert elapsed < 3.0  # ~0.1 s idle; generous for a loaded shared machine


def _error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """Run the CLI in-process; assert exit 2 and exactly one stderr line, return it."""
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse
        code = stop.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("tangentlens")
    return lines[0]


@pytest.fixture
def not_a_dir(tmp_path: Path) -> Path:
    """An output path below a plain file: unwritable even as root."""
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    return blocker / "out"


def test_bad_input_gives_one_line_and_exit_2(
    tmp_path: Path, not_a_dir: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TANGENTLENS_DEBUG", raising=False)
    out = str(tmp_path / "out")
    tiny = str(hf_folder("llama"))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "results.csv").write_bytes(b"\x00\xff garbage \xfe")
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    short = tmp_path / "short.txt"
    short.write_text("In the beginning God created the heaven and the earth.\n")
    capsys.readouterr()  # building the tiny model prints progress
    cases = {
        "report of a missing folder": (["report", str(tmp_path / "missing")], "not a folder"),
        "corrupt results file": (["report", str(corrupt)], "corrupt"),
        "unknown model": (["probe", "--model", "no-such-model", "--out", out], "Known names"),
        "rank zero": (["probe", "--model", tiny, "--rank", "0", "--out", out], "positive"),
        "rank above d_model": (
            ["probe", "--model", tiny, "--rank", "64", "--out", out, "-q"], "d_model=32"),
        "unwritable output": (["probe", "--model", tiny, "--out", str(not_a_dir)], "writable"),
        "hub id while offline": (
            ["probe", "--model", "no-org/no-model", "--out", out], "HF_HUB_OFFLINE"),
        "folder that is no model": (["probe", "--model", str(no_config), "--out", out],
                                    "config.json"),
        "missing checkpoints": (
            ["study", "--checkpoints", str(tmp_path / "none"), "--out", out], "folder"),
        "layer out of range": (
            ["probe", "--model", tiny, "--layers", "7", "--out", out, "-q", "--tokens", "64",
             "--seq-len", "16"], "--layers [7]"),
        "model that is a file": (["probe", "--model", str(short), "--out", out], str(short)),
        "corpus too short": (["train", "--quick", "--corpus", str(short), "--out",
                              str(tmp_path / "trained"), "-q"],
                             str(short)),
        "window fraction": (["study", "--checkpoints", tiny, "--out", out,
                             "--window-fraction", "0.9"], "fraction"),
        "train into a file": (["train", "--quick", "--out", str(not_a_dir)], "writable"),
        "empty and bad seeds": (["train", "--out", out, "--seeds", "0,,x"], "'' is no seed"),
        "repeated seed": (["demo", "--out", out, "--seeds", "1,2,1"], "repeats seed 1"),
        "negative seed": (["train", "--out", out, "--seeds", "0,-1"], "'-1' is no seed"),
        "seeds and a seed": (["train", "--out", out, "--seeds", "0,1", "--seed", "2"],
                             "not allowed with"),
        "series without seeds": (["study", "--checkpoints", tiny, str(no_config), "--out", out],
                                 "seed{S}"),
        "one seed twice": (["study", "--checkpoints", str(tmp_path / "a" / "seed1"),
                            str(tmp_path / "b-seed1"), "--out", out], "both seed 1"),
    }  # fmt: skip
    for name, (argv, needle) in cases.items():
        line = _error(argv, capsys)
        assert needle in line, f"{name}: {line}"


def test_errors_in_a_real_process_and_the_debug_switch(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "tangentlens", "report", str(tmp_path / "missing")]
    run = subprocess.run(argv, capture_output=True, text=True, env=ENV)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "Traceback" not in run.stderr
    debug = subprocess.run(argv, capture_output=True, text=True,
                           env={**ENV, "TANGENTLENS_DEBUG": "1"})  # fmt: skip
    assert (
        debug.returncode == 1
        and "Traceback" in debug.stderr
        and "MissingFileError" in (debug.stderr)
    )


PROBE_TINY = ["--rank", "4", "--tokens", "256", "--seq-len", "32", "--n-controls", "50", "-q"]


def test_probe_on_a_tiny_local_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "probe"
    code = main(["probe", "--model", str(hf_folder("llama")), "--out", str(out), *PROBE_TINY])
    assert code == 0
    printed = capsys.readouterr().out
    assert "report:" in printed and "energy ratio" in printed
    results = pd.read_csv(out / "results.csv")
    assert {"residual", "attention", "gradient"} <= set(results["probe"])
    assert (out / "results.json").is_file() and (out / "bases" / "rank4.safetensors").is_file()
    figures = {p.stem for p in (out / "figures").glob("*.png")}
    assert {"depth_profile", "head_heatmap"} <= figures
    assert 'id="head_heatmap"' in (out / "report.html").read_text()
    assert json.loads((out / "manifest.json").read_text())["notes"] == []
    rounded = [*PROBE_TINY, "--tokens", "250", "--layers", "0", "--out", str(tmp_path / "r")]
    assert main(["probe", "--model", str(hf_folder("llama")), *rounded]) == 0
    notes = json.loads((tmp_path / "r" / "manifest.json").read_text())["notes"]
    assert notes == ["--tokens 250: 224 probed, in blocks of 32"]  # whole blocks, said


def test_a_probe_rerun_stopped_after_its_table_leaves_nothing_of_the_old_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe rerun that replaces the table and stops right after: the old page, figures,
    bases and manifest went first, so none lies beside the new table."""
    out = tmp_path / "probe"
    argv = ["probe", "--model", str(hf_folder("llama")), "--out", str(out), *PROBE_TINY]
    assert main(argv) == 0
    assert (out / "report.html").is_file() and list((out / "figures").glob("*.png"))

    (out / "figures" / "my_notes.png").write_bytes(b"not the report's")
    write = workflows.results.write

    def stop(*args: object) -> None:
        write(*args)
        raise RuntimeError("stopped")

    monkeypatch.setattr(workflows.results, "write", stop)
    assert main(argv) == 1  # a crash, reported as one
    assert (out / "results.csv").is_file()
    left = [p.name for p in out.rglob("*") if p.is_file() and p.suffix in (".html", ".png")]
    assert left == ["my_notes.png"]  # the report's own figures went, nothing else
    assert not (out / "manifest.json").exists() and not list((out / "bases").iterdir())
    monkeypatch.undo()
    assert main(argv) == 0 and (out / "report.html").is_file()


def test_probe_on_the_real_smollm2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`probe --model smollm2-135m` offline: the bundled real model, two of its 30 layers."""
    out = tmp_path / "smol"
    args = ["probe", "--model", "smollm2-135m", "--layers", "0", "5", "--tokens", "128"]
    assert main([*args, "--seq-len", "64", "--n-controls", "50", "--out", str(out), "-q"]) == 0
    capsys.readouterr()
    results = pd.read_csv(out / "results.csv")
    assert {"residual", "attention", "gradient"} <= set(results["probe"])
    assert set(results["layer"].dropna().astype(int)) == {0, 5}
    heads = results[results["statistic"] == "score_share_TT"]
    assert len(heads) == 2 * 9  # SmolLM2-135M: 9 query heads per layer
    shares = results[(results["probe"] == "residual") & (results["statistic"] == "tangent_share")]
    assert shares["value"].between(0, 1).all()
    assert "layers 0, 5" in (out / "report.html").read_text()  # the layers probed, not 0–5


def test_demo_prints_each_claim_from_the_typed_claims(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`demo` prints the claims `cli.demo.demo` returns, one line each: verdict, model,
    gradient object and the paper's words, read from the `Claim` objects."""
    from tangentlens.cli import demo
    from tangentlens.report import PAPER, Claim, Estimate

    claim = Claim("energy_early", "decoder", "gradient", "gradient_energy_ratio", 4,
                  Estimate(3.0, 2.0, 4.0), "agrees", between=Estimate(3.0, 2.0, 4.0),
                  p_value=0.01, p_holm=0.04)  # fmt: skip
    done = demo.DemoOutcome(pd.DataFrame(), tmp_path / "report.html", 1.0, [claim])
    monkeypatch.setattr(demo, "demo", lambda *args, **kwargs: done)
    assert main(["demo", "--quick", "--out", str(tmp_path), "-q"]) == 0
    printed = capsys.readouterr().out.splitlines()
    at = printed.index(f"  [agrees] decoder, gradient: {PAPER['energy_early']}")
    # the number and the test the verdict turns on, as the page shows them
    assert "3 [2, 4]" in printed[at + 1] and "p 0.01, Holm-adjusted 0.04" in printed[at + 1]


def test_demo_then_train_study_report(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`demo --quick --seeds 0,1` end to end: a decoder and an encoder per seed, each a
    full study folder, one probe set per kind, the verdicts and the seeds in summary.json
    and an overview page; then `train`, `study` and `report` on a decoder seed's folders
    (they resume: same configuration, nothing is redone), and `study` over both seeds."""
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--seeds", "0,1", "--out", str(out), "-q"]) == 0
    printed = capsys.readouterr().out
    assert "report:" in printed and "summary:" in printed and "verdicts" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == [0, 1] and summary["models"] == ["decoder", "encoder"]
    assert [Claim.from_dict(c).to_dict() for c in summary["claims"]] == summary["claims"]
    verdicts = {c["verdict"] for c in summary["claims"]}
    assert verdicts <= set(VERDICTS) and verdicts  # one seed: at most "suggests ..."
    kinds = {(c["model"], c["gradient_object"]) for c in summary["claims"]}
    for model in ("decoder", "encoder"):
        assert {(model, "gradient"), (model, "weight_gradient")} <= kinds
        assert sorted(p.name for p in (out / model).iterdir()) == ["seed0", "seed1"]
        probe_sets, weights = set(), set()
        for seed in (0, 1):
            folder = out / model / f"seed{seed}"
            steps = sorted(int(p.name[4:]) for p in (folder / "checkpoints").glob("step*"))
            assert steps == [0, 1, 2, 4, 8]
            assert (folder / "results.csv").is_file() and (folder / "manifest.json").is_file()
            manifest = json.loads((folder / "manifest.json").read_text())
            probe_sets.add(manifest["probe_set"]["tokens_hash"])
            weights.add(manifest["weights_hashes"]["0"])
            table = pd.read_csv(folder / "results.csv")
            heads = table[table["statistic"] == "score_share_TT"]  # heads inside the study
            assert set(heads["step"]) == set(steps) and heads["head"].notna().all()
            assert (folder / "report.html").read_text().count("data:image/png;base64,") == 6
        assert len(probe_sets) == 1 and len(weights) == 2  # one probe set; two initialisations
    overview = (out / "report.html").read_text()
    assert overview.count("data:image/png;base64,") == 24
    assert overview.count("8 probe sequences of") == overview.count("50 controls a test") == 4
    page = out / "encoder" / "seed1" / "report.html"
    title = "<title>tangentlens demo: encoder, seed 1</title>"
    assert title in page.read_text()
    assert main(["report", str(out), "-q"]) == 0 and title in page.read_text()  # re-rendered
    swapped = tmp_path / "swapped"  # runs that are not those the claims came from
    shutil.copytree(out, swapped, ignore=shutil.ignore_patterns("checkpoints"))
    seed0, seed1 = swapped / "decoder" / "seed0", swapped / "decoder" / "seed1"
    seed0.rename(swapped / "spare")
    assert main(["report", str(swapped), "-q"]) == 2
    assert "seed0 is missing" in capsys.readouterr().err
    seed1.rename(seed0)
    (swapped / "spare").rename(seed1)
    assert main(["report", str(swapped), "-q"]) == 2
    assert str(seed0) in capsys.readouterr().err
    seed0.rename(swapped / "spare")  # the runs as they were, and one more beside them
    seed1.rename(seed0)
    (swapped / "spare").rename(seed1)
    shutil.copytree(seed1, swapped / "decoder" / "seed7")
    assert main(["report", str(swapped), "-q"]) == 2
    assert "seed7 is a run summary.json does not record" in capsys.readouterr().err

    decoder = out / "decoder" / "seed0"
    ckpt = str(decoder / "checkpoints")
    assert main(["train", "--quick", "--out", ckpt, "-q"]) == 0  # seed 0: the same run
    seeds = [str(out / "decoder" / f"seed{s}" / "checkpoints") for s in (0, 1)]
    both = tmp_path / "both"
    assert main(["study", "--quick", "--checkpoints", *seeds, "--out", str(both), "-q"]) == 0
    assert "summary:" in capsys.readouterr().out
    summary = json.loads((both / "summary.json").read_text())
    assert summary["seeds"] == [0, 1] and summary["models"] == ["decoder"]
    for seed in (0, 1):  # each seed's study equals the demo's own
        mine = pd.read_csv(both / f"seed{seed}" / "results.csv")
        demo = pd.read_csv(out / "decoder" / f"seed{seed}" / "results.csv")
        assert mine[mine["probe"] == "window"]["value"].tolist() == (
            demo[demo["probe"] == "window"]["value"].tolist()
        )

    # a rerun refused (other options) replaces no table and keeps the claims and overview
    other = ["study", "--quick", "--checkpoints", *seeds, "--out", str(both), "--rank", "3"]
    assert main([*other, "-q"]) == 2 and "rank" in capsys.readouterr().err
    assert (both / "summary.json").is_file() and (both / "report.html").is_file()

    # a rerun stopped at seed 0's page: the old claims and overview went first
    def stop(*args: object, **kwargs: object) -> None:
        raise RuntimeError("stopped")

    monkeypatch.setattr(workflows, "write_report", stop)
    assert main(["study", "--quick", "--checkpoints", *seeds, "--out", str(both), "-q"]) == 1
    monkeypatch.undo()
    assert not (both / "summary.json").exists() and not (both / "report.html").exists()
    assert main(["report", str(both), "-q"]) == 2 and "summary.json" in capsys.readouterr().err
    # seeds of two designs: refused before any study, naming the series and the setting
    mixed = [ckpt, str(out / "encoder" / "seed1" / "checkpoints")]
    assert main(["study", "--quick", "--checkpoints", *mixed, "--out", str(tmp_path / "mix")]) == 2
    err = capsys.readouterr().err
    assert mixed[1] in err and "train objective" in err and not (tmp_path / "mix").exists()
    assert main(["study", "--quick", "--checkpoints", ckpt, "--out", str(decoder), "-q"]) == 0
    assert "paper:" in capsys.readouterr().out
    (decoder / "report.html").unlink()
    assert main(["report", str(decoder), "-q"]) == 0
    again = (decoder / "report.html").read_text()
    assert again.count("data:image/png;base64,") == 6
    assert (decoder / "figures" / "energy_over_training.png").is_file()


def test_train_an_encoder_per_seed_then_study_the_seeds(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`train --objective masked --seeds 0,1` makes one encoder series per seed with one
    tokenizer and one split; `study` over their folder studies each seed as an encoder."""
    runs = tmp_path / "runs"
    argv = ["train", "--quick", "--objective", "masked", "--seeds", "0,1", "--out", str(runs)]
    assert main([*argv, "-q"]) == 0
    assert "seed" in capsys.readouterr().out
    for seed in (0, 1):
        folder = runs / f"seed{seed}"
        config = json.loads((folder / "train_config.json").read_text())
        assert config["objective"] == "masked" and config["seed"] == seed
        assert config["split_seed"] == (None if seed == 0 else 0)  # the split of seed 0
        model = json.loads((folder / "step8" / "config.json").read_text())
        assert model["architectures"] == ["BertForMaskedLM"]
    tokenizers = {(runs / f"seed{s}" / "tokenizer" / "tokenizer.json").read_bytes() for s in (0, 1)}
    assert len(tokenizers) == 1
    assert main(["train", "--quick", "--out", str(runs), "-q"]) == 2  # one run in a seeds folder
    assert "holds the output of `tangentlens train --seeds`" in capsys.readouterr().err
    again = ["train", "--quick", "--objective", "masked", "--n-seeds", "2", "--out", str(runs)]
    assert main([*again, "-q"]) == 0  # the same seeds: each run is finished, nothing redone
    out = tmp_path / "study"
    assert main(["study", "--quick", "--checkpoints", str(runs), "--out", str(out), "-q"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["models"] == ["encoder"] and summary["seeds"] == [0, 1]
    assert {c["model"] for c in summary["claims"]} == {"encoder"}
    assert (out / "seed1" / "report.html").is_file()
    page = out / "report.html"  # the overview, as the demo writes one
    assert is_report(page)
    assert all(f'href="seed{s}/report.html"' in page.read_text(encoding="utf-8") for s in (0, 1))


def test_probe_data_parallel_equals_one_process(tmp_path: Path) -> None:
    model = str(hf_folder("llama"))
    tables = []
    for world_size in (1, 2):
        out = tmp_path / f"ws{world_size}"
        argv = ["probe", "--model", model, "--out", str(out), "--world-size", str(world_size)]
        assert main([*argv, *PROBE_TINY]) == 0
        tables.append(pd.read_csv(out / "results.csv"))
    keys = ["probe", "site", "layer", "head", "statistic"]
    merged = tables[0].merge(tables[1], on=keys, how="outer", validate="one_to_one")
    assert len(merged) == len(tables[0]) == len(tables[1])
    # summation order differs across ranks: equal to rounding (a z of −100 to 1e-10 relative)
    np.testing.assert_allclose(merged["value_x"], merged["value_y"], rtol=1e-9, atol=1e-9)


def test_demo_kinds_side_by_side_give_the_tables_of_the_kinds_in_turn(tmp_path: Path) -> None:
    """`demo(workers=2)` runs the decoder and the encoder in two processes: each on one
    torch thread, exactly, so summary.json and every results table equal those of
    `workers=1`, where the kinds run one after the other in this process."""
    from tangentlens.cli.demo import demo

    found = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        demo(out, quick=True, seeds=(0,), progress=False, workers=workers)
        tables = {
            p.relative_to(out): p.read_bytes() for p in sorted(out.glob("*/seed*/results.csv"))
        }
        found[workers] = (json.loads((out / "summary.json").read_text()), tables)
    assert len(found[1][1]) == 2 and found[1][1].keys() == found[2][1].keys()
    assert found[1] == found[2]


def test_a_demo_refused_a_resume_names_its_own_fixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training step the demo cannot resume (its folder made with other inputs, options
    or code) names what the demo offers: it has no --restart."""

    def refused(config: object, out: Path, *args: object, **kwargs: object) -> Path:
        raise ResumeRefusedError(f"{out} was trained otherwise: rerun with --restart.")

    monkeypatch.setattr(demo_module, "train", refused)
    with pytest.raises(UsageError, match="new --out") as err:
        demo_module.demo(tmp_path / "d", quick=True, workers=1, progress=False)
    assert str(tmp_path / "d" / "decoder" / "seed0" / "checkpoints") in str(err.value)
    assert not isinstance(err.value, ResumeRefusedError)
    # a refused rerun replaces no table, so the claims and the page of the tables stay
    for name in ("summary.json", "report.html"):
        (tmp_path / "d" / name).write_text("the claims of the tables")
    with pytest.raises(UsageError, match="new --out"):
        demo_module.demo(tmp_path / "d", quick=True, workers=1, progress=False)
    assert (tmp_path / "d" / "summary.json").read_text() == "the claims of the tables"
    assert (tmp_path / "d" / "report.html").is_file()
