"""Atomic file writes, safetensors round trips (no pickle anywhere) and content hashes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from .errors import CorruptFileError, MissingFileError, UsageError

__all__ = [
    "atomic_write",
    "dataclass_from_dict",
    "load_tensors",
    "save_tensors",
    "tensor_hash",
    "write_json",
    "write_text",
]

T = TypeVar("T")
_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync, then rename.

    A reader never sees a partial file under the final name: a crash leaves at
    most a ``.tmp`` file that the next run overwrites.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(
            f"cannot create the output folder {path.parent}: {err.strerror}; "
            "choose a writable --out."
        ) from err
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        os.chmod(tmp_path, 0o666 & ~_UMASK)  # mkstemp makes 0600: give ordinary permissions
        with open(tmp_path, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)
    return path


def write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def write_json(path: str | Path, obj: Any) -> Path:
    return write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def save_tensors(path: str | Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> Path:
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    return atomic_write(path, lambda p: save_file(tensors, str(p), metadata=metadata))


def load_tensors(path: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path} does not exist; check the path.")
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = dict(fh.metadata() or {})
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as err:
        raise CorruptFileError(
            f"{path} is corrupt or truncated ({err}); delete it and re-create it."
        ) from err
    return tensors, meta


def dataclass_from_dict(cls: type[T], d: Mapping[str, Any]) -> T:
    """``cls(**d)`` for a config dataclass, refusing unknown keys with a clear message."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise UsageError(f"unknown {cls.__name__} keys {unknown}; valid keys are {sorted(known)}.")
    return cls(**d)


def tensor_hash(tensors: dict[str, Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes of a state dict (order independent)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
