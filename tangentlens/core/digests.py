"""SHA-256 digests of what a run reads and writes: tensors (`tensor_hash`), files and
folders by content (`content_sha256`) and settings by their canonical JSON
(`config_digest`). One formula each, so a record written by one command is checked by
another with the same bytes."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["config_digest", "content_sha256", "source_digest", "tensor_hash"]


def tensor_hash(tensors: dict[str, Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes of a state dict (order independent)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy
    return h.hexdigest()


def content_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes, or of a folder's files (each one's relative name, size
    and bytes, in name order): what a run records of an input it reads by path, so one
    edited or rewritten in place is known as another input."""
    path = Path(path)
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        if file is not path:
            h.update(f"{file.relative_to(path)}|{file.stat().st_size}|".encode())
        with open(file, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def config_digest(config: Mapping[str, Any]) -> str:
    """SHA-256 of a configuration's canonical JSON: what a folder's record compares."""
    text = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def source_digest() -> str:
    """SHA-256 of tangentlens's own source (each module's path and bytes), read once a
    process: what a file the tool reuses records of the code that computed it, so one
    computed by another version or an edited tree is computed again, never mixed with
    this code's results."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    modules = (p for p in root.rglob("*.py") if p.is_file() and not p.name.startswith("."))
    for file in sorted(modules):  # an editor's hidden lock or backup is no module
        h.update(f"{file.relative_to(root).as_posix()}|".encode())
        h.update(file.read_bytes())
    return h.hexdigest()
