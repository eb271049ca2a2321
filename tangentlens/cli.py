"""The ``tangentlens`` command (also ``python -m tangentlens``).

    tangentlens demo [--out DIR] [--quick]         train, study, report: all offline
    tangentlens probe --model NAME|FOLDER --out DIR one checkpoint: bases, probes, figures
    tangentlens train --out DIR                     the small model, Pythia-like checkpoints
    tangentlens study --checkpoints DIR|HUB_ID --out DIR
    tangentlens report DIR                          re-render report.html from saved results

Imports stay inside the commands so ``tangentlens --help`` answers without loading torch.
Mistakes a person can make end in one line on stderr that names the fix and exit code 2;
set ``TANGENTLENS_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from . import __version__

__all__ = ["build_parser", "main"]

EXIT_USAGE = 2
DEBUG_ENV = "TANGENTLENS_DEBUG"
CHECKPOINTS_DIR = "checkpoints"


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see `{self.prog} --help`.\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _layer(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"a layer is an integer >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 0.5:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 0.5], got {text!r}")
    return value


# ----------------------------------------------------------------------------- helpers
def _writable_dir(path: str | Path) -> Path:
    """Create ``path`` and check a file can be written there, before any long work."""
    import tempfile

    out = Path(path).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise OSError(f"cannot write to {out} ({reason}); choose a writable --out folder") from err
    return out


def _save_table(table: Any, out: Path, name: str = "results") -> None:
    from .io import write_text

    write_text(out / f"{name}.csv", table.to_csv(index=False))
    write_text(out / f"{name}.json", table.to_json(orient="records", indent=1) + "\n")


def _token_blocks(tokenizer: Any, text: str | None, tokens: int, seq_len: int) -> Any:
    """``(n, seq_len)`` token blocks: ``2 * tokens`` tokens of the text (or the KJV)."""
    from .corpus import encode, load_lines

    lines = load_lines(text, max_chars=max(20_000, 12 * 2 * tokens))
    ids = encode(tokenizer, lines)
    n_blocks = min(ids.numel() // seq_len, 2 * max(1, tokens // seq_len))
    if n_blocks < 2:
        raise ValueError(
            f"the text has {ids.numel()} tokens, too few for two blocks of {seq_len}; "
            "pass a longer --text or a smaller --seq-len"
        )
    return ids[: n_blocks * seq_len].view(n_blocks, seq_len)


def _probe_checkpoint(
    model: Any,
    blocks: Any,
    *,
    rank: int,
    layers: Sequence[int] | None = None,
    probes: Sequence[str] = ("residual", "attention", "gradient"),
    batch_size: int = 8,
    n_controls: int = 1000,
    world_size: int = 1,
    model_factory: Callable[[], Any] | None = None,
    progress: bool = True,
) -> tuple[Any, Any]:
    """Fit rank-``rank`` bases (resid_pre and attention input) on the first half of
    ``blocks`` and probe the second half; returns ``(results, bases)``."""
    from .hooks.base import get_backend
    from .hooks.sites import Site
    from .probes.session import fit_bases, run

    d_model = get_backend(model).d_model
    if 2 * rank > d_model:
        raise ValueError(
            f"--rank {rank} is too large for d_model={d_model}: matched-rank normal controls "
            f"need rank <= d_model / 2 = {d_model // 2}"
        )
    half = blocks.shape[0] // 2
    fit_set = list(blocks[:half].split(batch_size))
    per_process = -(-(blocks.shape[0] - half) // world_size)  # every process gets a batch
    probe_set = list(blocks[half:].split(min(batch_size, per_process)))

    def sites(name: str) -> bool:
        return Site.from_hook_name(name).kind in ("resid_pre", "attn_in")

    bases = fit_bases(model, fit_set, rank, sites=sites, layers=layers, progress=progress)
    if world_size > 1:
        from .distributed import run_probe

        results = run_probe(
            model_factory, probe_set, bases, probes, world_size=world_size,
            layers=layers, n_controls=n_controls, progress=progress,
        )  # fmt: skip
    else:
        session = run(
            model, probe_set, bases, probes, layers=layers, n_controls=n_controls,
            progress=progress,
        )  # fmt: skip
        results = session.results()
    return results, bases


def _context_length(model: Any) -> int | None:
    """The longest sequence the model takes (TransformerLens ``cfg.n_ctx`` or HF config)."""
    cfg = getattr(model, "cfg", None)
    if getattr(cfg, "n_ctx", None):
        return int(cfg.n_ctx)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(limit) if limit else None


def _load_model(name: str, backend: str) -> Any:
    """Module-level (picklable) model factory for data-parallel workers."""
    from .models import load

    return load(name, backend).model


# ----------------------------------------------------------------------------- commands
def cmd_probe(args: argparse.Namespace) -> int:
    """One checkpoint: fit bases, run the probes, write tables, figures and a report."""
    import functools

    import tangentlens

    from .checkpoints import quiet_transformers
    from .io import write_json
    from .models import load
    from .report import format_summary, summary, write_report

    out = _writable_dir(args.out)
    start = time.perf_counter()
    print(f"loading {args.model} ({args.backend}) …", flush=True)
    with quiet_transformers():
        loaded = load(args.model, args.backend)
    probes = ["residual", "attention"]
    if loaded.causal:
        probes.append("gradient")
    else:
        print("encoder: no next-token loss, so the gradient probe is skipped", flush=True)
    seq_len = args.seq_len
    context = _context_length(loaded.model)
    if context is not None and seq_len > context:
        print(f"--seq-len {seq_len} exceeds the model's context; using {context}", flush=True)
        seq_len = context
    blocks = _token_blocks(loaded.tokenizer, args.text, args.tokens, seq_len)
    results, bases = _probe_checkpoint(
        loaded.model,
        blocks,
        rank=args.rank,
        layers=args.layers,
        probes=probes,
        batch_size=args.batch_size,
        n_controls=args.controls,
        world_size=args.world_size,
        model_factory=functools.partial(_load_model, args.model, args.backend),
        progress=not args.quiet,
    )
    _save_table(results, out)
    bases.save(out / "bases" / f"rank{args.rank}.safetensors")
    manifest = {
        "command": "probe",
        "model": args.model,
        "source": loaded.source,
        "backend": args.backend,
        "tokens_fitted": int(blocks.shape[0] // 2 * blocks.shape[1]),
        "tokens_probed": int((blocks.shape[0] - blocks.shape[0] // 2) * blocks.shape[1]),
        "probes": probes,
        "seconds": round(time.perf_counter() - start, 1),
        "tangentlens_version": tangentlens.__version__,
        "bases": bases.provenance,
        "config": _config(args),
    }
    write_json(out / "manifest.json", manifest)
    page = write_report(results, out / "report.html", manifest=manifest, title=f"{args.model}")
    print(f"\nreport: {page}\ntables: {out / 'results.csv'}, bases: {out / 'bases'}", flush=True)
    print(format_summary(summary(results)), flush=True)
    return 0


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("func", "quiet")}


def _train_config(args: argparse.Namespace) -> Any:
    from .train import TrainConfig

    names = ("corpus", "max_steps", "seed")
    overrides = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    if args.quick:  # five checkpoints (0, 1, 2, 4, 8) of a tiny model: seconds
        return TrainConfig.tiny(**{"max_steps": 8, **overrides})
    return TrainConfig(**overrides)


def cmd_train(args: argparse.Namespace) -> int:
    """Train the small model and save its checkpoint series."""
    from .train import train

    out = _writable_dir(args.out)
    config = _train_config(args)
    start = time.perf_counter()
    train(config, out, progress=not args.quiet)
    elapsed = time.perf_counter() - start
    steps = config.steps
    print(f"checkpoints: {out} (steps {steps[0]}…{steps[-1]}, {elapsed:.0f} s)", flush=True)
    return 0


_QUICK_STUDY = {"n_controls": 50, "n_permutations": 20, "n_sequences": 8, "reservoir": 256}


def _trained_with(checkpoints: str) -> dict[str, Any]:
    """Corpus settings of a `tangentlens train` folder, so the study's probe set is the
    trainer's held-out split and fits the model's context (empty for other series)."""
    import json

    path = Path(checkpoints).expanduser() / "train_config.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    keys = ("corpus", "max_chars", "seq_len", "probe_fraction", "seed")
    return {k: saved[k] for k in keys if k in saved}


def _study_config(args: argparse.Namespace, checkpoints: str) -> Any:
    from .study import StudyConfig

    ranks = getattr(args, "rank", None) or []
    options = {"n_controls": "controls", "n_sequences": "sequences"}
    options |= {k: k for k in ("backend", "window_fraction", "corpus", "seed")}
    chosen = {key: getattr(args, name, None) for key, name in options.items()}
    chosen["rank"] = tuple(ranks) if len(ranks) > 1 else (ranks[0] if ranks else None)
    base = dict(_QUICK_STUDY) if args.quick else {}
    base.update(_trained_with(checkpoints))
    base.update({k: v for k, v in chosen.items() if v is not None})
    return StudyConfig(checkpoints=checkpoints, **base)


def _run_study(args: argparse.Namespace, checkpoints: str, out: Path) -> Any:
    from .study import Study

    config = _study_config(args, checkpoints)
    return Study(config).run(out, world_size=args.world_size, progress=not args.quiet)


def cmd_study(args: argparse.Namespace) -> int:
    """Run the training-dynamics study over a checkpoint series and write the report."""
    from .models import is_hub_id
    from .report import format_summary, summary, write_report

    out = _writable_dir(args.out)
    checkpoints = args.checkpoints
    if not Path(checkpoints).expanduser().exists() and not is_hub_id(checkpoints):
        raise FileNotFoundError(
            f"--checkpoints {checkpoints} is neither an existing folder nor a hub id "
            "'org/name'; pass the folder `tangentlens train` wrote"
        )
    start = time.perf_counter()
    table = _run_study(args, checkpoints, out)
    page = write_report(out, out / "report.html")
    print(f"\nreport: {page} ({time.perf_counter() - start:.0f} s)", flush=True)
    print(format_summary(summary(table)), flush=True)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Re-render report.html (and figures/) from a saved results folder."""
    from .report import write_report

    folder = Path(args.dir).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder} is not a folder; pass the --out folder of `tangentlens study` or `probe`"
        )
    target = Path(args.out) if args.out else folder / "report.html"
    _writable_dir(target.parent)
    page = write_report(folder, target)
    print(f"report: {page}", flush=True)
    return 0


def _heads(args: argparse.Namespace, checkpoints: Path, out: Path, table: Any) -> None:
    """Attention-head probe of the last early-window and the final checkpoint (the
    study itself has no per-head numbers); written to ``heads.csv``."""
    import pandas as pd

    from .checkpoints import CheckpointSeries, quiet_transformers
    from .io import write_text
    from .models import load
    from .report import HEADS_FILE

    series = CheckpointSeries.from_folder(checkpoints)
    windows = table.drop_duplicates("step").set_index("step")["window"]
    early = [s for s in series.steps if windows.get(s) == "early"]
    chosen = sorted({early[-1] if early else series.steps[0], series.steps[-1]})
    rank = int(pd.to_numeric(table["rank"], errors="coerce").min())
    frames = []
    for step in chosen:
        with quiet_transformers():
            loaded = load(str(series[series.index(step)].source), "transformer_lens")
        seq_len = min(64, _context_length(loaded.model) or 64)
        blocks = _token_blocks(loaded.tokenizer, None, 16 * seq_len, seq_len)
        results, _ = _probe_checkpoint(
            loaded.model, blocks, rank=rank, probes=("attention",), progress=not args.quiet
        )
        results = results.assign(
            checkpoint=f"step{step}", step=step, window=windows.get(step), rank=rank
        )
        frames.append(results)
    heads = pd.concat(frames, ignore_index=True)
    write_text(out / HEADS_FILE, heads.to_csv(index=False))


def cmd_demo(args: argparse.Namespace) -> int:
    """Train the small model, run the study, probe the heads, write the report."""
    from .report import format_summary, summary, write_report
    from .train import train

    out = _writable_dir(args.out)
    start = time.perf_counter()
    checkpoints = out / CHECKPOINTS_DIR
    config = _train_config(args)
    print(f"[1/4] training the small model ({config.max_steps} steps) → {checkpoints}", flush=True)
    train(config, checkpoints, progress=not args.quiet)
    print("[2/4] running the study over the checkpoints", flush=True)
    table = _run_study(args, str(checkpoints), out)
    print("[3/4] probing attention heads (early window and final checkpoint)", flush=True)
    _heads(args, checkpoints, out, table)
    print("[4/4] writing the report", flush=True)
    page = write_report(out, out / "report.html")
    elapsed = time.perf_counter() - start
    print(f"\ntangentlens demo finished in {elapsed:.0f} s", flush=True)
    print(f"report:  {page.resolve()}\nresults: {(out / 'results.csv').resolve()}", flush=True)
    print("\nheadline numbers (measured here vs the paper):", flush=True)
    print(format_summary(summary(table)), flush=True)
    return 0


# ----------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    """The argument parser (no heavy imports)."""
    parser = _Parser(
        prog="tangentlens",
        description="Tangent-subspace probes and anisotropy statistics for language models.",
        epilog="Set TANGENTLENS_DEBUG=1 to see tracebacks instead of one-line errors.",
    )
    parser.add_argument("--version", action="version", version=f"tangentlens {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    kjv = "text file or folder of .txt files (default: the King James Bible)"
    backends = ("transformer_lens", "nnsight")

    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="train, study and report, fully offline (at most 5 minutes)",
        description="Train the small model on the embedded corpus (King James Bible), run "
        "the study over its checkpoints, probe the attention heads, write report.html.",
    )
    demo.add_argument("--out", metavar="DIR", default="tangentlens-demo", help="(%(default)s)")
    demo.add_argument("--quick", action="store_true", help="tiny configs: seconds (tests)")
    demo.set_defaults(func=cmd_demo, world_size=1)

    probe = sub.add_parser(
        "probe",
        parents=[common],
        help="probe one checkpoint: bases, probes, tables, figures",
        description="Fit rank-k tangent bases at resid_pre and the attention input on one "
        "half of the tokens, run the residual, attention and gradient probes on the other "
        "half, write results.csv/json, bases/, figures/ and report.html.",
    )
    probe.add_argument(
        "--model",
        metavar="NAME|FOLDER",
        required=True,
        help="smollm2-135m, minilm-l6, a local Hugging Face folder, or a hub id",
    )
    probe.add_argument("--backend", choices=backends, default=backends[0], help="(%(default)s)")
    probe.add_argument("--text", metavar="FILE", help=kjv)
    probe.add_argument(
        "--rank", metavar="K", type=_positive_int, default=16, help="rank of Q_T (16)"
    )
    probe.add_argument("--layers", metavar="L", type=_layer, nargs="+", help="layers (all)")
    probe.add_argument(
        "--tokens",
        metavar="N",
        type=_positive_int,
        default=1024,
        help="tokens probed; as many again fit the bases (%(default)s)",
    )
    probe.add_argument(
        "--seq-len", metavar="N", type=_positive_int, default=128, help="tokens per row (128)"
    )
    probe.add_argument(
        "--batch-size", metavar="N", type=_positive_int, default=8, help="rows per batch (8)"
    )
    probe.add_argument(
        "--controls",
        metavar="N",
        type=_positive_int,
        default=200,
        help="normal controls per test (200)",
    )
    probe.add_argument(
        "--world-size",
        metavar="N",
        type=_positive_int,
        default=1,
        help="data-parallel processes (1)",
    )
    probe.add_argument("--out", metavar="DIR", required=True, help="output folder")
    probe.set_defaults(func=cmd_probe)

    train = sub.add_parser(
        "train",
        parents=[common],
        help="train the small model, save its checkpoints",
        description="Train a small Llama-style LM with a Pythia-like checkpoint schedule "
        "(step0, step1, step2, step4, ...); a rerun with the same options resumes.",
    )
    train.add_argument("--out", metavar="DIR", required=True, help="output folder")
    train.add_argument("--corpus", metavar="FILE", help=kjv)
    train.add_argument(
        "--max-steps", metavar="N", type=_positive_int, help="training steps (default: TrainConfig)"
    )
    train.add_argument("--seed", metavar="N", type=int, help="random seed (0)")
    train.add_argument("--quick", action="store_true", help="a tiny model: seconds")
    train.set_defaults(func=cmd_train)

    study = sub.add_parser(
        "study",
        parents=[common],
        help="the training-dynamics study over a checkpoint series",
        description="Fit Q_T on the early-window checkpoints, test the gradients of every "
        "checkpoint against it, measure embedding geometry, write the results and "
        "report.html. A rerun with the same options resumes.",
    )
    study.add_argument(
        "--checkpoints",
        metavar="DIR|HUB_ID",
        required=True,
        help="a folder of step{N}/ checkpoints, or a hub id such as EleutherAI/pythia-70m",
    )
    study.add_argument("--out", metavar="DIR", required=True, help="output folder")
    study.add_argument("--backend", choices=backends, help="(transformer_lens)")
    study.add_argument("--rank", metavar="K", type=_positive_int, nargs="+", help="rank(s) (16)")
    study.add_argument("--controls", metavar="N", type=_positive_int, help="controls (1000)")
    study.add_argument(
        "--window-fraction", metavar="F", type=_fraction, help="of checkpoints (0.3)"
    )
    study.add_argument("--sequences", metavar="N", type=_positive_int, help="probe set (32)")
    study.add_argument("--corpus", metavar="FILE", help=kjv)
    study.add_argument("--seed", metavar="N", type=int, help="random seed (0)")
    study.add_argument(
        "--world-size",
        metavar="N",
        type=_positive_int,
        default=1,
        help="data-parallel processes (1)",
    )
    study.add_argument("--quick", action="store_true", help="few controls and tokens")
    study.set_defaults(func=cmd_study)

    report = sub.add_parser(
        "report",
        parents=[common],
        help="re-render report.html from saved results",
        description="Read results.csv (and manifest.json) in DIR; write report.html and figures/.",
    )
    report.add_argument("dir", metavar="DIR", help="the --out folder of study, probe or demo")
    report.add_argument("--out", metavar="FILE", help="HTML file to write (DIR/report.html)")
    report.set_defaults(func=cmd_report)
    return parser


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text.rstrip(".")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(
            f"tangentlens {args.command}: interrupted; rerun to resume", file=sys.stderr, flush=True
        )
        return 130
    except (ValueError, OSError, ModuleNotFoundError) as err:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print(f"tangentlens {args.command}: error: {_one_line(err)}", file=sys.stderr, flush=True)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
