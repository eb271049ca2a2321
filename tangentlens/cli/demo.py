"""`tangentlens demo`: a decoder and an encoder, several training seeds each, trained,
studied and reported offline, then the verdicts over every seed and one overview page.

Each model kind runs seed after seed (`_demo_kind`); the kinds run side by side in worker
processes, each on one torch thread, so the tables equal those of the kinds in turn. The
steps themselves are the other commands' workflows (`tangentlens.cli.workflows`).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..core.errors import ResumeRefusedError, UsageError
from ..core.files import remove_stale_temporaries, write_checked_json
from ..core.folders import lock_folder
from ..core.settings import DEMO, DEMO_STUDY, QUICK_DEMO
from ..core.validation import check_int, check_seeds
from ..data.train import TOKENIZER_DIR, train
from ..probes.distributed import die_with_parent
from ..report import write_overview, write_report
from ..report.claims import Claim
from ..report.page import run_title
from ..report.render import run_digests
from ..report.verdicts import paper_claims
from ..study import Study
from .workflows import (
    CHECKPOINTS_DIR,
    SEED_DIR,
    SUMMARY_FILE,
    Log,
    overview_files,
    page_files,
    quiet,
    seed_config,
    study_config,
    train_config,
)

__all__ = ["MODEL_KINDS", "DemoOutcome", "demo", "demo_seeds"]

MODEL_KINDS = {"decoder": "causal", "encoder": "masked"}
DEMO_OUTPUTS = (*MODEL_KINDS, SUMMARY_FILE, "report.html", "figures")


@dataclass(frozen=True)
class DemoOutcome:
    """What `demo` produced: the first seed's decoder table, the overview page, the
    seconds it took, the verdicts, the seeds (of each model kind) and the seconds of work
    of each step, summed over the model kinds (which may run side by side)."""

    table: pd.DataFrame
    report: Path
    seconds: float
    claims: list[Claim]
    seeds: tuple[int, ...] = ()
    timings: dict[str, float] = dataclasses.field(default_factory=dict)


def demo_seeds(seeds: Sequence[int] | str | None, quick: bool) -> tuple[int, ...]:
    """The demo's seeds: ``seeds`` (checked), else `QUICK_DEMO`'s with ``quick``, else
    `DEMO`'s."""
    if seeds is None:
        seeds = QUICK_DEMO["seeds"] if quick else DEMO.seeds.default
    return check_seeds(seeds, "--seeds")


def _demo_kind(
    out: Path,
    kind: str,
    seeds: tuple[int, ...],
    quick: bool,
    progress: bool,
    log: Log,
    parent: int | None = None,
) -> tuple[dict[int, pd.DataFrame], dict[str, float]]:
    """One model kind of the demo, seed after seed: train, study, report. ``parent``: run
    as a worker process of that pid, which it dies with (`die_with_parent`)."""
    if parent is not None:
        die_with_parent(parent)
    objective, shared, tables = MODEL_KINDS[kind], None, {}
    design = train_config(quick=quick, objective=objective)
    timings = {"train_s": 0.0, "study_s": 0.0, "report_s": 0.0}
    first, n_steps = list(MODEL_KINDS).index(kind) * len(seeds), len(MODEL_KINDS) * len(seeds) + 1
    for i, seed in enumerate(seeds):
        folder, step = out / kind / SEED_DIR.format(seed), f"[{first + i + 1}/{n_steps}]"
        config = seed_config(design, seed, seeds)
        log(f"{step} {kind} seed {seed}: training ({objective}, {config.max_steps} "
            f"steps), its study and report → {folder}")  # fmt: skip
        clock = time.perf_counter()
        try:
            ckpt = train(config, folder / CHECKPOINTS_DIR, progress, tokenizer_from=shared)
        except ResumeRefusedError as err:  # the demo has no --restart
            raise UsageError(
                f"{err} For `tangentlens demo`, which has no --restart: delete "
                f"{folder / CHECKPOINTS_DIR} to train it again, or choose a new --out."
            ) from None
        shared = shared or ckpt / TOKENIZER_DIR
        timings["train_s"] += time.perf_counter() - clock
        clock = time.perf_counter()
        cfg = study_config(str(ckpt), quick=quick, **({} if quick else DEMO_STUDY))
        study = Study(cfg)
        stale = [*page_files(folder), *overview_files(out)]
        tables[seed] = study.run(folder, progress=progress, also_retire=stale)
        timings["study_s"] += time.perf_counter() - clock
        clock = time.perf_counter()
        title = run_title("demo", f"{kind}/{SEED_DIR.format(seed)}")
        write_report(tables[seed], folder / "report.html", manifest=study.manifest, title=title)
        timings["report_s"] += time.perf_counter() - clock
    return tables, timings


def demo(
    out: Path,
    *,
    quick: bool = False,
    seeds: Sequence[int] | None = None,
    progress: bool = True,
    log: Log = quiet,
    workers: int | None = None,
) -> DemoOutcome:
    """Train a decoder and an encoder once per seed (`demo_seeds`), study each series,
    probe their heads, write each a report, then ``summary.json`` (the paper's claims
    with verdicts from intervals over every seed's table, and the seeds) and
    ``report.html`` side by side: the whole folder is the demo's.

    ``OUT/{decoder,encoder}/seed{S}/`` holds each run: ``checkpoints/`` and its study.
    The seeds of a kind share the tokenizer (trained once, copied) and the train/probe
    split (`seed_config`), so every seed is studied on the same held-out probe set and
    the corpus is encoded once per kind (`tangentlens.data.corpus.encoded`).

    ``workers``: processes the kinds run in side by side (default: one a kind, up to the CPU
    count); each trains and studies on one torch thread, exactly, so they give the tables
    of the kinds in turn; each kind's folder has one writer; the bars are the first kind's."""
    start = time.perf_counter()
    out = Path(out).expanduser()
    seeds = demo_seeds(seeds, quick)
    kinds, n_steps = list(MODEL_KINDS), len(MODEL_KINDS) * len(seeds) + 1
    workers = check_int(min(len(kinds), os.cpu_count() or 1) if workers is None else workers,
                        "workers", minimum=1)  # fmt: skip
    with lock_folder(out, "demo") as lock:
        claim = {"quick": bool(quick), "seeds": list(seeds)}
        lock.claim(claim, DEMO_OUTPUTS, results=("*/seed*/results.csv",))
        remove_stale_temporaries(out)
        if workers > 1:
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(min(workers, len(kinds)), mp_context=context) as pool:
                jobs = [pool.submit(_demo_kind, out, kind, seeds, quick, progress and not n, log,
                                    os.getpid()) for n, kind in enumerate(kinds)]  # fmt: skip
                done = [job.result() for job in jobs]
        else:
            done = [_demo_kind(out, kind, seeds, quick, progress, log) for kind in kinds]
        tables = {kind: found[0] for kind, found in zip(kinds, done, strict=True)}
        timings = {key: sum(spent[key] for _, spent in done) for key in done[0][1]}  # summed
        log(f"[{n_steps}/{n_steps}] verdicts over {len(seeds)} seed(s) per kind, and the report")
        clock = time.perf_counter()
        claims = paper_claims(tables)
        folders = {f"{k}/{SEED_DIR.format(s)}": out / k / SEED_DIR.format(s)
                   for k in kinds for s in seeds}  # fmt: skip
        summary = {"claims": [c.to_dict() for c in claims], "models": kinds,
                   "seeds": list(seeds), "runs": run_digests(folders)}  # fmt: skip
        write_checked_json(out / SUMMARY_FILE, summary)
        page = write_overview(folders, claims, out / "report.html")
        timings["verdicts_s"] = time.perf_counter() - clock
    first = tables["decoder"][seeds[0]]
    return DemoOutcome(first, page, time.perf_counter() - start, claims, seeds, timings)
