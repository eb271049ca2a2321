"""The report page: one self-contained ``report.html`` (PNG figures inlined as base64,
no network, no external CSS or JS) with the summary table on top, the figures, the
configuration and the provenance; each figure is also saved under ``figures/``.

>>> from tangentlens import report
>>> report.write_report("runs/study", "runs/study/report.html")   # a study's folder
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from ..core import results
from ..core.files import read_json, write_bytes, write_text
from ..core.results import frame
from .claims import Claim
from .figures import Rendered, render_figures
from .summary import SummaryRow, summary
from .table import prepare, ranks, steps

__all__ = ["MANIFEST_FILE", "is_report", "load_results", "write_overview", "write_report"]

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
pre{background:#f6f8fa;border:1px solid #e2e2e2;padding:10px;overflow-x:auto;font-size:12px}
"""


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, facecolor="white")
    return buf.getvalue()


def _json_block(obj: Any) -> str:
    text = json.dumps(obj, indent=2, sort_keys=True, default=str)
    return f"<pre>{html.escape(text)}</pre>"


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
        parts.append(f"layers {int(layers.min())}–{int(layers.max())}")
    return ", ".join(parts)


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
            "<th>Paper</th><th>Agrees</th></tr>"
        )
        for c in rows:
            out.append(
                f"<tr><td>{esc(c.quantity)}</td><td>{esc(c.measured)}"
                f"{_details(seeds=c.seeds, windows=c.windows)}</td>"
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
    out.append(_json_block(config) if config else "<p>Not recorded.</p>")
    out.append("<h2>Provenance</h2>")
    out.append(_json_block(manifest) if manifest else "<p>No manifest.</p>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _details(**lines: str) -> str:
    """Secondary lines of a cell (per-seed numbers, the window panel), small and muted so
    the verdict and its pooled number stay what the eye reads first."""
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
    return read_json(path, dict, fix="re-create it or delete it") if path.is_file() else None


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
    return out / "report.html" if out.is_dir() else out


def write_report(
    source: str | Path | pd.DataFrame,
    out_path: str | Path,
    config: Mapping[str, Any] | None = None,
    manifest: Mapping[str, Any] | None = None,
    *,
    title: str = "tangentlens report",
    rank: int | None = None,
) -> Path:
    """Write one self-contained HTML report and ``figures/*.png`` beside it.

    ``source``: a results folder (reads its table, its `sub_tables` and ``manifest.json``;
    the config defaults to the manifest's ``config``) or a long
    DataFrame. ``out_path``: the HTML file (an existing folder gets ``report.html``).
    ``rank``: which rank of Q_T the figures show (default: the smallest; the page says
    which). Returns the HTML path.
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
    table = prepare(full, rank=rank)
    description = _describe(table, ranks(frame(full)), extra)
    out = _target(out_path)
    figures_dir = out.parent / "figures"
    rendered = []
    for fig in render_figures(table):
        png = _png(fig.figure)
        write_bytes(figures_dir / f"{fig.name}.png", png)
        rendered.append((fig, png))
    page = _html(table, description, summary(table), rendered, config, manifest, title)
    return write_text(out, page)


def write_overview(
    folders: Mapping[str, Path],
    claims: list[Claim],
    out_path: str | Path,
    *,
    title: str = "tangentlens demo: decoder and encoder",
) -> Path:
    """One self-contained page for several studies side by side: the paper's claims with
    the numbers (value [95 % interval]) and a verdict per model and gradient object, then
    each study's figures (from its ``figures/``) and a link to its own report."""
    esc = html.escape
    out = Path(out_path)
    rows = "".join(
        f"<tr><td>{esc(c.paper)}</td><td>{esc(c.model)}</td>"
        f"<td>{esc(c.gradient_object)}</td><td>{esc(c.statistic)} (rank {c.rank})</td>"
        f"<td>{esc(c.describe_numbers())}"
        f"{_details(seeds=c.describe_seeds(), windows=c.describe_panel())}</td>"
        f'<td class="{esc(c.verdict)}">{esc(c.verdict)}</td></tr>'
        for c in claims
    )
    body = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        '<p class="meta">With several training seeds a verdict comes from the between-seed '
        "95 % t-interval and a t-test against the paper's line, Holm-corrected across the "
        "claims; with one seed the interval covers probe sequences only and a verdict can only "
        "suggest. A dynamics claim must hold under every window definition (else "
        "window-dependent), the frequency claim for every embedding centre; the weight "
        "gradient is read over its random-backprop null (normalized_ratio). See "
        "docs/VERDICTS.md.</p>",
        "<h2>Claims</h2>",
        '<table class="summary"><tr><th>Paper</th><th>Model</th><th>Gradient object</th>'
        f"<th>Statistic</th><th>Measured</th><th>Verdict</th></tr>{rows}</table>",
    ]
    for name, folder in folders.items():
        body.append(f'<h2>{esc(name)} <a href="{esc(name)}/report.html">(full report)</a></h2>')
        for png in sorted(Path(folder, "figures").glob("*.png")):
            data = base64.b64encode(png.read_bytes()).decode("ascii")
            body.append(
                f"<figure><h3>{esc(png.stem.replace('_', ' '))}</h3>"
                f'<img src="data:image/png;base64,{data}" alt="{esc(png.stem)}"></figure>'
            )
    body.append("</body></html>")
    return write_text(out, "\n".join(body) + "\n")
