"""What a resumed training run checks, and what starting over deletes.

A run's folder (`tangentlens.data.train.train`) resumes only the run it holds. Its
configuration is its ``train_config.json``; the corpus text and the tokenizer are recorded
by content (SHA-256, `inputs_digest`) in the training state and in every checkpoint's
``tangentlens.json``, because both are read by name: a corpus file edited between a kill
and the rerun, or a tokenizer folder changed by hand, would otherwise be resumed without a
word, and the final weights would match neither text. A changed input is a `UsageError`
naming it and the three fixes: restore it, start over (``--restart``), or another folder.

`start_over` deletes what the trainer made (checkpoints, state, tokenizer, records) and
nothing else, and only in a folder that no other command wrote.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..core.digests import content_sha256, source_digest
from ..core.errors import CorruptFileError, ResumeRefusedError, UsageError
from ..core.files import (
    RECORD_FILE,
    check_safetensors,
    load_tensors,
    read_checked_json,
    read_json,
)
from ..core.folders import TRAIN_COMMANDS, lock_folder
from .checkpoints import METADATA_FILE, CheckpointSeries
from .corpus import text_sha256

__all__ = [
    "CONFIG_FILE",
    "INPUT_KEYS",
    "SOURCE_KEY",
    "STATE_FILE",
    "TOKENIZER_DIR",
    "check_finished",
    "check_inputs",
    "check_recorded",
    "check_source",
    "inputs_digest",
    "is_started",
    "load_resumed",
    "missing_steps",
    "resumable",
    "start_over",
    "trained_to",
]

CONFIG_FILE = "train_config.json"
STATE_FILE = "train_state.safetensors"
TOKENIZER_DIR = "tokenizer"
INPUT_KEYS = ("corpus_sha256", "tokenizer_sha256")
SOURCE_KEY = "source_sha256"  # the training state's record of the code that wrote it
_STEP = re.compile(r"step\d+")
_SEED = re.compile(r"seed\d+")
RESTART = (  # the fixes every refusal of a resume names
    "rerun with --restart (train(..., restart=True)) to delete its checkpoints and train "
    "again from step 0, or choose a new --out"
)


def inputs_digest(lines: list[str], tokenizer_dir: Path) -> dict[str, str]:
    """SHA-256 of the corpus text a run trains on (its lines, after ``max_chars``) and of
    the tokenizer folder's files (names and bytes: they are written once and never
    rewritten, so the digest does not move with a library's serialisation)."""
    return {"corpus_sha256": text_sha256(lines), "tokenizer_sha256": content_sha256(tokenizer_dir)}


def _steps(out: Path) -> list[Path]:
    return sorted(p for p in out.glob("step*") if p.is_dir() and _STEP.fullmatch(p.name))


def is_started(out: Path) -> bool:
    """Whether ``out`` holds a checkpoint or a training state (anything a resume keeps)."""
    return (out / STATE_FILE).exists() or bool(_steps(out))


def missing_steps(out: Path, steps: list[int], upto: int | None = None) -> list[int]:
    """The scheduled ``steps`` (up to ``upto``) with no checkpoint folder in ``out``. Such a
    step is trained again from step 0, which checks every folder kept on the way against
    the weights it reaches there: the training state resumes only from the last step, so
    a deleted earlier folder cannot be rebuilt from it."""
    return [s for s in steps if (upto is None or s <= upto) and not (out / f"step{s}").is_dir()]


def trained_to(out: Path) -> int | None:
    """The step a run's training state resumes from (the last checkpoint it wrote), or
    None without a readable one. Read from the file's header alone: a study asks this of
    every series it opens and needs none of the optimizer's tensors; a damaged state is
    the resume's to name (it loads and checks the whole file)."""
    if not (out / STATE_FILE).is_file():
        return None
    try:
        return int(check_safetensors(out / STATE_FILE)["__metadata__"]["step"])
    except (CorruptFileError, KeyError, TypeError, ValueError):
        return None


def resumable(out: Path, steps: list[int]) -> bool:
    """Whether the training state resumes ``out``: it exists, and no scheduled checkpoint
    up to its step is missing (else training starts again from step 0). A state without a
    step is resumable here, so that the resume names the file and the fix."""
    if not (out / STATE_FILE).exists():
        return False
    step = trained_to(out)
    return step is None or not missing_steps(out, steps, step)


def check_source(state: Path, meta: Mapping[str, str]) -> None:
    """Refuse to resume a training state that another tangentlens source wrote
    (`source_digest`: an upgrade or an edit since the run started): its remaining steps
    would be trained by other code than its first ones, and its checkpoints mix the two."""
    recorded = meta.get(SOURCE_KEY)
    if recorded is not None and recorded != source_digest():
        raise ResumeRefusedError(
            f"{state} was written by another tangentlens source than this one (upgraded or "
            "edited since the run started), so its remaining steps would be trained by "
            f"other code: run the tangentlens that started it, or {RESTART}."
        )


def load_resumed(folder: Path, model: Any) -> None:
    """Load the checkpoint a training state resumes from into ``model`` (its weights are
    checked against their record when the resumed run reaches that step again, before any
    update: `tangentlens.data.train`'s checkpoint writer)."""
    weights, _ = load_tensors(folder / "model.safetensors")
    result = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())  # not saved
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise UsageError(
            f"{folder} does not match this config's model; "
            "delete the output folder or pass the config it was trained with."
        )


def check_recorded(out: Path) -> None:
    """Refuse a training run with a checkpoint folder that lacks its record
    (`METADATA_FILE`): every one the trainer writes has it, and without it nothing checks
    the weights, so such a folder is rebuilt, never read."""
    bare = [folder for folder in _steps(out) if not (folder / METADATA_FILE).is_file()]
    if bare:
        raise CorruptFileError(
            f"{bare[0]} has no {METADATA_FILE}, the record of its weights' digest: delete that "
            "checkpoint folder and rerun train (`tangentlens train`) with the same options, "
            "which rebuilds it"
        )


def check_inputs(out: Path, inputs: Mapping[str, str], corpus: str | None) -> None:
    """Refuse to resume ``out`` with a corpus or tokenizer other than the one its training
    state and checkpoints record (a record without these keys tells nothing). ``corpus``:
    the configured corpus, named in the message."""
    records: list[tuple[Path, Mapping[str, Any]]] = []
    if (out / STATE_FILE).is_file():
        records.append(
            (out / STATE_FILE, check_safetensors(out / STATE_FILE).get("__metadata__", {}))
        )
    for folder in _steps(out):
        if (folder / METADATA_FILE).is_file():
            meta = read_checked_json(folder / METADATA_FILE, fix="delete that checkpoint and rerun")
            records.append((folder, meta))
    for where, record in records:
        if record.get("corpus_sha256", inputs["corpus_sha256"]) != inputs["corpus_sha256"]:
            name = "the embedded KJV corpus" if corpus in (None, "kjv") else f"the corpus {corpus}"
            raise ResumeRefusedError(
                f"{name} is not the text {where} was trained on (its SHA-256 differs): restore "
                f"it, {RESTART}."
            )
        if record.get("tokenizer_sha256", inputs["tokenizer_sha256"]) != inputs["tokenizer_sha256"]:
            raise ResumeRefusedError(
                f"{out / TOKENIZER_DIR} is not the tokenizer {where} was trained with (its "
                f"SHA-256 differs): restore it, {RESTART}."
            )


def check_finished(out: Path, inputs: Mapping[str, str], corpus: str | None) -> None:
    """Refuse a finished run trained on other inputs (`check_inputs`) or whose checkpoints
    are not whole as a study opening them would find them (a folder without its config or
    weights, a truncated weights file, a damaged record): a rerun of `train` names the
    damage where a study would meet it later."""
    check_inputs(out, inputs, corpus)
    check_recorded(out)
    try:
        CheckpointSeries.from_folder(out)
    except (UsageError, CorruptFileError) as err:
        raise type(err)(
            f"{err} In a training run the simplest fix is to delete that checkpoint folder "
            "and rerun train with the same options, which rebuilds it."
        ) from err


def start_over(out: str | Path) -> None:
    """Delete a `tangentlens train` run's checkpoints, state, tokenizer and config in
    ``out`` (in each ``seed{S}/`` run too, for a `train --seeds` folder), so the next run
    starts from step 0, with these options or others. A folder that another command wrote
    is refused with a `UsageError` and left as it is; files the trainer does not make are
    never deleted."""
    out = Path(out).expanduser()
    if not out.is_dir():
        return
    with lock_folder(out, "train"):  # nests inside the caller's hold of the same folder
        if not _is_train_folder(out):
            return
        for seed in sorted(p for p in out.iterdir() if p.is_dir() and _SEED.fullmatch(p.name)):
            with lock_folder(seed, "train"):
                if _is_train_folder(seed):
                    _forget(seed)
        _forget(out)


def _is_train_folder(folder: Path) -> bool:
    """Whether ``folder`` is the trainer's: its record names only training commands (or,
    without a record, it has the trainer's config file); a record naming any other command
    is a `UsageError`."""
    record = folder / RECORD_FILE
    if not record.is_file():
        return (folder / CONFIG_FILE).is_file()
    writers = read_json(record, dict, fix="restore it, or choose a new --out").get("writers")
    if not isinstance(writers, list) or not all(
        isinstance(w, dict) and isinstance(w.get("command"), str) for w in writers
    ):
        raise CorruptFileError(
            f"{record} is damaged (no list of writers, each naming its command); restore it, "
            "or choose a new --out."
        )
    others = sorted({w["command"] for w in writers} - set(TRAIN_COMMANDS))
    if others:
        raise UsageError(
            f"{folder} holds the output of `tangentlens {others[0]}`; --restart deletes only "
            "what `tangentlens train` made: choose a new --out."
        )
    return True


def _forget(folder: Path) -> None:
    for path in (*_steps(folder), folder / TOKENIZER_DIR):
        if path.is_dir():
            shutil.rmtree(path)
    # the folder record stays: it says the folder is the trainer's, and a claim with
    # other options replaces it once no checkpoint is left
    for name in (STATE_FILE, CONFIG_FILE):
        (folder / name).unlink(missing_ok=True)
