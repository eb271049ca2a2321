"""What each command does, as functions the CLI calls (and notebooks may too).

`probe_model` (one model: bases, probes, tables, report), `train_config` and
`train_seeds` (the small model's checkpoints, one series per seed), `run_study` and
`run_studies` (the study over a series, or over the seeds of one design) and
`render_report`; `tangentlens.cli.demo` runs them all for a decoder and an encoder.
Seeds are the unit of replication: each seed is its own run in its own ``seed{S}/``
folder, and the verdicts read every seed's table.
Each takes keyword options and a ``log`` callable for its one-line progress messages; the
CLI passes ``print``. Each command that writes a folder holds it as its one writer for the
whole run (`tangentlens.core.folders.lock_folder`) and writes only into a folder that it made
with the same configuration, or an empty one.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from torch import Tensor

from ..core import results
from ..core.digests import content_sha256
from ..core.errors import MissingFileError, UsageError
from ..core.files import remove_stale_temporaries, retire, write_checked_json, write_json
from ..core.folders import lock_folder
from ..core.settings import (
    PROBE,
    QUICK_STUDY,
    QUICK_TRAIN,
    STUDY,
    TRAIN,
)
from ..core.validation import (
    check_backend,
    check_encoding,
    check_int,
    check_layers,
    check_rank,
    check_seeds,
    check_seq_len,
    is_int,
)
from ..data.corpus import encode, load_lines
from ..data.train import TOKENIZER_DIR, TrainConfig, train
from ..hooks.base import get_backend
from ..hooks.sites import Site
from ..models.batches import check_tokens, context_length
from ..models.loading import is_hub_id, load, quiet_transformers
from ..probes.bases import BasisSet
from ..probes.distributed import run_probe
from ..probes.driver import fit_bases, run
from ..report import FIGURES, write_overview, write_report
from ..report.claims import Claim
from ..report.page import OVERVIEW_TITLES
from ..report.render import render_report, run_digests
from ..report.verdicts import paper_claims
from ..study import Study, StudyConfig
from ..study.config import open_series, trained_config
from ..version import __version__

__all__ = [
    "CHECKPOINTS_DIR",
    "QUICK_STUDY",
    "overview_files",
    "page_files",
    "probe_checkpoint",
    "probe_model",
    "render_report",
    "run_studies",
    "run_study",
    "seed_config",
    "series_seeds",
    "study_config",
    "token_blocks",
    "train_config",
    "train_seeds",
]

CHECKPOINTS_DIR = "checkpoints"
PROBE_OUTPUTS = ("results.csv", "results.json", "manifest.json", "report.html", "bases", "figures")
SUMMARY_FILE = "summary.json"
SEED_DIR = "seed{}"  # one run of a multi-seed design: OUT/seed{S}/
_SEED_NAME = re.compile(r"(?:^|[-_/.])seed(\d+)$")  # runs/seed2, EleutherAI/pythia-70m-seed3
Log = Callable[[str], None]


def page_files(folder: Path) -> list[Path]:
    """A run's page and the figures it shows (the report's own names, nothing else in
    ``figures/``): what a rerun retires before it replaces the run's table."""
    return [folder / "report.html", *(folder / "figures" / f"{name}.png" for name in FIGURES)]


def overview_files(folder: Path) -> list[Path]:
    """The claims over several runs and their overview page: what a rerun retires before
    it replaces any of those runs' tables."""
    return [folder / SUMMARY_FILE, folder / "report.html"]


def quiet(_: str) -> None:
    """The default ``log``: say nothing."""


def _local(path: str | None) -> str | None:
    """An existing local path as an absolute one (what a folder's record compares), else
    the name as given (a bundled model, a hub id, None)."""
    if path is None or not Path(path).expanduser().exists():
        return path
    return str(Path(path).expanduser().resolve())


def _contents(path: str | None) -> str | None:
    """SHA-256 of a local input's files (`content_sha256`), None for a name that is not
    a path (a bundled model, a hub id, the embedded corpus)."""
    if path is None or not Path(path).expanduser().exists():
        return None
    return content_sha256(Path(path).expanduser())


def token_blocks(
    tokenizer: Any, text: str | None, tokens: int, seq_len: int, encoding: str = "utf-8"
) -> Tensor:
    """``(n, seq_len)`` token blocks: ``2 * tokens`` tokens of the text (or the KJV)."""
    seq_len = check_seq_len(seq_len, "--seq-len")
    lines = load_lines(text, max(20_000, 12 * 2 * tokens), encoding)
    ids = encode(tokenizer, lines)
    n_blocks = min(ids.numel() // seq_len, 2 * max(1, tokens // seq_len))
    if n_blocks < 2:
        raise UsageError(
            f"the text has {ids.numel()} tokens, too few for two blocks of {seq_len}; "
            "pass a longer --text or a smaller --seq-len"
        )
    return ids[: n_blocks * seq_len].view(n_blocks, seq_len)


def _check_blocks(model: Any, blocks: Any) -> None:
    """Token blocks: an integer ``(n, seq_len)`` tensor the model takes (`check_tokens`)."""
    if not isinstance(blocks, Tensor) or blocks.ndim != 2 or blocks.is_floating_point():
        raise UsageError(
            "blocks must be a (n, seq_len) tensor of token ids; tokenize with token_blocks()."
        )
    check_tokens(model, blocks)


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
    batch_size: int = PROBE.batch_size.default,
    n_controls: int = PROBE.n_controls.default,
    world_size: int = PROBE.world_size.default,
    model_factory: Callable[[], Any] | None = None,
    progress: bool = True,
) -> tuple[pd.DataFrame, BasisSet]:
    """Fit rank-``rank`` bases (resid_pre and attention input) on the first half of
    ``blocks`` and probe the second half; returns ``(results, bases)``."""
    backend = get_backend(model)
    check_rank(rank, backend.d_model, name="--rank")
    if layers is not None:
        check_layers(layers, backend.n_layers, name="--layers")
    _check_blocks(model, blocks)
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
    backend: str = PROBE.backend.default,
    text: str | None = PROBE.text.default,
    encoding: str = PROBE.encoding.default,
    rank: int = PROBE.rank.default,
    layers: Sequence[int] | None = PROBE.layers.default,
    tokens: int = PROBE.tokens.default,
    seq_len: int = PROBE.seq_len.default,
    batch_size: int = PROBE.batch_size.default,
    n_controls: int = PROBE.n_controls.default,
    world_size: int = PROBE.world_size.default,
    config: dict[str, Any] | None = None,
    progress: bool = True,
    log: Log = quiet,
) -> tuple[pd.DataFrame, Path]:
    """One model: fit bases, run the probes, write ``results.csv/json``, ``bases/``,
    ``manifest.json`` and ``report.html`` into ``out``, a folder only this probe (same
    model and options) writes. Returns ``(table, report)``. Defaults:
    `tangentlens.core.settings.PROBE` (what `tangentlens probe` shows)."""
    settings = {
        "model": _local(name),
        "backend": check_backend(backend),
        "text": _local(text),
        # what those paths hold: a model retrained or a text edited in place is another run
        "model_sha256": _contents(name),
        "text_sha256": _contents(text),
        "encoding": check_encoding(encoding, "--encoding"),
        "rank": check_int(rank, "--rank", minimum=1),
        "layers": _check_layers(layers),
        "tokens": check_int(tokens, "--tokens", minimum=1),
        "seq_len": check_seq_len(seq_len, "--seq-len"),
        "batch_size": check_int(batch_size, "--batch-size", minimum=1),
        "n_controls": check_int(n_controls, "--n-controls", minimum=1),
    }
    world_size = check_int(world_size, "--world-size", minimum=1)
    with lock_folder(out, "probe") as lock:
        lock.claim(settings, PROBE_OUTPUTS, results=("results.csv", "bases"))
        remove_stale_temporaries(out)
        return _probe_model(name, Path(out), settings, world_size, config, progress, log)


def _check_layers(layers: Sequence[int] | None) -> list[int] | None:
    if layers is None:
        return None
    if isinstance(layers, str | bytes) or not all(is_int(v) and v >= 0 for v in layers):
        raise UsageError(f"--layers must be ints >= 0; got {layers!r}.")
    return [int(v) for v in layers]


def _probe_model(
    name: str,
    out: Path,
    settings: dict[str, Any],
    world_size: int,
    config: dict[str, Any] | None,
    progress: bool,
    log: Log,
) -> tuple[pd.DataFrame, Path]:
    start = time.perf_counter()
    backend, rank, seq_len = settings["backend"], settings["rank"], settings["seq_len"]
    log(f"loading {name} ({backend}) …")
    with quiet_transformers():
        loaded = load(name, backend)
    probes, notes = ["residual", "attention"], []
    if loaded.causal:
        probes.append("gradient")
    else:
        notes.append("encoder: no next-token loss, so the gradient probe is skipped")
        log(notes[-1])
    context = context_length(loaded.model)
    if context is not None and seq_len > context:
        log(f"--seq-len {seq_len} exceeds the model's context; using {context}")
        seq_len = context
    blocks = token_blocks(
        loaded.tokenizer, settings["text"], settings["tokens"], seq_len, settings["encoding"]
    )
    probed = int((blocks.shape[0] - blocks.shape[0] // 2) * blocks.shape[1])
    if probed != settings["tokens"]:  # whole blocks of --seq-len, as the text allows
        notes.append(f"--tokens {settings['tokens']}: {probed} probed, in blocks of {seq_len}")
        log(notes[-1])
    table, bases = probe_checkpoint(
        loaded.model,
        blocks,
        rank=rank,
        layers=settings["layers"],
        probes=probes,
        batch_size=settings["batch_size"],
        n_controls=settings["n_controls"],
        world_size=world_size,
        model_factory=functools.partial(_load_model, name, backend),
        progress=progress,
    )
    own = ["manifest.json", f"bases/rank{rank}.safetensors"]  # and the page: what it describes
    retire(out, [*own, *(p.relative_to(out).as_posix() for p in page_files(out))])
    results.write(table, out)
    bases.save(out / "bases" / f"rank{rank}.safetensors")
    manifest = {
        "command": "probe",
        "model": name,
        "source": loaded.source,
        "backend": backend,
        "tokens_fitted": int(blocks.shape[0] // 2 * blocks.shape[1]),
        "tokens_probed": probed,
        "probes": probes,
        "notes": notes,
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
    encoding: str | None = None,
    max_steps: int | None = None,
    seed: int | None = None,
    objective: str | None = None,
) -> TrainConfig:
    """The trainer's config: defaults, or a tiny model (``quick``: five checkpoints);
    ``objective`` "causal" (a decoder) or "masked" (an encoder)."""
    if encoding is not None:
        check_encoding(encoding, "--encoding")
    chosen = {
        "corpus": _local(corpus),
        "encoding": encoding,
        "max_steps": max_steps,
        "seed": seed,
        "objective": objective,
    }
    overrides = {k: v for k, v in chosen.items() if v is not None}
    if quick:  # a tiny model, `QUICK_TRAIN`: seconds
        return TrainConfig.tiny(**{**QUICK_TRAIN, **overrides})
    return TrainConfig(**overrides)


def seed_config(config: TrainConfig, seed: int, seeds: Sequence[int]) -> TrainConfig:
    """``config`` for ``seed`` as one of ``seeds``: their runs share the train/probe split
    of the smallest seed, so one probe set is held out from every seed's training."""
    return dataclasses.replace(config, seed=seed, split_seed=min(seeds))


def train_seeds(
    config: TrainConfig,
    out: Path,
    *,
    seeds: Sequence[int] | None = TRAIN.seeds.default,
    progress: bool = True,
    log: Log = quiet,
) -> dict[int, Path]:
    """Train ``config`` into ``out`` (``seeds`` None), or once per seed into
    ``out/seed{S}/`` (`seed_config`); returns ``{seed: folder}``. Each seed's folder is its
    own run, resumed on its own; the seeds after the first copy its tokenizer (the same
    one, trained once). ``out`` itself is held for the whole run and records the design
    (the config without its seeds), so seeds above the smallest (whose split all share)
    can be added later to the same folder."""
    out = Path(out).expanduser()
    if seeds is None:
        return {config.seed: train(config, out, progress=progress)}
    seeds = check_seeds(seeds, "--seeds")
    design = {k: v for k, v in config.to_dict().items() if k not in ("seed", "split_seed")}
    folders: dict[int, Path] = {}
    with lock_folder(out, "train --seeds") as lock:  # its own name: no single run mixes in
        lock.claim(design, ("seed*",), results=("seed*/step*", "step*"))
        remove_stale_temporaries(out)
        shared: Path | None = None
        for n, seed in enumerate(seeds):
            folder = out / SEED_DIR.format(seed)
            log(f"[{n + 1}/{len(seeds)}] seed {seed} → {folder}")
            train(seed_config(config, seed, seeds), folder, progress, tokenizer_from=shared)
            shared = shared or folder / TOKENIZER_DIR
            folders[seed] = folder
    return folders


# ----------------------------------------------------------------------------- study
def _train_record(checkpoints: str) -> dict[str, Any]:
    """The config a `tangentlens train` folder records (empty for other series); a damaged
    one names its file (`trained_config`)."""
    config = trained_config(checkpoints)
    return {} if config is None else config.to_dict()


def _trained_with(checkpoints: str) -> dict[str, Any]:
    """Corpus settings of a `tangentlens train` folder, so the study's probe set is the
    trainer's held-out split (for one of several seeds, their shared split) and fits the
    model's context (empty for other series)."""
    saved = _train_record(checkpoints)
    keys = ("corpus", "encoding", "max_chars", "seq_len", "probe_fraction", "seed")
    found = {k: saved[k] for k in keys if k in saved}
    if saved.get("split_seed") is not None:
        found["seed"] = saved["split_seed"]
    return found


def study_config(checkpoints: str, *, quick: bool = False, **options: Any) -> StudyConfig:
    """A `StudyConfig` for ``checkpoints``: the trainer's corpus settings when it is a
    `tangentlens train` folder, the quick settings, then ``options`` that are not None."""
    if not Path(checkpoints).expanduser().exists() and not is_hub_id(checkpoints):
        raise MissingFileError(
            f"--checkpoints {checkpoints} does not exist (and is no hub id 'org/name'); "
            "pass the folder `tangentlens train` wrote"
        )
    if options.get("encoding") is not None:
        check_encoding(options["encoding"], "--encoding")
    base = dict(QUICK_STUDY) if quick else {}
    base.update(_trained_with(checkpoints))
    base.update({k: v for k, v in options.items() if v is not None})
    if base.get("corpus") is not None:
        base["corpus"] = _local(base["corpus"])
    return StudyConfig(checkpoints=_local(checkpoints), **base)


def run_study(
    config: StudyConfig,
    out: Path,
    *,
    world_size: int = STUDY.world_size.default,
    progress: bool = True,
) -> pd.DataFrame:
    """Run (or resume) the study into ``out`` and write its report from the table and
    manifest it wrote (not read back), holding the folder."""
    with lock_folder(out, "study"):
        study = Study(config)
        stale = page_files(Path(out))
        table = study.run(out, world_size=world_size, progress=progress, also_retire=stale)
        write_report(table, Path(out) / "report.html", manifest=study.manifest)
    return table


def _seed_folders(folder: Path) -> dict[int, Path]:
    """The ``seed{S}/`` series in ``folder`` (what `train_seeds` writes), by seed."""
    subs = [(re.fullmatch(r"seed(\d+)", p.name), p) for p in folder.iterdir() if p.is_dir()]
    return dict(sorted((int(m.group(1)), p) for m, p in subs if m))


def series_seeds(checkpoints: Sequence[str]) -> dict[int, str]:
    """``{seed: series}`` for the ``--checkpoints`` given: one folder of ``seed{S}/``
    series (no ``step{N}/`` of its own), or several series, each named by its seed
    (``.../seed{S}`` or ``...-seed{S}``) or recording it (a `tangentlens train` folder).
    A single series of another kind is ``{seed: it}`` with its trainer's seed, else 0."""
    checkpoints = [str(c) for c in checkpoints]
    if not checkpoints:
        raise UsageError("--checkpoints names no series; pass a folder or hub id")
    if len(checkpoints) == 1:
        only = Path(checkpoints[0]).expanduser()
        found = _seed_folders(only) if only.is_dir() else {}
        if found and not any(only.glob("step*")):
            return {seed: str(path) for seed, path in found.items()}
        return {int(_train_record(checkpoints[0]).get("seed", 0)): checkpoints[0]}
    out: dict[int, str] = {}
    for source in checkpoints:
        match = _SEED_NAME.search(source.rstrip("/\\"))
        seed = int(match.group(1)) if match else _train_record(source).get("seed")
        if not is_int(seed):
            raise UsageError(
                f"--checkpoints {source}: its seed is unknown; name each series by its seed "
                "(a folder seed{S}, a hub id ending -seed{S}) or pass `tangentlens train` folders"
            )
        seed = int(seed)
        if seed in out:
            raise UsageError(
                f"--checkpoints {out[seed]} and {source} are both seed {seed}; pass each "
                "seed's series once"
            )
        out[seed] = source
    return dict(sorted(out.items()))


# what may differ between the seeds of one design: the series, the seeds, and the threads
# a run was trained on (which move the bits of the weights, not the design)
_SEED_KEYS = ("checkpoints", "seed", "train seed", "train split_seed", "train num_threads")


def _one_design(configs: Mapping[int, StudyConfig]) -> None:
    """Refuse seeds of different designs before any study runs: an interval over seeds
    pools replications of one training design, studied one way. Their series must have
    checkpoints at the same steps, and their study and training settings must agree but
    for the series, the seed, the seed of the held-out split (a run trained on its own
    draws its split from its seed; other text to probe is part of what a seed varies) and
    the thread count it trained on."""

    def settings(cfg: StudyConfig) -> dict[str, Any]:
        trained = {f"train {k}": v for k, v in _train_record(cfg.checkpoints).items()}
        found = cfg.to_dict() | trained
        return {k: v for k, v in found.items() if k not in _SEED_KEYS}

    (_, first), *rest = configs.items()
    mine, steps = settings(first), open_series(first.checkpoints).steps
    for seed, cfg in rest:
        theirs = settings(cfg)
        differ = sorted(k for k in mine.keys() | theirs.keys() if theirs.get(k) != mine.get(k))
        if differ:
            raise UsageError(
                f"--checkpoints {cfg.checkpoints} (seed {seed}) was trained or is studied with "
                f"other settings than {first.checkpoints} ({differ}); pass the seeds of one "
                "design (`tangentlens train --seeds` writes them) and study others apart"
            )
        found = open_series(cfg.checkpoints).steps
        if found != steps:
            raise UsageError(
                f"--checkpoints {cfg.checkpoints} (seed {seed}) has checkpoints at steps "
                f"{found}, {first.checkpoints} at {steps}; pass the seeds of one design "
                "(the same training length and schedule)"
            )


def run_studies(
    configs: Mapping[int, StudyConfig],
    out: Path,
    *,
    world_size: int = STUDY.world_size.default,
    progress: bool = True,
    log: Log = quiet,
) -> tuple[dict[str, dict[int, pd.DataFrame]], list[Claim]]:
    """One study per seed's series (``{seed: config}``, one design) into
    ``out/seed{S}/``, each with its report, then the claims over every seed's table
    (`paper_claims`) into ``out/summary.json`` and the overview page ``out/report.html``
    (the claims, each seed's figures and a link to its report, as `demo` writes); returns
    ``({kind: {seed: table}}, claims)``.
    ``out`` is held for the whole run; each seed's study resumes on its own."""
    if not configs:
        raise UsageError("no series to study; pass --checkpoints")
    _one_design(configs)
    out = Path(out).expanduser()
    tables: dict[int, pd.DataFrame] = {}
    kinds: dict[int, str] = {}
    series = {str(seed): cfg.checkpoints for seed, cfg in configs.items()}
    with lock_folder(out, "study per seed") as lock:  # its own name: no single study mixes in
        lock.claim(
            {"series": series},
            ("seed*", SUMMARY_FILE, "report.html"),
            results=("seed*/results.csv",),
        )
        remove_stale_temporaries(out)
        for n, (seed, cfg) in enumerate(configs.items()):
            folder = out / SEED_DIR.format(seed)
            log(f"[{n + 1}/{len(configs)}] seed {seed}: {cfg.checkpoints} → {folder}")
            with lock_folder(folder, "study"):
                study = Study(cfg)
                stale = [*page_files(folder), *overview_files(out)]
                tables[seed] = study.run(
                    folder, world_size=world_size, progress=progress, also_retire=stale
                )
                write_report(tables[seed], folder / "report.html", manifest=study.manifest)
            masked = (study.manifest or {}).get("objective") == "masked-token"
            kinds[seed] = "encoder" if masked else "decoder"
        if len(set(kinds.values())) > 1:
            raise UsageError(
                f"the series mix decoders and encoders ({kinds}); study each design on its own"
            )
        kind = next(iter(kinds.values()))
        fraction = next(iter(configs.values())).window_fraction  # the panel's, as the study's
        claims = paper_claims({kind: tables}, window_fraction=fraction)
        folders = {SEED_DIR.format(s): out / SEED_DIR.format(s) for s in tables}
        summary = {"claims": [c.to_dict() for c in claims], "models": [kind],
                   "seeds": list(tables), "series": series,
                   "runs": run_digests(folders)}  # fmt: skip
        write_checked_json(out / SUMMARY_FILE, summary)
        title = OVERVIEW_TITLES["study per seed"]
        write_overview(folders, claims, out / "report.html", title=title)
    return {kind: tables}, claims
