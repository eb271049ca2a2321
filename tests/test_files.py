"""The file layer under attack and damage: the folder lock (planted links, a deleted
lock file, a killed holder), import without side effects, the strict JSON reader, and
results tables checked against what their writer recorded."""

from __future__ import annotations

import errno
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

import tangentlens
from tangentlens.cli import main
from tangentlens.core import results
from tangentlens.core.digests import source_digest
from tangentlens.core.errors import CorruptFileError, MissingFileError, UsageError
from tangentlens.core.files import (
    LOCK_FILE,
    RECORD_FILE,
    atomic_folder,
    atomic_write,
    read_json,
    retire,
    write_text,
)
from tangentlens.core.folders import lock_folder

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
ENV.pop("TANGENTLENS_DEBUG", None)


def _error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """Run the CLI in-process; assert exit 2 and exactly one line on stderr; return it."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------------------- import
def test_import_changes_nothing_in_the_process() -> None:
    """Importing the file layer calls no `os.umask` (a process-wide change) and needs no
    Unix-only module of its own."""
    code = textwrap.dedent(
        """
        import os
        def refuse(mask):
            raise AssertionError("os.umask called at import")
        os.umask = refuse
        import tangentlens.core.files as files, tangentlens.core.results
        assert not hasattr(files, "_UMASK") and "fcntl" not in vars(files)
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_permissions_come_from_the_umask_at_call_time(tmp_path: Path) -> None:
    umask = os.umask(0o027)
    try:
        made = write_text(tmp_path / "a.txt", "x")
        folder = atomic_folder(tmp_path / "f", lambda p: (p / "b.txt").write_text("y"))
    finally:
        os.umask(umask)
    assert made.stat().st_mode & 0o777 == 0o640
    assert folder.stat().st_mode & 0o777 == 0o750
    assert (folder / "b.txt").stat().st_mode & 0o777 == 0o640
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ----------------------------------------------------------------------------- the lock
def _plant_link(folder: Path, tmp: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    victim = tmp / "victim.txt"
    victim.write_bytes(b"someone else's file\n")
    (folder / LOCK_FILE).symlink_to(victim)
    return victim


def test_a_planted_link_at_the_lock_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    victim = _plant_link(tmp_path / "out", tmp_path)
    before = (victim.read_bytes(), victim.stat().st_mtime_ns)
    with pytest.raises(UsageError) as err, lock_folder(tmp_path / "out", "probe"):
        pass
    assert str(tmp_path / "out" / LOCK_FILE) in str(err.value) and "delete it" in str(err.value)
    assert "\n" not in str(err.value)
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == before
    assert (tmp_path / "out" / LOCK_FILE).is_symlink()


def test_a_planted_link_at_the_lock_via_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    victim = _plant_link(tmp_path / "study", tmp_path)
    before = victim.read_bytes()
    line = _error(["report", str(tmp_path / "study")], capsys)
    assert f"{tmp_path / 'study' / LOCK_FILE} is a symbolic link" in line, line
    assert victim.read_bytes() == before


def test_a_hard_link_at_the_lock_leaves_its_other_name_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    os.link(victim, out / LOCK_FILE)
    with lock_folder(out, "probe"):
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert victim.read_bytes() == b"precious\n"


_HOLDER = textwrap.dedent(
    """
    import sys
    from tangentlens.core.folders import lock_folder
    with lock_folder(sys.argv[1], "study"):
        print("held", flush=True)
        sys.stdin.readline()
    """
)


def test_deleting_the_lock_file_admits_no_second_writer(tmp_path: Path) -> None:
    """The lock is on the folder, not on the file: with the lock file deleted (or
    replaced) while another process holds the folder, a second writer is still refused;
    once the holder is killed, nothing stale blocks the next one."""
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(out)],
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        (out / LOCK_FILE).unlink()
        with pytest.raises(UsageError, match="in use"), lock_folder(out, "probe"):
            pass
        (out / LOCK_FILE).write_text("{}")  # a fresh file under the name: still refused
        with pytest.raises(UsageError, match="in use"), lock_folder(out, "probe"):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    with lock_folder(out, "probe"):  # the killed holder's lock went with it
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_the_refusal_names_the_holder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(out)],
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=f"pid {holder.pid}"), lock_folder(out, "probe"):
            pass
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0


def _train_folder(folder: Path) -> Path:
    """A `tangentlens train` run's folder as its record and one checkpoint show it."""
    (folder / "step0").mkdir(parents=True)
    (folder / "step0" / "config.json").write_text("{}")
    (folder / "step0" / "model.safetensors").write_bytes(b"weights")
    (folder / "tokenizer").mkdir()
    writer = {"command": "train", "digest": "0" * 64, "config": {}}
    (folder / RECORD_FILE).write_text(json.dumps({"writers": [writer]}))
    return folder


@pytest.mark.parametrize("inside", ["tokenizer/x", "step0", "step0/pages", "other"])
def test_no_output_folder_inside_a_training_run_or_a_model_folder(
    inside: str, tmp_path: Path
) -> None:
    """Their files are read by content (the tokenizer's digest, a model's): a folder made
    there, even its lock file, would change them. Refused before anything is made."""
    run = _train_folder(tmp_path / "run")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    with pytest.raises(UsageError) as err, lock_folder(run / inside, "study"):
        pass
    assert str(run / inside) in str(err.value) and "--out" in str(err.value)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_the_tools_own_nesting_stays_allowed(tmp_path: Path) -> None:
    """A run beside or around a training run (a study's folder holding its checkpoints),
    a training run itself, and a folder this process already writes all lock."""
    run = _train_folder(tmp_path / "study" / "checkpoints")
    for folder in (run, tmp_path / "study", tmp_path / "beside"):
        with lock_folder(folder, "study"):
            pass
    with lock_folder(run, "train"), lock_folder(run / "seed1", "train"):
        pass


def test_an_out_inside_a_checkpoint_via_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _train_folder(tmp_path / "run")
    line = _error(["train", "--quick", "--out", str(run / "step0" / "again"), "-q"], capsys)
    assert str(run / "step0") in line
    assert not (run / "step0" / "again").exists()


# ----------------------------------------------------------------------------- JSON
@pytest.mark.parametrize(
    ("text", "needle"),
    [("[1, 2]", "JSON array where a JSON object"), ("{oops", "not valid JSON"), ("\xff", "JSON")],
)
def test_read_json_names_the_file_and_the_fix(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "x.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(CorruptFileError, match=needle) as err:
        read_json(path, dict, fix="delete it")
    assert str(path) in str(err.value) and "delete it" in str(err.value)
    with pytest.raises(MissingFileError):
        read_json(tmp_path / "none.json")


def test_a_folder_record_of_the_wrong_type_is_corrupt(tmp_path: Path) -> None:
    (tmp_path / RECORD_FILE).write_text("[]")
    with pytest.raises(CorruptFileError, match=RECORD_FILE), lock_folder(tmp_path, "probe") as lk:
        lk.claim({"a": 1}, ("results.csv",))


# ----------------------------------------------------------------------------- results
def _table() -> pd.DataFrame:
    rows = [
        {
            "probe": "residual",
            "hook": f"blocks.{layer}.hook_resid_pre",
            "site": "resid_pre",
            "layer": layer,
            "statistic": "tangent_share",
            "value": 5.346757000898135 + layer,
        }
        for layer in range(4)
    ]
    return results.frame(rows)


@pytest.fixture
def written(tmp_path: Path) -> Path:
    folder = tmp_path / "study"
    results.write(_table(), folder)
    assert (folder / "results.meta.json").is_file()
    pd.testing.assert_frame_equal(results.read(folder), _table())
    return folder


def _row_cut(data: bytes) -> bytes:
    return data[: data.rstrip(b"\n").rindex(b"\n") + 1]


def _number_cut(data: bytes) -> bytes:
    return data.rstrip(b"\n")[:-5]


def _flip(data: bytes) -> bytes:
    at = data.rindex(b"5.346757")  # the first digit of the first row's value
    return data[:at] + b"6" + data[at + 1 :]


DAMAGE = {"cut at a row boundary": _row_cut, "cut inside the last number": _number_cut}
DAMAGE["a flipped digit"] = _flip


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("name", ["results.csv", "results.json"])
def test_a_damaged_table_is_refused(written: Path, damage: str, name: str) -> None:
    path = written / name
    data = path.read_bytes()
    if name.endswith(".json") and damage == "cut at a row boundary":
        records = json.loads(data)
        data = (json.dumps(records[:-1]) + "\n").encode()
    else:
        data = DAMAGE[damage](data)
    path.write_bytes(data)
    with pytest.raises(CorruptFileError) as err:
        results.read(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_table_via_the_cli(
    written: Path, damage: str, capsys: pytest.CaptureFixture
) -> None:
    path = written / "results.csv"
    path.write_bytes(DAMAGE[damage](path.read_bytes()))
    line = _error(["report", str(written)], capsys)
    assert str(path) in line and ("delete it" in line or "re-create" in line), line


def test_a_table_without_a_record_is_read_on_its_own_terms(written: Path) -> None:
    """A table someone made (no record beside it) reads; cut at a row boundary it is a
    shorter table, which only the writer's record could have told."""
    (written / "results.meta.json").unlink()
    path = written / "results.csv"
    path.write_bytes(_row_cut(path.read_bytes()))
    assert len(results.read(written)) == len(_table()) - 1


def test_a_manifest_of_the_wrong_type_is_one_line(
    written: Path, capsys: pytest.CaptureFixture
) -> None:
    (written / "manifest.json").write_text("[1, 2, 3]\n")
    line = _error(["report", str(written)], capsys)
    assert str(written / "manifest.json") in line and "JSON array" in line, line


def test_retire_deletes_the_files_its_patterns_match_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "figures" / "nested").mkdir(parents=True)
    for name in ("report.html", "results.csv", "figures/a.png", "figures/notes.txt"):
        (tmp_path / name).write_text(name)
    (tmp_path / "figures" / "gone.png").symlink_to(tmp_path / "missing.png")  # dangling
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    (elsewhere / "theirs.png").write_text("a file of another folder")
    (tmp_path / "linked").symlink_to(elsewhere, target_is_directory=True)
    patterns = ("report.html", "figures/*.png", "summary.json", "figures/nested", "linked/*")
    retire(tmp_path, patterns)
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert left == ["figures", "figures/nested", "figures/notes.txt", "linked", "results.csv"]
    assert (elsewhere / "theirs.png").is_file()  # behind a linked folder: not this one's
    (elsewhere / "report.html").write_text("a page")  # the folder itself reached by a link
    retire(tmp_path / "linked", ["report.html"])
    assert not (elsewhere / "report.html").exists()


def test_a_failed_write_names_the_file_it_makes_not_its_temporary(tmp_path: Path) -> None:
    """A folder standing where a file belongs, or a file where a folder belongs: the error
    names that path (what the user can find and move), never the hidden temporary."""
    (tmp_path / "results.csv").mkdir()
    with pytest.raises(OSError) as err:
        write_text(tmp_path / "results.csv", "a")
    assert err.value.filename == str(tmp_path / "results.csv")
    (tmp_path / "step4").write_text("not a folder")
    with pytest.raises(OSError) as err:
        atomic_folder(tmp_path / "step4", lambda tmp: (tmp / "x").write_text("x"))
    assert err.value.filename == str(tmp_path / "step4")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left

    def full(tmp: Path) -> None:  # a write that fails as a full disk does: no file named
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError) as err:
        atomic_write(tmp_path / "figure.png", full)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(tmp_path / "figure.png")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    def reads(tmp: Path) -> None:  # a file of its own that is missing: named as it is
        (tmp_path / "absent" / "source.txt").read_text()

    with pytest.raises(FileNotFoundError) as err:
        atomic_write(tmp_path / "copy.txt", reads)
    assert err.value.filename == str(tmp_path / "absent" / "source.txt")
    for raised in (OSError("a library's own words"), MissingFileError("ours, as it was")):

        def fails(tmp: Path, raised: OSError = raised) -> None:
            raise raised

        with pytest.raises(OSError) as err:
            atomic_write(tmp_path / "x.txt", fails)
        assert err.value is raised


def test_the_source_digest_moves_with_any_module_of_the_package(tmp_path: Path) -> None:
    """`source_digest` covers every module's path and bytes: an edit anywhere in the tree
    is another source, so the study's parts computed before it are recomputed."""
    package = Path(tangentlens.__file__).resolve().parent
    copy = tmp_path / "tangentlens"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))

    def digest() -> str:  # the copy's own function, rooted at the copy
        return runpy.run_path(str(copy / "core" / "digests.py"))["source_digest"]()

    assert digest() == source_digest()
    (copy / "report" / "style.py").write_text((copy / "report" / "style.py").read_text() + "\n")
    edited = digest()
    assert edited != source_digest()
    (copy / "report" / "added.py").write_text("")
    added = digest()
    assert added != edited
    (copy / "report" / ".#style.py").symlink_to("nowhere")  # an editor's lock: no module
    assert digest() == added
