"""`Study`: the paper's experiment over a checkpoint series, into one output folder.

>>> frame = Study(StudyConfig(checkpoints="runs/demo")).run("runs/demo-study")

1. **Probe set** (`collect.probe_set`): fixed held-out token blocks of the corpus and
   the corpus token counts, ``probe_set.safetensors``.
2. **Collection** (`collect.collect_part`): one forward and backward per checkpoint,
   reduced to sufficient statistics, ``parts/step{N}.safetensors``; a killed study
   resumes. The early window goes first: once its parts exist the bases are fitted
   (`analyse.fit_bases`, ``bases/``), and every later checkpoint's probe pass
   (`probe_pass.ProbePass`: the registered probes of ``StudyConfig.probes``, by default
   the attention probe's per-head shares) runs on the model its collection loaded.
3. **Analysis** (`analyse.analyse`): from the parts and bases alone, deterministic:
   ``results.csv`` / ``results.json`` (schema: `tangentlens.core.results`) and
   ``manifest.json``; `Study.run` returns the table it wrote (and keeps the manifest in
   `Study.manifest`), so nothing is read back. A page a rerun finds in the folder
   describes the table it replaces and goes with the old manifest, right before the new
   table is written (`DERIVED`, and ``also_retire``: its figures, the claims over several
   studies); `tangentlens study` writes them again.

Loads: a checkpoint is loaded (and hashed) once per run. The early window's models wait
in memory until Q_T exists (the probe pass needs it, and it needs every early part), so
the early window costs a model's memory per checkpoint while it is collected. A resumed
run loads each checkpoint once, for the probe pass only; with the pass off
(``head_sequences=0`` or no probes), a resumed run loads none, and where no chosen probe
reads a site with the study's bases (the attention probe with ``weight_gradient=False``),
one.
With ``world_size > 1`` the worker processes collect and this process loads each
checkpoint once more for the probe pass (which is why a probe registered in this process
alone is enough).

Every file is written atomically, by one writer: the run holds the folder's lock
(`tangentlens.core.folders.lock_folder`) and refuses a folder that another command or another
configuration made. Whatever it reuses is verified first: the probe set and each part
carry the settings (and probe-set hash) that made them, and are made again, never
trusted, when those differ (a folder whose record was deleted).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from ..core import results
from ..core.digests import tensor_hash
from ..core.errors import UsageError
from ..core.files import read_json, remove_stale_temporaries, retire, write_json
from ..core.folders import FolderLock, lock_folder
from ..core.validation import check_int
from ..probes.distributed import launch
from .analyse import analyse, fit_bases
from .collect import (
    PROBE_FILE,
    check_parts_match,
    collect_part,
    collect_worker,
    load_checkpoint,
    load_part,
    part_path,
    probe_set,
    save_part,
    stale_parts,
)
from .config import StudyConfig, open_series, threads
from .probe_pass import ProbePass

__all__ = ["CONFIG_FILE", "DERIVED", "OUTPUTS", "Study"]

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
DERIVED = ("manifest.json", "report.html")
"""What describes a study's table in its folder, retired before a run replaces the table
(`retire`); `Study.run`'s ``also_retire`` names the rest (figures, claims over seeds)."""
_RESULTS = ("parts/step*.safetensors", "results.csv")


class Study:
    """Run a `StudyConfig` into an output folder; see the module docstring."""

    def __init__(self, config: StudyConfig) -> None:
        if not isinstance(config, StudyConfig):
            raise TypeError(f"Study takes a StudyConfig; got {type(config).__name__}.")
        self.config = config
        self.manifest: dict[str, Any] | None = None  # of the last run, as written

    def run(
        self,
        out_dir: str | Path,
        *,
        world_size: int = 1,
        progress: bool | None = None,
        also_retire: Sequence[str | Path] = (),
    ) -> pd.DataFrame:
        """Run (or resume) the study; returns the results table. ``also_retire``: files
        that describe the table it replaces (its figures, the claims of several studies),
        deleted with its page and manifest right before the new table is written, and
        not at all when the run is refused or fails before."""
        cfg = self.config
        progress = cfg.progress if progress is None else progress
        world_size = check_int(world_size, "world_size", minimum=1)
        start = time.perf_counter()
        out = Path(out_dir)
        source = Path(cfg.checkpoints).expanduser()
        if source.is_dir() and out.expanduser().resolve().is_relative_to(source.resolve()):
            raise UsageError(  # its parts and tables would land among the checkpoints it reads
                f"--out {out} lies inside the series it studies ({source}); choose a folder "
                "outside it."
            )
        series = open_series(cfg.checkpoints)
        windows = series.windows(
            cfg.window_fraction, by=cfg.windows, early=cfg.early, late=cfg.late
        )
        with lock_folder(out, "study") as lock:
            _prepare_out_dir(cfg, out, lock)
            stale = [Path(p) for p in also_retire]
            return self._run(series, windows, out, world_size, progress, start, stale)

    def _run(
        self,
        series: Any,
        windows: dict[str, list[int]],
        out: Path,
        world_size: int,
        progress: bool,
        start: float,
        stale: list[Path],
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
                todo = []
            parts, bases, probed = self._collect(series, windows, out, tokens, todo, progress)
            collect_s = time.perf_counter() - start
            check_parts_match(series, parts)
            frame, info = analyse(cfg, series, windows, parts, counts, bases, progress)
        if probed:
            frame = pd.concat([frame, *(probed[i] for i in sorted(probed))], ignore_index=True)
            frame = results.frame(frame, results.COLUMNS)
        retire(out, DERIVED)
        for path in stale:
            retire(path.parent, [path.name])
        results.write(frame, out)
        manifest = {
            **info,
            "command": "study",
            "objective": parts[series.steps[0]].meta.get("objective"),  # the loss it measured
            "config": cfg.to_dict(),
            "world_size": world_size,
            "probe_set": {
                "n_sequences": int(tokens.shape[0]),
                "seq_len": int(tokens.shape[1]),
                "head_sequences": min(cfg.head_sequences, int(tokens.shape[0])),  # the first
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
        self.manifest = manifest
        return frame

    def _collect(
        self,
        series: Any,
        windows: dict[str, list[int]],
        out: Path,
        tokens: Any,
        todo: list[int],
        progress: bool,
    ) -> tuple[dict[int, Any], dict[int, Any], dict[int, pd.DataFrame]]:
        """The parts of ``todo`` (written), the bases, and each checkpoint's probe-pass
        rows: the early window first, so that one load of a later checkpoint serves both
        its collection and its probe pass (see the module docstring for the loads)."""
        cfg = self.config
        early = windows["early"]
        label = {i: "middle" for i in range(len(series))}
        for name in ("early", "late"):
            label |= {i: name for i in windows[name]}
        order = early + [i for i in range(len(series)) if i not in early]
        parts: dict[int, Any] = {}
        bases: dict[int, Any] = {}
        probed: dict[int, pd.DataFrame] = {}
        probe_pass: ProbePass | None = None
        wanted = bool(cfg.probes) and cfg.head_sequences > 0
        # early checkpoints whose probe pass waits for Q_T, with their model when this run
        # loaded it (held until then, so that no checkpoint is loaded twice)
        waiting: list[tuple[int, Any]] = []
        bar = tqdm(order, desc="study: checkpoints", disable=not progress)
        for n, i in enumerate(bar):
            step = series[i].step
            bar.set_postfix(step=step)
            loaded = None
            if i in todo:
                loaded = load_checkpoint(cfg, series, i)
                save_part(out, collect_part(cfg, loaded, tokens, 0, 1))
            parts[step] = load_part(part_path(out, step), cfg)
            waiting.append((i, loaded if wanted else None))
            loaded = None
            if n == len(early) - 1:  # every early part exists: fit Q_T
                bases = fit_bases(cfg, series, windows, parts, out)
                probe_pass = ProbePass(cfg, bases, tokens)
            if probe_pass is None:
                continue
            for j, model in waiting:
                if probe_pass.enabled:  # off once no probe reads a site
                    # a resumed part: loaded for its probe pass only
                    model = model if model is not None else load_checkpoint(cfg, series, j)
                    probed[j] = probe_pass.rows(model, label[j])
            waiting = []
        return parts, bases, probed


def _prepare_out_dir(cfg: StudyConfig, out: Path, lock: FolderLock) -> None:
    """Claim ``out`` for this configuration, clear what killed runs left, record it."""
    path = out / CONFIG_FILE
    mine = json.loads(json.dumps({k: v for k, v in cfg.to_dict().items() if k != "progress"}))

    def study_folder() -> bool:
        """A folder without a record: a study's (its own files, and a
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
