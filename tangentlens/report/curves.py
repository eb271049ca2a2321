"""The report's curves over training: the gradient energy ratio and the ΔIsoScore* of
removing Q_T, per site and checkpoint with their intervals, and the windows' means, with
their intervals, as the summary's verdicts read them (`tangentlens.report.scope`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
from matplotlib.ticker import FuncFormatter

from .claims import Estimate
from .scope import describe_sites, describe_steps, window_numbers
from .style import OKABE_ITO, figure, layer_colourbar, layer_colours, legend, step_axis
from .table import ALPHA, per_step, pick, ranks, steps, window_spans
from .verdicts import TAU

__all__ = ["energy_figure", "gradient_rows", "isotropy_figure"]

_MAX_BANDS = 4  # beyond this many sites, curves over training drop their per-site bands
_SITE_STYLE = {"resid_pre": "-", "resid_mid": "-.", "resid_post": "--", "attn_in": "-",
               "mlp_in": "--"}  # fmt: skip


def _series(rows: pd.DataFrame) -> list[tuple[str, str, int, pd.DataFrame]]:
    """One series per (site, layer) of ``rows``: (label, site, layer, rows by step)."""
    keys = rows[["site", "layer"]].dropna().drop_duplicates()
    order = {k: i for i, k in enumerate(_SITE_STYLE)}
    keys = sorted(((str(s), int(layer)) for s, layer in keys.itertuples(index=False)),
                  key=lambda k: (k[1], order.get(k[0], 99)))  # fmt: skip
    out = []
    for site, layer in keys:
        g = rows[(rows["site"] == site) & (rows["layer"] == layer)]
        g = g.groupby("step")[["value", "ci_low", "ci_high"]].mean().sort_index()
        out.append((f"{site} {layer}", site, layer, g))
    return out


def _window_boxes(ax: Any, t: pd.DataFrame, numbers: dict[str, Estimate]) -> None:
    """Each window's mean as a black bar across the window's steps, its 95 % interval as
    a box behind it: the numbers the summary's verdicts read."""
    spans = window_spans(t)
    for name in ("early", "late"):
        est, span = numbers.get(name), spans.get(name)
        if est is None or span is None:
            continue
        lo, hi = span
        label = "window mean, 95 % CI" if name == "early" else None
        if math.isfinite(est.low) and math.isfinite(est.high):
            ax.fill_between([lo, hi], est.low, est.high, color="black", alpha=0.12, lw=0)
            ax.vlines([lo, hi], est.low, est.high, color="black", lw=1.0)
        ax.hlines(est.value, lo, hi, color="black", lw=3.0, label=label)


def _windows_text(rows: pd.DataFrame, numbers: dict[str, Estimate]) -> str:
    """``early window steps 0–2 (3 checkpoints) 3.08 [0.81, 5.35]; late …; late − early …``."""
    parts = []
    for name in ("early", "late"):
        if name in numbers:
            in_window = rows.loc[rows["window"] == name, "step"].dropna()
            parts.append(f"{name} window {describe_steps(in_window)} {numbers[name]}")
    if "late-early" in numbers:
        parts.append(f"late − early {numbers['late-early']}")
    return "; ".join(parts).replace(" [nan, nan]", "")


def gradient_rows(t: pd.DataFrame, statistic: str) -> pd.DataFrame:
    """Finite rows of one activation-gradient statistic at every site it was measured:
    the rows a study's window means average (`tangentlens.study.windows`)."""
    rows = pick(t, statistic, probe="gradient")
    return rows[rows["probe"] == "gradient"].dropna(subset=["site", "layer"])


def _curves(ax: Any, t: pd.DataFrame, rows: pd.DataFrame, bands: bool) -> None:
    """One line per site over training (colour: layer; dash: site kind), with its 95 %
    band per checkpoint when ``bands``."""
    series = _series(rows)
    layers = sorted({layer for _, _, layer, _ in series})
    colour = dict(zip(layers, layer_colours(len(layers)), strict=True))
    for label, site, layer, g in series:
        ax.plot(g.index, g["value"].to_numpy(), _SITE_STYLE.get(site, "-"), color=colour[layer],
                lw=1.1, alpha=0.85, label=label if len(series) <= 8 else None)  # fmt: skip
        ci = g.dropna(subset=["ci_low", "ci_high"])
        if bands and len(ci):
            ax.fill_between(ci.index, ci["ci_low"], ci["ci_high"], color=colour[layer],
                            alpha=0.12, lw=0)  # fmt: skip


def _ratio_axis(ax: Any, values: list[float]) -> None:
    """A log axis for a ratio, its limits set by the values (an interval reaching far
    beyond them, or below 0, runs off the panel instead of flattening the lines)."""
    found = [v for v in values if math.isfinite(v) and v > 0]
    if not found:
        return
    ax.set_yscale("log")
    ax.set_ylim(min(found) / 1.6, max(found) * 1.6)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def energy_figure(t: pd.DataFrame) -> tuple[Figure, str] | None:
    ratio, pval = gradient_rows(t, "energy_ratio"), gradient_rows(t, "p_value")
    if len(steps(ratio)) < 2:
        return None
    fig, (ax_r, ax_p) = figure(2)
    n_sites = len(_series(ratio))
    for ax, frame in ((ax_r, ratio), (ax_p, pval)):
        step_axis(ax, t)
        _curves(ax, t, frame, bands=ax is ax_r and n_sites <= _MAX_BANDS)
    mean = per_step(ratio)["mean"]
    ax_r.plot(mean.index, mean.to_numpy(), "k:o", lw=1.2, ms=3,
              label=f"mean over the {n_sites} sites")  # fmt: skip
    rank = ranks(t)
    numbers = window_numbers(t, "gradient", rank[0] if rank else None)
    _window_boxes(ax_r, ratio, numbers)
    ax_r.axhline(1.0, color="gray", ls=":", lw=1.2)
    ax_r.axhline(TAU, color="#D55E00", ls="--", lw=1.0, label=f"τ = {TAU:g} (concentrated)")
    windows = [numbers[w].value for w in ("early", "late") if w in numbers]
    _ratio_axis(ax_r, [*ratio["value"], *windows, 1.0, TAU])
    ax_r.set(title=f"energy_ratio, activation gradient ({n_sites} sites)",
             ylabel="share in Q_T / normal-control share")  # fmt: skip
    if len(pval):
        ax_p.set_yscale("log")
        ax_p.axhline(ALPHA, color="#D55E00", ls="--", lw=1.2, label=f"α = {ALPHA}")
        floor = float(pval["value"].min())
        if (pval["value"] <= floor * (1 + 1e-9)).mean() > 0.2:  # many tests at the MC floor
            ax_p.axhline(floor, color="gray", ls=":", lw=1.2,
                         label=f"smallest p with these controls ({floor:.2g})")  # fmt: skip
    ax_p.set(title="p_value: energy test against uniformly random k-frames",
             ylabel="p-value (log)")  # fmt: skip
    legend(fig, [ax_r, ax_p])
    if n_sites > 8:
        layer_colourbar(fig, [ax_r, ax_p], sorted(ratio["layer"].dropna().unique()))
    where = f"mean over {describe_sites(ratio)}"
    if not numbers:
        first, last = mean.iloc[0], mean.iloc[-1]
        return fig, f"{where}: {first:.3g} at the first checkpoint, {last:.3g} at the last."
    bands = "bands: each site's 95 % interval per checkpoint; " if n_sites <= _MAX_BANDS else ""
    return fig, (
        f"Gradient energy ratio, {where}: {_windows_text(ratio, numbers)} (95 % intervals "
        "over probe tokens: the window means the summary's verdicts read). Boxes: those "
        f"window means; {bands}dotted: the sites' mean per checkpoint."
    )


def isotropy_figure(t: pd.DataFrame) -> tuple[Figure, str] | None:
    d_t, d_n = gradient_rows(t, "delta_iso_tangent"), gradient_rows(t, "delta_iso_normal")
    if d_t.empty or d_n.empty:
        return None
    keys = ["step", "site", "layer"] if "step" in d_t.columns else ["site", "layer"]
    both = d_t.merge(d_n[[*keys, "value"]], on=keys, suffixes=("", "_normal"))
    where, n_sites = f"mean over {describe_sites(both)}", len(_series(both))
    series = (("remove Q_T", "value", OKABE_ITO[5]), ("remove a normal control",
              "value_normal", OKABE_ITO[0]))  # fmt: skip
    if len(steps(d_t)) >= 2:
        fig, (ax, ax_x) = figure(2)
        step_axis(ax, t)
        for label, column, colour in series:
            s = both.groupby("step")[column].agg(["mean", "min", "max"])
            ax.plot(s.index, s["mean"].to_numpy(), "o-", color=colour, ms=3, label=label)
            ax.fill_between(s.index, s["min"], s["max"], color=colour, alpha=0.15, lw=0)
        ax.set_title(f"ΔIsoScore* of the gradients ({n_sites} sites; band: min–max)")
        step_axis(ax_x, t)
        excess = both.assign(value=both["value"] - both["value_normal"])
        s = excess.groupby("step")["value"].mean()
        ax_x.plot(s.index, s.to_numpy(), "k:o", ms=3, lw=1.2, label="excess, mean over sites")
        rank = ranks(t)
        numbers = window_numbers(t, "isotropy", rank[0] if rank else None)
        _window_boxes(ax_x, excess, numbers)
        ax_x.axhline(0.0, color="gray", lw=0.8)
        ax_x.set(title="excess: ΔIsoScore*(Q_T) − ΔIsoScore*(normal control)",
                 ylabel="excess")  # fmt: skip
        axes = [ax, ax_x]
        reading = f"ΔIsoScore* excess, {where}: " + (
            f"{_windows_text(excess, numbers)} (95 % intervals over probe tokens: the window "
            "means the summary's verdict reads). Boxes: those window means; left: each "
            "removal's mean over the sites, band min–max over sites."
            if numbers
            else f"{s.iloc[0]:+.3f} at the first checkpoint, {s.iloc[-1]:+.3f} at the last."
        )
    else:
        fig, (ax,) = figure(1, width=7.5)
        labels = [f"{r.site} {int(r.layer)}" for r in both.itertuples()]
        x = np.arange(len(both))
        for offset, (label, column, colour) in zip((-0.2, 0.2), series, strict=True):
            ax.bar(x + offset, both[column].to_numpy(float), width=0.4, color=colour, label=label)
        ci = both[["ci_low", "ci_high"]].to_numpy(float)
        ok = np.isfinite(ci).all(axis=1)
        ax.vlines(x[ok] - 0.2, ci[ok, 0], ci[ok, 1], color="black", lw=1.2)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_xlabel("site")
        ax.set_title("ΔIsoScore* of the gradients per site (bars: 95 % CI of removing Q_T)")
        axes = [ax]
        mt, mn = float(both["value"].mean()), float(both["value_normal"].mean())
        reading = (
            f"ΔIsoScore*, {where}, this checkpoint: removing Q_T {mt:+.3g}, removing a normal "
            f"control {mn:+.3g} (excess {mt - mn:+.3g}); the summary decides from each site's "
            "interval."
        )
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.set_ylabel("ΔIsoScore* after removal")
    legend(fig, axes)
    return fig, reading
