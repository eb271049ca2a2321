"""The report's figures: each takes a long results table and returns a matplotlib
`Figure` and a one-line reading, or None when the table holds no data for it.

Each reading names the sites and checkpoints its numbers average (`tangentlens.report.scope`),
and a figure over training quotes the very window means the summary's verdicts read, so
a page never shows two values under one name. Intervals are drawn wherever the table has
them: per site and checkpoint (bands, bars), and the windows' means as boxes.

>>> from tangentlens import report
>>> fig = report.plot_depth_profile(session.results())
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
from matplotlib.patches import Rectangle

from ..analysis.depth import DepthProfile, plot_profiles
from ..analysis.heads import head_arrays
from ..core.errors import UsageError
from .claims import Estimate
from .curves import energy_figure, isotropy_figure
from .scope import describe_layers, describe_sites, describe_steps
from .style import OKABE_ITO, SEQUENTIAL, figure, layer_colours, legend, step_axis
from .table import (
    CENTRES,
    correlations,
    per_step,
    pick,
    prepare,
    residual_site,
    steps,
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
_MAX_LINES = 6  # beyond this many checkpoints, per-layer figures show the windows' ends


def _groups(t: pd.DataFrame) -> list[tuple[str, int | None, pd.DataFrame]]:
    """Single checkpoints for per-layer figures: each one when few, else the first and
    last checkpoint of each window (a window's mean of per-layer intervals would be no
    interval, and a single checkpoint keeps its own). Each: (label, step, its rows)."""
    seen = steps(t)
    if not seen:
        return [("this checkpoint", None, t)]
    if len(seen) > _MAX_LINES:
        chosen = set()
        for name in ("early", "late"):
            in_window = sorted(int(s) for s in t.loc[t["window"] == name, "step"].dropna())
            chosen |= {in_window[0], in_window[-1]} if in_window else set()
        seen = sorted(chosen or {seen[0], seen[-1]})
    windows = t.dropna(subset=["step"]).groupby("step")["window"].first()
    out = []
    for s in seen:
        window = windows.get(s)
        label = f"step {s}" + (f" ({window} window)" if window in ("early", "late") else "")
        out.append((label, s, t[t["step"] == s]))
    return out


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
    groups = [(label, _profile(g, site, True)) for label, _, g in _groups(t)]
    profiles = [(label, p) for label, p in groups if p is not None]
    if not profiles:
        return None
    fig, axes = figure(3, width=4.4)
    plot_profiles(profiles, axes, colours=OKABE_ITO, legend=False)
    axes[0].set_title(f"Residual stream ({site}): energy share in Q_T")
    legend(fig, axes)
    parts = []
    for label, profile in (profiles[0], profiles[-1]) if len(profiles) > 1 else profiles:
        layers = profile.to_frame()
        s, e = layers["tangent_share"].dropna(), layers["energy_ratio"].dropna()
        text = []
        if len(s):
            text.append(f"residual share in Q_T {s.mean():.2f} (peak at layer {s.idxmax():.0f})")
        if len(e):
            text.append(f"gradient energy ratio {e.mean():.2f} (peak at layer {e.idxmax():.0f})")
        parts.append(f"{label[0].upper()}{label[1:]}: " + ", ".join(text))
    chance = pick(t, "chance_share", site=site, probe="residual")["value"]
    note = f"; chance share {chance.mean():.2f}" if len(chance) else ""
    layers = describe_layers(profiles[0][1].layers)
    return fig, (
        f"At {site}, {layers}; each number a mean over those layers at one checkpoint. "
        + "; ".join(parts)
        + note
        + ". Bars: 95 % intervals over probe tokens, per layer "
        "and checkpoint."
    )


def _heatmap(t: pd.DataFrame) -> tuple[Figure, str] | None:
    tt = pick(t, "score_share_TT").dropna(subset=["head", "layer"])
    if tt.empty:
        return None
    panels = _groups(tt)
    if len(panels) > 2:
        panels = [panels[0], panels[-1]]
    grids = [head_arrays(g, "score_share_TT", mean=True).frame() for _, _, g in panels]
    zs = []
    for _, step, _ in panels:
        z = pick(t if step is None else t[t["step"] == step], "score_share_TT_z")
        z = z.dropna(subset=["head", "layer"])
        zs.append(head_arrays(z, "score_share_TT_z", mean=True).frame() if len(z) else None)
    n_layers, n_heads = grids[0].shape
    width = min(6.5, 2.2 + 0.45 * n_heads)
    fig = Figure(
        figsize=(width * len(grids) + 0.8, min(9.0, 1.6 + 0.28 * n_layers)),
        dpi=100,
        layout="constrained",
    )
    axes = fig.subplots(1, len(grids), squeeze=False)[0]
    vmax = max(float(np.nanmax(g.to_numpy())) for g in grids)
    image, hatched = None, 0
    for ax, (label, _, _), grid, z in zip(axes, panels, grids, zs, strict=True):
        values = grid.to_numpy(dtype=float)
        image = ax.imshow(values, cmap=SEQUENTIAL, vmin=0, vmax=vmax, aspect="auto")
        ax.set_xticks(range(grid.shape[1]), [f"{int(h)}" for h in grid.columns])
        ax.set_yticks(range(grid.shape[0]), [f"{int(r)}" for r in grid.index])
        if grid.shape[0] > 16:
            for lbl in ax.get_yticklabels()[1::2]:
                lbl.set_visible(False)
        ax.set(xlabel="head", ylabel="layer", title=label)
        if z is not None:
            near = z.reindex(index=grid.index, columns=grid.columns).abs().to_numpy() < 1.96
            for i, j in zip(*np.nonzero(near), strict=True):
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///",
                                       edgecolor="#D55E00", lw=0))  # fmt: skip
            hatched += int(near.sum())
        if values.size <= 160:
            for (i, j), v in np.ndenumerate(values):
                if np.isfinite(v):
                    colour = "black" if v > 0.6 * vmax else "white"
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color=colour)
    fig.colorbar(image, ax=list(axes), label="share of score energy")
    fig.suptitle("score_share_TT: attention score from tangent query × tangent key")
    last = grids[-1]
    layer, head = np.unravel_index(np.nanargmax(last.to_numpy()), last.shape)
    null = (
        " Hatched: heads within 1.96 null standard deviations of the random-frame null "
        f"(|score_share_TT_z| < 1.96; {hatched} cells)."
        if any(z is not None for z in zs)
        else ""
    )
    reading = (
        f"Mean over the {last.size} heads of {describe_layers(last.index)} (attention "
        f"input), {panels[-1][0]}: the tangent–tangent term carries "
        f"{np.nanmean(last.to_numpy()):.2f} of the score energy; the most tangent head is "
        f"layer {int(last.index[layer])}, head {int(last.columns[head])} "
        f"({last.to_numpy()[layer, head]:.2f}).{null}"
    )
    linear = sorted({str(s) for s in t["statistic"].unique() if str(s).startswith("linearised_")})
    if linear:  # q/k norms over each head: the split is of their linearisation
        what = ", ".join(name.removeprefix("linearised_") for name in linear)
        reading += (
            f" This model normalises its queries and keys ({what}): the split holds each "
            "norm's scale at its value on the full query or key, per token and head, so "
            "these shares rest on that linearisation (the linearised_qk_norm rows)."
        )
    return fig, reading


def _frequency(t: pd.DataFrame) -> tuple[Figure, str] | None:
    present = list(correlations(t))
    if not present:
        return None
    fig, axes = figure(2)
    seen = steps(pick(t, f"pearson_{present[0]}"))
    for ax, kind in zip(axes, ("pearson", "spearman"), strict=True):
        if len(seen) >= 2:
            step_axis(ax, t)
            for colour, centre in zip(OKABE_ITO, present, strict=False):
                g = pick(t, f"{kind}_{centre}").groupby("step")[["value", "ci_low", "ci_high"]]
                g = g.mean()
                ax.plot(g.index, g["value"].to_numpy(), "o-", color=colour, ms=3,
                        label=CENTRES[centre])  # fmt: skip
                ci = g.dropna()
                ax.fill_between(ci.index, ci["ci_low"], ci["ci_high"], color=colour,
                                alpha=0.12, lw=0)  # fmt: skip
            null_m = pick(t, f"{kind}_weighted_null_mean").groupby("step")["value"].mean()
            null_s = pick(t, f"{kind}_weighted_null_std").groupby("step")["value"].mean()
            if len(null_m) and len(null_s):
                ax.fill_between(null_m.index, null_m - 2 * null_s, null_m + 2 * null_s,
                                color="gray", alpha=0.25, lw=0,
                                label="weighted centre, null ± 2 sd")  # fmt: skip
        else:
            rows = [pick(t, f"{kind}_{c}")[["value", "ci_low", "ci_high"]].mean() for c in present]
            x = np.arange(len(present))
            ax.bar(x, [r["value"] for r in rows], color=OKABE_ITO[: len(present)])
            low, high = [r["ci_low"] for r in rows], [r["ci_high"] for r in rows]
            ax.vlines(x, low, high, color="black", lw=1.2)
            labels = [CENTRES[c].replace(" ", "\n", 1) for c in present]
            ax.set_xticks(x, labels, fontsize=8)
        ax.axhline(0.0, color="gray", lw=0.8)
        ax.set_ylim(-1, 1)
        ax.set(title=f"{kind.title()} r: log frequency vs distance to centre", ylabel="r")
    legend(fig, axes)
    where = f"the last checkpoint ({describe_steps(seen[-1:])})" if seen else "this checkpoint"
    shown = []
    for centre in present:
        rows = pick(t, f"pearson_{centre}")
        rows = rows[rows["step"] == seen[-1]] if seen else rows
        r = rows.iloc[0]
        shown.append(f"{CENTRES[centre]} {Estimate(r['value'], r['ci_low'], r['ci_high'])}")
    return fig, (
        f"Pearson r at {where}, 95 % CI: {', '.join(shown)} (negative: frequent tokens sit "
        "closer to the centre; over the embedding rows of the tokens seen in the corpus, as "
        "the study stores no per-token distances). Bands and bars: 95 % intervals."
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
    fig, axes = figure(len(names))
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
            step_axis(ax, t)
            colours = layer_colours(len(layers))
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
        where = describe_sites(rows)
    legend(fig, axes)
    span = describe_steps(steps(t)) if len(steps(t)) >= 2 else "this checkpoint"
    return fig, f"Mean over {where}; {span}: " + "; ".join(readings) + "."


FIGURES: dict[str, tuple[str, Callable[[pd.DataFrame], tuple[Figure, str] | None]]] = {
    "depth_profile": ("Depth profile", _depth),
    "head_heatmap": ("Attention heads: tangent–tangent share of the score (TT)", _heatmap),
    "energy_over_training": ("Gradient energy ratio over training", energy_figure),
    "isotropy_removal": ("IsoScore* after removing Q_T vs a normal control", isotropy_figure),
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
