"""The window panel: the early and late windows under several definitions, and the window
means of a gradient object's per-checkpoint rows under each.

A dynamics claim ("concentrated early", "weaker late") turns on which checkpoints count
as early and late, and there is no single right rule: the study's windows go by training
steps, the paper takes its first and last checkpoints, and a run whose loss falls fast is
"early" for fewer steps than one that falls slowly. A verdict that holds under one rule
only is a property of the rule, so the report evaluates each dynamics claim under every
definition here (`DEFINITIONS`) and calls it window-dependent unless all agree.

- ``steps``: the first and last ``fraction`` of the training steps, each at least the
  two checkpoints nearest its end (the study's default rule);
- ``checkpoints``: the first and last ceil(fraction·n) checkpoints (the paper's rule);
- ``progress``: early = the checkpoints before the probe loss has fallen by ``fraction``
  of its total drop (first to last checkpoint), late = those after it has fallen by
  1 − fraction for good; from the ``probe="checkpoint"`` ``probe_loss`` rows, and absent
  when the table has none or the loss did not fall.

`window_mean` is the one computation of a window mean from per-checkpoint rows: the mean
over the window's checkpoints and over the object's sites, each row weighing the same, as
the study's own window rows (`tangentlens.study.windows`) weigh them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pandas as pd

from ..core.results import select
from ..data.checkpoints import window_indices

__all__ = ["DEFINITIONS", "object_rows", "panel_windows", "window_mean", "windows_by"]

DEFINITIONS = ("steps", "checkpoints", "progress")
# each definition's rule in `window_indices`
_RULES = {"steps": "step", "checkpoints": "index", "progress": "progress"}
# the per-checkpoint statistic each gradient object's claims read, by probe
_PER_CHECKPOINT = {
    "gradient": ("gradient", "energy_ratio"),
    "weight_gradient": ("weight_gradient", "normalized_ratio"),
}


def window_mean(rows: pd.DataFrame, steps: Iterable[int]) -> float | None:
    """The mean ``value`` of the finite rows whose ``step`` is one of ``steps`` (None when
    there is none)."""
    wanted = {int(s) for s in steps}
    if rows.empty or not wanted:
        return None
    values = rows.loc[rows["step"].isin(wanted), "value"].astype(float).to_numpy()
    values = values[np.isfinite(values)]
    return float(values.mean()) if values.size else None


def object_rows(table: pd.DataFrame, obj: str, rank: int) -> pd.DataFrame:
    """Per-checkpoint ``step``/``value`` rows of a claim's object at rank ``rank``:
    ``gradient`` (``energy_ratio`` at the residual sites), ``weight_gradient``
    (``normalized_ratio`` at the input sites) or ``isotropy`` (``delta_iso_tangent −
    delta_iso_normal`` per site and checkpoint)."""
    if obj == "isotropy":
        keys = ["step", "hook"]
        got = [
            select(table, probe="gradient", statistic=s, rank=rank).dropna(subset=["step"])
            for s in ("delta_iso_tangent", "delta_iso_normal")
        ]
        both = got[0][[*keys, "value"]].merge(
            got[1][[*keys, "value"]], on=keys, suffixes=("_t", "_n")
        )
        return pd.DataFrame(
            {"step": both["step"], "value": both["value_t"].astype(float) - both["value_n"]}
        )
    probe, stat = _PER_CHECKPOINT[obj]
    rows = select(table, probe=probe, statistic=stat, rank=rank).dropna(subset=["step"])
    return rows[["step", "value"]]


def _steps(table: pd.DataFrame) -> list[int]:
    return sorted(int(s) for s in table["step"].dropna().unique())


def _losses(table: pd.DataFrame) -> dict[int, float]:
    rows = select(table, probe="checkpoint", statistic="probe_loss").dropna(subset=["step"])
    by = rows.assign(value=rows["value"].astype(float)).groupby("step")["value"].mean()
    return {int(s): float(v) for s, v in by.items() if math.isfinite(v)}


def windows_by(
    definition: str, steps: list[int], fraction: float, losses: dict[int, float] | None = None
) -> dict[str, list[int]] | None:
    """The early and late steps under ``definition`` (see the module docstring), by the
    series' own rules (`tangentlens.data.checkpoints.window_indices`); None where the
    definition cannot be applied (fewer than two checkpoints, no loss drop)."""
    if definition not in _RULES:
        raise ValueError(f"unknown window definition {definition!r}; known: {DEFINITIONS}.")
    if len(steps) < 2:
        return None
    found = window_indices(steps, fraction, _RULES[definition], losses)
    if not (found["early"] and found["late"]):
        return None
    return {name: [steps[i] for i in idx] for name, idx in found.items()}


def panel_windows(table: pd.DataFrame, fraction: float) -> dict[str, dict[str, list[int]]]:
    """Definition → its early and late steps in this table (definitions that cannot be
    applied are left out)."""
    steps, losses = _steps(table), _losses(table)
    found = {d: windows_by(d, steps, fraction, losses) for d in DEFINITIONS}
    return {d: w for d, w in found.items() if w is not None}
