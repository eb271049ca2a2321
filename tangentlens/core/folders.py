"""One writer per output folder: an exclusive lock on the folder itself, held for a whole
command (`lock_folder`), the folder's record of the command and configuration that write
it (`FolderLock.claim`), and who holds a folder now (`writer_of`), for a reader that must
not read a run still writing."""

from __future__ import annotations

import json
import os
import shlex
import stat
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import lock_descriptor

from ..version import __version__
from .digests import config_digest
from .errors import CorruptFileError, UsageError
from .files import LOCK_FILE, RECORD_FILE, is_model_folder, read_json, write_json

__all__ = ["TRAIN_COMMANDS", "FolderLock", "lock_folder", "writer_of"]

TRAIN_COMMANDS = ("train", "train --seeds")  # the records of a training run's folder


@dataclass
class _Held:
    fd: int
    claimed_by: str | None = None  # the outermost command of this process that claimed it


_HELD: dict[str, _Held] = {}


@dataclass
class FolderLock:
    """This process's exclusive hold on an output folder (see `lock_folder`)."""

    folder: Path
    command: str
    _key: str = field(repr=False)

    def claim(
        self,
        config: Mapping[str, Any],
        outputs: Sequence[str],
        *,
        results: Sequence[str] = (),
        adopt: Callable[[], bool] | None = None,
    ) -> None:
        """Check, then record, that this command with this configuration writes the folder.

        ``outputs``: glob patterns of what the command writes; ``results``: those whose
        presence means work is done. The folder's record (`RECORD_FILE`) must name this
        command and configuration; a record of another configuration is replaced only
        while none of ``results`` exists (a run that failed before computing anything).
        A folder without a record may hold none of ``outputs`` unless ``adopt()`` accepts
        them (a folder this command wrote without a record; it may raise its own
        `UsageError`). A command run inside another one of this process that already
        claimed the folder (the demo's steps) adds itself to that record.
        """
        held = _HELD[self._key]
        path = self.folder / RECORD_FILE
        mine = {"command": self.command, "digest": config_digest(config), "config": config}
        record = _read_record(path)
        writers = record["writers"] if record else []
        if any(w["command"] == mine["command"] and w["digest"] == mine["digest"] for w in writers):
            held.claimed_by = held.claimed_by or self.command
            return
        if held.claimed_by not in (None, self.command):
            _write_record(path, [*writers, json.loads(json.dumps(mine, default=str))])
            return
        if writers:
            same = [w for w in writers if w["command"] == self.command]
            if not same:
                raise UsageError(
                    f"{self.folder} holds the output of `tangentlens {writers[0]['command']}`; "
                    f"`tangentlens {self.command}` never writes over another command's "
                    "results: choose a new --out."
                )
            done = _present(self.folder, results)
            if done:
                diff = _differences(same[0].get("config", {}), mine["config"])
                raise UsageError(
                    f"{self.folder} holds a `tangentlens {self.command}` run with another "
                    f"configuration (differs in {diff}); rerun with the same options to "
                    "resume, or choose a new --out."
                )
        else:
            found = _present(self.folder, outputs)
            if found and not (adopt is not None and adopt()):
                raise UsageError(
                    f"{self.folder} already holds {', '.join(found[:4])} not made by "
                    f"`tangentlens {self.command}` (no {RECORD_FILE}); it never overwrites "
                    "results it did not make: choose a new --out."
                )
        _write_record(path, [json.loads(json.dumps(mine, default=str))])
        held.claimed_by = self.command


def _read_record(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    record = read_json(path, dict, fix="restore this damaged folder record, or choose a new --out")
    try:
        if not all(isinstance(w["command"], str) and w["digest"] for w in record["writers"]):
            raise ValueError("a writer without command or digest")
    except (ValueError, TypeError, KeyError) as err:
        raise CorruptFileError(
            f"{path} is damaged ({err}); restore it, or choose a new --out."
        ) from err
    return record


def _write_record(path: Path, writers: list[dict[str, Any]]) -> None:
    write_json(path, {"tangentlens_version": __version__, "writers": writers})


def _present(folder: Path, patterns: Sequence[str]) -> list[str]:
    found = {str(p.relative_to(folder)) for pattern in patterns for p in folder.glob(pattern)}
    return sorted(found)


def _differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    b = json.loads(json.dumps(b, default=str))
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _holder(folder: Path) -> str:
    """Who holds a folder, from the record its holder wrote into the lock file (opened
    without following a link and without blocking, so a planted link or FIFO tells
    nothing and stops nothing)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(folder / LOCK_FILE, flags)
        try:
            info = json.loads(os.read(fd, 4096) or b"{}")
        finally:
            os.close(fd)
        return f"pid {int(info['pid'])}: `{info['argv']}`"
    except (OSError, ValueError, TypeError, KeyError):
        return "a process that has not said who it is yet"


def _open_folder(folder: Path) -> int:
    """A descriptor of the folder itself, which is what the lock is taken on."""
    if os.name == "nt":  # pragma: no cover - no descriptor of a folder there
        raise UsageError(
            f"cannot lock {folder}: output folders are locked with POSIX directory locks, "
            "which this system lacks; run tangentlens on Linux or macOS (or in WSL)."
        )
    return os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def _say_who(folder: Path, me: Mapping[str, Any]) -> None:
    """Record the holder in the lock file: refuse anything there but a plain file (a
    planted link is named, and what it points to is never opened), then replace the
    name atomically, so even a hard link to another file leaves that file as it was."""
    path = folder / LOCK_FILE
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a plain file"
        raise UsageError(
            f"{path} is {kind}, not tangentlens's lock file (nothing it points to was "
            "touched); delete it and rerun, or choose another --out."
        )
    write_json(path, me)


def writer_of(folder: str | Path) -> str | None:
    """Who holds ``folder`` as its writer now (the holder's record), or None when no run
    of another process does: a reader of a run's output (a study of a series still
    training) refuses it rather than read half of it. The check takes the lock for an
    instant and drops it with the descriptor."""
    folder = Path(folder).expanduser()
    if not folder.is_dir() or os.path.realpath(folder) in _HELD:  # this process's own
        return None
    try:
        fd = _open_folder(folder)
    except OSError:
        return None
    try:
        return None if lock_descriptor(fd, blocking=False) else _holder(folder)
    except OSError:  # a file system without locks: no writer can hold it either
        return None
    finally:
        os.close(fd)


def _check_nesting(folder: Path, real: Path) -> None:
    """Refuse, before anything is made, an output folder that is a model folder or lies in
    one, or inside a `tangentlens train` run no command of this process holds: their files
    are read by content (a model's digest, a run's tokenizer and checkpoints), and a folder
    written there, even its lock file, would change them."""
    try:
        _refuse_nesting(folder, real)
    except OSError:  # a name too long, a file as a parent: making the folder names --out
        return


def _refuse_nesting(folder: Path, real: Path) -> None:
    if is_model_folder(real):
        raise UsageError(f"{folder} is a model folder, never written into: choose another --out")
    for parent in real.parents:
        if str(parent) in _HELD:  # a folder this process writes: its own layout below
            return
        if is_model_folder(parent):
            raise UsageError(
                f"{folder} is inside the model folder {parent}, which is read by its content: "
                "choose an --out outside it"
            )
        try:
            record = _read_record(parent / RECORD_FILE)
        except (CorruptFileError, UsageError):  # that folder's own commands name it
            continue
        commands = {w["command"] for w in record["writers"]} if record else set()
        if commands and commands <= set(TRAIN_COMMANDS):
            raise UsageError(
                f"{folder} is inside {parent}, a `tangentlens train` run whose files are "
                "checked by content: choose an --out outside it"
            )


@contextmanager
def lock_folder(folder: str | Path, command: str) -> Iterator[FolderLock]:
    """Hold ``folder`` for ``command`` as its one writer until the block ends.

    The lock is an exclusive ``flock`` (`filelock.lock_descriptor`) on a descriptor of
    the folder itself, not on a file in it: deleting or replacing ``.tangentlens.lock``
    while a run holds the folder cannot let a second writer in, a symbolic link planted
    under that name is never followed, and the kernel drops the lock when the process
    ends, however it ends (a killed run leaves nothing stale). The holder then writes
    its pid and command line into ``.tangentlens.lock`` (a plain record, replaced
    atomically), which a second writer's refusal names; a second writer fails at once
    with a `UsageError`. Holding it again in the same process nests (the demo's steps).
    """
    folder = Path(folder).expanduser()
    key = os.path.realpath(folder)
    held = _HELD.get(key)
    if held is None:
        _check_nesting(folder, Path(key))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = held.fd if held else _open_folder(folder)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise UsageError(f"cannot write to {folder} ({reason}); choose a writable --out.") from err
    if held is not None:  # an outer command of this process holds it: one writer still
        yield FolderLock(folder, command, key)
        return
    try:
        locked = lock_descriptor(fd, blocking=False)
    except OSError as err:
        os.close(fd)
        raise UsageError(
            f"cannot lock {folder} ({err.strerror or err}): its file system has no locks; "
            "choose an --out on a local disk."
        ) from None
    if not locked:
        holder = _holder(folder)
        os.close(fd)
        raise UsageError(
            f"{folder} is in use by another tangentlens run ({holder}); wait for it to "
            "finish, or choose another --out."
        )
    _HELD[key] = _Held(fd)
    try:
        _say_who(folder, {"pid": os.getpid(), "command": command, "argv": shlex.join(sys.argv)})
        yield FolderLock(folder, command, key)
    finally:
        del _HELD[key]
        os.close(fd)  # releases the lock
