"""Figures and a self-contained HTML report from a long results table.

Every plot function takes the long table (``session.results()`` or a study's
``results.csv``: ``[checkpoint, step, window,] [probe,] site, layer, head, statistic,
value``) and returns a matplotlib `Figure`, or None when the table holds no data for
it. `write_report` renders all of them into one ``report.html`` (PNG figures inlined
as base64, no network, no external CSS or JS) with a summary table on top that puts
the headline numbers next to the paper's claims, and saves each figure under
``figures/``.

>>> from tangentlens import report
>>> report.write_report("runs/study", "runs/study/report.html")   # a study's folder
>>> fig = report.plot_depth_profile(session.results())
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

__all__ = [
    "FIGURES",
    "PAPER",
    "Claim",
    "Rendered",
    "format_summary",
    "load_results",
    "plot_depth_profile",
    "plot_energy_over_training",
    "plot_frequency_distance",
    "plot_head_heatmap",
    "plot_intrinsic_dimension",
    "plot_isotropy_removal",
    "render_figures",
    "summary",
    "write_report",
]

# Okabe & Ito (2008): distinguishable under the common colour-vision deficiencies.
OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#000000")
SEQUENTIAL = "cividis"  # perceptually uniform and colour-blind safe
WINDOW_SHADE = {"early": 0.07, "late": 0.14}  # grey alpha: shading never competes with data
ALPHA = 0.05
RESULTS_FILE = "results.csv"
HEADS_FILE = "heads.csv"  # per-head attention rows kept beside a study's table (the demo)
MANIFEST_FILE = "manifest.json"
REQUIRED = ("site", "layer", "statistic", "value")
_OPTIONAL = ("checkpoint", "step", "window", "rank", "probe", "head")
_MAX_LINES = 6  # beyond this many checkpoints, profiles are drawn per window
CENTRES = {
    "mean_all": "mean of all rows",
    "mean_seen": "mean of seen rows",
    "weighted": "frequency-weighted mean",
    "norm": "origin (norm)",
}

PAPER = {
    "frequency": "strong negative frequency–distance correlation for decoders",
    "energy_early": "gradient energy concentrated in Q_T early in training (ratio ≫ 1)",
    "energy_late": "weaker late in training than early",
    "isotropy": "removing Q_T raises IsoScore* more than removing a normal control",
}


# ----------------------------------------------------------------------------- table
def load_results(path: str | Path) -> pd.DataFrame:
    """Read ``results.csv`` (or ``.json``) from a results folder or a file path.

    Raises `FileNotFoundError` for a missing folder or file and `ValueError` for a file
    that is not a readable results table, each with the fix in the message.
    """
    path = Path(path)
    if path.is_dir():
        candidates = [path / RESULTS_FILE, path / "results.json"]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise FileNotFoundError(
                f"{path} has no {RESULTS_FILE}; pass the --out folder of `tangentlens study` "
                "or `tangentlens probe`."
            )
        path = found
    elif not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass a results folder or results.csv.")
    try:
        if path.suffix == ".json":
            table = pd.DataFrame(json.loads(path.read_text(encoding="utf-8")))
        else:
            table = pd.read_csv(path)
    except (ValueError, OSError, UnicodeDecodeError) as err:  # ParserError is a ValueError
        raise ValueError(
            f"{path} is corrupt or not a results table ({str(err).splitlines()[0]}); "
            "re-create it with `tangentlens study` or `tangentlens probe`."
        ) from err
    heads = path.parent / HEADS_FILE
    if heads.is_file():
        try:
            table = pd.concat([table, pd.read_csv(heads)], ignore_index=True)
        except (ValueError, OSError) as err:
            raise ValueError(
                f"{heads} is corrupt ({str(err).splitlines()[0]}); delete it or rerun the demo."
            ) from err
    return _prepare(table, str(path))


def _prepare(results: pd.DataFrame, name: str = "results") -> pd.DataFrame:
    """A normalised copy: optional columns present, numeric values, sorted by step."""
    if not isinstance(results, pd.DataFrame):
        raise TypeError(f"results must be a pandas DataFrame; got {type(results).__name__}.")
    missing = [c for c in REQUIRED if c not in results.columns]
    if missing:
        raise ValueError(
            f"{name} lacks the columns {missing} of a tangentlens results table; re-create it "
            "with `tangentlens study` or `tangentlens probe`."
        )
    t = results.copy()
    for col in _OPTIONAL:
        if col not in t.columns:
            t[col] = pd.NA
    t["value"] = pd.to_numeric(t["value"], errors="coerce")
    t["layer"] = pd.to_numeric(t["layer"], errors="coerce")
    t["head"] = pd.to_numeric(t["head"], errors="coerce")
    t["step"] = pd.to_numeric(t["step"], errors="coerce")
    t["rank"] = pd.to_numeric(t["rank"], errors="coerce")
    ranks = sorted(t["rank"].dropna().unique())
    if len(ranks) > 1:  # a rank sweep: the figures show the smallest rank
        t = t[t["rank"].isna() | (t["rank"] == ranks[0])]
    return t


def _pick(
    t: pd.DataFrame, statistic: str, *, site: str | None = None, probe: str | None = None
) -> pd.DataFrame:
    """Finite rows of one statistic (optionally at one site kind, from one probe)."""
    keep = (t["statistic"] == statistic) & np.isfinite(t["value"].astype(float))
    if site is not None:
        keep &= t["site"] == site
    if probe is not None:
        keep &= (t["probe"] == probe).fillna(False) | t["probe"].isna()
    return t[keep]


def _residual_site(t: pd.DataFrame) -> str:
    present = set(t["site"].dropna().unique())
    return next((s for s in ("resid_pre", "resid_mid", "resid_post") if s in present), "resid_pre")


def _steps(t: pd.DataFrame) -> list[int]:
    return sorted(int(s) for s in t["step"].dropna().unique())


def _window_spans(t: pd.DataFrame) -> dict[str, tuple[float, float]]:
    spans = {}
    for name in ("early", "late"):
        steps = t.loc[t["window"] == name, "step"].dropna()
        if len(steps):
            spans[name] = (float(steps.min()), float(steps.max()))
    return spans


def _groups(t: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Line groups for per-layer profiles: each checkpoint, or each window when many."""
    steps = _steps(t)
    if not steps:
        return [("this checkpoint", t)]
    if len(steps) <= _MAX_LINES:
        return [(f"step {s}", t[t["step"] == s]) for s in steps]
    groups = [(f"{w} window (mean)", t[t["window"] == w]) for w in ("early", "late")]
    groups = [(label, g) for label, g in groups if len(g)]
    return groups or [(f"step {s}", t[t["step"] == s]) for s in (steps[0], steps[-1])]


# ----------------------------------------------------------------------------- style
def _figure(ncols: int = 1, width: float = 6.0, height: float = 3.6) -> tuple[Figure, list]:
    fig = Figure(figsize=(width * ncols, height), dpi=100, layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    for ax in axes:
        ax.grid(True, color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
        ax.set_prop_cycle(color=OKABE_ITO)
    return fig, list(axes)


def _layer_colours(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps[SEQUENTIAL]
    return [cmap(0.8 * i / max(1, n - 1)) for i in range(n)]


def _step_axis(ax: Any, t: pd.DataFrame) -> None:
    """Symmetric-log step axis (Pythia-like schedules start at 0, 1, 2, 4, …) with the
    early and late windows shaded."""
    steps = _steps(t)
    if steps and steps[-1] > 8 * max(1, steps[1] if len(steps) > 1 else 1):
        ax.set_xscale("symlog", linthresh=1)
    from matplotlib.transforms import blended_transform_factory

    top = blended_transform_factory(ax.transData, ax.transAxes)
    for name, (lo, hi) in _window_spans(t).items():
        ax.axvspan(lo, hi, color="black", alpha=WINDOW_SHADE[name], lw=0)
        ax.text((lo + hi) / 2 if hi > lo else lo, 0.98, f"{name}\nwindow", transform=top,
                ha="center", va="top", fontsize=8, color="#333333")  # fmt: skip
    ax.set_xlabel("training step")


def _legend(fig: Figure, axes: list) -> None:
    """One legend for the whole figure, below the panels (never over the data)."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="outside lower center",
                   ncols=len(seen) if len(seen) <= 5 else -(-len(seen) // 2),
                   fontsize=8, frameon=False)  # fmt: skip


# ----------------------------------------------------------------------------- figures
@dataclass
class Rendered:
    """One figure of the report: its file name, title, the figure and a one-line reading."""

    name: str
    title: str
    figure: Figure
    reading: str


def _depth(t: pd.DataFrame) -> tuple[Figure, str] | None:
    site = _residual_site(t)
    share = _pick(t, "tangent_share", site=site, probe="residual")
    energy = _pick(t, "energy_ratio", site=site, probe="gradient")
    if share.empty and energy.empty:
        return None
    if "probe" in t and share["probe"].isna().all() and not energy.empty:
        share = share.iloc[0:0]  # without a probe column the shares are ambiguous
    fig, (ax_s, ax_e) = _figure(2)
    for label, g in _groups(t):
        s = share[share.index.isin(g.index)].groupby("layer")["value"].mean()
        e = energy[energy.index.isin(g.index)].groupby("layer")["value"].mean()
        if len(s):
            ax_s.plot(s.index, s.to_numpy(), "o-", label=label, ms=4)
        if len(e):
            ax_e.plot(e.index, e.to_numpy(), "s-", label=label, ms=4)
    chance = _pick(t, "chance_share", site=site, probe="residual")["value"]
    if len(chance):
        ax_s.axhline(float(chance.mean()), color="gray", ls=":", lw=1.2, label="chance (k/d)")
    ax_e.axhline(1.0, color="gray", ls=":", lw=1.2, label="normal controls (1)")
    ax_s.set(title=f"Residual stream ({site}): energy share in Q_T", xlabel="layer")
    ax_s.set_ylabel("tangent share")
    ax_e.set(title="Gradient energy in Q_T over matched normal controls", xlabel="layer")
    ax_e.set_ylabel("energy ratio")
    for ax in (ax_s, ax_e):
        ax.xaxis.get_major_locator().set_params(integer=True)
    _legend(fig, [ax_s, ax_e])
    groups = _groups(t)
    parts = []
    for label, g in (groups[0], groups[-1]) if len(groups) > 1 else groups:
        s = share[share.index.isin(g.index)].groupby("layer")["value"].mean()
        e = energy[energy.index.isin(g.index)].groupby("layer")["value"].mean()
        text = []
        if len(s):
            text.append(f"residual share in Q_T {s.mean():.2f} (peak at layer {s.idxmax():.0f})")
        if len(e):
            text.append(
                f"gradient energy {e.mean():.2f}× the controls (peak at layer {e.idxmax():.0f})"
            )
        parts.append(f"{label}: " + ", ".join(text))
    note = f"; chance share {chance.mean():.2f}" if len(chance) else ""
    return fig, "Mean over layers, " + "; ".join(parts) + note + "."


def _heatmap(t: pd.DataFrame) -> tuple[Figure, str] | None:
    tt = _pick(t, "score_share_TT").dropna(subset=["head", "layer"])
    if tt.empty:
        return None
    panels = [(label, g) for label, g in _groups(tt)]
    if len(panels) > 2:
        panels = [panels[0], panels[-1]]
    grids = [
        g.groupby(["layer", "head"])["value"].mean().unstack("head").sort_index() for _, g in panels
    ]
    n_layers, n_heads = grids[0].shape
    width = min(6.5, 2.2 + 0.45 * n_heads)
    fig = Figure(
        figsize=(width * len(grids) + 0.8, min(9.0, 1.6 + 0.28 * n_layers)),
        dpi=100,
        layout="constrained",
    )
    axes = fig.subplots(1, len(grids), squeeze=False)[0]
    vmax = max(float(np.nanmax(g.to_numpy())) for g in grids)
    image = None
    for ax, (label, _), grid in zip(axes, panels, grids, strict=True):
        values = grid.to_numpy(dtype=float)
        image = ax.imshow(values, cmap=SEQUENTIAL, vmin=0, vmax=vmax, aspect="auto")
        ax.set_xticks(range(grid.shape[1]), [f"{int(h)}" for h in grid.columns])
        ax.set_yticks(range(grid.shape[0]), [f"{int(r)}" for r in grid.index])
        if grid.shape[0] > 16:
            for lbl in ax.get_yticklabels()[1::2]:
                lbl.set_visible(False)
        ax.set(xlabel="head", ylabel="layer", title=label if len(grids) > 1 else "")
        if values.size <= 160:
            for (i, j), v in np.ndenumerate(values):
                if np.isfinite(v):
                    colour = "black" if v > 0.6 * vmax else "white"
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color=colour)
    fig.colorbar(image, ax=list(axes), label="TT share of score energy")
    fig.suptitle("Attention score from tangent query × tangent key (TT)")
    last = grids[-1]
    layer, head = np.unravel_index(np.nanargmax(last.to_numpy()), last.shape)
    reading = (
        f"The tangent–tangent term carries {np.nanmean(last.to_numpy()):.2f} of the score "
        f"energy on average ({panels[-1][0]}); the most tangent head is layer "
        f"{int(last.index[layer])}, head {int(last.columns[head])} "
        f"({last.to_numpy()[layer, head]:.2f})."
    )
    return fig, reading


def _per_step(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean, min and max over layers per step."""
    return frame.groupby("step")["value"].agg(["mean", "min", "max"])


def _energy(t: pd.DataFrame) -> tuple[Figure, str] | None:
    site = _residual_site(t)
    ratio = _pick(t, "energy_ratio", site=site, probe="gradient")
    pval = _pick(t, "p_value", site=site, probe="gradient")
    if len(_steps(ratio)) < 2:
        return None
    fig, (ax_r, ax_p) = _figure(2)
    layers = sorted(ratio["layer"].dropna().unique())
    colours = _layer_colours(len(layers))
    for ax, frame in ((ax_r, ratio), (ax_p, pval)):
        _step_axis(ax, t)
        for colour, layer in zip(colours, layers, strict=True):
            g = frame[frame["layer"] == layer].groupby("step")["value"].mean()
            if len(g):
                ax.plot(g.index, g.to_numpy(), "-", color=colour, lw=1.1, alpha=0.85,
                        label=f"layer {int(layer)}" if len(layers) <= 8 else None)  # fmt: skip
    mean = _per_step(ratio)["mean"]
    ax_r.plot(mean.index, mean.to_numpy(), "k-o", lw=2.2, ms=3, label="mean over layers")
    ax_r.axhline(1.0, color="gray", ls=":", lw=1.2)
    ax_r.set(title=f"Gradient energy ratio ({site})", ylabel="energy in Q_T / normal control")
    if len(pval):
        ax_p.set_yscale("log")
        ax_p.axhline(ALPHA, color="#D55E00", ls="--", lw=1.2, label=f"α = {ALPHA}")
        floor = float(pval["value"].min())
        if (pval["value"] <= floor * (1 + 1e-9)).mean() > 0.2:  # many tests at the MC floor
            ax_p.axhline(floor, color="gray", ls=":", lw=1.2,
                         label=f"smallest p with these controls ({floor:.2g})")  # fmt: skip
    ax_p.set(title="p-value against normal controls", ylabel="p-value (log)")
    _legend(fig, [ax_r, ax_p])
    if len(layers) > 8:
        _layer_colourbar(fig, [ax_r, ax_p], layers)
    early, late = _window_means(ratio)
    if early is None or late is None:
        reading = f"Mean energy ratio goes from {mean.iloc[0]:.2f} to {mean.iloc[-1]:.2f}."
    else:
        trend = "weaker" if late < early else "stronger"
        reading = (
            f"Mean gradient energy ratio is {early:.2f}× the normal controls in the early "
            "window and "
            f"{late:.2f}× in the late window: the tangent concentration is {trend} late."
        )
    return fig, reading


def _layer_colourbar(fig: Figure, axes: list, layers: list) -> None:
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import ListedColormap, Normalize

    cmap = ListedColormap(_layer_colours(256))
    mappable = ScalarMappable(Normalize(min(layers), max(layers)), cmap)
    fig.colorbar(mappable, ax=axes, label="layer", fraction=0.04)


def _window_means(frame: pd.DataFrame) -> tuple[float | None, float | None]:
    out = []
    for name in ("early", "late"):
        v = frame.loc[frame["window"] == name, "value"]
        out.append(float(v.mean()) if len(v) else None)
    return out[0], out[1]


def _isotropy(t: pd.DataFrame) -> tuple[Figure, str] | None:
    site = _residual_site(t)
    d_t = _pick(t, "delta_iso_tangent", site=site, probe="gradient")
    d_n = _pick(t, "delta_iso_normal", site=site, probe="gradient")
    if d_t.empty or d_n.empty:
        return None
    fig, (ax,) = _figure(1, width=7.5)
    series = (("remove Q_T", d_t, OKABE_ITO[5]), ("remove a normal control", d_n, OKABE_ITO[0]))
    if len(_steps(d_t)) >= 2:
        _step_axis(ax, t)
        for label, frame, colour in series:
            s = _per_step(frame)
            ax.plot(s.index, s["mean"].to_numpy(), "o-", color=colour, ms=3, label=label)
            ax.fill_between(s.index, s["min"], s["max"], color=colour, alpha=0.15, lw=0)
        ax.set_title(f"ΔIsoScore* of the gradients ({site}; mean over layers, band: min–max)")
    else:
        layers = sorted(d_t["layer"].unique())
        x = np.arange(len(layers))
        for offset, (label, frame, colour) in zip((-0.2, 0.2), series, strict=True):
            v = frame.groupby("layer")["value"].mean().reindex(layers)
            ax.bar(x + offset, v.to_numpy(), width=0.4, color=colour, label=label)
        ax.set_xticks(x, [f"{int(layer)}" for layer in layers])
        ax.set_xlabel("layer")
        ax.set_title(f"ΔIsoScore* of the gradients per layer ({site})")
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.set_ylabel("ΔIsoScore* after removal")
    _legend(fig, [ax])
    mt, mn = float(d_t["value"].mean()), float(d_n["value"].mean())
    more = "more" if mt > mn else "less"
    return fig, (
        f"Removing Q_T changes IsoScore* by {mt:+.3f} on average against {mn:+.3f} for a normal "
        f"control: Q_T removal raises isotropy {more} than a control."
    )


def _frequency(t: pd.DataFrame) -> tuple[Figure, str] | None:
    present = [c for c in CENTRES if not _pick(t, f"pearson_{c}").empty]
    if not present:
        return None
    fig, axes = _figure(2)
    steps = _steps(_pick(t, f"pearson_{present[0]}"))
    for ax, kind in zip(axes, ("pearson", "spearman"), strict=True):
        if len(steps) >= 2:
            _step_axis(ax, t)
            for colour, centre in zip(OKABE_ITO, present, strict=False):
                s = _pick(t, f"{kind}_{centre}").groupby("step")["value"].mean()
                ax.plot(s.index, s.to_numpy(), "o-", color=colour, ms=3, label=CENTRES[centre])
            null_m = _pick(t, f"{kind}_weighted_null_mean").groupby("step")["value"].mean()
            null_s = _pick(t, f"{kind}_weighted_null_std").groupby("step")["value"].mean()
            if len(null_m) and len(null_s):
                ax.fill_between(null_m.index, null_m - 2 * null_s, null_m + 2 * null_s,
                                color="gray", alpha=0.25, lw=0,
                                label="weighted centre, null ± 2 sd")  # fmt: skip
        else:
            vals = [float(_pick(t, f"{kind}_{c}")["value"].mean()) for c in present]
            ax.bar(range(len(present)), vals, color=OKABE_ITO[: len(present)])
            labels = [CENTRES[c].replace(" ", "\n", 1) for c in present]
            ax.set_xticks(range(len(present)), labels, fontsize=8)
        ax.axhline(0.0, color="gray", lw=0.8)
        ax.set_ylim(-1, 1)
        ax.set(title=f"{kind.title()} r: log frequency vs distance to centre", ylabel="r")
    _legend(fig, axes)
    last = steps[-1] if steps else None
    final = {c: _final(t, f"pearson_{c}") for c in present}
    text = ", ".join(f"{CENTRES[c]} {v:+.2f}" for c, v in final.items() if v is not None)
    where = f" at step {last}" if last is not None else ""
    return fig, (
        f"Pearson r{where}: {text} (negative: frequent tokens sit closer to the centre; "
        "correlations over the tokens seen in the corpus, as the study stores no per-token "
        "distances)."
    )


def _final(t: pd.DataFrame, statistic: str) -> float | None:
    """Mean of ``statistic`` at the last step (or over the whole table without steps)."""
    rows = _pick(t, statistic)
    if rows.empty:
        return None
    steps = _steps(rows)
    if steps:
        rows = rows[rows["step"] == steps[-1]]
    return float(rows["value"].mean())


def _dimension(t: pd.DataFrame) -> tuple[Figure, str] | None:
    present = set(t["statistic"].unique())
    names = [("twonn_dimension", "TwoNN intrinsic dimension"), ("effective_rank", "effective rank")]
    names = [(n, label) for n, label in names if n in present]
    if not names:
        return None
    fig, axes = _figure(len(names))
    readings = []
    for ax, (stat, label) in zip(axes, names, strict=True):
        rows = _pick(t, stat)
        site = _residual_site(rows) if rows["site"].notna().any() else None
        if site is not None and (rows["site"] == site).any():
            rows = rows[rows["site"] == site]
        layers = sorted(rows["layer"].dropna().unique())
        if len(_steps(rows)) >= 2:
            _step_axis(ax, t)
            colours = _layer_colours(len(layers))
            for colour, layer in zip(colours, layers, strict=True):
                g = rows[rows["layer"] == layer].groupby("step")["value"].mean()
                ax.plot(g.index, g.to_numpy(), "o-", ms=3, color=colour,
                        label=f"layer {int(layer)}" if len(layers) <= 8 else None)  # fmt: skip
            s = _per_step(rows)["mean"]
            readings.append(f"{label} {s.iloc[0]:.1f} → {s.iloc[-1]:.1f}")
        else:
            g = rows.groupby("layer")["value"].mean()
            ax.plot(g.index, g.to_numpy(), "o-", ms=4)
            ax.set_xlabel("layer")
            readings.append(f"{label} {g.mean():.1f} on average")
        ax.set(title=f"{label} of activations" + (f" ({site})" if site else ""), ylabel=label)
    _legend(fig, axes)
    prefix = "Over training (mean over layers)" if len(_steps(t)) >= 2 else "Mean over layers"
    return fig, f"{prefix}: " + "; ".join(readings) + "."


FIGURES: dict[str, tuple[str, Callable[[pd.DataFrame], tuple[Figure, str] | None]]] = {
    "depth_profile": ("Depth profile", _depth),
    "head_heatmap": ("Attention heads: tangent–tangent share of the score", _heatmap),
    "energy_over_training": ("Gradient energy in Q_T over training", _energy),
    "isotropy_removal": ("IsoScore* after removing Q_T vs a normal control", _isotropy),
    "frequency_distance": ("Token frequency vs distance to the embedding centre", _frequency),
    "intrinsic_dimension": ("Intrinsic dimension and effective rank", _dimension),
}


def _public(name: str) -> Callable[[Any], Figure | None]:
    def plot(results: Any) -> Figure | None:
        out = FIGURES[name][1](_prepare(results))
        return None if out is None else out[0]

    plot.__name__ = f"plot_{name}"
    plot.__doc__ = f"{FIGURES[name][0]} from a long results table; None when it has no data."
    return plot


plot_depth_profile = _public("depth_profile")
plot_head_heatmap = _public("head_heatmap")
plot_energy_over_training = _public("energy_over_training")
plot_isotropy_removal = _public("isotropy_removal")
plot_frequency_distance = _public("frequency_distance")
plot_intrinsic_dimension = _public("intrinsic_dimension")


def render_figures(results: Any) -> list[Rendered]:
    """Every figure the table has data for, in report order."""
    t = _prepare(results)
    out = []
    for name, (title, build) in FIGURES.items():
        made = build(t)
        if made is not None:
            out.append(Rendered(name, title, made[0], made[1]))
    return out


# ----------------------------------------------------------------------------- summary
@dataclass(frozen=True)
class Claim:
    """One row of the summary: what was measured here next to what the paper reports."""

    quantity: str
    measured: str
    paper: str
    agrees: str  # "yes", "no", "partly" or "n/a"


def _agree(ok: bool | None) -> str:
    return "n/a" if ok is None else ("yes" if ok else "no")


def _significant(frame: pd.DataFrame) -> str:
    return f"p < {ALPHA} in {(frame['value'] < ALPHA).mean():.0%}" if len(frame) else ""


def summary(results: Any) -> list[Claim]:
    """Headline numbers next to the paper's claims (rows only where data exists)."""
    t = _prepare(results)
    site = _residual_site(t)
    claims: list[Claim] = []

    r = {c: _final(t, f"pearson_{c}") for c in CENTRES}
    if any(v is not None for v in r.values()):
        shown = ", ".join(f"{CENTRES[c]} {v:+.2f}" for c, v in r.items() if v is not None)
        weighted = r["weighted"]
        null_m, p = _final(t, "pearson_weighted_null_mean"), _final(t, "pearson_weighted_p_value")
        if weighted is not None and null_m is not None:
            shown += f" (weighted null {null_m:+.2f}"
            shown += f", p = {p:.3g})" if p is not None else ")"
        values = [v for v in r.values() if v is not None]
        # "partly": strongly negative for some centre, but the sign depends on the centre
        strong = min(values) <= -0.3
        ok = "no" if not strong else ("yes" if max(values) < 0 else "partly")
        claims.append(Claim("Frequency vs distance, Pearson r (last step)", shown,
                            PAPER["frequency"], ok))  # fmt: skip

    ratio = _pick(t, "energy_ratio", site=site, probe="gradient")
    pval = _pick(t, "p_value", site=site, probe="gradient")
    early, late = _window_means(ratio)
    if early is not None and late is not None:
        sig_e = _significant(pval[pval["window"] == "early"])
        sig_l = _significant(pval[pval["window"] == "late"])
        claims.append(Claim("Gradient energy ratio, early window (mean over layers)",
                            f"{early:.2f}× controls" + (f"; {sig_e}" if sig_e else ""),
                            PAPER["energy_early"], _agree(early > 1)))  # fmt: skip
        claims.append(Claim("Gradient energy ratio, late window",
                            f"{late:.2f}× controls" + (f"; {sig_l}" if sig_l else ""),
                            PAPER["energy_late"], _agree(late < early)))  # fmt: skip
    elif len(ratio):
        mean = float(ratio["value"].mean())
        sig = _significant(pval)
        claims.append(Claim("Gradient energy ratio (one checkpoint, mean over layers)",
                            f"{mean:.2f}× controls" + (f"; {sig}" if sig else ""),
                            f"{PAPER['energy_early']}; {PAPER['energy_late']}",
                            "n/a"))  # fmt: skip

    d_t = _pick(t, "delta_iso_tangent", site=site, probe="gradient")
    d_n = _pick(t, "delta_iso_normal", site=site, probe="gradient")
    if len(d_t) and len(d_n):
        mt, mn = float(d_t["value"].mean()), float(d_n["value"].mean())
        sig = _significant(_pick(t, "isotropy_p_value", site=site, probe="gradient"))
        claims.append(Claim("ΔIsoScore*: remove Q_T vs a normal control (mean)",
                            f"{mt:+.3f} vs {mn:+.3f}" + (f"; {sig}" if sig else ""),
                            PAPER["isotropy"], _agree(mt > mn)))  # fmt: skip

    loss = _pick(t, "probe_loss").groupby("step")["value"].mean()
    if len(loss) >= 2:
        claims.append(Claim("Probe-set loss (nats), first → last checkpoint",
                            f"{loss.iloc[0]:.2f} → {loss.iloc[-1]:.2f}", "—", "n/a"))  # fmt: skip

    tt = _pick(t, "score_share_TT")
    if len(tt):
        steps = _steps(tt)
        last = tt[tt["step"] == steps[-1]] if steps else tt
        claims.append(Claim("Attention: TT share of the score (last checkpoint, mean over heads)",
                            f"{last['value'].mean():.3f} (max {last['value'].max():.3f})",
                            "—", "n/a"))  # fmt: skip
    return claims


def format_summary(claims: list[Claim]) -> str:
    """The summary as plain text lines, for the terminal."""
    if not claims:
        return "  (no headline numbers in these results)"
    lines = []
    for c in claims:
        lines.append(f"  {c.quantity}: {c.measured}")
        if c.paper != "—":
            lines.append(f"      paper: {c.paper}  [agrees: {c.agrees}]")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- HTML
_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0 auto;
max-width:1180px;padding:24px 32px;color:#1b1b1b;line-height:1.45}
h1{margin:0 0 4px}h2{margin-top:36px;border-bottom:2px solid #0072B2;padding-bottom:4px}
.meta{color:#555;font-size:14px}
table.summary{border-collapse:collapse;width:100%;font-size:14px}
table.summary th,table.summary td{border:1px solid #ccc;padding:6px 9px;text-align:left;
vertical-align:top}table.summary th{background:#eef4fa}
td.yes{background:#e3f2ea}td.no{background:#fbe5d6}td.partly{background:#fff4cc}
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


def _describe(t: pd.DataFrame) -> str:
    steps = _steps(t)
    layers = t["layer"].dropna()
    parts = [f"{len(t)} rows"]
    if steps:
        parts.append(f"{len(steps)} checkpoints (steps {steps[0]}–{steps[-1]})")
    if len(layers):
        parts.append(f"layers {int(layers.min())}–{int(layers.max())}")
    return ", ".join(parts)


def _html(
    t: pd.DataFrame,
    claims: list[Claim],
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
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f'<p class="meta">Generated {now} · {esc(_describe(t))}</p>',
        "<h2>Summary</h2>",
    ]
    if claims:
        out.append(
            '<table class="summary"><tr><th>Quantity</th><th>Measured here</th>'
            "<th>Paper</th><th>Agrees</th></tr>"
        )
        for c in claims:
            out.append(
                f"<tr><td>{esc(c.quantity)}</td><td>{esc(c.measured)}</td>"
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


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is corrupt ({err}); re-create it or delete it.") from err


def write_report(
    results: str | Path | pd.DataFrame,
    out_path: str | Path,
    config: Mapping[str, Any] | None = None,
    manifest: Mapping[str, Any] | None = None,
    *,
    title: str = "tangentlens report",
) -> Path:
    """Write one self-contained ``report.html`` and ``figures/*.png`` beside it.

    ``results``: a results folder (reads ``results.csv`` and ``manifest.json``; the
    config defaults to the manifest's ``config``) or a long DataFrame. ``out_path``: the
    HTML file, or a folder to hold ``report.html``. Returns the HTML path.
    """
    from .io import atomic_write, write_text

    if isinstance(results, pd.DataFrame):
        table = _prepare(results)
    else:
        table = load_results(results)
        folder = Path(results) if Path(results).is_dir() else Path(results).parent
        if manifest is None:
            manifest = _read_json(folder / MANIFEST_FILE)
    if config is None and manifest:
        config = manifest.get("config")
    out = Path(out_path)
    if out.suffix.lower() not in (".html", ".htm"):
        out = out / "report.html"
    figures_dir = out.parent / "figures"
    rendered = []
    for fig in render_figures(table):
        png = _png(fig.figure)
        atomic_write(figures_dir / f"{fig.name}.png", lambda p, b=png: p.write_bytes(b))
        rendered.append((fig, png))
    page = _html(table, summary(table), rendered, config, manifest, title)
    return write_text(out, page)
