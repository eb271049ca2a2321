"""`tangentlens report`: every folder the tool writes (a study, a probe, a demo, a study
over seeds) gets its page; ``--out DIR/page.html`` writes only that page and its own figure
folder, refuses another run's folder, and leaves every file it did not make as it was."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_report import one_checkpoint, synthetic_results, with_windows

from tangentlens import report
from tangentlens.cli import main
from tangentlens.core import results
from tangentlens.core.files import RECORD_FILE, write_checked_json
from tangentlens.report.page import is_report
from tangentlens.report.render import FIGURES_RECORD


def _run(folder: Path, table, command: str) -> Path:
    results.write(table, folder)
    (folder / "manifest.json").write_text(json.dumps({"command": command, "config": {"rank": 4}}))
    return folder


def _several(folder: Path, runs: dict[str, object], command: str) -> Path:
    """A folder of several runs as `demo` or `study` over seeds leave it: the runs, the
    claims in summary.json and the folder record."""
    for name, table in runs.items():
        _run(folder / name, table, "study")
    kinds: dict[str, dict[int, object]] = {}
    for name, table in runs.items():
        kind, seed = name.split("/") if "/" in name else ("decoder", name)
        kinds.setdefault(kind, {})[int(seed.removeprefix("seed"))] = table
    claims = report.paper_claims(kinds)
    write_checked_json(folder / "summary.json", {"claims": [c.to_dict() for c in claims]})
    writer = {"command": command, "digest": "0" * 64, "config": {}}
    (folder / RECORD_FILE).write_text(json.dumps({"writers": [writer]}))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One folder of each kind the tool writes, from small synthetic studies."""
    root = tmp_path_factory.mktemp("written")
    study = with_windows(synthetic_results(n_layers=2, n_heads=2, steps=(0, 1, 2, 4, 8)))
    # the residual and gradient rows: three figures a page, enough for what is tested here
    study = study[study["probe"].isin(["residual", "gradient", "window", "checkpoint"])]
    other = study.assign(value=study["value"] * 1.1)
    probe = one_checkpoint(study).assign(ci_low=study["ci_low"], ci_high=study["ci_high"])
    demo = _several(root / "demo", {"decoder/seed0": study, "encoder/seed0": other}, "demo")
    # an overview without the generator mark: the demo's own all the same, by its folder record
    (demo / "report.html").write_text("<!DOCTYPE html>\n<title>tangentlens demo</title>\n")
    return {
        "study": _run(root / "study", study, "study"),
        "probe": _run(root / "probe", probe, "probe"),
        "demo": demo,
        "seeds": _several(root / "seeds", {"seed0": study}, "study per seed"),
    }


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def test_report_refuses_an_edited_summary(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The claims a page shows are the ones the run wrote: an edited number in
    summary.json is one line naming the file and exit 2, not a page."""
    folder = _copy(folders["seeds"], tmp_path)
    summary = folder / "summary.json"
    record = json.loads(summary.read_text())
    record["claims"][0]["early"]["value"] = 9.5
    summary.write_text(json.dumps(record))
    assert "summary.json was changed" in _error(["report", str(folder), "-q"], capsys)


def _error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("kind", ["study", "probe", "demo", "seeds"])
def test_report_accepts_every_folder_the_tool_writes(
    kind: str, folders: dict[str, Path], tmp_path: Path
) -> None:
    folder = _copy(folders[kind], tmp_path)
    assert main(["report", str(folder), "-q"]) == 0
    page = (folder / "report.html").read_text(encoding="utf-8")
    assert is_report(folder / "report.html") and "averages: " in page
    runs = [p.parent for p in folder.rglob("results.csv")]
    for run in runs:  # each run's own page and figures, re-rendered in place
        assert is_report(run / "report.html") and (run / "figures" / "depth_profile.png").is_file()
    if kind in ("demo", "seeds"):
        assert page.count("<figcaption>") == page.count("<img ") > 0  # each figure captioned
        for run in runs:
            assert f'href="{run.relative_to(folder).as_posix()}/report.html"' in page


def test_report_out_writes_only_its_page_and_figure_folder(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The user's files in DIR (a figures/ folder with a file named like one of ours, a
    page that is no report) stay byte for byte; a rerun replaces only what it wrote."""
    out = tmp_path / "mine"
    (out / "figures").mkdir(parents=True)
    (out / "figures" / "x.png").write_bytes(b"\x89PNG user")
    (out / "figures" / "depth_profile.png").write_bytes(b"my own depth profile")
    (out / "report.html").write_text("<p>my notes</p>")
    (out / "notes.txt").write_text("keep me")
    before = _snapshot(out)
    for source in (folders["study"], folders["seeds"], folders["study"]):
        argv = ["report", str(_copy(source, tmp_path / source.name)), "--out"]
        assert main([*argv, str(out / f"{source.name}.html"), "-q"]) == 0
        shutil.rmtree(tmp_path / source.name)
    after = _snapshot(out)
    assert {k: after[k] for k in before} == before
    made = {k.split("/")[0] for k in set(after) - set(before)}
    assert made == {"study.html", "study_files", "seeds.html", "seeds_files", ".tangentlens.lock"}
    assert (out / "study_files" / "depth_profile.png").is_file()
    assert (out / "seeds_files" / "seed0" / "energy_over_training.png").is_file()
    assert "<figcaption>" in (out / "seeds.html").read_text(encoding="utf-8")
    capsys.readouterr()


def test_report_out_refuses_what_it_did_not_make(
    folders: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another run's folder, a figure folder it did not make, and one of its figures that
    someone changed: one line naming it, exit 2, nothing touched."""
    study = str(folders["study"])
    other = _copy(folders["probe"], tmp_path)
    before = _snapshot(other)
    for page in (other / "page.html", other / "bases" / "page.html"):  # or a folder in it
        line = _error(["report", study, "--out", str(page)], capsys)
        assert str(other) in line and "run" in line
    assert _snapshot(other) == before and not (other / "bases").exists()
    (other / "figures").mkdir()  # reached through a link, or from inside it
    (tmp_path / "link").symlink_to(other / "figures")
    line = _error(["report", study, "--out", str(tmp_path / "link" / "p.html")], capsys)
    assert str(other) in line
    monkeypatch.chdir(other / "figures")
    assert str(other) in _error(["report", study, "--out", "p.html"], capsys)
    assert not any((other / "figures").iterdir())
    # a file named like a run's below a project is no run: pages below it are written
    project = tmp_path / "project"
    (project / "docs").mkdir(parents=True)
    (project / "manifest.json").write_text("{}")
    assert main(["report", study, "--out", str(project / "docs" / "st.html"), "-q"]) == 0
    assert "is a folder" in _error(["report", study, "--out", "."], capsys)

    out = tmp_path / "pages"
    (out / "page_files").mkdir(parents=True)
    (out / "page_files" / "holiday.jpg").write_bytes(b"mine")
    line = _error(["report", study, "--out", str(out / "page.html")], capsys)
    assert str(out / "page_files") in line
    assert (out / "page_files" / "holiday.jpg").read_bytes() == b"mine"
    assert not (out / "page.html").exists()

    assert main(["report", study, "--out", str(out / "fresh.html"), "-q"]) == 0
    assert json.loads((out / "fresh_files" / FIGURES_RECORD).read_text())["files"]
    edited = out / "fresh_files" / "head_heatmap.png"
    edited.write_bytes(b"annotated by hand")
    line = _error(["report", study, "--out", str(out / "fresh.html")], capsys)
    assert str(edited) in line and edited.read_bytes() == b"annotated by hand"


def test_a_folder_of_runs_without_its_summary_names_the_fix(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    demo = _copy(folders["demo"], tmp_path)
    (demo / "summary.json").unlink()
    line = _error(["report", str(demo)], capsys)
    assert str(demo) in line and "summary.json" in line
    (demo / "summary.json").write_text('{"claims": 3}')
    line = _error(["report", str(demo)], capsys)
    assert "summary.json" in line


def test_report_refuses_a_page_inside_the_runs_own_folders(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """figures/ (and any folder below the run) is rewritten by the run's commands: a page
    there is refused before anything is written."""
    folder = _copy(folders["probe"], tmp_path)
    before = _snapshot(folder)
    line = _error(["report", str(folder), "--out", str(folder / "figures" / "x.html")], capsys)
    assert "--out" in line and str(folder / "figures" / "x.html") in line
    assert _snapshot(folder) == before
    # --out naming a folder suggests a page the command accepts
    assert main(["report", str(folder), "-q"]) == 0  # the run's own page and figures/
    line = _error(["report", str(folder), "--out", str(folder / "figures")], capsys)
    assert str(folder / "figures.html") in line
    assert main(["report", str(folder), "--out", str(folder / "figures.html"), "-q"]) == 0


def test_a_page_that_is_a_folder_is_never_written_into(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    folder = _copy(folders["study"], tmp_path)
    page = folder / "report.html"
    page.mkdir()
    with pytest.raises(ValueError, match="is a folder"):
        report.write_report(results.read(folder), page)
    assert str(page) in _error(["report", str(folder), "-q"], capsys)
    assert not any(page.iterdir())


def test_values_no_figure_can_draw_are_one_line(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A table whose values overflow an axis's span (±1e308) is refused naming the
    statistic, where matplotlib would fail on a singular transform."""
    folder = _copy(folders["study"], tmp_path)
    table = results.read(folder)
    statistic = table["statistic"].iloc[0]
    results.write(table.assign(value=[(-1) ** i * 1e308 for i in range(len(table))]), folder)
    line = _error(["report", str(folder), "-q"], capsys)
    assert statistic in line and str(folder) in line
    # a p-value outside [0, 1] would be drawn on a logarithmic axis
    p_value = table["statistic"].str.endswith("p_value")
    assert p_value.any()
    results.write(table.assign(value=table["value"].where(~p_value, -0.5)), folder)
    line = _error(["report", str(folder), "-q"], capsys)
    assert "p_value" in line and "[0, 1]" in line
    # inf is a value some statistics take on purpose (a ratio over 0): drawn without it
    ratio = table["statistic"] == "energy_ratio"
    assert ratio.any()
    results.write(table.assign(value=table["value"].where(~ratio, np.inf)), folder)
    assert main(["report", str(folder), "-q"]) == 0
