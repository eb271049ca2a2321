"""The ``tangentlens`` command (also ``python -m tangentlens``).

    tangentlens demo [--out DIR] [--seeds 0,1,2] [--quick]  train, study, report: offline
    tangentlens probe --model NAME|FOLDER --out DIR one checkpoint: bases, probes, figures
    tangentlens train --out DIR [--seeds 0,1,2]     the small model, Pythia-like checkpoints
    tangentlens study --checkpoints DIR|HUB_ID [...] --out DIR
    tangentlens report DIR                          re-render report.html from saved results

Imports stay inside the commands so ``tangentlens --help`` answers without loading torch.
Every default and its help text come from `tangentlens.core.settings`, the records the API's
signatures and config dataclasses read too.
Mistakes a person can make end in one line on stderr that names the fix and exit code 2;
set ``TANGENTLENS_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from .. import __version__
from ..core.errors import CorruptFileError, UsageError
from ..core.settings import (
    DEMO,
    PROBE,
    QUICK_DEMO,
    QUICK_STUDY,
    QUICK_TRAIN,
    STUDY,
    TRAIN,
    Setting,
    shown,
)
from ..core.validation import (
    BACKENDS,
    CONTROLS,
    OBJECTIVES,
    check_int,
)
from . import arguments as arg

__all__ = ["build_parser", "main"]

EXIT_USAGE = 2
EXIT_BUG = 1
DEBUG_ENV = "TANGENTLENS_DEBUG"


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        message = message.rstrip(".")  # the package's own messages end in one
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see `{self.prog} --help`.\n")


def _help(setting: Setting, *, quick: object = None, trainer: str = "") -> str:
    """``setting``'s help with its default (and its ``--quick`` value, and for a
    `tangentlens train` folder the trainer's ``trainer`` setting in its place)."""
    default = setting.default_text
    if quick is not None:
        default += f"; {shown(quick)} with --quick"
    if trainer:
        default += f", or the trainer's {trainer} for a `tangentlens train` folder"
    return f"{setting.help} (default: {default})".replace("%", "%%")


def _chosen_seeds(args: argparse.Namespace) -> tuple[int, ...] | None:
    """``--seeds``, or ``--n-seeds N`` as seeds 0..N-1, or None (neither given)."""
    if args.n_seeds is not None:
        return tuple(range(check_int(args.n_seeds, "--n-seeds", minimum=1)))
    return args.seeds


# ----------------------------------------------------------------------------- commands
# Each command imports `tangentlens.cli.workflows` when it runs (torch, transformers and the
# model libraries behind it take seconds to import), so ``--help`` answers at once.
def _say(line: str) -> None:
    print(line, flush=True)


def cmd_probe(args: argparse.Namespace) -> int:
    """One checkpoint: fit bases, run the probes, write tables, figures and a report."""
    from ..report import format_summary, summary
    from . import workflows

    out = Path(args.out).expanduser()
    options = {k: v for k, v in vars(args).items() if k not in ("func", "quiet", "command")}
    table, page = workflows.probe_model(
        args.model,
        out,
        backend=args.backend,
        text=args.text,
        encoding=args.encoding,
        rank=args.rank,
        layers=args.layers,
        tokens=args.tokens,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        n_controls=args.n_controls,
        world_size=args.world_size,
        config=options,
        progress=not args.quiet,
        log=_say,
    )
    _say(f"\nreport: {page}\ntables: {out / 'results.csv'}, bases: {out / 'bases'}")
    _say(format_summary(summary(table)))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train the small model and save its checkpoint series."""
    from ..data.resume import start_over
    from ..data.train import train
    from . import workflows

    out = Path(args.out).expanduser()
    config = workflows.train_config(
        quick=args.quick,
        corpus=args.corpus,
        encoding=args.encoding,
        max_steps=args.max_steps,
        seed=args.seed,
        objective=args.objective,
    )
    start = time.perf_counter()
    seeds = _chosen_seeds(args)
    if seeds is None:
        train(config, out, progress=not args.quiet, restart=args.restart)
    else:
        if args.restart:
            start_over(out)
        workflows.train_seeds(config, out, seeds=seeds, progress=not args.quiet, log=_say)
    steps = config.steps
    where = out if seeds is None else out / workflows.SEED_DIR.format("{S}")
    _say(
        f"checkpoints: {where} (steps {steps[0]}…{steps[-1]}, {time.perf_counter() - start:.0f} s)"
    )
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    """Run the training-dynamics study over a checkpoint series (or over each seed's series
    of one design, and the verdicts over all of them) and write the reports."""
    from ..report import format_summary, summary
    from . import workflows

    ranks = args.rank or []
    options = dict(
        quick=args.quick,
        backend=args.backend,
        rank=tuple(ranks) if len(ranks) > 1 else (ranks[0] if ranks else None),
        n_controls=args.n_controls,
        controls=args.controls,
        window_fraction=args.window_fraction,
        windows=args.windows,
        early=args.early,
        late=args.late,
        n_sequences=args.sequences,
        seq_len=args.seq_len,
        head_sequences=args.head_sequences,
        corpus=args.corpus,
        encoding=args.encoding,
        seed=args.seed,
    )
    out = Path(args.out).expanduser()
    start = time.perf_counter()
    series = workflows.series_seeds(args.checkpoints)
    if list(series.values()) == args.checkpoints[:1]:  # one series: its study goes into OUT
        config = workflows.study_config(args.checkpoints[0], **options)
        progress = not args.quiet
        table = workflows.run_study(config, out, world_size=args.world_size, progress=progress)
        _say(f"\nreport: {out / 'report.html'} ({time.perf_counter() - start:.0f} s)")
        _say(format_summary(summary(table, window_fraction=config.window_fraction)))
        return 0
    configs = {seed: workflows.study_config(path, **options) for seed, path in series.items()}
    _, claims = workflows.run_studies(
        configs, out, world_size=args.world_size, progress=not args.quiet, log=_say
    )
    seconds = time.perf_counter() - start
    each = out / workflows.SEED_DIR.format("{S}") / "report.html"
    _say(f"\nreport: {out / 'report.html'} ({seconds:.0f} s); each seed's: {each}")
    _say(f"summary: {out / workflows.SUMMARY_FILE} (seeds {', '.join(map(str, series))})")
    _print_claims(claims)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Re-render the page of a folder the tool wrote (`tangentlens.report.render`)."""
    from . import workflows

    _say(f"report: {workflows.render_report(args.dir, args.out)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Train a decoder and an encoder, study both, write the verdicts and the report."""
    from . import workflows
    from .demo import demo

    out = Path(args.out).expanduser()
    seeds = _chosen_seeds(args)
    done = demo(out, quick=args.quick, seeds=seeds, progress=not args.quiet, log=_say)
    _say(f"\ntangentlens demo finished in {done.seconds:.0f} s")
    spent = ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in done.timings.items())
    if spent:
        _say(
            f"seeds {','.join(map(str, done.seeds))} per model kind; work, summed over the "
            f"kinds run side by side: {spent}"
        )
    _say(f"report:  {done.report.resolve()}")
    _say(f"summary: {(out / workflows.SUMMARY_FILE).resolve()}")
    _print_claims(done.claims)
    return 0


def _print_claims(claims: Sequence[Any]) -> None:
    _say("\nthe paper's claims (verdicts from 95 % intervals; over seeds, Holm-adjusted tests):")
    for c in claims:
        _say(f"  [{c.verdict}] {c.model}, {c.gradient_object}: {c.paper}")
        test = c.describe_test()
        _say(f"      {c.measured} (over {c.interval_covers}{f'; test: {test}' if test else ''})")


# ----------------------------------------------------------------------------- parser
def _seed_options(
    parser: argparse.ArgumentParser, seeds: Setting, *, quick: object = None
) -> argparse._MutuallyExclusiveGroup:
    """``--seeds S,S,...`` and ``--n-seeds N`` (one of them; the group is returned so a
    command can add its single ``--seed`` to it)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--seeds", metavar="S,S,...", type=arg.seeds, help=_help(seeds, quick=quick))
    group.add_argument(
        "--n-seeds", metavar="N", type=arg.positive_int, help=_help(DEMO.n_seeds, quick=None)
    )
    return group


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

    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="train, study and report, fully offline (minutes on two CPU cores)",
        description="Train the small model as a decoder and as an encoder, once per seed, "
        "on the embedded corpus (King James Bible), run the study over each checkpoint "
        "series, probe the attention heads, write the verdicts over all seeds "
        "(summary.json) and report.html.",
    )
    demo.add_argument(
        "--out",
        metavar="DIR",
        type=arg.path,
        default="tangentlens-demo",
        help="output folder (default: %(default)s)",
    )
    _seed_options(demo, DEMO.seeds, quick=QUICK_DEMO["seeds"])
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
        type=arg.path,
        required=True,
        help="smollm2-135m, minilm-l6, gemma3-270m, a local Hugging Face folder, or a hub id",
    )
    probe.add_argument(
        "--backend", choices=BACKENDS, default=PROBE.backend.default, help=_help(PROBE.backend)
    )
    probe.add_argument(
        "--text", metavar="FILE", type=arg.path, default=PROBE.text.default, help=_help(PROBE.text)
    )
    probe.add_argument(
        "--encoding", metavar="NAME", default=PROBE.encoding.default, help=_help(PROBE.encoding)
    )
    # each option's argparse default is its setting's (the API's) default
    for flag, metavar, kind, extra in (
        ("--rank", "K", arg.positive_int, {}),
        ("--layers", "L", arg.layer, {"nargs": "+"}),
        ("--tokens", "N", arg.positive_int, {}),
        ("--seq-len", "N", arg.seq_len, {}),
        ("--batch-size", "N", arg.positive_int, {}),
        ("--n-controls", "N", arg.positive_int, {}),
        ("--world-size", "N", arg.positive_int, {}),
    ):
        setting = getattr(PROBE, flag[2:].replace("-", "_"))
        probe.add_argument(
            flag, metavar=metavar, type=kind, default=setting.default, help=_help(setting), **extra
        )
    probe.add_argument("--out", metavar="DIR", type=arg.path, required=True, help="output folder")
    probe.set_defaults(func=cmd_probe)

    # train and study: an option left out is None, so the config's own default applies
    # (after --quick's, and for a study, a `tangentlens train` folder's); help shows it.
    train = sub.add_parser(
        "train",
        parents=[common],
        help="train the small model, save its checkpoints",
        description="Train a small Llama-style decoder (or, with --objective masked, a "
        "BERT-style encoder) with a Pythia-like checkpoint schedule (step0, step1, step2, "
        "step4, ...); a rerun with the same options resumes.",
    )
    train.add_argument("--out", metavar="DIR", type=arg.path, required=True, help="output folder")
    train.add_argument("--corpus", metavar="FILE", type=arg.path, help=_help(TRAIN.corpus))
    train.add_argument("--encoding", metavar="NAME", help=_help(TRAIN.encoding))
    train.add_argument(
        "--max-steps",
        metavar="N",
        type=arg.positive_int,
        help=_help(TRAIN.max_steps, quick=QUICK_TRAIN["max_steps"]),
    )
    train.add_argument("--objective", choices=OBJECTIVES, help=_help(TRAIN.objective))
    seeds = _seed_options(train, TRAIN.seeds)
    seeds.add_argument("--seed", metavar="N", type=arg.seed, help=_help(TRAIN.seed))
    train.add_argument("--quick", action="store_true", help="a tiny model: seconds")
    train.add_argument("--restart", action="store_true", help=_help(TRAIN.restart))
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
        type=arg.path,
        nargs="+",
        required=True,
        help="a folder of step{N}/ checkpoints, or a hub id such as EleutherAI/pythia-70m; "
        "several seeds of one design (each named seed{S} or a `tangentlens train` folder), "
        "or the folder of `tangentlens train --seeds`: one study per seed into OUT/seed{S}/ "
        "and the verdicts over all of them in OUT/summary.json",
    )
    study.add_argument("--out", metavar="DIR", type=arg.path, required=True, help="output folder")
    study.add_argument("--backend", choices=BACKENDS, help=_help(STUDY.backend))
    study.add_argument(
        "--rank",
        metavar="K",
        type=arg.positive_int,
        nargs="+",
        help=_help(STUDY.rank, quick=QUICK_STUDY["rank"]),
    )
    study.add_argument(
        "--n-controls",
        metavar="N",
        type=arg.positive_int,
        help=_help(STUDY.n_controls, quick=QUICK_STUDY["n_controls"]),
    )
    study.add_argument("--controls", choices=CONTROLS, help=_help(STUDY.controls))
    study.add_argument(
        "--window-fraction", metavar="F", type=arg.fraction, help=_help(STUDY.window_fraction)
    )
    study.add_argument("--windows", choices=("step", "index"), help=_help(STUDY.windows))
    study.add_argument("--early", metavar="LO:HI", type=arg.step_range, help=_help(STUDY.early))
    study.add_argument("--late", metavar="LO:HI", type=arg.step_range, help=_help(STUDY.late))
    study.add_argument(
        "--sequences",
        metavar="N",
        type=arg.positive_int,
        help=_help(STUDY.n_sequences, quick=QUICK_STUDY["n_sequences"]),
    )
    study.add_argument(
        "--seq-len",
        metavar="N",
        type=arg.positive_int,
        help=_help(STUDY.seq_len, trainer="seq_len"),
    )
    study.add_argument(
        "--head-sequences",
        metavar="N",
        type=arg.head_sequences,
        help=_help(STUDY.head_sequences),
    )
    study.add_argument(
        "--corpus", metavar="FILE", type=arg.path, help=_help(STUDY.corpus, trainer="corpus")
    )
    study.add_argument("--encoding", metavar="NAME", help=_help(STUDY.encoding, trainer="encoding"))
    study.add_argument("--seed", metavar="N", type=arg.seed, help=_help(STUDY.seed, trainer="seed"))
    study.add_argument(
        "--world-size",
        metavar="N",
        type=arg.positive_int,
        default=STUDY.world_size.default,
        help=_help(STUDY.world_size),
    )
    quick = ", ".join(f"{k} {v}" for k, v in QUICK_STUDY.items())
    study.add_argument("--quick", action="store_true", help=f"few controls and tokens: {quick}")
    study.set_defaults(func=cmd_study)

    report = sub.add_parser(
        "report",
        parents=[common],
        help="re-render report.html from saved results",
        description="Read the results in DIR (a study, a probe, a demo or a study over seeds) "
        "and write its page: DIR/report.html and figures/ (a demo's or a study over seeds': the "
        "overview, and each run's page), or with --out only that page and its own figure folder.",
    )
    report.add_argument(
        "dir", metavar="DIR", type=arg.path, help="the --out folder of study, probe or demo"
    )
    report.add_argument(
        "--out",
        metavar="FILE",
        type=arg.path,
        help="the HTML file to write, not a folder, with its figures in FILE_files/ beside it "
        "(default: DIR/report.html)",
    )
    report.set_defaults(func=cmd_report)
    return parser


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text.rstrip(".")


_ENVIRONMENT = {
    errno.ENOSPC: "free some space",
    errno.EDQUOT: "free some space",
    errno.EFBIG: "raise the file-size limit (ulimit -f) or free space",
    errno.EACCES: "fix the permissions",
    errno.EPERM: "fix the permissions",
    errno.EROFS: "choose a writable --out",
    errno.ENAMETOOLONG: "choose a shorter file or folder name",
    errno.EMFILE: "raise the open-file limit (ulimit -n)",
    errno.ENFILE: "close files other programs hold open, or raise the system's file limit",
    errno.EISDIR: "delete or move the folder standing where a file belongs",
    errno.ENOTDIR: "delete or move the file standing where a folder belongs",
}


def _environment_line(err: OSError) -> str:
    """One line for a fault of the machine, not of tangentlens: what, where, the fix."""
    where = f" ({err.filename})" if err.filename else ""
    return (
        f"{err.strerror or _one_line(err)}{where}; {_ENVIRONMENT[err.errno]} and rerun: "
        "finished work is kept and the run resumes"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    A `UsageError` or `CorruptFileError` (the person can fix it) and an environment
    fault (disk full, file too large, no permission, read-only, a name too long, too
    many open files, a missing package, memory running out) print one line and exit 2;
    anything else is a bug: one line asking for a rerun with the traceback, exit 1.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(
            f"tangentlens {args.command}: interrupted; rerun to resume", file=sys.stderr, flush=True
        )
        return 130
    except (UsageError, CorruptFileError) as err:
        if debug:
            raise
        print(f"tangentlens {args.command}: error: {_one_line(err)}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except OSError as err:
        if debug or err.errno not in _ENVIRONMENT:
            return _bug(args.command, err, debug)
        line = _environment_line(err)
        print(f"tangentlens {args.command}: error: {line}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except ModuleNotFoundError as err:  # an installation fault, not a bug of the command
        if debug or not err.name:
            return _bug(args.command, err, debug)
        top = err.name.split(".")[0]
        print(
            f"tangentlens {args.command}: error: the package {top} is not installed (or "
            f"broken); install it (pip install {top}) or reinstall tangentlens, then rerun",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_USAGE
    except MemoryError as err:  # the machine's limit, not a fault of the command
        if debug:
            raise
        print(
            f"tangentlens {args.command}: error: out of memory ({_one_line(err)}); free memory "
            "or ask for less (a smaller --corpus or --text, fewer --tokens or --sequences, a "
            "lower --world-size), then rerun: finished work is kept and the run resumes",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_USAGE
    except Exception as err:
        return _bug(args.command, err, debug)


def _bug(command: str, err: BaseException, debug: bool) -> int:
    if debug:
        raise err
    print(
        f"tangentlens {command}: internal error ({type(err).__name__}: {_one_line(err)}); "
        f"this is a bug: rerun with {DEBUG_ENV}=1 for the traceback and report it",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())
