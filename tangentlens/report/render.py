"""`tangentlens report`: re-render the pages of any folder the tool wrote, touching only
what the pages own.

A folder is one of three kinds: a run (``results.csv``: a study, a probe, one seed of a
demo), or several runs under a ``summary.json`` (a demo: ``{decoder,encoder}/seed{S}/``;
a study over seeds: ``seed{S}/``), whose page is the overview of the claims and every
run's figures. Without ``--out`` each page goes where the command put it (a run's
``report.html`` and ``figures/``; the overview's ``report.html``), each folder held while
it is written.

``--out DIR/page.html`` writes that page and its own figure folder ``DIR/page_files/``
and nothing else: a folder that holds another run is refused (its report is that run's
to write), a page that is no tangentlens report is never replaced, and the figure folder
records what it wrote (names and SHA-256), so a rerun replaces or removes only those of
its files that are still as it left them and refuses to write over anything else.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ..core.digests import content_sha256
from ..core.errors import MissingFileError, UsageError
from ..core.files import (
    RECORD_FILE,
    read_checked_json,
    read_json,
    remove_stale_temporaries,
    write_json,
)
from ..core.folders import lock_folder
from ..core.results import META_SUFFIX
from .claims import Claim
from .figures import FIGURES
from .page import (
    MANIFEST_FILE,
    OVERVIEW_TITLES,
    is_report,
    run_title,
    write_figures,
    write_overview,
    write_report,
)

__all__ = ["FIGURES_RECORD", "SUMMARY_FILE", "render_report", "run_digests", "run_folders"]

SUMMARY_FILE = "summary.json"
FIGURES_RECORD = ".tangentlens-figures.json"  # what a page's figure folder holds of ours
_RUN_MARKERS = ("results.csv", SUMMARY_FILE, MANIFEST_FILE, RECORD_FILE)


def run_folders(folder: Path) -> dict[str, Path]:
    """The runs under a folder of several (``seed{S}/`` or ``{kind}/seed{S}/``), by their
    path relative to it."""
    found = [*folder.glob("seed*/results.csv"), *folder.glob("*/seed*/results.csv")]
    runs = {p.parent.relative_to(folder).as_posix(): p.parent for p in found}
    return dict(sorted(runs.items()))


def run_digests(runs: Mapping[str, Path]) -> dict[str, str]:
    """SHA-256 of each run's ``results.csv`` (``runs``: path under the folder → run): the
    summary records them, so its claims are shown only beside the runs they came from."""
    return {name: content_sha256(Path(run) / "results.csv") for name, run in sorted(runs.items())}


def _check_runs(folder: Path, recorded: object) -> None:
    """Refuse a folder whose runs are not those its summary's claims came from (one
    missing, added, swapped with another or changed since). A summary without the record
    (one written without it) is read as it is."""
    if recorded is None:
        return
    found = run_digests(run_folders(folder))
    if not isinstance(recorded, dict):
        raise UsageError(f"{folder / SUMMARY_FILE} has a damaged runs record; rerun its command")
    for name in sorted(set(found) | set(recorded)):
        if found.get(name) != recorded.get(name):
            if name not in recorded:
                what = f"is a run {SUMMARY_FILE} does not record: move it out of {folder}"
            else:
                what = "is missing" if name not in found else "is not the run its claims came from"
                what += (
                    f" ({SUMMARY_FILE} records its results.csv): restore it as the command left it"
                )
            raise UsageError(f"{folder / name} {what}, or rerun that command")


def _writer(folder: Path) -> str | None:
    """The command that claimed ``folder`` (its folder record), or None."""
    path = folder / RECORD_FILE
    if not path.is_file():
        return None
    writers = read_json(path, dict, fix="restore it, or choose a new --out").get("writers")
    first = writers[0] if isinstance(writers, list) and writers else {}
    return first.get("command") if isinstance(first, dict) else None


def _check_page(page: Path, folder: Path) -> None:
    """Refuse to replace a file at ``page`` that no tangentlens report wrote (the demo's
    overview in its own folder is the demo's)."""
    if not page.exists() or is_report(page):
        return
    if page == folder / "report.html" and _writer(folder) == "demo":
        return
    raise UsageError(
        f"{page} exists and is not a tangentlens report; it is never overwritten: "
        "pass another --out file"
    )


def _check_target(target: str | Path, source: Path) -> Path:
    page = Path(target).expanduser()
    if page.is_dir() or str(target).endswith(("/", "\\")):
        named = page.resolve()
        example = named.with_name(named.name + ".html") if named.name else named / "page.html"
        raise UsageError(
            f"--out {target} is a folder; --out takes the HTML file to write, e.g. {example}"
        )
    home = page.parent
    if home.resolve().is_relative_to(source.resolve()) and home.resolve() != source.resolve():
        # figures/, bases/, a seed's run: folders the tool rewrites, never a page's home
        raise UsageError(
            f"--out {page} is inside {source}'s own folders, which its commands rewrite: "
            f"write the page in {source} itself or outside it"
        )
    if home.resolve() != source.resolve():
        other = [name for name in _RUN_MARKERS if (home / name).exists()]
        if other:
            raise UsageError(
                f"--out {page}: {home} holds another run ({other[0]}); its report is that "
                f"run's own (`tangentlens report {home}`): write this page elsewhere"
            )
        for folder in home.resolve().parents:  # a folder inside a run: its commands' own
            if (folder / RECORD_FILE).is_file() or (folder / f"results{META_SUFFIX}").is_file():
                raise UsageError(
                    f"--out {page} is inside {folder}, the folder of a tangentlens run, which "
                    "its commands rewrite: write this page elsewhere"
                )
    return page


class _FigureFolder:
    """A page's own figure folder and its record: what it wrote, so a rerun replaces only
    what is still as it left it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        record = folder / FIGURES_RECORD
        if record.is_file():
            files = read_json(record, dict, fix="delete the folder and rerun").get("files", {})
            self.files = (
                {str(k): str(v) for k, v in files.items()} if isinstance(files, dict) else {}
            )
        elif folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            raise UsageError(
                f"{folder} exists and was not made by `tangentlens report`; it is never "
                "written into: move it, or pass another --out name"
            )
        else:
            self.files = {}

    def check(self, names: list[str]) -> None:
        """Refuse before writing anything if one of ``names`` is not ours as we left it."""
        for name in names:
            path = self.folder / name
            if path.exists() and (
                name not in self.files or content_sha256(path) != self.files[name]
            ):
                raise UsageError(
                    f"{path} was not written by `tangentlens report` (or changed since); it "
                    "is never overwritten: move it, or pass another --out name"
                )

    def commit(self, written: list[str]) -> None:
        """Record ``written``; remove those we wrote before and no longer write, where
        they are still as we left them."""
        for name, digest in self.files.items():
            path = self.folder / name
            if name not in written and path.is_file() and content_sha256(path) == digest:
                path.unlink()
        self.files = {
            n: content_sha256(self.folder / n) for n in written if (self.folder / n).is_file()
        }
        write_json(self.folder / FIGURES_RECORD, {"files": self.files})


def _figure_names(prefix: str = "") -> list[str]:
    return [f"{prefix}{name}.png" for name in FIGURES]


def _clear_own_temporaries(folder: Path, names: list[str]) -> None:
    """Temporaries a killed write of ours left (``.{name}.*.tmp``), and nothing else."""
    if folder.is_dir():
        remove_stale_temporaries(folder, tuple(f".{n}.*.tmp" for n in names))


def _render_run(
    source: Path, page: Path, figures: Path | None, title: str = "tangentlens report"
) -> Path:
    _check_page(page, source)
    folder = figures if figures is not None else page.parent / "figures"
    _clear_own_temporaries(page.parent, [page.name])
    _clear_own_temporaries(folder, _figure_names())
    return write_report(source, page, figures_dir=folder, title=title)


def _claims(folder: Path) -> list[Claim]:
    """The summary's claims, once its runs are checked to be those they came from."""
    fix = "rerun the command that wrote this folder"
    record = read_checked_json(folder / SUMMARY_FILE, fix=fix)
    found = record.get("claims")
    if not isinstance(found, list) or not all(isinstance(c, dict) for c in found):
        raise UsageError(f"{folder / SUMMARY_FILE} holds no list of claims; {fix}")
    _check_runs(folder, record.get("runs"))
    return [Claim.from_dict(c) for c in found]


def _render_runs(source: Path, page: Path, own: _FigureFolder | None) -> Path:
    """The overview of a folder of several runs (and, in place, each run's own page)."""
    runs = run_folders(source)
    claims = _claims(source)
    _check_page(page, source)
    figures: dict[str, Path] = {}
    written: list[str] = []
    if own is not None:
        names = [f"{run}/{n}" for run in runs for n in _figure_names()]
        own.check(names)
    writer = _writer(source)
    for name, run in runs.items():
        if own is None:
            with lock_folder(run, "report"):
                _render_run(run, run / "report.html", None, run_title(writer, name))
            figures[name] = run / "figures"
        else:
            figures[name] = own.folder / name
            _clear_own_temporaries(figures[name], _figure_names())
            write_figures(run, figures[name])
            written += [f"{name}/{n}" for n in _figure_names() if (figures[name] / n).is_file()]
    title = OVERVIEW_TITLES.get(writer or "", "tangentlens: the claims over several runs")
    _clear_own_temporaries(page.parent, [page.name])
    out = write_overview(runs, claims, page, title=title, figures=figures)
    if own is not None:
        own.commit(written)
    return out


def _kind(source: Path) -> bool:
    """Whether ``source`` holds several runs (else one); a folder of neither kind is a
    `MissingFileError` naming what to pass."""
    if (source / "results.csv").exists() or (source / "results.json").exists():
        return False
    if (source / SUMMARY_FILE).is_file():
        return True
    if run_folders(source):
        raise MissingFileError(
            f"{source} holds runs but no {SUMMARY_FILE}; rerun the command that wrote it, "
            "or pass one run's folder"
        )
    raise MissingFileError(
        f"{source} has no results.csv; pass the --out folder of `tangentlens study`, `probe` "
        "or `demo`"
    )


def render_report(folder: str | Path, target: str | Path | None = None) -> Path:
    """Re-render the page of ``folder`` (a run, a demo or a study over seeds; see the
    module docstring) at its own place, or at the HTML file ``target`` with its figures
    in ``{target stem}_files/`` beside it. Returns the page."""
    source = Path(folder).expanduser()
    if not source.is_dir():
        raise MissingFileError(
            f"{source} is not a folder; pass the --out folder of `tangentlens study`, `probe` "
            "or `demo`"
        )
    page = source / "report.html" if target is None else _check_target(target, source)
    with lock_folder(page.parent, "report"):
        several = _kind(source)
        own = None
        if target is not None and page != source / "report.html":
            own = _FigureFolder(page.parent / f"{page.stem}_files")
        if several:
            return _render_runs(source, page, own)
        if own is None:
            return _render_run(source, page, None)
        names = _figure_names()
        own.check(names)
        out = _render_run(source, page, own.folder)
        own.commit([n for n in names if (own.folder / n).is_file()])
        return out
