"""Heads at a glance: per-head statistics of a results table as ``(layer, head)`` arrays
and heatmaps.

`head_arrays` turns the attention probe's per-head rows (``score_share_TT`` …,
``write_share``, any ``_p_value`` or ``_z``) into a `HeadArrays`: a numpy ``(n_layers,
n_heads)`` grid with its layer and head labels and each head's key/value group, ready for
``imshow`` or circuitsvis (``np.asarray(arrays)``). `plot_heads` draws one heatmap per
statistic, with lines between the key/value groups of a grouped-query model. The report's
head heatmap is built on `head_arrays`, so both read the table the same way.

>>> arrays = tangentlens.head_arrays(table, "score_share_TT")
>>> fig = tangentlens.plot_heads(table)   # TT, TN, NT, NN (+ write_share when measured)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm, SymLogNorm
from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

from ..core.errors import UsageError

__all__ = ["TERM_PANELS", "HeadArrays", "head_arrays", "plot_heads"]

TERM_PANELS = ("score_share_TT", "score_share_TN", "score_share_NT", "score_share_NN")
_SEQUENTIAL = "cividis"  # perceptually uniform and colour-blind safe
_DIVERGING = "PuOr_r"  # colour-blind safe, centred on 0 for z
_MAX_COLUMNS = 3


@dataclass(frozen=True)
class HeadArrays:
    """One per-head statistic as a grid: ``values[i, j]`` is layer ``layers[i]``, head
    ``heads[j]`` (NaN where the table has no row). ``kv_groups[j]`` is head j's key/value
    group (the ``kv_group`` rows; ``heads`` themselves without grouped-query attention, or
    None when the table has no such rows). ``np.asarray(arrays)`` gives ``values``."""

    statistic: str
    values: np.ndarray
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    kv_groups: tuple[int, ...] | None

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return self.values if dtype is None else self.values.astype(dtype)

    def frame(self) -> pd.DataFrame:
        """The grid as a DataFrame: index ``layer``, columns ``head``."""
        return pd.DataFrame(
            self.values,
            index=pd.Index(self.layers, name="layer"),
            columns=pd.Index(self.heads, name="head"),
        )


def head_arrays(
    table: pd.DataFrame, statistic: str = "score_share_TT", *, mean: bool = False
) -> HeadArrays:
    """One per-head statistic of a results table as a ``(layer, head)`` grid.

    The grid is what ``imshow`` and circuitsvis take; it keeps its layer and head labels
    and each head's key/value group, so a grouped-query model is not misread. Several
    rows for one head (tags, checkpoints) are refused unless asked to average, so two
    runs are never blended silently.

    Args:
        table: ``session.results()`` or a study table.
        statistic: A per-head statistic (``score_share_TT`` …, ``write_share``, a ``_z``).
        mean: Average several rows per (layer, head), e.g. a window of checkpoints.

    Returns:
        A `HeadArrays`: ``values`` (NaN where a head has no row), ``layers``, ``heads``,
        ``kv_groups``; ``np.asarray(arrays)`` is ``values``.

    Raises:
        UsageError: Missing columns, no per-head rows of ``statistic``, or several rows
            per head without ``mean=True``.

    Example:
        With ``model`` a TransformerLens bridge and ``table`` from
        ``tangentlens.run(model, texts, bases).results()``:

        >>> arrays = tangentlens.head_arrays(table, "score_share_TT")
        >>> arrays.values.shape == (model.cfg.n_layers, model.cfg.n_heads)
        True
    """
    missing = {"layer", "head", "statistic", "value"} - set(table.columns)
    if missing:
        raise UsageError(f"the table lacks columns {sorted(missing)}; pass session.results().")
    rows = table[(table["statistic"] == statistic) & table["head"].notna()]
    if "probe" in table.columns:
        rows = rows[rows["probe"] == "attention"]
    if rows.empty:
        known = sorted(set(table.loc[table["head"].notna(), "statistic"]))
        raise UsageError(f"no per-head rows of {statistic!r}; the table has per-head {known}.")
    keys = rows[["layer", "head"]].astype(int)
    if not mean and keys.duplicated().any():
        raise UsageError(
            f"several {statistic!r} rows per (layer, head) (tags, checkpoints or runs?): "
            "filter the table to one, or pass mean=True to average them."
        )
    grouped = rows.assign(layer=keys["layer"], head=keys["head"]).groupby(["layer", "head"])
    grid = grouped["value"].mean().unstack("head").sort_index().sort_index(axis=1)
    return HeadArrays(
        statistic,
        grid.to_numpy(dtype=float),
        tuple(int(v) for v in grid.index),
        tuple(int(v) for v in grid.columns),
        _kv_groups(table, tuple(int(v) for v in grid.columns)),
    )


def _kv_groups(table: pd.DataFrame, heads: tuple[int, ...]) -> tuple[int, ...] | None:
    """Each head's ``kv_group`` (the same at every layer), or None without those rows."""
    rows = table[(table["statistic"] == "kv_group") & table["head"].notna()]
    if rows.empty:
        return None
    groups = rows.groupby(rows["head"].astype(int))["value"].first()
    if not set(heads) <= set(groups.index):
        return None
    return tuple(int(groups[h]) for h in heads)


def _default_panels(table: pd.DataFrame) -> list[str]:
    per_head = set(table.loc[table["head"].notna(), "statistic"])
    return [s for s in (*TERM_PANELS, "write_share") if s in per_head]


def plot_heads(
    table: pd.DataFrame,
    statistics: Sequence[str] | None = None,
    *,
    mean: bool = False,
    annotate: bool | None = None,
) -> Figure:
    """One heatmap (layer × head) per statistic, on scales that compare.

    Shares share one 0–1 colour scale, so panels compare by colour; a ``_p_value`` gets a
    log scale from its smallest value (a null's p-values run from 1/(frames + 1) to 1, and
    the small ones are the finding); a ``_z`` statistic a diverging symmetric-log scale
    centred on 0, since z against a null spans decades. Dashed lines separate key/value
    groups (grouped-query attention); at most three panels a row.

    Args:
        table: ``session.results()`` or a study table.
        statistics: Per-head statistics, one panel each (default: the four score terms'
            shares TT, TN, NT, NN, and ``write_share`` when the table has it).
        mean: Average several rows per (layer, head), as `head_arrays`.
        annotate: Write each value in its cell (default: when a panel has at most 160).

    Returns:
        A matplotlib `Figure` (no pyplot state; ``fig.savefig(path)`` to keep it).

    Raises:
        UsageError: No per-head score shares in the table, or any error of `head_arrays`.

    Example:
        With ``table`` from ``tangentlens.run(model, texts, bases).results()``:

        >>> fig = tangentlens.plot_heads(table)
        >>> [ax.get_title() for ax in fig.axes[:2]]
        ['score_share_TT', 'score_share_TN']
    """
    names = list(statistics) if statistics is not None else _default_panels(table)
    if not names:
        raise UsageError(
            "the table has no per-head score shares: run the attention probe (bases at "
            "blocks.{l}.ln1.hook_out) or pass statistics=[...]."
        )
    grids = [head_arrays(table, s, mean=mean) for s in names]
    n_layers, n_heads = grids[0].values.shape
    ncols = min(len(grids), _MAX_COLUMNS)
    nrows = -(-len(grids) // ncols)
    fig = Figure(
        figsize=(ncols * min(5.5, 1.8 + 0.4 * n_heads), nrows * min(8.0, 1.6 + 0.3 * n_layers)),
        dpi=100,
        layout="constrained",
    )
    axes = list(fig.subplots(nrows, ncols, squeeze=False).flat)
    for ax in axes[len(grids) :]:
        ax.remove()
    for ax, grid in zip(axes, grids, strict=False):
        values = grid.values
        if grid.statistic.endswith("_z"):
            finite = np.abs(values[np.isfinite(values)])
            bound = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
            norm = SymLogNorm(linthresh=1.0, vmin=-bound, vmax=bound)  # z spans decades
            image = ax.imshow(values, cmap=_DIVERGING, norm=norm, aspect="auto")
        elif grid.statistic.endswith("_p_value"):
            positive = values[np.isfinite(values) & (values > 0)]
            low = min(float(positive.min()), 0.1) if positive.size else 0.01
            image = ax.imshow(values, cmap=_SEQUENTIAL, norm=LogNorm(low, 1), aspect="auto")
        else:
            image = ax.imshow(values, cmap=_SEQUENTIAL, vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(grid.heads)), [str(h) for h in grid.heads])
        ax.set_yticks(range(len(grid.layers)), [str(layer) for layer in grid.layers])
        ax.set(xlabel="head", ylabel="layer", title=grid.statistic)
        _group_lines(ax, grid, "black" if grid.statistic.endswith("_z") else "white")
        if annotate if annotate is not None else values.size <= 160:
            _annotate(ax, values, image)
        fig.colorbar(image, ax=ax, shrink=0.8)
    return fig


def _group_lines(ax: Any, grid: HeadArrays, colour: str) -> None:
    """Dashed vertical lines where the key/value group changes (only with GQA)."""
    groups = grid.kv_groups
    if groups is None or len(set(groups)) == len(groups):
        return
    for j in range(1, len(groups)):
        if groups[j] != groups[j - 1]:
            ax.axvline(j - 0.5, color=colour, linewidth=1.5, linestyle="--")


def _annotate(ax: Any, values: np.ndarray, image: Any) -> None:
    for (i, j), v in np.ndenumerate(values):
        if np.isfinite(v):
            r, g, b, _ = image.cmap(image.norm(v))
            colour = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
            ax.text(j, i, _short(v), ha="center", va="center", fontsize=7, color=colour)


def _short(v: float) -> str:
    """At most four characters for a cell: 0.25, 83, 2e+05 → 2e5."""
    if abs(v) < 10:
        return f"{v:.2f}"
    if abs(v) < 1000:
        return f"{v:.0f}"
    return f"{v:.0e}".replace("e+0", "e").replace("e+", "e")
