"""Atomic file writes (files and whole folders), safetensors round trips (no pickle
anywhere), the strict JSON reader, content hashes, and the one-writer rule for output
folders (`lock_folder`: an exclusive lock plus a record of which command and configuration
made the folder).

Importing this module changes nothing in the process (no umask is set, no platform-only
module is needed): the umask is read where a permission is computed, and the lock comes
from `filelock`, which picks the platform's primitive itself."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from .digests import config_digest, tensor_hash
from .errors import CorruptFileError, MissingFileError, UsageError

__all__ = [
    "CONTENT_KEY",
    "LOCK_FILE",
    "METADATA_KEY",
    "RECORD_FILE",
    "WEIGHT_FILES",
    "atomic_folder",
    "atomic_write",
    "check_safetensors",
    "dataclass_from_dict",
    "environment_error",
    "is_model_folder",
    "load_tensors",
    "make_readable",
    "metadata_hash",
    "read_checked_json",
    "read_json",
    "remove_stale_temporaries",
    "retire",
    "save_tensors",
    "write_bytes",
    "write_checked_json",
    "write_json",
    "write_text",
]

LOCK_FILE = ".tangentlens.lock"
# the metadata entry of a safetensors file that holds `tensor_hash` of its tensors
CONTENT_KEY = "content_sha256"
# and the entry that holds `metadata_hash` of the others (counts, losses, steps)
METADATA_KEY = "metadata_sha256"
# what a killed writer leaves: `atomic_write`'s files, `atomic_folder`'s folders, and the
# ``.tmpXXXXXX`` that safetensors itself writes before renaming onto its target
TEMPORARIES = (".*.tmp", ".tmp*")
RECORD_FILE = ".tangentlens-folder.json"
# the weights of a Hugging Face model folder (with its config.json): a checkpoint
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")

T = TypeVar("T")


def is_model_folder(folder: Path) -> bool:
    """Whether ``folder`` is a model folder (a ``config.json`` beside its weights)."""
    return (folder / "config.json").is_file() and any(
        (folder / name).is_file() for name in WEIGHT_FILES
    )


def _make_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(
            f"cannot create the output folder {path.parent}: {err.strerror}; "
            "choose a writable --out."
        ) from err


def _fill(path: Path, tmp: Path, write: Callable[[Path], Any]) -> None:
    """``write(tmp)``, with a full disk or a file-size limit that a library reported inside
    its own exception type (safetensors, tokenizers) raised as the `OSError` it is."""
    try:
        write(tmp)
    except OSError:
        raise
    except Exception as err:
        env = environment_error(err, path)
        if env is None:
            raise
        raise env from err


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync, then rename.

    A reader never sees a partial file under the final name: a crash leaves at
    most a hidden ``.{name}.*.tmp`` file, which `remove_stale_temporaries` clears when
    the command runs again. The temporary is created (exclusively, so nothing planted
    there is followed) with mode 0666, so the kernel applies the umask as it does to
    any new file; that mode is put back if ``write`` replaced the file (safetensors
    writes 0600), and the rename replaces the name, never writing into what it pointed to.
    """
    path = Path(path)
    _make_parent(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    while True:
        tmp_path = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            with _naming(path):
                fd = os.open(tmp_path, flags, 0o666)
        except FileExistsError:
            continue
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        os.close(fd)
        break
    try:
        with _naming(path):  # a write that fails (a full disk) names the file, not the call
            _fill(path, tmp_path, write)
        if stat.S_IMODE(os.stat(tmp_path).st_mode) != mode:
            os.chmod(tmp_path, mode)
        with open(tmp_path, "rb") as fh:
            os.fsync(fh.fileno())
        with _naming(path):
            os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)
    return path


def atomic_folder(
    final: str | Path, fill: Callable[[Path], Any], *, prefix: str | None = None
) -> Path:
    """Build a folder under a hidden temporary name with ``fill(tmp)``, give it and its
    files the umask's permissions (not mkdtemp's 0700 or a library's 0600), fsync its
    files, then rename it to ``final``: a reader never sees half a checkpoint or model.

    ``prefix``: the temporary's name start (default ``.{name}.``), for a command that
    clears its own leftovers by name. A rename onto an existing ``final`` fails with the
    `OSError`; nothing of the temporary is left either way."""
    final = Path(final)
    _make_parent(final)
    with _naming(final):
        tmp = Path(
            tempfile.mkdtemp(prefix=prefix or f".{final.name}.", suffix=".tmp", dir=final.parent)
        )
    try:
        _fill(final, tmp, fill)
        make_readable(tmp)
        for f in tmp.rglob("*"):
            if f.is_file() and not f.is_symlink():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        with _naming(final):
            os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An `OSError` inside the block, of the same kind, naming the file a writer makes
    rather than its hidden temporary, which a message would name and the user would not
    find."""
    try:
        yield
    except OSError as err:
        renamable = err.filename is None or Path(str(err.filename)).name.startswith(".")
        if err.errno is None or type(err).__module__ != "builtins" or not renamable:
            raise  # no errno to keep, one of ours, or naming a file of its own: as it is
        raise type(err)(err.errno, err.strerror, str(path)) from None


def current_umask() -> int:
    """The process's umask, read when a permission is computed (never at import).

    Linux states it in ``/proc/self/status``, which reads it without changing it.
    Elsewhere the only way is to set a mask and put the old one back; the mask set in
    between is the strictest (0o077), so a file another thread makes then is private
    rather than open to all."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def environment_error(err: BaseException, path: str | Path) -> OSError | None:
    """The `OSError` (disk full, file too large, ...) that a library reported inside its own
    exception type, as Rust code does ("... (os error 28)"); None when there is none, so
    the CLI can name the cause in one line instead of a traceback."""
    found = re.search(r"os error (\d+)|code: (\d+)", str(err))
    if found is None:
        return None
    code = int(found.group(1) or found.group(2))
    return OSError(code, os.strerror(code), str(path))


def make_readable(path: str | Path) -> None:
    """Give a folder made by ``tempfile.mkdtemp`` (0700) and the files that libraries write
    there (0600) the permissions of the umask, as every other output has."""
    root = Path(path)
    umask = current_umask()
    for entry in [root, *root.rglob("*")]:
        if entry.is_symlink():
            continue
        os.chmod(entry, (0o777 if entry.is_dir() else 0o666) & ~umask)


def remove_stale_temporaries(folder: str | Path, patterns: Sequence[str] = TEMPORARIES) -> int:
    """Delete the temporaries (files and folders: by default every writer's, `TEMPORARIES`)
    a killed run left under ``folder``; returns how many. Only the folder's one writer
    calls it: subfolders with a lock of their own (another writer's) are skipped."""
    removed = 0
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not (Path(root, d) / LOCK_FILE).exists()]
        for name in [d for d in dirs if any(fnmatch.fnmatch(d, p) for p in patterns)]:
            dirs.remove(name)
            shutil.rmtree(Path(root, name), ignore_errors=True)
            removed += 1
        for name in files:
            if any(fnmatch.fnmatch(name, p) for p in patterns):
                Path(root, name).unlink(missing_ok=True)
                removed += 1
    return removed


def retire(folder: str | Path, patterns: Sequence[str]) -> None:
    """Delete the files matching ``patterns`` (globs under ``folder``) that describe its
    results (a page, its figures, a manifest, a summary), before those results are
    replaced: a run stopped in between then leaves results with nothing derived from them,
    never beside a page or summary of the results it replaced, and its rerun writes them
    again. Only the folder's one writer calls it, once its claim on the folder stands.
    Files reached through a linked folder belong to the link's target and stay."""
    folder = Path(folder)
    for pattern in patterns:
        for path in folder.glob(pattern):
            inside = list(path.relative_to(folder).parents)[:-1]  # the last is "." itself
            linked = any((folder / p).is_symlink() for p in inside)
            if (path.is_file() or path.is_symlink()) and not linked:
                path.unlink(missing_ok=True)


def write_bytes(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda p: p.write_bytes(data))


def write_text(path: str | Path, text: str) -> Path:
    """``text`` as UTF-8 bytes, newlines as given (no platform translation), so a hash of
    the text is a hash of the file."""
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, obj: Any) -> Path:
    return write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def write_checked_json(path: str | Path, obj: Mapping[str, Any]) -> Path:
    """`write_json` of ``obj`` with `config_digest` of its entries under `CONTENT_KEY`: the
    numbers the tool reads back from JSON (a summary's claims, a checkpoint's step and
    loss) are checked by `read_checked_json` as a safetensors file's tensors are."""
    return write_json(path, {**obj, CONTENT_KEY: config_digest(obj)})


def read_checked_json(path: str | Path, *, fix: str = "delete it and re-run") -> dict[str, Any]:
    """The dict `write_checked_json` wrote, its digest checked and dropped; one without a
    digest (written by another tool) is read as it is."""
    found = read_json(path, dict, fix=fix)
    recorded = found.pop(CONTENT_KEY, None)
    if recorded is not None and recorded != config_digest(found):
        raise CorruptFileError(
            f"{path} was changed after it was written (its entries no longer match their "
            f"{CONTENT_KEY}: edited or damaged); {fix}."
        )
    return found


def save_tensors(path: str | Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> Path:
    """Write ``tensors`` with ``metadata`` and `tensor_hash` of the tensors under
    `CONTENT_KEY`: a file whose structure is intact but whose numbers were edited, or
    re-saved in another dtype, then fails `load_tensors` instead of being reused."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    metadata = {**metadata, CONTENT_KEY: tensor_hash(tensors)}
    metadata[METADATA_KEY] = metadata_hash(metadata)
    return atomic_write(path, lambda p: save_file(tensors, str(p), metadata=metadata))


def check_safetensors(path: str | Path) -> dict[str, Any]:
    """The header of a safetensors file, after checking that the file is whole: a readable
    header whose tensors cover the data exactly (a truncated copy fails here, at once,
    instead of deep inside a model loader). Damage is a `CorruptFileError`."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= size - 8:
                raise ValueError(f"header length {n} in a file of {size} bytes")
            header = json.loads(fh.read(n))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
        raise CorruptFileError(
            f"{path} is truncated or damaged ({err}); restore it, or delete it and re-create it."
        ) from err
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        raise CorruptFileError(
            f"{path} is truncated or damaged ({size} bytes where its header needs {expected}); "
            "restore it, or delete it and re-create it."
        )
    return header


def load_tensors(
    path: str | Path, *, verified: bool = False
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file, checked against the content hash
    `save_tensors` wrote with them (when there is one; ``verified=True``: there must be).
    A mismatch is a `CorruptFileError` naming the file: what tangentlens reuses is what it
    wrote, never a copy edited in place."""
    path = Path(path)
    if path.is_dir():
        raise CorruptFileError(f"{path} is a folder, not a safetensors file; delete it.")
    if not path.is_file():
        raise MissingFileError(f"{path} does not exist; check the path.")
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = dict(fh.metadata() or {})
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    except (SafetensorError, ValueError) as err:
        raise CorruptFileError(
            f"{path} is corrupt or truncated ({err}); delete it and re-create it."
        ) from err
    described = meta.pop(METADATA_KEY, None)
    if described is not None and described != metadata_hash(meta):
        raise CorruptFileError(
            f"{path} was changed after it was written (its metadata no longer match their "
            f"{METADATA_KEY}: edited or damaged); delete it to recompute."
        )
    recorded = meta.pop(CONTENT_KEY, None)
    if recorded is None and verified:
        raise CorruptFileError(
            f"{path} carries no {CONTENT_KEY} of its tensors, so it cannot be verified; "
            "delete it to recompute."
        )
    if recorded is not None and recorded != tensor_hash(tensors):
        raise CorruptFileError(
            f"{path} was changed after it was written (its tensors no longer match their "
            f"{CONTENT_KEY}: edited, re-saved in another dtype or damaged); delete it to "
            "recompute."
        )
    return tensors, meta


def read_json(path: str | Path, expect: type = dict, *, fix: str = "delete it and re-run") -> Any:
    """The JSON value in ``path``, which must be an ``expect`` (dict, list, ...).

    What tangentlens reads back (manifests, configs, folder records, checkpoint metadata)
    is data it wrote; anything else there, unreadable bytes, broken JSON or JSON of
    another shape, is a `CorruptFileError` naming the file and ``fix`` (one line, exit 2),
    never a `KeyError` or `AttributeError` deep inside a command. A missing file is a
    `MissingFileError`."""
    path = Path(path)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise MissingFileError(f"{path} does not exist; {fix}.") from None
    except IsADirectoryError:
        raise CorruptFileError(f"{path} is corrupt (a folder, not a JSON file); {fix}.") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CorruptFileError(f"{path} is corrupt (not valid JSON: {err}); {fix}.") from None
    if not isinstance(data, expect):
        raise CorruptFileError(
            f"{path} is corrupt (a JSON {_json_kind(data)} where a JSON "
            f"{_json_kind(expect())} belongs); {fix}."
        )
    return data


def _json_kind(value: Any) -> str:
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return kinds.get(type(value), "number")


def dataclass_from_dict(cls: type[T], d: Mapping[str, Any]) -> T:
    """``cls(**d)`` for a config dataclass, refusing unknown keys with a clear message."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise UsageError(f"unknown {cls.__name__} keys {unknown}; valid keys are {sorted(known)}.")
    return cls(**d)


def metadata_hash(metadata: Mapping[str, str]) -> str:
    """SHA-256 of a safetensors file's metadata entries but this hash's own (the content
    hash included): the numbers a file keeps beside its tensors are checked as they are."""
    return config_digest({k: v for k, v in metadata.items() if k != METADATA_KEY})
