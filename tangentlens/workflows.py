"""What each command does, as functions the CLI calls (and notebooks may too).

`probe_model` (one model: bases, probes, tables, report), `train_series` (the small
model's checkpoints), `run_study` (the study over a series), `probe_heads` (per-head
attention probe of chosen checkpoints) and `demo` (all of it, offline). Each takes
keyword options and a ``log`` callable for its one-line progress messages; the CLI
passes ``print``.
"""

from __future__ import annotations

import functools
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from torch import Tensor

from . import results
from .checkpoints import CheckpointSeries
from .corpus import encode, load_lines
from .distributed import run_probe
from .errors import MissingFileError, UsageError
from .files import write_json
from .hooks.base import get_backend
from .hooks.sites import Site
from .models import is_hub_id, load, quiet_transformers
from .probes.bases import BasisSet
from .probes.driver import fit_bases, run
from .report import write_report
from .study import Study, StudyConfig
from .train import TrainConfig, train
from .validation import check_rank
from .version import __version__

__all__ = [
    "CHECKPOINTS_DIR",
    "HEADS_DIR",
    "QUICK_STUDY",
    "DemoOutcome",
    "demo",
    "probe_checkpoint",
    "probe_heads",
    "probe_model",
    "run_study",
    "study_config",
    "token_blocks",
    "train_config",
    "writable_dir",
]

CHECKPOINTS_DIR = "checkpoints"
HEADS_DIR = "heads"
QUICK_STUDY = {"n_controls": 50, "n_permutations": 20, "n_sequences": 8, "reservoir": 256}
Log = Callable[[str], None]


def _quiet(_: str) -> None:
    """The default ``log``: say nothing."""


def writable_dir(path: str | Path) -> Path:
    """Create ``path`` and check a file can be written there, before any long work."""
    out = Path(path).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise UsageError(
            f"cannot write to {out} ({reason}); choose a writable --out folder"
        ) from err
    return out


def token_blocks(tokenizer: Any, text: str | None, tokens: int, seq_len: int) -> Tensor:
    """``(n, seq_len)`` token blocks: ``2 * tokens`` tokens of the text (or the KJV)."""
    lines = load_lines(text, max_chars=max(20_000, 12 * 2 * tokens))
    ids = encode(tokenizer, lines)
    n_blocks = min(ids.numel() // seq_len, 2 * max(1, tokens // seq_len))
    if n_blocks < 2:
        raise UsageError(
            f"the text has {ids.numel()} tokens, too few for two blocks of {seq_len}; "
            "pass a longer --text or a smaller --seq-len"
        )
    return ids[: n_blocks * seq_len].view(n_blocks, seq_len)


def context_length(model: Any) -> int | None:
    """The longest sequence the model takes (TransformerLens ``cfg.n_ctx`` or HF config)."""
    cfg = getattr(model, "cfg", None)
    if getattr(cfg, "n_ctx", None):
        return int(cfg.n_ctx)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(limit) if limit else None


def _load_model(name: str, backend: str) -> Any:
    """Module-level (picklable) model factory for data-parallel workers."""
    return load(name, backend).model


# ----------------------------------------------------------------------------- probe
def probe_checkpoint(
    model: Any,
    blocks: Tensor,
    *,
    rank: int,
    layers: Sequence[int] | None = None,
    probes: Sequence[str] = ("residual", "attention", "gradient"),
    batch_size: int = 8,
    n_controls: int = 1000,
    world_size: int = 1,
    model_factory: Callable[[], Any] | None = None,
    progress: bool = True,
) -> tuple[pd.DataFrame, BasisSet]:
    """Fit rank-``rank`` bases (resid_pre and attention input) on the first half of
    ``blocks`` and probe the second half; returns ``(results, bases)``."""
    check_rank(rank, get_backend(model).d_model, "normal", name="--rank")
    half = blocks.shape[0] // 2
    fit_set = list(blocks[:half].split(batch_size))
    per_process = -(-(blocks.shape[0] - half) // world_size)  # every process gets a batch
    probe_set = list(blocks[half:].split(min(batch_size, per_process)))

    def sites(name: str) -> bool:
        return Site.from_hook_name(name).kind in ("resid_pre", "attn_in")

    bases = fit_bases(model, fit_set, rank, sites=sites, layers=layers, progress=progress)
    options = {"layers": layers, "n_controls": n_controls, "progress": progress}
    if world_size > 1:
        table = run_probe(model_factory, probe_set, bases, probes, world_size=world_size, **options)
    else:
        table = run(model, probe_set, bases, probes, **options).results()
    return table, bases


def probe_model(
    name: str,
    out: Path,
    *,
    backend: str = "transformer_lens",
    text: str | None = None,
    rank: int = 16,
    layers: Sequence[int] | None = None,
    tokens: int = 1024,
    seq_len: int = 128,
    batch_size: int = 8,
    n_controls: int = 200,
    world_size: int = 1,
    config: dict[str, Any] | None = None,
    progress: bool = True,
    log: Log = _quiet,
) -> tuple[pd.DataFrame, Path]:
    """One model: fit bases, run the probes, write ``results.csv/json``, ``bases/``,
    ``manifest.json`` and ``report.html`` into ``out``. Returns ``(table, report)``."""
    start = time.perf_counter()
    log(f"loading {name} ({backend}) …")
    with quiet_transformers():
        loaded = load(name, backend)
    probes = ["residual", "attention"]
    if loaded.causal:
        probes.append("gradient")
    else:
        log("encoder: no next-token loss, so the gradient probe is skipped")
    context = context_length(loaded.model)
    if context is not None and seq_len > context:
        log(f"--seq-len {seq_len} exceeds the model's context; using {context}")
        seq_len = context
    blocks = token_blocks(loaded.tokenizer, text, tokens, seq_len)
    table, bases = probe_checkpoint(
        loaded.model,
        blocks,
        rank=rank,
        layers=layers,
        probes=probes,
        batch_size=batch_size,
        n_controls=n_controls,
        world_size=world_size,
        model_factory=functools.partial(_load_model, name, backend),
        progress=progress,
    )
    results.write(table, out)
    bases.save(out / "bases" / f"rank{rank}.safetensors")
    manifest = {
        "command": "probe",
        "model": name,
        "source": loaded.source,
        "backend": backend,
        "tokens_fitted": int(blocks.shape[0] // 2 * blocks.shape[1]),
        "tokens_probed": int((blocks.shape[0] - blocks.shape[0] // 2) * blocks.shape[1]),
        "probes": probes,
        "seconds": round(time.perf_counter() - start, 1),
        "tangentlens_version": __version__,
        "bases": bases.provenance,
        "config": config or {},
    }
    write_json(out / "manifest.json", manifest)
    page = write_report(table, out / "report.html", manifest=manifest, title=name)
    return table, page


# ----------------------------------------------------------------------------- train
def train_config(
    *,
    quick: bool = False,
    corpus: str | None = None,
    max_steps: int | None = None,
    seed: int | None = None,
) -> TrainConfig:
    """The trainer's config: defaults, or a tiny model (``quick``: five checkpoints)."""
    chosen = {"corpus": corpus, "max_steps": max_steps, "seed": seed}
    overrides = {k: v for k, v in chosen.items() if v is not None}
    if quick:  # five checkpoints (0, 1, 2, 4, 8) of a tiny model: seconds
        return TrainConfig.tiny(**{"max_steps": 8, **overrides})
    return TrainConfig(**overrides)


# ----------------------------------------------------------------------------- study
def _trained_with(checkpoints: str) -> dict[str, Any]:
    """Corpus settings of a `tangentlens train` folder, so the study's probe set is the
    trainer's held-out split and fits the model's context (empty for other series)."""
    path = Path(checkpoints).expanduser() / "train_config.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    keys = ("corpus", "max_chars", "seq_len", "probe_fraction", "seed")
    return {k: saved[k] for k in keys if k in saved}


def study_config(checkpoints: str, *, quick: bool = False, **options: Any) -> StudyConfig:
    """A `StudyConfig` for ``checkpoints``: the trainer's corpus settings when it is a
    `tangentlens train` folder, the quick settings, then ``options`` that are not None."""
    if not Path(checkpoints).expanduser().exists() and not is_hub_id(checkpoints):
        raise MissingFileError(
            f"--checkpoints {checkpoints} is neither an existing folder nor a hub id "
            "'org/name'; pass the folder `tangentlens train` wrote"
        )
    base = dict(QUICK_STUDY) if quick else {}
    base.update(_trained_with(checkpoints))
    base.update({k: v for k, v in options.items() if v is not None})
    return StudyConfig(checkpoints=checkpoints, **base)


def run_study(
    config: StudyConfig, out: Path, *, world_size: int = 1, progress: bool = True
) -> pd.DataFrame:
    """Run (or resume) the study into ``out`` and write its report."""
    table = Study(config).run(out, world_size=world_size, progress=progress)
    write_report(out, out / "report.html")
    return table


def probe_heads(
    checkpoints: Path, out: Path, table: pd.DataFrame, *, progress: bool = True
) -> Path:
    """Attention-head probe of the last early-window and the final checkpoint (the
    study itself has no per-head numbers), as a results table of its own under
    ``out/heads/`` (the report reads it with the study's); returns its path."""
    series = CheckpointSeries.from_folder(checkpoints)
    windows = table.drop_duplicates("step").set_index("step")["window"]
    early = [s for s in series.steps if windows.get(s) == "early"]
    chosen = sorted({early[-1] if early else series.steps[0], series.steps[-1]})
    rank = int(pd.to_numeric(table["rank"], errors="coerce").min())
    frames = []
    for step in chosen:
        with quiet_transformers():
            loaded = load(str(series[series.index(step)].source), "transformer_lens")
        seq_len = min(64, context_length(loaded.model) or 64)
        blocks = token_blocks(loaded.tokenizer, None, 16 * seq_len, seq_len)
        heads, _ = probe_checkpoint(
            loaded.model, blocks, rank=rank, probes=("attention",), progress=progress
        )
        frames.append(
            heads.assign(checkpoint=f"step{step}", step=step, window=windows.get(step), rank=rank)
        )
    return results.write(pd.concat(frames, ignore_index=True), out / HEADS_DIR)[0]


# ----------------------------------------------------------------------------- demo
@dataclass(frozen=True)
class DemoOutcome:
    """What `demo` produced."""

    table: pd.DataFrame
    report: Path
    seconds: float


def demo(
    out: Path, *, quick: bool = False, progress: bool = True, log: Log = _quiet
) -> DemoOutcome:
    """Train the small model, run the study, probe the heads, write the report."""
    start = time.perf_counter()
    checkpoints = out / CHECKPOINTS_DIR
    config = train_config(quick=quick)
    log(f"[1/4] training the small model ({config.max_steps} steps) → {checkpoints}")
    train(config, checkpoints, progress=progress)
    log("[2/4] running the study over the checkpoints")
    table = Study(study_config(str(checkpoints), quick=quick)).run(out, progress=progress)
    log("[3/4] probing attention heads (early window and final checkpoint)")
    probe_heads(checkpoints, out, table, progress=progress)
    log("[4/4] writing the report")
    page = write_report(out, out / "report.html")
    return DemoOutcome(table, page, time.perf_counter() - start)
