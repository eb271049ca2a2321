"""The report's figures: each takes a long results table and returns a matplotlib
`Figure` and a one-line reading, or None when the table holds no data for it.

>>> from tangentlens import report
>>> fig = report.plot_depth_profile(session.results())
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import ListedColormap, Normalize
from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
from matplotlib.transforms import blended_transform_factory

from ..analysis.depth import DepthProfile, plot_profiles
from ..analysis.heads import head_arrays
from ..core.errors import UsageError
from .table import (
    ALPHA,
    CENTRES,
    centres_text,
    correlations,
    gradient,
    per_step,
    pick,
    prepare,
    residual_site,
    steps,
    window_means,
    window_spans,
)

__all__ = [
    "FIGURES",
    "Rendered",
    "plot_depth_profile",
    "plot_energy_over_training",
    "plot_frequency_distance",
    "plot_head_heatmap",
    "plot_intrinsic_dimension",
    "plot_isotropy_removal",
    "render_figures",
]

# Okabe & Ito (2008): distinguishable under the common colour-vision deficiencies.
OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#000000")
SEQUENTIAL = "cividis"  # perceptually uniform and colour-blind safe
WINDOW_SHADE = {"early": 0.07, "late": 0.14}  # grey alpha: shading never competes with data
_MAX_LINES = 6  # beyond this many checkpoints, profiles are drawn per window


def _groups(t: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """Line groups for per-layer profiles: each checkpoint, or each window when many."""
    seen = steps(t)
    if not seen:
        return [("this checkpoint", t)]
    if len(seen) <= _MAX_LINES:
        return [(f"step {s}", t[t["step"] == s]) for s in seen]
    groups = [(f"{w} window (mean)", t[t["window"] == w]) for w in ("early", "late")]
    groups = [(label, g) for label, g in groups if len(g)]
    return groups or [(f"step {s}", t[t["step"] == s]) for s in (seen[0], seen[-1])]


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
    cmap = colormaps[SEQUENTIAL]
    return [cmap(0.8 * i / max(1, n - 1)) for i in range(n)]


def _step_axis(ax: Any, t: pd.DataFrame) -> None:
    """Symmetric-log step axis (Pythia-like schedules start at 0, 1, 2, 4, …) with the
    early and late windows shaded."""
    seen = steps(t)
    if seen and seen[-1] > 8 * max(1, seen[1] if len(seen) > 1 else 1):
        ax.set_xscale("symlog", linthresh=1)
    top = blended_transform_factory(ax.transData, ax.transAxes)
    for name, (lo, hi) in window_spans(t).items():
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


def _profile(g: pd.DataFrame, site: str, intervals: bool) -> DepthProfile | None:
    """The depth profile of one line group: each statistic's mean per layer (a window's
    checkpoints averaged; their intervals only where the group is one checkpoint, as a mean
    of intervals is no interval; a table with the shares but not their ratio gets it from
    them); None when the group has neither ratio at ``site``."""
    rows = g[g["site"].notna() & g["layer"].notna() & g["head"].isna()]
    if rows["probe"].isna().all() and (rows["statistic"] == "energy_ratio").any():
        rows = rows[rows["statistic"] != "tangent_share"]  # whose? residual and gradient's
    rows = rows.assign(probe=rows["probe"].fillna(""))  # DepthProfile's "any probe"
    columns = ["value", *(c for c in ("ci_low", "ci_high") if intervals and c in g)]
    means = rows.groupby(["probe", "site", "layer", "statistic"])[columns].mean().reset_index()
    stream = means[(means["probe"].isin(["residual", ""])) & (means["site"] == site)]
    by = stream.pivot_table(index="layer", columns="statistic", values="value")
    if "share_ratio" not in by and {"tangent_share", "chance_share"} <= set(by):
        ratio = (by["tangent_share"] / by["chance_share"]).dropna()  # the catalogue's definition
        derived = pd.DataFrame({"probe": "residual", "site": site, "layer": ratio.index,
                                "statistic": "share_ratio", "value": ratio.to_numpy()})  # fmt: skip
        means = pd.concat([means, derived], ignore_index=True)
    try:
        return DepthProfile(means, site=site)
    except UsageError:  # neither ratio in this group
        return None


def _depth(t: pd.DataFrame) -> tuple[Figure, str] | None:
    site = residual_site(t)
    groups = [(label, _profile(g, site, g["step"].nunique() <= 1)) for label, g in _groups(t)]
    profiles = [(label, p) for label, p in groups if p is not None]
    if not profiles:
        return None
    fig, axes = _figure(3, width=4.4)
    plot_profiles(profiles, axes, colours=OKABE_ITO, legend=False)
    axes[0].set_title(f"Residual stream ({site}): energy share in Q_T")
    _legend(fig, axes)
    parts = []
    for label, profile in (profiles[0], profiles[-1]) if len(profiles) > 1 else profiles:
        layers = profile.to_frame()
        s, e = layers["tangent_share"].dropna(), layers["energy_ratio"].dropna()
        text = []
        if len(s):
            text.append(f"residual share in Q_T {s.mean():.2f} (peak at layer {s.idxmax():.0f})")
        if len(e):
            text.append(
                f"gradient energy {e.mean():.2f}× the controls (peak at layer {e.idxmax():.0f})"
            )
        parts.append(f"{label}: " + ", ".join(text))
    chance = pick(t, "chance_share", site=site, probe="residual")["value"]
    note = f"; chance share {chance.mean():.2f}" if len(chance) else ""
    return fig, "Mean over layers, " + "; ".join(parts) + note + "."


def _heatmap(t: pd.DataFrame) -> tuple[Figure, str] | None:
    tt = pick(t, "score_share_TT").dropna(subset=["head", "layer"])
    if tt.empty:
        return None
    panels = [(label, g) for label, g in _groups(tt)]
    if len(panels) > 2:
        panels = [panels[0], panels[-1]]
    grids = [head_arrays(g, "score_share_TT", mean=True).frame() for _, g in panels]
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


def _energy(t: pd.DataFrame) -> tuple[Figure, str] | None:
    site = residual_site(t)
    ratio, pval = gradient(t, "energy_ratio"), gradient(t, "p_value")
    if len(steps(ratio)) < 2:
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
    mean = per_step(ratio)["mean"]
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
    early, late = window_means(ratio)
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
    cmap = ListedColormap(_layer_colours(256))
    mappable = ScalarMappable(Normalize(min(layers), max(layers)), cmap)
    fig.colorbar(mappable, ax=axes, label="layer", fraction=0.04)


def _isotropy(t: pd.DataFrame) -> tuple[Figure, str] | None:
    site = residual_site(t)
    d_t, d_n = gradient(t, "delta_iso_tangent"), gradient(t, "delta_iso_normal")
    if d_t.empty or d_n.empty:
        return None
    fig, (ax,) = _figure(1, width=7.5)
    series = (("remove Q_T", d_t, OKABE_ITO[5]), ("remove a normal control", d_n, OKABE_ITO[0]))
    if len(steps(d_t)) >= 2:
        _step_axis(ax, t)
        for label, frame, colour in series:
            s = per_step(frame)
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
    present = list(correlations(t))
    if not present:
        return None
    fig, axes = _figure(2)
    seen = steps(pick(t, f"pearson_{present[0]}"))
    for ax, kind in zip(axes, ("pearson", "spearman"), strict=True):
        if len(seen) >= 2:
            _step_axis(ax, t)
            for colour, centre in zip(OKABE_ITO, present, strict=False):
                s = pick(t, f"{kind}_{centre}").groupby("step")["value"].mean()
                ax.plot(s.index, s.to_numpy(), "o-", color=colour, ms=3, label=CENTRES[centre])
            null_m = pick(t, f"{kind}_weighted_null_mean").groupby("step")["value"].mean()
            null_s = pick(t, f"{kind}_weighted_null_std").groupby("step")["value"].mean()
            if len(null_m) and len(null_s):
                ax.fill_between(null_m.index, null_m - 2 * null_s, null_m + 2 * null_s,
                                color="gray", alpha=0.25, lw=0,
                                label="weighted centre, null ± 2 sd")  # fmt: skip
        else:
            vals = [float(pick(t, f"{kind}_{c}")["value"].mean()) for c in present]
            ax.bar(range(len(present)), vals, color=OKABE_ITO[: len(present)])
            labels = [CENTRES[c].replace(" ", "\n", 1) for c in present]
            ax.set_xticks(range(len(present)), labels, fontsize=8)
        ax.axhline(0.0, color="gray", lw=0.8)
        ax.set_ylim(-1, 1)
        ax.set(title=f"{kind.title()} r: log frequency vs distance to centre", ylabel="r")
    _legend(fig, axes)
    last = seen[-1] if seen else None
    text = centres_text(correlations(t))
    where = f" at step {last}" if last is not None else ""
    return fig, (
        f"Pearson r{where}: {text} (negative: frequent tokens sit closer to the centre; "
        "correlations over the tokens seen in the corpus, as the study stores no per-token "
        "distances)."
    )


def _nondegenerate(rows: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """TwoNN rows without the degenerate estimates (value below 1), and how many went.
    Points that span any direction give a dimension of at least 1; below 1, the ratios
    r₂/r₁ are dominated by near-ties (neighbours at almost equal distance, as near-duplicate
    tokens give), so the number measures the sample's ties, not the cloud, and would drag a
    mean over layers or checkpoints toward 0."""
    keep = rows["value"].astype(float) >= 1
    return rows[keep], int((~keep).sum())


def _dimension(t: pd.DataFrame) -> tuple[Figure, str] | None:
    present = set(t["statistic"].unique())
    names = [("twonn_dimension", "TwoNN intrinsic dimension"), ("effective_rank", "effective rank")]
    names = [(n, label) for n, label in names if n in present]
    if not names:
        return None
    fig, axes = _figure(len(names))
    readings = []
    for ax, (stat, label) in zip(axes, names, strict=True):
        rows = pick(t, stat)
        if stat.startswith("twonn"):
            rows, dropped = _nondegenerate(rows)
            if dropped:
                readings.append(f"{dropped} TwoNN estimates below 1 left out as degenerate")
        site = residual_site(rows) if rows["site"].notna().any() else None
        if site is not None and (rows["site"] == site).any():
            rows = rows[rows["site"] == site]
        layers = sorted(rows["layer"].dropna().unique())
        if len(steps(rows)) >= 2:
            _step_axis(ax, t)
            colours = _layer_colours(len(layers))
            for colour, layer in zip(colours, layers, strict=True):
                g = rows[rows["layer"] == layer].groupby("step")["value"].mean()
                ax.plot(g.index, g.to_numpy(), "o-", ms=3, color=colour,
                        label=f"layer {int(layer)}" if len(layers) <= 8 else None)  # fmt: skip
            s = per_step(rows)["mean"]
            readings.append(f"{label} {s.iloc[0]:.1f} → {s.iloc[-1]:.1f}")
        else:
            g = rows.groupby("layer")["value"].mean()
            ax.plot(g.index, g.to_numpy(), "o-", ms=4)
            ax.set_xlabel("layer")
            readings.append(f"{label} {g.mean():.1f} on average")
        ax.set(title=f"{label} of activations" + (f" ({site})" if site else ""), ylabel=label)
    _legend(fig, axes)
    prefix = "Over training (mean over layers)" if len(steps(t)) >= 2 else "Mean over layers"
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
        out = FIGURES[name][1](prepare(results))
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
    t = prepare(results)
    out = []
    for name, (title, build) in FIGURES.items():
        made = build(t)
        if made is not None:
            out.append(Rendered(name, title, made[0], made[1]))
    return out
