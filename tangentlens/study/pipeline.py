"""`Study`: the paper's experiment over a checkpoint series, into one output folder.

>>> frame = Study(StudyConfig(checkpoints="runs/demo")).run("runs/demo-study")

1. **Probe set** (`collect.probe_set`): fixed held-out token blocks of the corpus and
   the corpus token counts, ``probe_set.safetensors``.
2. **Collection** (`collect.collect`): one forward and backward per checkpoint, reduced
   to sufficient statistics, ``parts/step{N}.safetensors``; a killed study resumes.
3. **Analysis** (`analyse.analyse`): from the parts alone, deterministic:
   ``results.csv`` / ``results.json`` (schema: `tangentlens.results`), ``bases/`` and
   ``manifest.json``.

Every file is written atomically.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd

from .. import results
from ..distributed import launch
from ..errors import CorruptFileError, UsageError
from ..files import remove_stale_temporaries, tensor_hash, write_json
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
)
from .config import StudyConfig, open_series, threads

__all__ = ["CONFIG_FILE", "Study"]

CONFIG_FILE = "study_config.json"


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
        windows = series.windows(cfg.window_fraction, early=cfg.early, late=cfg.late)
        _prepare_out_dir(cfg, out)
        with threads(cfg.num_threads):
            tokens, counts = probe_set(cfg, series, out)
            todo = [i for i, c in enumerate(series) if not part_path(out, c.step).is_file()]
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
        results.write(frame, out)
        manifest = {
            **info,
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


def _prepare_out_dir(cfg: StudyConfig, out: Path) -> None:
    remove_stale_temporaries(out)  # left by a killed run of this study
    path = out / CONFIG_FILE
    mine = {k: v for k, v in cfg.to_dict().items() if k != "progress"}
    if path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise CorruptFileError(
                f"{path} is corrupt ({err}); delete it or use another --out."
            ) from err
        saved.pop("progress", None)
        if saved == json.loads(json.dumps(mine)):
            return
        if any((out / "parts").glob("step*.safetensors")):
            diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
            raise UsageError(
                f"{out} holds a study with another configuration (differs in {diff}); "
                "rerun with the same configuration to resume, or choose another output folder."
            )
        # nothing computed yet (e.g. the first run failed a check): start afresh
        (out / PROBE_FILE).unlink(missing_ok=True)
    write_json(path, mine)
