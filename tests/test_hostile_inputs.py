"""Hostile input, part three: a training resume on a changed corpus, tokenizer or
configuration (and ``--restart``), token ids fed to a `probe` session on both backends,
hooks cleared under a live nnsight session, a killed or starved data-parallel worker, and
memory running out. Each case asserts the exception type or exit code, that the message
names the file or argument, and that nothing was lost or overwritten."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from models import hf_folder, hf_model, tl_bridge, tokens
from test_hostile import _snapshot
from test_reliability import _error, _probe

from tangentlens.cli import main, workflows
from tangentlens.core import results
from tangentlens.core.errors import CorruptFileError, UsageError
from tangentlens.core.files import RECORD_FILE
from tangentlens.core.folders import lock_folder
from tangentlens.data import corpus, resume
from tangentlens.data import train as train_module
from tangentlens.data.train import TrainConfig, train
from tangentlens.hooks.families import unwrap
from tangentlens.probes import fit_bases, probe
from tangentlens.probes.distributed import launch

KILLED_AT = 2  # the last checkpoint a killed run finished (of 0, 1, 2, 4, 8)


# ----------------------------------------------------------------------------- helpers
def _hashes(out: Path) -> dict[str, str]:
    return {
        p.name: json.loads((p / "tangentlens.json").read_text())["weights_hash"]
        for p in sorted(out.glob("step*"))
    }


def _argv(out: Path, text: Path, *extra: str) -> list[str]:
    return ["train", "--quick", "--corpus", str(text), "--out", str(out), "-q", *extra]


def _edit(text: Path) -> None:
    """Change a few words near the start, where the quick run's ``max_chars`` reads."""
    data = text.read_text()
    text.write_text(data.replace("God", "Dog", 5))


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``train --quick --corpus F`` stopped right after checkpoint ``KILLED_AT`` (its
    state saved, later steps not begun), with ``F`` beside it; each test copies it."""
    root = tmp_path_factory.mktemp("killed")
    text = root / "corpus.txt"
    text.write_text(corpus.load_text(max_chars=60_000))
    real = train_module._checkpoint

    def stop_after(out: Path, step: int, *args: Any) -> None:
        real(out, step, *args)
        if step == KILLED_AT:
            raise KeyboardInterrupt  # as a kill between two checkpoints

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_module, "_checkpoint", stop_after)
        assert main(_argv(root / "run", text)) == 130
    assert (root / "run" / f"step{KILLED_AT}").is_dir() and not (root / "run" / "step4").exists()
    return root


@pytest.fixture
def copy(killed: Path, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A copy of the killed run and its corpus file (the one the run records, restored
    afterwards): ``(out, corpus file)``."""
    text = killed / "corpus.txt"
    original = text.read_bytes()
    shutil.copytree(killed / "run", tmp_path / "run")
    try:
        yield tmp_path / "run", text
    finally:
        text.write_bytes(original)


# ------------------------------------------------------- 1. a resume checks its inputs
def test_a_resume_refuses_an_edited_corpus_and_restart_trains_it_anew(
    copy: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out, text = copy
    _edit(text)
    before = _snapshot(out)
    line = _error(_argv(out, text), capsys)
    assert str(text) in line and "--restart" in line and "new --out" in line, line
    assert _snapshot(out) == before  # refused: nothing resumed, rewritten or deleted
    (out / "notes.txt").write_text("mine\n")
    assert main(_argv(out, text, "--restart")) == 0
    assert main(_argv(tmp_path / "fresh", text)) == 0
    assert _hashes(out) == _hashes(tmp_path / "fresh")  # the new text's run, whole
    assert (out / "notes.txt").read_text() == "mine\n"  # not the trainer's: kept


def test_a_resume_refuses_a_changed_tokenizer(
    copy: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    out, text = copy
    path = out / resume.TOKENIZER_DIR / "tokenizer.json"
    path.write_text(path.read_text() + "\n")  # still a valid tokenizer, other bytes
    before = _snapshot(out)
    line = _error(_argv(out, text), capsys)
    assert str(out / resume.TOKENIZER_DIR) in line and "--restart" in line, line
    assert _snapshot(out) == before


def test_a_resume_with_other_options_names_restart(
    copy: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    out, text = copy
    before = _snapshot(out)
    line = _error(_argv(out, text, "--seed", "3"), capsys)
    assert "'seed'" in line and "--restart" in line and "new --out" in line, line
    assert _snapshot(out) == before


def test_without_its_state_the_checkpoints_still_name_the_corpus(
    copy: tuple[Path, Path],
) -> None:
    """Killed between a checkpoint's rename and the state's write: the checkpoints'
    records refuse the edited text (not the weights check, whose fix would not apply)."""
    out, text = copy
    meta = json.loads((out / "step1" / "tangentlens.json").read_text())
    assert set(resume.INPUT_KEYS) <= set(meta)
    (out / resume.STATE_FILE).unlink()
    _edit(text)
    with pytest.raises(UsageError) as err:
        train(workflows.train_config(quick=True, corpus=str(text)), out, progress=False)
    assert str(text) in str(err.value) and "--restart" in str(err.value)


def test_a_finished_run_refuses_an_edited_corpus(
    copy: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    out, text = copy
    assert main(_argv(out, text)) == 0  # resumed to the end on the same text
    _edit(text)
    before = _snapshot(out)
    line = _error(_argv(out, text), capsys)
    assert str(text) in line and "--restart" in line, line
    assert _snapshot(out) == before


def test_a_tokenizer_of_the_old_text_without_checkpoints_is_made_again(
    copy: tuple[Path, Path], tmp_path: Path
) -> None:
    """Killed after the tokenizer, before any checkpoint: nothing records its text, so the
    rerun on the edited text trains it again and ends as a fresh run of that text."""
    out, text = copy
    for step in out.glob("step*"):
        shutil.rmtree(step)
    (out / resume.STATE_FILE).unlink()
    _edit(text)
    assert main(_argv(out, text)) == 0
    assert main(_argv(tmp_path / "fresh", text)) == 0
    assert _hashes(out) == _hashes(tmp_path / "fresh")


def test_restart_refuses_a_folder_of_another_command(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "study"
    with lock_folder(out, "study") as lock:
        lock.claim({"rank": 4}, ("results.csv",), results=("results.csv",))
    (out / "results.csv").write_text("their numbers\n")
    before = _snapshot(out)
    line = _error(["train", "--quick", "--out", str(out), "--restart"], capsys)
    assert str(out) in line and "tangentlens study" in line and "new --out" in line, line
    assert _snapshot(out) == before


def test_restart_clears_every_seed_of_a_seeds_folder(tmp_path: Path) -> None:
    config = TrainConfig.tiny(max_steps=2, last_log_step=1, checkpoint_every=1, warmup_steps=1)
    out = tmp_path / "seeds"
    workflows.train_seeds(config, out, seeds=(0, 1), progress=False)
    (out / "seed1" / "notes.txt").write_text("mine\n")
    resume.start_over(out)
    assert not list(out.glob("seed*/step*")) and not list(out.glob("seed*/tokenizer"))
    assert not list(out.glob("seed*/train_*")) and (out / "seed0" / RECORD_FILE).is_file()
    assert (out / "seed1" / "notes.txt").read_text() == "mine\n"
    other = dataclasses.replace(config, lr=1e-3)
    assert set(workflows.train_seeds(other, out, seeds=(0, 1), progress=False)) == {0, 1}


@pytest.mark.parametrize("text", ["[1, 2]", '"step"', "{oops"])
def test_a_checkpoint_record_of_the_wrong_type_is_one_line(
    text: str, copy: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``step1/tangentlens.json`` damaged: a resume and a study of the folder both name it."""
    out, corpus_file = copy
    meta = out / "step1" / "tangentlens.json"
    meta.write_text(text)
    before = _snapshot(out)
    line = _error(_argv(out, corpus_file), capsys)
    assert str(meta) in line and "delete" in line, line
    study = ["study", "--checkpoints", str(out), "--out", str(tmp_path / "s"), "--quick", "-q"]
    line = _error(study, capsys)
    assert str(meta) in line, line
    assert _snapshot(out) == before


@pytest.mark.parametrize("record", ['{"writers": "train"}', '{"writers": [1]}', "[]"])
def test_a_folder_record_of_the_wrong_type_is_one_line_and_restart_deletes_nothing(
    record: str, copy: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    out, corpus_file = copy
    (out / RECORD_FILE).write_text(record)
    before = _snapshot(out)
    for extra in ((), ("--restart",)):
        line = _error(_argv(out, corpus_file, *extra), capsys)
        assert str(out / RECORD_FILE) in line and "new --out" in line, line
        assert _snapshot(out) == before


# ------------------------------------------------- 2. token ids fed to a probe session
@pytest.fixture(scope="module")
def llama() -> dict[str, Any]:
    import nnsight

    ids = tokens("llama")
    bridge = tl_bridge("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nn_model = nnsight.NNsight(hf_model("llama"))
        bases = fit_bases(bridge, [ids, ids], rank=2, progress=False)
    return {"transformer_lens": bridge, "nnsight": nn_model, "ids": ids, "bases": bases}


BAD_IDS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "ids past the vocabulary": lambda t: t + 10**5,
    "negative ids": lambda t: t - 100,
    "bool ids": lambda t: t > 10,
    "a (0, n) batch": lambda t: t[:0],
    "longer than the context": lambda t: torch.full((1, 100_000), 5, dtype=torch.long),
}


@pytest.mark.parametrize("backend", ["transformer_lens", "nnsight"])
@pytest.mark.parametrize("name", list(BAD_IDS))
def test_a_probe_session_refuses_bad_ids(name: str, backend: str, llama: dict[str, Any]) -> None:
    model = llama[backend]
    with pytest.raises(UsageError) as err, probe(model, llama["bases"], ("residual",)):
        model(BAD_IDS[name](llama["ids"]))
    assert "input_ids" in str(err.value) and "\n" not in str(err.value), str(err.value)
    with probe(model, llama["bases"], ("residual",)) as session:  # the hooks went with it
        model(llama["ids"])
    assert len(session.results()) > 0


def test_an_nnsight_mask_passed_by_position_is_checked(llama: dict[str, Any]) -> None:
    ids = llama["ids"]
    mask = torch.ones_like(ids)
    mask[0, -1] = 2
    model = llama["nnsight"]
    with pytest.raises(UsageError, match="attention_mask"), probe(model, llama["bases"]):
        model(ids, mask)


def test_torch_hooks_cleared_under_an_nnsight_session_are_named(llama: dict[str, Any]) -> None:
    model, ids = llama["nnsight"], llama["ids"]
    with probe(model, llama["bases"], ("residual",)) as session:
        model(ids)
        for module in unwrap(model).modules():
            module._forward_hooks.clear()
            module._forward_pre_hooks.clear()
        model(ids)  # not seen: the session must say so rather than count one pass
    with pytest.raises(UsageError, match="hooks were removed"):
        session.results()


# ------------------------------------------------------------ 3. workers and memory
def _killed_rank(rank: int, world_size: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


@pytest.mark.slow
def test_a_worker_killed_by_a_signal_is_named_with_the_fix() -> None:
    with pytest.raises(UsageError) as err:
        launch(_killed_rank, 2)
    message = str(err.value)
    assert "SIGKILL" in message and "--world-size" in message, message
    assert "__main__" not in message  # the advice for a script without a main guard


@pytest.fixture
def few_files(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An open-file limit of 20 as ``resource`` reports it (the process keeps its own)."""
    import resource

    real = resource.getrlimit

    def limit(kind: int) -> tuple[int, int]:
        return (20, 4096) if kind == resource.RLIMIT_NOFILE else real(kind)

    monkeypatch.setattr(resource, "getrlimit", limit)
    yield


def test_too_few_open_files_for_the_workers_is_one_line(
    few_files: None, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(UsageError, match=r"ulimit -n .*--world-size"):
        launch(_killed_rank, 2)
    line = _error(_probe(hf_folder("llama"), tmp_path / "o", "--world-size", "2"), capsys)
    assert "ulimit -n" in line and "--world-size" in line, line
    assert not (tmp_path / "o" / "results.csv").exists()


def test_memory_running_out_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def out_of_memory(**_: Any) -> None:
        raise MemoryError

    monkeypatch.setattr(workflows, "train_config", out_of_memory)
    line = _error(["train", "--quick", "--out", str(tmp_path / "o")], capsys)
    assert "out of memory" in line and "--corpus" in line and "rerun" in line, line


def test_a_large_corpus_is_tokenised_a_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """What keeps a corpus of hundreds of MB within memory: the tokenizer never sees more
    than a chunk of lines at once, and the ids do not depend on the chunk."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_folder("llama"))
    lines = corpus.load_lines(max_chars=20_000)
    whole = corpus.encode(tokenizer, lines)
    seen: list[int] = []

    def spy(texts: list[str], **kwargs: Any) -> Any:
        seen.append(len(texts))
        return tokenizer(texts, **kwargs)

    monkeypatch.setattr(corpus, "_ENCODE_CHUNK", 7)
    assert torch.equal(corpus.encode(spy, lines), whole)
    assert max(seen) == 7 and sum(seen) == len(lines)


# ----------------------------------------------------------------- 4. results tables
def test_every_cut_of_a_results_table_is_refused(tmp_path: Path) -> None:
    """A table cut anywhere (a row boundary, inside a number, inside the header) is
    refused with the file's name, never read as a shorter or rounded table."""
    rows = [
        {"probe": "residual", "hook": f"blocks.{i % 4}.hook_resid_pre", "site": "resid_pre",
         "layer": i % 4, "statistic": "tangent_share", "value": 5.346757000898135 + i}
        for i in range(60)
    ]  # fmt: skip
    results.write(results.frame(rows), tmp_path)
    path = tmp_path / "results.csv"
    whole = path.read_bytes()
    cuts = torch.randperm(len(whole) - 1, generator=torch.Generator().manual_seed(0))[:120]
    for cut in sorted(int(c) + 1 for c in cuts):
        path.write_bytes(whole[:cut])
        with pytest.raises((CorruptFileError, UsageError)) as err:
            results.read(tmp_path)
        assert str(path) in str(err.value), (cut, str(err.value))
    path.write_bytes(whole)
    assert len(results.read(tmp_path)) == len(rows)
