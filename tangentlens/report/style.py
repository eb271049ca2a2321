"""The report's figure style: one look for every figure (colour-blind-safe colours, a
symmetric-log step axis with the windows shaded, one legend below the panels)."""

from __future__ import annotations

from typing import Any

import pandas as pd
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import ListedColormap, Normalize
from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
from matplotlib.transforms import blended_transform_factory

from .table import steps, window_spans

__all__ = [
    "OKABE_ITO",
    "SEQUENTIAL",
    "WINDOW_SHADE",
    "figure",
    "layer_colourbar",
    "layer_colours",
    "legend",
    "step_axis",
]

OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#000000")
SEQUENTIAL = "cividis"  # perceptually uniform and colour-blind safe
WINDOW_SHADE = {"early": 0.07, "late": 0.14}  # grey alpha: shading never competes with data


def figure(ncols: int = 1, width: float = 6.0, height: float = 3.6) -> tuple[Figure, list]:
    fig = Figure(figsize=(width * ncols, height), dpi=100, layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    for ax in axes:
        ax.grid(True, color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
        ax.set_prop_cycle(color=OKABE_ITO)
    return fig, list(axes)


def layer_colours(n: int) -> list:
    cmap = colormaps[SEQUENTIAL]
    return [cmap(0.8 * i / max(1, n - 1)) for i in range(n)]


def step_axis(ax: Any, t: pd.DataFrame) -> None:
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


def legend(fig: Figure, axes: list) -> None:
    """One legend for the whole figure, below the panels (never over the data)."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="outside lower center",
                   ncols=len(seen) if len(seen) <= 5 else -(-len(seen) // 2),
                   fontsize=8, frameon=False)  # fmt: skip


def layer_colourbar(fig: Figure, axes: list, layers: list) -> None:
    cmap = ListedColormap(layer_colours(256))
    mappable = ScalarMappable(Normalize(min(layers), max(layers)), cmap)
    fig.colorbar(mappable, ax=axes, label="layer", fraction=0.04)
