"""The report page: one self-contained ``report.html`` (PNG figures inlined as base64,
no network, no external CSS or JS) with the summary table on top, the figures, the
configuration and the provenance (as tables: a reader compares settings, not JSON); each
figure is also saved as a PNG in the page's figure folder.

>>> from tangentlens import report
>>> report.write_report("runs/study", "runs/study/report.html")   # a study's folder
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import os
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from ..core import results
from ..core.errors import CorruptFileError, UsageError
from ..core.files import read_json, write_bytes, write_text
from ..core.results import frame
from ..core.validation import check_window_fraction
from .claims import Claim
from .figures import FIGURES, Rendered, render_figures
from .summary import SummaryRow, summary
from .table import prepare, ranks, steps

__all__ = [
    "MANIFEST_FILE",
    "OVERVIEW_TITLES",
    "is_report",
    "load_results",
    "run_title",
    "write_figures",
    "write_overview",
    "write_report",
]

OVERVIEW_TITLES = {  # by the command that wrote the folder, for its first page and re-renders
    "demo": "tangentlens demo: decoder and encoder",
    "study per seed": "tangentlens study: the claims over seeds",
}


def run_title(writer: str | None, name: str) -> str:
    """The page title of the run ``name`` (``decoder/seed0``) in a folder ``writer`` (the
    command) wrote: the demo names each run's kind and seed, on its first page and on
    re-renders alike; other runs take the default."""
    kind, _, seed = name.partition("/")
    if writer == "demo" and seed.startswith("seed"):
        return f"tangentlens demo: {kind}, seed {seed.removeprefix('seed')}"
    return "tangentlens report"


MANIFEST_FILE = "manifest.json"
_GENERATOR = '<meta name="generator" content="tangentlens">'
_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0 auto;
max-width:1180px;padding:24px 32px;color:#1b1b1b;line-height:1.45}
h1{margin:0 0 4px}h2{margin-top:36px;border-bottom:2px solid #0072B2;padding-bottom:4px}
.meta{color:#555;font-size:14px}
table.summary{border-collapse:collapse;width:100%;font-size:14px}
table.summary th,table.summary td{border:1px solid #ccc;padding:6px 9px;text-align:left;
vertical-align:top}table.summary th{background:#eef4fa}
td.yes,td.agrees{background:#e3f2ea}td.no,td.disagrees{background:#fbe5d6}
td.partly,td.inconclusive,td.window-dependent,td.centre-dependent{background:#fff4cc}
td.suggests{font-style:italic}small.detail{color:#555;display:block;margin-top:3px}
figure{margin:26px 0;padding:0}figure h3{margin:0 0 6px}
figure img{max-width:100%;height:auto;border:1px solid #e2e2e2}
figcaption{font-size:15px;margin-top:4px}
table.kv{border-collapse:collapse;font-size:13px;margin:4px 0;max-width:100%}
table.kv th,table.kv td{border:1px solid #ddd;padding:3px 8px;text-align:left;
vertical-align:top;overflow-wrap:anywhere}table.kv th{background:#f6f8fa;font-weight:600;
white-space:nowrap}table.kv table.kv{margin:0}code{overflow-wrap:anywhere;font-size:12px}
"""
_MAX_LIST = 24  # items of a list shown inline; longer lists say how many more


def _png(fig: Figure, reading: str = "") -> bytes:
    """The figure as PNG bytes, its reading in the PNG's own ``Description`` text, so a page
    that shows the file later (the demo's overview) shows the caption made with it."""
    buf = io.BytesIO()
    meta = {"Description": reading} if reading else {}
    fig.savefig(buf, format="png", dpi=110, facecolor="white", metadata=meta)
    return buf.getvalue()


def png_description(data: bytes) -> str:
    """The ``Description`` text of a PNG (`_png` writes it), or "" when it has none."""
    at = 8  # after the signature: length, type, data, CRC per chunk
    while at + 8 <= len(data):
        (size,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + size]
        at += 12 + size
        key, _, rest = body.partition(b"\0")
        if key != b"Description":
            continue
        if kind == b"tEXt":
            return rest.decode("latin-1")
        if kind == b"iTXt" and len(rest) >= 2:
            compressed, text = rest[0], rest[2:].split(b"\0", 2)[-1]
            try:
                return (zlib.decompress(text) if compressed else text).decode("utf-8")
            except (zlib.error, UnicodeDecodeError):
                return ""
    return ""


def _key_order(keys: list[str]) -> list[str]:
    """Keys as written, except that keys which are all integers (steps) go in number order."""
    if keys and all(k.lstrip("-").isdigit() for k in keys):
        return sorted(keys, key=int)
    return keys


def _cell(value: Any) -> str:
    """One value as HTML: a nested table for a mapping or a list of mappings, a list
    inline, a number to four significant digits, a long token (a hash, a path) wrapped."""
    esc = html.escape
    if isinstance(value, Mapping):
        return _kv_table(value) if value else "—"
    if isinstance(value, list | tuple):
        if value and all(isinstance(v, Mapping) for v in value):
            return "".join(_kv_table(v) for v in value)
        shown = ", ".join(_cell(v) for v in value[:_MAX_LIST])
        more = f" … ({len(value) - _MAX_LIST} more)" if len(value) > _MAX_LIST else ""
        return (shown + more) or "—"
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return esc(f"{value:.4g}")
    text = str(value)
    return f"<code>{esc(text)}</code>" if " " not in text and len(text) > 24 else esc(text)


def _kv_table(obj: Mapping[str, Any], skip: tuple[str, ...] = ()) -> str:
    keys = _key_order([str(k) for k in obj if str(k) not in skip])
    by = {str(k): v for k, v in obj.items()}
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{_cell(by[k])}</td></tr>" for k in keys)
    return f'<table class="kv">{rows}</table>'


def _describe(t: pd.DataFrame, all_ranks: list[int], extra: list[str]) -> str:
    seen = steps(t)
    layers = t["layer"].dropna()
    parts = [f"{len(t)} rows"]
    if seen:
        parts.append(f"{len(seen)} checkpoints (steps {seen[0]}–{seen[-1]})")
    if all_ranks:
        also = f" (the table also has ranks {all_ranks})" if len(all_ranks) > 1 else ""
        parts.append(f"rank {ranks(t)[0]} of Q_T{also}")
    if extra:
        parts.append("with " + ", ".join(extra))
    if len(layers):
        parts.append(f"layers {_layer_list(sorted({int(v) for v in layers}))}")
    return ", ".join(parts)


def _layer_list(seen: list[int]) -> str:
    """``0–29`` for every layer between the ends, else the layers themselves (``0, 3``)."""
    if len(seen) > 2 and seen[-1] - seen[0] == len(seen) - 1:
        return f"{seen[0]}–{seen[-1]}"
    return ", ".join(map(str, seen))


def _html(
    t: pd.DataFrame,
    description: str,
    rows: list[SummaryRow],
    figures: list[tuple[Rendered, bytes]],
    config: Mapping[str, Any] | None,
    manifest: Mapping[str, Any] | None,
    title: str,
) -> str:
    esc = html.escape
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        _GENERATOR,
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f'<p class="meta">Generated {now} · {esc(description)}</p>',
        "<h2>Summary</h2>",
    ]
    if rows:
        out.append(
            '<table class="summary"><tr><th>Quantity</th><th>Measured here</th>'
            "<th>Paper</th><th>Verdict</th></tr>"
        )
        for c in rows:
            out.append(
                f"<tr><td>{esc(c.quantity)}</td><td>{esc(c.measured)}"
                f"{_details(averages=c.scope, seeds=c.seeds, windows=c.windows, test=c.test)}</td>"
                f'<td>{esc(c.paper)}</td><td class="{esc(c.agrees)}">{esc(c.agrees)}</td></tr>'
            )
        out.append("</table>")
    else:
        out.append("<p>No headline numbers in these results.</p>")
    out.append("<h2>Figures</h2>")
    if not figures:
        out.append("<p>No figure: the results hold none of the plotted statistics.</p>")
    for rendered, png in figures:
        data = base64.b64encode(png).decode("ascii")
        out.append(
            f'<figure id="{rendered.name}"><h3>{esc(rendered.title)}</h3>'
            f'<img src="data:image/png;base64,{data}" alt="{esc(rendered.title)}">'
            f"<figcaption>{esc(rendered.reading)}</figcaption></figure>"
        )
    out.append("<h2>Configuration</h2>")
    out.append(_kv_table(config) if config else "<p>Not recorded.</p>")
    out.append("<h2>Provenance</h2>")
    # the configuration is shown once, above
    out.append(_kv_table(manifest, skip=("config",)) if manifest else "<p>No manifest.</p>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _details(**lines: str) -> str:
    """Secondary lines of a cell (per-seed numbers, the window panel, the test), small
    and muted so the verdict and its pooled number stay what the eye reads first."""
    esc = html.escape
    return "".join(
        f'<small class="detail">{esc(name.replace("seeds", "per seed"))}: {esc(text)}</small>'
        for name, text in lines.items()
        if text
    )


def is_report(path: str | Path) -> bool:
    """Whether ``path`` is a page this module wrote (so rewriting it loses nothing)."""
    try:
        with open(path, "rb") as fh:
            return _GENERATOR.encode() in fh.read(4096)
    except OSError:
        return False


def _read_json(path: Path) -> dict[str, Any] | None:
    """A run's manifest, None without one; its fields the page reads are of the kinds a
    run writes (`_MANIFEST_FIELDS`), else a `CorruptFileError` naming the file."""
    if not path.is_file():
        return None
    fix = "re-create it or delete it"
    manifest = read_json(path, dict, fix=fix)
    for key, kind in _MANIFEST_FIELDS.items():
        if manifest.get(key) is not None and not isinstance(manifest[key], kind):
            raise CorruptFileError(f"{path} is corrupt (its {key!r} is no {kind.__name__}); {fix}.")
    fraction = (manifest.get("config") or {}).get("window_fraction")
    if fraction is not None:
        try:
            check_window_fraction(fraction, "window_fraction")
        except UsageError:
            raise CorruptFileError(
                f"{path} is corrupt (its config's window_fraction {fraction!r}); {fix}."
            ) from None
    return manifest


# the manifest fields a page reads, by the kind a run writes them as
_MANIFEST_FIELDS = {"config": dict, "probe_set": dict, "steps": list, "timings": dict}


def _run_settings(manifest: Mapping[str, Any] | None) -> str:
    """What an overview says of how a run was made (its series, checkpoints, probe set and
    controls), so a quick run is not mistaken for a full one; empty without a manifest."""
    if not manifest:
        return ""
    config, probe_set = manifest.get("config") or {}, manifest.get("probe_set") or {}
    seen = manifest.get("steps") or []
    parts = [f"`{manifest.get('command', 'study')}` of {config.get('checkpoints', '?')}"]
    if seen:
        parts.append(f"{len(seen)} checkpoints (steps {seen[0]}–{seen[-1]})")
    if probe_set:
        parts.append(
            f"{probe_set.get('n_sequences')} probe sequences of {probe_set.get('seq_len')} tokens"
        )
    if "n_controls" in config:
        parts.append(f"{config['n_controls']} controls a test")
    return ", ".join(parts)


def sub_tables(folder: Path) -> list[str]:
    """Results tables one level below a results folder (the demo's ``heads/``), which the
    report reads with the folder's own table and names on the page."""
    return sorted(str(p.relative_to(folder)) for p in folder.glob("*/results.csv"))


def load_results(path: str | Path) -> pd.DataFrame:
    """A results folder's table (`tangentlens.core.results.read`) and its `sub_tables`, each
    read with the same strict reader (a file path: that table alone)."""
    path = Path(path)
    table = results.read(path)
    if not path.is_dir():
        return table
    extra = [results.read(path / name) for name in sub_tables(path)]
    return pd.concat([table, *extra], ignore_index=True) if extra else table


def _target(out_path: str | Path) -> Path:
    out = Path(out_path)
    if out.is_dir() and out.suffix.lower() in (".html", ".htm"):
        # a folder named as the page (a run's report.html replaced by one): never written into
        raise UsageError(
            f"{out} is a folder, not a page: move it out of the way, or pass another file"
        )
    return out / "report.html" if out.is_dir() else out


def write_report(
    source: str | Path | pd.DataFrame,
    out_path: str | Path,
    config: Mapping[str, Any] | None = None,
    manifest: Mapping[str, Any] | None = None,
    *,
    title: str = "tangentlens report",
    rank: int | None = None,
    figures_dir: str | Path | None = None,
) -> Path:
    """Write one self-contained HTML report and each figure as a PNG.

    ``source``: a results folder (reads its table, its `sub_tables` and ``manifest.json``;
    the config defaults to the manifest's ``config``) or a long
    DataFrame. ``out_path``: the HTML file (an existing folder gets ``report.html``).
    ``rank``: which rank of Q_T the figures show (default: the smallest; the page says
    which). ``figures_dir``: where the PNGs go (default: ``figures/`` beside the page, the
    layout of a run's own folder; `tangentlens.report.render` gives a page elsewhere a
    folder named after it). Returns the HTML path.
    """
    extra: list[str] = []
    if isinstance(source, pd.DataFrame):
        full = source
    else:
        full = load_results(source)
        folder = Path(source) if Path(source).is_dir() else Path(source).parent
        extra = sub_tables(folder) if Path(source).is_dir() else []
        if manifest is None:
            manifest = _read_json(folder / MANIFEST_FILE)
    if config is None and manifest:
        config = manifest.get("config")
    try:
        table = prepare(full, rank=rank)
    except UsageError as err:  # a folder's table: name it
        if isinstance(source, pd.DataFrame):
            raise
        raise UsageError(f"{source}: {err}") from err
    description = _describe(table, ranks(frame(full)), extra)
    out = _target(out_path)
    figures_dir = out.parent / "figures" if figures_dir is None else Path(figures_dir)
    rendered = _write_figures(table, figures_dir)
    fraction = (config or {}).get("window_fraction")
    rows = summary(table, window_fraction=None if fraction is None else float(fraction))
    page = _html(table, description, rows, rendered, config, manifest, title)
    return write_text(out, page)


def _write_figures(table: pd.DataFrame, folder: Path) -> list[tuple[Rendered, bytes]]:
    rendered = []
    for fig in render_figures(table):
        png = _png(fig.figure, fig.reading)
        write_bytes(folder / f"{fig.name}.png", png)
        rendered.append((fig, png))
    return rendered


def write_figures(
    source: str | Path | pd.DataFrame, folder: str | Path, *, rank: int | None = None
) -> list[Path]:
    """Every figure of a results folder or table as ``folder/{name}.png``, without a page
    (an overview inlines them); returns the files written."""
    full = source if isinstance(source, pd.DataFrame) else load_results(source)
    written = _write_figures(prepare(full, rank=rank), Path(folder))
    return [Path(folder) / f"{fig.name}.png" for fig, _ in written]


def _figure_files(folder: Path) -> list[Path]:
    """The report's figures in ``folder``, in report order (nothing else that lies there)."""
    return [folder / f"{name}.png" for name in FIGURES if (folder / f"{name}.png").is_file()]


def write_overview(
    folders: Mapping[str, Path],
    claims: list[Claim],
    out_path: str | Path,
    *,
    title: str = OVERVIEW_TITLES["demo"],
    figures: Mapping[str, Path] | None = None,
) -> Path:
    """One self-contained page for several studies side by side: the paper's claims with
    the numbers (value [95 % interval]), what each averages and a verdict per model and
    gradient object, then each study's figures (from ``figures[name]``, by default its
    ``figures/``) and a link to its own report."""
    esc = html.escape
    out = Path(out_path)
    rows = "".join(
        f"<tr><td>{esc(c.paper)}</td><td>{esc(c.model)}</td>"
        f"<td>{esc(c.gradient_object)}</td><td>{esc(c.statistic)} (rank {c.rank})</td>"
        f"<td>{esc(c.describe_numbers())}"
        + _details(
            averages=c.scope,
            seeds=c.describe_seeds(),
            windows=c.describe_panel(),
            test=c.describe_test(),
        )
        + "</td>"
        f'<td class="{esc(c.verdict)}">{esc(c.verdict)}</td></tr>'
        for c in claims
    )
    body = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        _GENERATOR,
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        '<p class="meta">With several training seeds a verdict comes from the between-seed '
        "95 % t-interval and a t-test against the paper's line, Holm-corrected across the "
        "claims; with one seed the interval covers probe sequences (embedding rows for the "
        "frequency claim; none for a difference of two models) and a verdict can only "
        "suggest. A dynamics claim must hold under every window definition (else "
        "window-dependent), the frequency claim for every embedding centre; the weight "
        "gradient is read over its random-backprop null (normalized_ratio). See "
        "docs/VERDICTS.md.</p>",
        "<h2>Claims</h2>",
        '<table class="summary"><tr><th>Paper</th><th>Model</th><th>Gradient object</th>'
        f"<th>Statistic</th><th>Measured</th><th>Verdict</th></tr>{rows}</table>",
    ]
    for name, folder in folders.items():
        link = html.escape(
            Path(os.path.relpath(Path(folder, "report.html"), out.parent)).as_posix()
        )
        body.append(f'<h2>{esc(name)} <a href="{link}">(full report)</a></h2>')
        made = _run_settings(_read_json(Path(folder, MANIFEST_FILE)))
        if made:
            body.append(f'<p class="meta">{esc(made)}</p>')
        shown = (figures or {}).get(name, Path(folder, "figures"))
        for png in _figure_files(Path(shown)):
            raw = png.read_bytes()
            data = base64.b64encode(raw).decode("ascii")
            heading = FIGURES[png.stem][0]
            body.append(
                f"<figure><h3>{esc(heading)}</h3>"
                f'<img src="data:image/png;base64,{data}" alt="{esc(heading)}">'
                f"<figcaption>{esc(png_description(raw))}</figcaption></figure>"
            )
    body.append("</body></html>")
    return write_text(out, "\n".join(body) + "\n")
