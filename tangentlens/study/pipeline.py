"""`Study`: the paper's experiment over a checkpoint series, into one output folder.

>>> frame = Study(StudyConfig(checkpoints="runs/demo")).run("runs/demo-study")

1. **Probe set** (`collect.probe_set`): fixed held-out token blocks of the corpus and
   the corpus token counts, ``probe_set.safetensors``.
2. **Collection** (`collect.collect`): one forward and backward per checkpoint, reduced
   to sufficient statistics, ``parts/step{N}.safetensors``; a killed study resumes.
3. **Analysis** (`analyse.analyse`): from the parts alone, deterministic:
   ``results.csv`` / ``results.json`` (schema: `tangentlens.results`), ``bases/`` and
   ``manifest.json``.

Every file is written atomically, by one writer: the run holds the folder's lock
(`tangentlens.files.lock_folder`) and refuses a folder that another command or another
configuration made. Whatever it reuses is verified first: the probe set and each part
carry the settings (and probe-set hash) that made them, and are made again, never
trusted, when those differ (a folder whose record was deleted).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pandas as pd

from .. import results
from ..distributed import launch
from ..errors import UsageError
from ..files import (
    FolderLock,
    lock_folder,
    read_json,
    remove_stale_temporaries,
    tensor_hash,
    write_json,
)
from ..validation import check_int
from .analyse import analyse
from .collect import (
    PROBE_FILE,
    check_parts_match,
    collect,
    collect_worker,
    load_part,
    part_path,
    probe_set,
    stale_parts,
)
from .config import StudyConfig, open_series, threads
from .heads import head_rows

__all__ = ["CONFIG_FILE", "OUTPUTS", "Study"]

CONFIG_FILE = "study_config.json"
OUTPUTS = (
    CONFIG_FILE,
    PROBE_FILE,
    "parts",
    "results.csv",
    "results.json",
    "manifest.json",
    "report.html",
    "bases",
    "figures",
)
"""What a study writes into its folder."""
_RESULTS = ("parts/step*.safetensors", "results.csv")


class Study:
    """Run a `StudyConfig` into an output folder; see the module docstring."""

    def __init__(self, config: StudyConfig) -> None:
        if not isinstance(config, StudyConfig):
            raise TypeError(f"Study takes a StudyConfig; got {type(config).__name__}.")
        self.config = config

    def run(
        self, out_dir: str | Path, *, world_size: int = 1, progress: bool | None = None
    ) -> pd.DataFrame:
        """Run (or resume) the study; returns the results table."""
        cfg = self.config
        progress = cfg.progress if progress is None else progress
        world_size = check_int(world_size, "world_size", minimum=1)
        start = time.perf_counter()
        out = Path(out_dir)
        series = open_series(cfg.checkpoints)
        windows = series.windows(
            cfg.window_fraction, by=cfg.windows, early=cfg.early, late=cfg.late
        )
        with lock_folder(out, "study") as lock:
            _prepare_out_dir(cfg, out, lock)
            return self._run(series, windows, out, world_size, progress, start)

    def _run(
        self,
        series: Any,
        windows: dict[str, list[int]],
        out: Path,
        world_size: int,
        progress: bool,
        start: float,
    ) -> pd.DataFrame:
        cfg = self.config
        with threads(cfg.num_threads):
            tokens, counts = probe_set(cfg, series, out)
            todo = stale_parts(cfg, series, out, tokens)
            n_batches = len(tokens.split(cfg.batch_size))
            if todo and world_size > 1:
                if n_batches < world_size:
                    raise UsageError(
                        f"the probe set has {n_batches} batches, too few for {world_size} "
                        "processes; raise n_sequences or lower the batch size or world size."
                    )
                launch(collect_worker, world_size, cfg.to_dict(), str(out), todo, progress)
            elif todo:
                collect(cfg, series, todo, out, tokens, 0, 1, progress)
            collect_s = time.perf_counter() - start
            parts = {c.step: load_part(part_path(out, c.step)) for c in series}
            check_parts_match(series, parts)
            frame, info = analyse(cfg, series, windows, parts, counts, out, progress)
            window = {step: "middle" for step in series.steps}
            for name in ("early", "late"):
                window |= {series.steps[i]: name for i in windows[name]}
            heads = head_rows(cfg, series, window, out, tokens, progress)
        if heads is not None:
            frame = results.frame(pd.concat([frame, heads], ignore_index=True), results.COLUMNS)
        results.write(frame, out)
        manifest = {
            **info,
            "command": "study",
            "config": cfg.to_dict(),
            "world_size": world_size,
            "probe_set": {
                "n_sequences": int(tokens.shape[0]),
                "seq_len": int(tokens.shape[1]),
                "tokens_hash": tensor_hash({"tokens": tokens}),
                "corpus_tokens": int(counts.sum()),
            },
            "timings": {
                **info["timings"],
                "collect_s": collect_s,
                "total_s": time.perf_counter() - start,
                "resumed_checkpoints": len(series) - len(todo),
            },
        }
        write_json(out / "manifest.json", manifest)
        return frame


def _prepare_out_dir(cfg: StudyConfig, out: Path, lock: FolderLock) -> None:
    """Claim ``out`` for this configuration, clear what killed runs left, record it."""
    path = out / CONFIG_FILE
    mine = json.loads(json.dumps({k: v for k, v in cfg.to_dict().items() if k != "progress"}))

    def study_folder() -> bool:
        """A folder without a record, from before records: a study's (its own files, and a
        study's manifest if any) and, once parts exist, of this configuration (by
        study_config.json). Its parts and probe set are verified file by file later."""
        if not any((out / name).exists() for name in (CONFIG_FILE, PROBE_FILE, "parts")):
            return False
        manifest = _read_json(out / "manifest.json")
        if manifest is not None and manifest.get("command", "study") != "study":
            return False
        saved = _read_json(path)
        if saved is not None and not any(out.glob(_RESULTS[0])):
            return True  # nothing computed yet (e.g. the first run failed a check)
        if saved is not None:
            saved.pop("progress", None)
            diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
            if diff:
                raise UsageError(
                    f"{out} holds a study with another configuration (differs in {diff}); "
                    "rerun with the same configuration to resume, or choose another output "
                    "folder."
                )
        return True

    lock.claim(mine, OUTPUTS, results=_RESULTS, adopt=study_folder)
    remove_stale_temporaries(out)  # left by a killed run of this study
    if _read_json(path) != mine:
        write_json(path, mine)


def _read_json(path: Path) -> dict[str, Any] | None:
    return read_json(path, dict, fix="delete it or use another --out") if path.is_file() else None
