"""Hostile input and faults: one writer per output folder, nothing reused unverified,
every failure one line on stderr that names the cause and the fix, exit code 2; faults of
the machine (file too large, disk full, a killed parent) leave work that resumes."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from models import hf_folder
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tangentlens.cli import main, workflows
from tangentlens.core import digests, files, results
from tangentlens.core.errors import CorruptFileError, UsageError
from tangentlens.core.files import LOCK_FILE, RECORD_FILE, check_safetensors, load_tensors
from tangentlens.core.folders import lock_folder
from tangentlens.core.stats import Moments
from tangentlens.core.validation import check_int
from tangentlens.data import corpus
from tangentlens.data.checkpoints import CheckpointSeries
from tangentlens.data.train import TrainConfig, train
from tangentlens.models import loading as models
from tangentlens.probes.bases import BasisSet
from tangentlens.study import Study, StudyConfig
from tangentlens.study.collect import load_part

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ENV.pop("TANGENTLENS_DEBUG", None)
PROBE = ["--rank", "4", "--tokens", "128", "--seq-len", "16", "--n-controls", "20", "-q"]
STUDY = ["--quick", "--rank", "4", "-q"]
Case = Callable[[Path, Path], tuple[list[str], tuple[str, ...]]]


# ----------------------------------------------------------------------------- the world
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the cases start from: the quick series (``series/``), a study of it
    (``study/``) and a probe of the tiny Llama (``probe/``), each made by the CLI."""
    root = tmp_path_factory.mktemp("world")
    train(workflows.train_config(quick=True), root / "series", progress=False)
    out = str(root / "study")
    assert main(["study", "--checkpoints", str(root / "series"), "--out", out, *STUDY]) == 0
    assert main(_probe(hf_folder("llama"), root / "probe")) == 0
    return root


def _error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """Run the CLI in-process; assert exit 2 and exactly one line on stderr; return it."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse
        code = stop.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"tangentlens {argv[0]}: error: ")
    return lines[0]


@contextmanager
def _held(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s lock as another process would (its own descriptor of the folder),
    recording a command line the refusal must name."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        record = {"pid": 4242, "command": "study", "argv": "tangentlens study x"}
        (folder / LOCK_FILE).write_text(json.dumps(record))
        yield
    finally:
        os.close(fd)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _study_again(w: Path, out: Path, *extra: str) -> list[str]:
    return ["study", "--checkpoints", str(w / "series"), "--out", str(out), *STUDY, *extra]


def _probe(model: Path | str, out: Path, *extra: str) -> list[str]:
    return ["probe", "--model", str(model), "--out", str(out), *PROBE, *extra]


def _model_copy(tmp: Path, name: str = "model") -> Path:
    return _copy(hf_folder("llama"), tmp / name)


def _series_copy(w: Path, tmp: Path) -> Path:
    folder = _copy(w / "series", tmp / "series")
    for hidden in (LOCK_FILE, RECORD_FILE):
        (folder / hidden).unlink()
    return folder


def _steps_only(w: Path, tmp: Path) -> Path:
    """The series' checkpoints copied without the trainer's files (its 32 positions
    unknown to a study, which takes 64 tokens a sequence unless told)."""
    for step in (w / "series").glob("step*"):
        shutil.copytree(step, tmp / "copied" / step.name)
    return tmp / "copied"


def _truncate(path: Path, keep: int = 2000) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _retensor(path: Path, change: Callable[[dict, dict], None]) -> None:
    """Rewrite a safetensors file with its tensors or header changed by ``change``, and
    its content hash updated to match (as a consistent writer would), so the checks
    behind the hash are what a case reaches."""
    tensors = load_file(str(path))
    header = check_safetensors(path).get("__metadata__", {})
    change(tensors, header)
    if files.CONTENT_KEY in header:
        header[files.CONTENT_KEY] = digests.tensor_hash(tensors)
    if files.METADATA_KEY in header:
        header[files.METADATA_KEY] = files.metadata_hash(header)
    save_file(tensors, str(path), metadata=header)


def _drop_part_key(key: str) -> Callable[[dict, dict], None]:
    def change(_: dict, header: dict) -> None:
        meta = json.loads(header["tangentlens_study_part"])
        del meta[key]
        header["tangentlens_study_part"] = json.dumps(meta)

    return change


def _nan_moments(tensors: dict, _: dict) -> None:
    key = next(k for k in tensors if k.startswith("gradient/grad/") and k.endswith("/mean"))
    tensors[key][0] = float("nan")


def _foreign_token(tensors: dict, _: dict) -> None:
    tensors["tokens"][0, 0] = 10**6


def _pickled(folder: Path) -> Path:
    (folder / "model.safetensors").unlink()
    with open(folder / "pytorch_model.bin", "wb") as fh:
        pickle.dump({"weights": [1, 2, 3]}, fh)
    return folder


# ----------------------------------------------------------------------------- CLI cases
def _part(w: Path, tmp: Path, change: Callable[[dict, dict], None]) -> list[str]:
    out = _copy(w / "study", tmp / "study")
    _retensor(out / "parts" / "step4.safetensors", change)
    return _study_again(w, out)


def _user_results(tmp: Path) -> Path:
    out = tmp / "mine"
    out.mkdir()
    (out / "results.csv").write_text("my own numbers\n")
    return out


def _unterminated_quote(w: Path, tmp: Path) -> Path:
    out = _copy(w / "probe", tmp / "probe")
    with open(out / "results.csv", "a") as fh:
        fh.write('residual,"blocks.0.hook_resid_pre,resid_pre,0,,tangent_share,0.5\n')
    return out


def _text(tmp: Path, data: bytes) -> str:
    path = tmp / "input.txt"
    path.write_bytes(data)
    return str(path)


LATIN1 = "Au commencement était la Parole. Café, où, déjà.\n".encode("latin-1") * 50
BINARY = bytes(range(256)) * 20
UNTRUSTED = ("the output of `tangentlens", "new --out")

CLI_CASES: dict[str, Case] = {
    # one writer per folder; a command's results are never another's
    "probe over a study": lambda w, t: (_probe(hf_folder("llama"), w / "study"), UNTRUSTED),
    "study over a probe": lambda w, t: (_study_again(w, w / "probe"), UNTRUSTED),
    "train over a study": lambda w, t: (
        ["train", "--quick", "--out", str(w / "study"), "-q"], UNTRUSTED),
    "demo over a probe": lambda w, t: (["demo", "--quick", "--out", str(w / "probe")], UNTRUSTED),
    "train over the study's checkpoints, other seed": lambda w, t: (
        ["train", "--quick", "--seed", "3", "--out", str(w / "series")],
        ("differs in ['seed']", "new --out")),
    "probe over a probe of another rank": lambda w, t: (
        _probe(hf_folder("llama"), w / "probe", "--rank", "2"), ("differs in ['rank']",)),
    "probe over a probe of another model": lambda w, t: (
        _probe(hf_folder("gpt2"), w / "probe"), ("differs in ['model', ", "new --out")),
    "study with other settings": lambda w, t: (
        _study_again(w, w / "study", "--n-controls", "30"), ("differs in ['n_controls']",)),
    "probe into a folder with results of its own": lambda w, t: (
        _probe(hf_folder("llama"), _user_results(t)), ("not made by", "new --out")),
    "study into a folder with results of its own": lambda w, t: (
        _study_again(w, _user_results(t)), ("not made by", "new --out")),
    "train into a folder of step folders": lambda w, t: (
        ["train", "--quick", "--out", str(_bare_steps(w, t))], ("not made by", "new --out")),
    "damaged folder record": lambda w, t: (
        _study_again(w, _damaged_record(w, t)), (RECORD_FILE, "damaged", "new --out")),
    # a second writer fails at once, naming the running one
    "probe while the folder is in use": lambda w, t: (
        _probe(hf_folder("llama"), t / "busy"), ("in use", "pid 4242", "another --out")),
    "train while the folder is in use": lambda w, t: (
        ["train", "--quick", "--out", str(t / "busy")], ("in use", "tangentlens study x")),
    "study while the folder is in use": lambda w, t: (
        _study_again(w, t / "busy"), ("in use", "pid 4242")),
    "demo while the folder is in use": lambda w, t: (
        ["demo", "--quick", "--out", str(t / "busy")], ("in use", "pid 4242")),
    "study of a series a run is writing": lambda w, t: (
        ["study", "--checkpoints", str(_copy(w / "series", t / "busy")), "--out",
         str(t / "out"), *STUDY], ("in use", "still writing", "pid 4242", "wait")),
    "report while its folder is in use": lambda w, t: (
        ["report", str(w / "study"), "--out", str(t / "busy" / "r.html")], ("in use",)),
    # strict readers: damage names the file and the fix
    "part without weights_hash": lambda w, t: (
        _part(w, t, _drop_part_key("weights_hash")), ("step4.safetensors", "weights_hash",
                                                      "delete it")),
    "part without n_groups": lambda w, t: (
        _part(w, t, _drop_part_key("n_groups")), ("damaged study part", "delete it")),
    "part with NaN statistics": lambda w, t: (
        _part(w, t, _nan_moments), ("NaN", "delete it")),
    "part with a bad group index": lambda w, t: (
        _part(w, t, _rename_group), ("damaged study part", "delete it")),
    "truncated part": lambda w, t: (_truncated_part(w, t), ("step4.safetensors", "truncated")),
    "probe set with a token outside the vocabulary": lambda w, t: (
        _probe_set(w, t, _foreign_token), ("probe_set.safetensors", "vocabulary", "delete it")),
    "probe set without counts": lambda w, t: (
        _probe_set(w, t, lambda ts, h: ts.pop("counts")), ("damaged probe set", "delete it")),
    "damaged study_config.json, no record": lambda w, t: (
        _study_again(w, _no_record(w, t, "study_config.json")), ("study_config.json", "corrupt")),
    "damaged manifest.json, no record": lambda w, t: (
        _study_again(w, _no_record(w, t, "manifest.json")), ("manifest.json", "corrupt")),
    "damaged train state": lambda w, t: (_train_state(w, t), ("train_state", "delete it")),
    "results.csv with an unterminated quote": lambda w, t: (
        ["report", str(_unterminated_quote(w, t))], ("results.csv, line", "re-create it")),
    "results.csv without a column": lambda w, t: (
        ["report", str(_csv(t, "probe,hook,site,layer,statistic,value\n"))],
        ("lacks the columns ['head']", "re-create it")),
    "results.csv that is binary": lambda w, t: (
        ["report", str(_csv(t, b"\x00\xff\xfe"))], ("not UTF-8", "re-create")),
    "manifest.json that is not JSON": lambda w, t: (
        ["report", str(_bad_manifest(w, t))], ("manifest.json", "corrupt")),
    "manifest.json whose config is a number": lambda w, t: (
        ["report", str(_bad_manifest(w, t, '{"config": 5}'))], ("manifest.json", "'config'")),
    "study manifest.json whose steps are a number": lambda w, t: (
        ["report", str(_bad_manifest(w, t, '{"steps": 5}', "study"))],
        ("manifest.json", "'steps'")),
    "manifest.json with a window fraction that is no number": lambda w, t: (
        ["report", str(_bad_manifest(w, t, '{"config": {"window_fraction": "x"}}', "study"))],
        ("manifest.json", "window_fraction")),
    # model folders
    "truncated model weights": lambda w, t: (
        _probe(_truncated_model(t), t / "out"), ("model.safetensors", "truncated", "restore")),
    "truncated checkpoint weights": lambda w, t: (
        ["study", "--checkpoints", str(_truncated_series(w, t)), "--out", str(t / "o"), *STUDY],
        ("step4/model.safetensors", "truncated")),
    "pickle weights in a model folder": lambda w, t: (
        _probe(_pickled(_model_copy(t)), t / "out"), ("pickle", "safetensors", "save_pretrained")),
    "pickle weights in a checkpoint": lambda w, t: (
        ["study", "--checkpoints", str(_pickled_series(w, t)), "--out", str(t / "o"), *STUDY],
        ("pickle", "safe_serialization")),
    "model folder without a tokenizer": lambda w, t: (
        _probe(_no_tokenizer(t), t / "out"), ("no tokenizer files", "save_pretrained")),
    "config.json that is not JSON": lambda w, t: (
        _probe(_bad_config(t), t / "out"), ("config.json", "not valid JSON")),
    "tokenizer_config.json that is not JSON": lambda w, t: (
        _probe(_edited(t, "tokenizer_config.json", "{bad"), t / "out"),
        ("tokenizer_config.json", "not valid JSON", "restore")),
    "tokenizer_config.json that is a list": lambda w, t: (
        _probe(_edited(t, "tokenizer_config.json", "[]"), t / "out"),
        ("tokenizer_config.json", "JSON array", "restore")),
    "config.json whose settings are not a model's": lambda w, t: (
        _probe(_edited(t, "config.json", '{"model_type": "llama", "hidden_size": "x"}'),
               t / "out"), ("model", "does not load as a model", "config.json")),
    "train_config.json with a seed that is no int": lambda w, t: (
        ["study", "--checkpoints", str(_train_config(w, t, seed="x")), "--out", str(t / "o"),
         *STUDY], ("train_config.json", "corrupt", "seed")),
    "train_config.json with a corpus that is no path": lambda w, t: (
        ["study", "--checkpoints", str(_train_config(w, t, corpus=5)), "--out", str(t / "o"),
         *STUDY], ("train_config.json", "corrupt", "corpus")),
    "sharded weights with a missing shard": lambda w, t: (
        _probe(_missing_shard(t), t / "out"), ("model-00002", "missing")),
    "checkpoint whose tokenizer does not fit the model": lambda w, t: (
        ["study", "--checkpoints", str(_foreign_tokenizer(w, t)), "--out", str(t / "o"), *STUDY,
         "--corpus", _kjv_excerpt(t)], ("outside the", "vocabulary", "tokenizer")),
    "missing local model path": lambda w, t: (
        _probe(_relative_missing(t), t / "out"), ("does not exist",)),
    "missing local checkpoints path": lambda w, t: (
        ["study", "--checkpoints", str(t / "runs" / "ckpts"), "--out", str(t / "o")],
        ("does not exist", "tangentlens train")),
    "relative checkpoints path under an existing folder": lambda w, t: (
        ["study", "--checkpoints", _relative_missing(t), "--out", str(t / "o")],
        ("does not exist",)),
    "checkpoints path that is a file": lambda w, t: (
        ["study", "--checkpoints", _text(t, b"x"), "--out", str(t / "o")], ("is a file",)),
    # text input
    "Latin-1 --text": lambda w, t: (
        _probe(hf_folder("llama"), t / "o", "--text", _text(t, LATIN1)),
        ("not utf-8 text", "--encoding")),
    "binary --text": lambda w, t: (
        _probe(hf_folder("llama"), t / "o", "--text", _text(t, BINARY)), ("binary", "text file")),
    "Latin-1 --corpus for train": lambda w, t: (
        ["train", "--quick", "--out", str(t / "o"), "--corpus", _text(t, LATIN1)],
        ("byte 0xe9", "--encoding")),
    "binary --corpus for study": lambda w, t: (
        _study_again(w, t / "o", "--corpus", _text(t, BINARY)), ("binary",)),
    "unknown --encoding": lambda w, t: (
        ["train", "--quick", "--out", str(t / "o"), "--encoding", "utf-9"], ("--encoding",
                                                                              "latin-1")),
    "empty --text": lambda w, t: (
        _probe(hf_folder("llama"), t / "o", "--text", _text(t, b"\n\n")), ("empty",)),
    "missing --corpus": lambda w, t: (
        ["train", "--quick", "--out", str(t / "o"), "--corpus", str(t / "none.txt")],
        ("does not exist",)),
    # arguments, with messages that name the real cause
    "--seq-len 1": lambda w, t: (
        _probe(hf_folder("llama"), t / "o", "--seq-len", "1"), ("no next token",)),
    "probe --out ''": lambda w, t: (
        ["probe", "--model", str(hf_folder("llama")), "--out", "", *PROBE], ("--out", "empty")),
    "report ''": lambda w, t: (["report", ""], ("DIR", "empty")),
    "study into a checkpoint of its own series": lambda w, t: (
        ["study", "--checkpoints", str(_series_copy(w, t)), "--out", str(t / "series" / "step8"),
         *STUDY], ("--out", "step8", "model folder")),
    "study of copied checkpoints with a short context": lambda w, t: (
        ["study", "--checkpoints", str(_steps_only(w, t)), "--out", str(t / "o"), *STUDY],
        ("--seq-len", "positions")),
    "train --seed -1": lambda w, t: (
        ["train", "--quick", "--out", str(t / "o"), "--seed", "-1"], ("seed", "[0, ")),
    "study --seed -1": lambda w, t: (_study_again(w, t / "o", "--seed", "-1"), ("seed",)),
    "report --out a folder": lambda w, t: (
        ["report", str(w / "study"), "--out", str(t)], ("HTML file", f"{t}.html")),
    "report --out over a file that is no report": lambda w, t: (
        ["report", str(w / "study"), "--out", _text(t, b"notes")], ("never overwritten",)),
    "report of a folder without results": lambda w, t: (["report", str(t)], ("results.csv",)),
    "output below a file": lambda w, t: (
        ["train", "--quick", "--out", str(Path(_text(t, b"x")) / "o")], ("writable --out",)),
    "report --out below a file": lambda w, t: (
        ["report", str(w / "study"), "--out", str(Path(_text(t, b"x")) / "r.html")],
        ("writable --out",)),
}  # fmt: skip


def _rename_group(tensors: dict, _: dict) -> None:
    for key in [k for k in tensors if k.startswith("gradient/grad/0/")]:
        tensors["gradient/grad/99/" + key.removeprefix("gradient/grad/0/")] = tensors.pop(key)


def _truncated_part(w: Path, tmp: Path) -> list[str]:
    out = _copy(w / "study", tmp / "study")
    _truncate(out / "parts" / "step4.safetensors")
    return _study_again(w, out)


def _probe_set(w: Path, tmp: Path, change: Callable[[dict, dict], None]) -> list[str]:
    out = _copy(w / "study", tmp / "study")
    _retensor(out / "probe_set.safetensors", change)
    return _study_again(w, out)


def _no_record(w: Path, tmp: Path, damaged: str) -> Path:
    out = _copy(w / "study", tmp / "study")
    (out / RECORD_FILE).unlink()
    (out / damaged).write_text("{not json")
    return out


def _train_state(w: Path, tmp: Path) -> list[str]:
    out = _copy(w / "series", tmp / "series")
    shutil.rmtree(out / "step8")  # so the run resumes from the state
    _retensor(out / "train_state.safetensors", lambda ts, h: h.pop("step"))
    return ["train", "--quick", "--out", str(out), "-q"]


def _csv(tmp: Path, data: str | bytes) -> Path:
    (tmp / "results.csv").write_bytes(data.encode() if isinstance(data, str) else data)
    return tmp


def _bad_manifest(w: Path, tmp: Path, text: str = "{", run: str = "probe") -> Path:
    out = _copy(w / run, tmp / run)
    (out / "manifest.json").write_text(text)
    return out


def _truncated_model(tmp: Path) -> Path:
    folder = _model_copy(tmp)
    _truncate(folder / "model.safetensors", 20_000)
    return folder


def _truncated_series(w: Path, tmp: Path) -> Path:
    folder = _series_copy(w, tmp)
    _truncate(folder / "step4" / "model.safetensors", 50_000)
    return folder


def _pickled_series(w: Path, tmp: Path) -> Path:
    folder = _series_copy(w, tmp)
    _pickled(folder / "step2")
    return folder


def _no_tokenizer(tmp: Path) -> Path:
    folder = _model_copy(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    return folder


def _bad_config(tmp: Path) -> Path:
    folder = _model_copy(tmp)
    (folder / "config.json").write_text('{"model_type": "llama",')
    return folder


def _train_config(w: Path, tmp: Path, **change: object) -> Path:
    folder = _series_copy(w, tmp)
    path = folder / "train_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    return folder


def _edited(tmp: Path, name: str, text: str) -> Path:
    folder = _model_copy(tmp)
    (folder / name).write_text(text)
    return folder


def _missing_shard(tmp: Path) -> Path:
    folder = _model_copy(tmp)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    names = load_file(str(folder / "model-00001-of-00002.safetensors"))
    weight_map = {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def _foreign_tokenizer(w: Path, tmp: Path) -> Path:
    """Four copies of the tiny Llama (a word-level vocabulary of a few dozen tokens) under
    the trainer's tokenizer (320 tokens)."""
    folder = tmp / "series"
    for step in range(4):
        shutil.copytree(hf_folder("llama"), folder / f"step{step}", ignore=_tokenizer_files)
    for path in (w / "series" / "tokenizer").iterdir():
        shutil.copy(path, folder)  # the parent's tokenizer serves every checkpoint
    return folder


def _tokenizer_files(_: str, names: list[str]) -> list[str]:
    return [n for n in names if n.startswith(("tokenizer", "special_tokens"))]


def _relative_missing(tmp: Path) -> str:
    """``runs/ckpts`` beside an existing ``runs/`` (the case's working folder): a path that
    does not exist, not a hub id ``org/name``."""
    (tmp / "runs").mkdir()
    return "runs/ckpts"


def _bare_steps(w: Path, tmp: Path) -> Path:
    folder = _series_copy(w, tmp)
    (folder / "train_config.json").unlink()
    return folder


def _damaged_record(w: Path, tmp: Path) -> Path:
    out = _copy(w / "study", tmp / "study")
    (out / RECORD_FILE).write_text("{oops")
    return out


def _kjv_excerpt(tmp: Path) -> str:
    return _text(tmp, corpus.load_text(max_chars=60_000).encode())


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_hostile_cli_case(
    name: str,
    world: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TANGENTLENS_DEBUG", raising=False)
    argv, needles = CLI_CASES[name](world, tmp_path)
    if "in use" in needles:
        with _held(tmp_path / "busy" if "busy" in " ".join(argv) else world / "study"):
            line = _error(argv, capsys)
    else:
        line = _error(argv, capsys)
    for needle in needles:
        assert needle in line, f"{name}: {line!r} lacks {needle!r}"


def test_a_study_takes_the_seq_len_it_is_given(world: Path, tmp_path: Path) -> None:
    """Checkpoints copied out of their training run fit a study once --seq-len does."""
    out = tmp_path / "o"
    argv = ["study", "--checkpoints", str(_steps_only(world, tmp_path)), "--out", str(out)]
    assert main([*argv, "--seq-len", "16", *STUDY]) == 0
    assert json.loads((out / "manifest.json").read_text())["config"]["seq_len"] == 16


# ----------------------------------------------------------------------------- API cases
def _moments_state(**change: torch.Tensor) -> dict[str, torch.Tensor]:
    state = Moments().update(torch.randn(20, 4)).state_dict()
    return {**state, **change}


def _write_part(w: Path, tmp: Path, change: Callable[[dict, dict], None]) -> Path:
    path = tmp / "step4.safetensors"
    shutil.copy(w / "study" / "parts" / "step4.safetensors", path)
    _retensor(path, change)
    return path


def _bases(w: Path, tmp: Path, change: Callable[[dict, dict], None]) -> Path:
    path = tmp / "rank4.safetensors"
    shutil.copy(w / "study" / "bases" / "rank4.safetensors", path)
    _retensor(path, change)
    return path


def _skew_basis(tensors: dict, _: dict) -> None:
    key = next(k for k in tensors if k.endswith("/basis"))
    tensors[key] = tensors[key] * 2


def _study_cfg(w: Path, **overrides: object) -> StudyConfig:
    return workflows.study_config(str(w / "series"), quick=True, **{"rank": 4, **overrides})


def _blocks(high: int) -> torch.Tensor:
    blocks = torch.randint(0, 10, (4, 16))
    blocks[0, 0] = high
    return blocks


API_CASES: dict[str, tuple[Callable[[Path, Path], object], type[Exception], tuple[str, ...]]] = {
    "Moments with a NaN mean": (
        lambda w, t: Moments().load_state_dict(_moments_state(mean=torch.full((4,), float("nan")))),
        CorruptFileError, ("NaN",)),
    "Moments with an infinite scatter": (
        lambda w, t: Moments().load_state_dict(
            _moments_state(scatter=torch.full((4, 4), float("inf")))), CorruptFileError,
        ("infinite",)),
    "Moments without a mean": (
        lambda w, t: Moments().load_state_dict({"count": torch.tensor(3)}), CorruptFileError,
        ("KeyError",)),
    "Moments with a fractional count": (
        lambda w, t: Moments().load_state_dict(_moments_state(count=torch.tensor(2.5))),
        CorruptFileError, ("count",)),
    "StudyConfig rank=True": (lambda w, t: _study_cfg(w, rank=True), UsageError, ("rank",)),
    "StudyConfig rank=[2, True]": (
        lambda w, t: _study_cfg(w, rank=[2, True]), UsageError, ("rank",)),
    "StudyConfig rank='4'": (lambda w, t: _study_cfg(w, rank="4"), UsageError, ("rank",)),
    "StudyConfig seed=True": (lambda w, t: _study_cfg(w, seed=True), UsageError, ("seed",)),
    "StudyConfig window_fraction='0.3'": (
        lambda w, t: _study_cfg(w, window_fraction="0.3"), UsageError, ("a number",)),
    "StudyConfig zeta=nan": (
        lambda w, t: _study_cfg(w, zeta=float("nan")), UsageError, ("zeta",)),
    "StudyConfig encoding='klingon'": (
        lambda w, t: StudyConfig(checkpoints="x", encoding="klingon"), UsageError,
        ("encoding", "latin-1")),
    "TrainConfig seed=-1": (lambda w, t: TrainConfig.tiny(seed=-1), UsageError, ("seed", "[0, ")),
    "TrainConfig d_model=True": (
        lambda w, t: TrainConfig.tiny(d_model=True), UsageError, ("d_model",)),
    "TrainConfig lr=nan": (
        lambda w, t: TrainConfig.tiny(lr=float("nan")), UsageError, ("lr", "finite")),
    "check_int(True)": (lambda w, t: check_int(True, "n"), UsageError, ("n must be an int",)),
    "Study.run(world_size=True)": (
        lambda w, t: Study(_study_cfg(w)).run(t / "o", world_size=True), UsageError,
        ("world_size",)),
    "Study.run into a probe folder": (
        lambda w, t: Study(_study_cfg(w)).run(w / "probe"), UsageError, UNTRUSTED),
    "train() into a study folder": (
        lambda w, t: train(TrainConfig.tiny(max_steps=8), w / "study"), UsageError, UNTRUSTED),
    "train() into a folder in use": (
        lambda w, t: _in_use(t, lambda: train(TrainConfig.tiny(), t / "busy")), UsageError,
        ("in use", "pid 4242")),
    "lock_folder on a folder in use": (
        lambda w, t: _in_use(t, lambda: lock_folder(t / "busy", "probe").__enter__()),
        UsageError, ("in use",)),
    "load_lines of Latin-1": (
        lambda w, t: corpus.load_lines(_text(t, LATIN1)), UsageError, ("not utf-8", "--encoding")),
    "load_lines of a binary file": (
        lambda w, t: corpus.load_lines(_text(t, BINARY)), UsageError, ("binary",)),
    "load_lines of UTF-8 as ascii": (
        lambda w, t: corpus.load_lines(_text(t, "é".encode()), encoding="ascii"), UsageError,
        ("not ascii",)),
    "load_tensors of a truncated file": (
        lambda w, t: load_tensors(_truncated_copy(w / "study" / "probe_set.safetensors", t)),
        CorruptFileError, ("corrupt or truncated", "re-create")),
    "load_part of a tampered part": (
        lambda w, t: load_part(_write_part(w, t, _drop_part_key("step"))), CorruptFileError,
        ("damaged study part", "KeyError")),
    "load_part of a part with NaN": (
        lambda w, t: load_part(_write_part(w, t, _nan_moments)), CorruptFileError, ("NaN",)),
    "load_part of a part of another step": (
        lambda w, t: load_part(_renamed_part(w, t)), CorruptFileError, ("holds step 4",)),
    "BasisSet.load of truncated bases": (
        lambda w, t: BasisSet.load(_truncated_copy(w / "study" / "bases" / "rank4.safetensors", t)),
        CorruptFileError, ("truncated",)),
    "BasisSet.load of a basis that is not orthonormal": (
        lambda w, t: BasisSet.load(_bases(w, t, _skew_basis)), CorruptFileError,
        ("orthonormal",)),
    "results.read of an unterminated quote": (
        lambda w, t: results.read(_unterminated_quote(w, t) / "results.csv"), CorruptFileError,
        ("line", "re-create it")),
    "probe_checkpoint with ids outside the vocabulary": (
        lambda w, t: workflows.probe_checkpoint(
            models.load(str(hf_folder("llama"))).model, _blocks(10**5), rank=4, progress=False),
        UsageError, ("vocabulary", "tokenizer")),
    "probe_checkpoint with negative ids": (
        lambda w, t: workflows.probe_checkpoint(
            models.load(str(hf_folder("llama"))).model, _blocks(-1), rank=4, progress=False),
        UsageError, ("vocabulary",)),
    "probe_model rank=True": (
        lambda w, t: workflows.probe_model(str(hf_folder("llama")), t / "o", rank=True),
        UsageError, ("--rank",)),
    "probe_model layers='0'": (
        lambda w, t: workflows.probe_model(str(hf_folder("llama")), t / "o", layers="0"),
        UsageError, ("--layers",)),
    "token_blocks with seq_len 1": (
        lambda w, t: workflows.token_blocks(None, None, 64, 1), UsageError, ("no next token",)),
    "models.load of truncated weights": (
        lambda w, t: models.load(str(_truncated_model(t))), CorruptFileError, ("truncated",)),
    "models.load of pickle weights": (
        lambda w, t: models.load(str(_pickled(_model_copy(t)))), UsageError, ("pickle",)),
    "CheckpointSeries of a pickled checkpoint": (
        lambda w, t: CheckpointSeries.from_folder(_pickled_series(w, t)), UsageError,
        ("pickle",)),
    "render_report --out a folder": (
        lambda w, t: workflows.render_report(w / "study", t), UsageError, ("HTML file",)),
}  # fmt: skip


def _in_use(tmp: Path, call: Callable[[], object]) -> object:
    with _held(tmp / "busy"):
        return call()


def _truncated_copy(path: Path, tmp: Path) -> Path:
    copy = tmp / path.name
    shutil.copy(path, copy)
    _truncate(copy, copy.stat().st_size - 100)
    return copy


def _renamed_part(w: Path, tmp: Path) -> Path:
    path = tmp / "step2.safetensors"
    shutil.copy(w / "study" / "parts" / "step4.safetensors", path)
    return path


@pytest.mark.parametrize("name", list(API_CASES))
def test_hostile_api_case(name: str, world: Path, tmp_path: Path) -> None:
    call, kind, needles = API_CASES[name]
    with pytest.raises(kind) as err:
        call(world, tmp_path)
    message = str(err.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, f"{name}: {message!r} lacks {needle!r}"


def test_a_study_prints_its_claims_with_its_own_window_fraction(
    world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary the command prints, like the page it writes, reads the claims' window
    panel with the study's --window-fraction."""
    import importlib

    module = importlib.import_module("tangentlens.report.summary")
    seen: list[object] = []
    real = module.paper_claims
    monkeypatch.setattr(
        module,
        "paper_claims",
        lambda t, **kw: seen.append(kw.get("window_fraction")) or real(t, **kw),
    )
    assert main(_study_again(world, tmp_path / "o", "--window-fraction", "0.4")) == 0
    assert seen and set(seen) == {0.4}


def test_numpy_integers_are_integers_and_configs_stay_json(world: Path, tmp_path: Path) -> None:
    cfg = _study_cfg(world, rank=np.int64(3), n_controls=np.int32(40), seed=np.int64(2))
    assert cfg.rank == 3 and cfg.ranks == (3,) and type(cfg.rank) is int
    assert json.loads(json.dumps(cfg.to_dict()))["n_controls"] == 40
    assert _study_cfg(world, rank=(np.int64(4), 2)).ranks == (2, 4)
    assert TrainConfig.tiny(max_steps=np.int64(8), seed=np.int64(1)).to_dict()["max_steps"] == 8
    assert check_int(np.int16(5), "n") == 5
    assert corpus.load_lines(_text(tmp_path, LATIN1), encoding="latin-1")[0].startswith("Au")


# ----------------------------------------------------------------------------- faults
def _cli(*argv: str, limit: int | None = None) -> subprocess.Popen:
    """The CLI in its own process; ``limit``: a file-size limit in bytes (``ulimit -f``)."""

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.Popen(
        [sys.executable, "-m", "tangentlens", *argv],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=None if limit is None else limited,
    )


def _lines(proc: subprocess.Popen) -> list[str]:
    return [line for line in proc.communicate(timeout=300)[1].splitlines() if line.strip()]


def _holder_pid(folder: Path) -> int | None:
    try:
        return json.loads((folder / LOCK_FILE).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.slow
def test_inputs_changed_in_place_make_another_probe(tmp_path: Path, capsys) -> None:
    """A probe records what its model folder and its text hold, not only their paths: the
    same paths with the text edited, or the model retrained, in place are another run,
    refused where results are, and the unchanged inputs run again."""
    text, model = tmp_path / "input.txt", _model_copy(tmp_path)
    text.write_text("In the beginning God created the heaven and the earth.\n" * 60)
    args = _probe(model, tmp_path / "out", "--text", str(text))
    assert main(args) == 0 and main(args) == 0
    text.write_text(text.read_text().replace("God", "Dog"))
    assert "differs in ['text_sha256']" in _error(args, capsys)
    text.write_text(text.read_text().replace("Dog", "God"))
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # the same bytes: the same model
    assert main(args) == 0
    config = model / "config.json"
    config.write_text(config.read_text().replace("{", '{"retrained": 1, ', 1))
    assert "differs in ['model_sha256']" in _error(args, capsys)


def test_two_writers_one_folder(world: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Two studies with different settings into one --out, the second started while the
    first holds the folder: the second fails at once naming the first (held still by
    SIGSTOP, so the race has one outcome), which then finishes unmixed; the second's
    settings are refused afterwards too."""
    out = tmp_path / "shared"
    args = ("study", "--checkpoints", str(world / "series"), "--out", str(out), *STUDY)
    first = _cli(*args)
    deadline = time.monotonic() + 120
    while _holder_pid(out) != first.pid:  # on a busy machine imports take seconds
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
        time.sleep(0.01)
    first.send_signal(signal.SIGSTOP)  # held still while it holds the folder: one outcome
    try:
        second = _cli(*args, "--rank", "2")
        lines = _lines(second)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2 and len(lines) == 1, lines
    assert "in use" in lines[0] and f"pid {first.pid}" in lines[0] and "--rank 4" in lines[0]
    assert first.wait(timeout=300) == 0, first.stderr.read()
    for name in ("results.csv", "results.json"):
        assert (out / name).read_bytes() == (world / "study" / name).read_bytes()
    line = _error([*args, "--rank", "2"], capsys)
    assert "differs in ['rank']" in line and "new --out" in line


@pytest.mark.slow
def test_file_too_large_then_resume(
    world: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``ulimit -f`` below a checkpoint's size: one line, exit 2, no temporary left; rerun
    without the limit: the same weights as an uninterrupted run. Then the study: the
    same, and the same results."""
    series = tmp_path / "series"
    limited = _cli("train", "--quick", "--out", str(series), "-q", limit=60_000)
    lines = _lines(limited)
    assert limited.returncode == 2 and len(lines) == 1, lines
    assert "File too large" in lines[0] and "ulimit -f" in lines[0] and "rerun" in lines[0]
    assert not [p for p in series.rglob("*") if ".tmp" in p.name]
    assert main(["train", "--quick", "--out", str(series), "-q"]) == 0
    for step in ("step0", "step8"):
        made = json.loads((series / step / "tangentlens.json").read_text())["weights_hash"]
        assert (
            made
            == json.loads((world / "series" / step / "tangentlens.json").read_text())[
                "weights_hash"
            ]
        )
    out = tmp_path / "study"
    args = ("study", "--checkpoints", str(series), "--out", str(out), *STUDY)
    limited = _cli(*args, limit=200_000)  # a part is ~290 kB here
    lines = _lines(limited)
    assert limited.returncode == 2 and "File too large" in lines[0], lines
    assert main(list(args)) == 0
    assert (out / "results.csv").read_bytes() == (world / "study" / "results.csv").read_bytes()
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    capsys.readouterr()


def test_disk_full_then_resume(
    world: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk after two parts (safetensors reports it inside its own error type): one
    line naming it, exit 2; after space is freed the run keeps both parts and finishes."""
    real = files.save_file
    calls = []

    def full(tensors: dict, path: str, metadata: dict) -> None:
        calls.append(path)
        if len(calls) > 3:  # the probe set, two parts, then the disk is full
            raise SafetensorError("Error while serializing: No space left on device (os error 28)")
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(files, "save_file", full)
    out = tmp_path / "study"
    argv = _study_again(world, out)
    line = _error(argv, capsys)
    assert "No space left on device" in line and "free some space" in line
    kept = {p.name: p.stat().st_mtime_ns for p in (out / "parts").iterdir()}
    assert len(kept) == 2
    monkeypatch.setattr(files, "save_file", real)
    assert main(argv) == 0
    assert json.loads((out / "manifest.json").read_text())["timings"]["resumed_checkpoints"] == 2
    assert {p.name: p.stat().st_mtime_ns for p in (out / "parts").iterdir() if p.name in kept} == (
        kept
    )
    assert (out / "results.csv").read_bytes() == (world / "study" / "results.csv").read_bytes()


def _workers(parent: int) -> list[int]:
    """Pids of the multiprocessing children of ``parent``, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, NotADirectoryError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_workers_die_with_their_parent(world: Path, tmp_path: Path) -> None:
    """SIGKILL the parent of a ``--world-size 2`` study once a part exists: both workers
    die at once and write nothing more; a rerun resumes and matches one process."""
    out = tmp_path / "ws2"
    args = ("study", "--checkpoints", str(world / "series"), "--out", str(out), *STUDY)
    parent = _cli(*args, "--world-size", "2")
    deadline = time.monotonic() + 240
    while not list(out.glob("parts/step*.safetensors")):
        assert parent.poll() is None and time.monotonic() < deadline, parent.stderr.read()
        time.sleep(0.02)
    workers = _workers(parent.pid)
    assert len(workers) == 2
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    killed = time.monotonic()
    parts = sorted(p.name for p in (out / "parts").iterdir())
    while any(_running(w) for w in workers):
        assert time.monotonic() - killed < 5, "orphaned workers are still running"
        time.sleep(0.01)
    time.sleep(1.0)
    assert sorted(p.name for p in (out / "parts").iterdir()) == parts
    assert main(list(args)) == 0
    table = pd.read_csv(out / "results.csv")
    reference = pd.read_csv(world / "study" / "results.csv")
    assert np.allclose(table["value"], reference["value"], rtol=1e-6, atol=1e-9, equal_nan=True)


# ----------------------------------------------------------------------------- reuse, cleanup
@pytest.mark.slow
def test_without_its_record_a_study_rebuilds_what_it_cannot_verify(
    world: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """study_config.json and the record deleted: parts made with these settings are
    verified and reused; with other settings, the probe set and every part are made again
    (never mixed into the new results)."""
    out = _copy(world / "study", tmp_path / "study")
    for name in (RECORD_FILE, "study_config.json"):
        (out / name).unlink()
    assert main(_study_again(world, out)) == 0
    assert json.loads((out / "manifest.json").read_text())["timings"]["resumed_checkpoints"] == 5
    for name in (RECORD_FILE, "study_config.json"):
        (out / name).unlink()
    tokens = load_tensors(out / "probe_set.safetensors")[0]["tokens"]
    assert main(_study_again(world, out, "--seed", "1")) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["timings"]["resumed_checkpoints"] == 0 and manifest["config"]["seed"] == 1
    assert not torch.equal(load_tensors(out / "probe_set.safetensors")[0]["tokens"], tokens)
    fresh = tmp_path / "fresh"
    assert main(_study_again(world, fresh, "--seed", "1")) == 0
    assert (out / "results.csv").read_bytes() == (fresh / "results.csv").read_bytes()
    capsys.readouterr()


def test_permissions_follow_the_umask(world: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    for path in [world / "series", *(world / "series").rglob("*"), *(world / "study").rglob("*")]:
        if path.name == LOCK_FILE:
            continue
        mode = path.stat().st_mode & 0o777
        assert mode == (0o777 if path.is_dir() else 0o666) & ~umask, f"{path}: {oct(mode)}"


def test_stale_temporaries_are_cleared_by_the_next_run(world: Path, tmp_path: Path) -> None:
    """What killed runs left (atomic_write's ``.NAME.*.tmp``, the trainer's ``.tmp-*``
    folders) is removed by the next run of the same command, under its lock."""
    series = _copy(world / "series", tmp_path / "series")
    (series / ".tmp-step16-abc").mkdir()
    (series / ".train_state.safetensors.x1.tmp").write_bytes(b"half")
    study = _copy(world / "study", tmp_path / "study")
    (study / "parts" / ".step4.safetensors.x2.tmp").write_bytes(b"half")
    (study / ".report.html.x3.tmp").write_bytes(b"half")
    (study / "figures" / ".depth_profile.png.x4.tmp").write_bytes(b"half")
    assert main(["train", "--quick", "--out", str(series), "-q"]) == 0
    assert main(["report", str(study), "-q"]) == 0
    assert not [p for p in study.rglob("*") if ".tmp" in p.name and p.parent != study / "parts"]
    assert main(_study_again(world, study)) == 0
    for folder in (series, study):
        assert not [p for p in folder.rglob("*") if ".tmp" in p.name]


def test_report_out_is_a_file_and_its_own_report_is_rewritten(
    world: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    target = tmp_path / "pages" / "x.txt"
    assert main(["report", str(world / "study"), "--out", str(target)]) == 0
    assert target.is_file() and (tmp_path / "pages" / "x_files").is_dir()
    assert main(["report", str(world / "study"), "--out", str(target)]) == 0  # its own: rewritten
    assert "report:" in capsys.readouterr().out


def test_tensor_hash_is_sha256_of_names_dtypes_shapes_and_bytes() -> None:
    gen = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(5, 3, generator=gen).T,  # not contiguous
        "b": torch.randn(4, generator=gen).to(torch.bfloat16),
        "empty": torch.zeros(0, 2),
        "step": torch.tensor(7),
    }
    reference = hashlib.sha256()
    for name in sorted(state):
        t = state[name].contiguous()
        reference.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        reference.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    assert digests.tensor_hash(state) == reference.hexdigest()
    assert digests.tensor_hash(dict(reversed(state.items()))) == reference.hexdigest()
    state["w"][0, 0] += 1
    assert digests.tensor_hash(state) != reference.hexdigest()
