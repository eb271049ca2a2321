"""What a number on a page averages, in words, and the number itself.

A study's window rows average a gradient object's rows over several sites and the
checkpoints of a window; a figure may plot one site, and a verdict may read another
average. So every caption and every verdict row takes both its words (`claim_scope`,
`describe_sites`, `describe_steps`) and its window numbers (`window_numbers`) from here:
a page can then not give one name two values without saying why they differ.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import pandas as pd

from ..core.results import select
from .claims import Estimate

__all__ = [
    "OBJECT_ROWS",
    "claim_scope",
    "describe_layers",
    "describe_sites",
    "describe_steps",
    "object_sites",
    "object_steps",
    "window_numbers",
]

# the per-checkpoint rows each gradient object's window rows average: (probe, statistic)
OBJECT_ROWS = {
    "gradient": ("gradient", "energy_ratio"),
    "weight_gradient": ("weight_gradient", "normalized_ratio"),
    "isotropy": ("gradient", "delta_iso_tangent"),
}
_WINDOW_STATISTIC = {
    "gradient": "gradient_energy_ratio",
    "weight_gradient": "weight_gradient_normalized_ratio",
    "isotropy": "gradient_delta_iso_excess",
}


def describe_layers(layers: Iterable[int]) -> str:
    """``layer 3``, ``layers 0–5``, ``layers 0, 2, 5–7``: runs of consecutive layers."""
    values = sorted({int(v) for v in layers})
    if not values:
        return "no layer"
    runs: list[list[int]] = [[values[0], values[0]]]
    for v in values[1:]:
        if v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in runs)
    return f"layer{'s' if len(values) > 1 else ''} {text}"


def object_sites(rows: pd.DataFrame) -> dict[str, list[int]]:
    """Site kind → its layers, for the rows given (in the order kinds first appear)."""
    found: dict[str, list[int]] = {}
    for kind, layer in rows[["site", "layer"]].dropna().drop_duplicates().itertuples(False):
        found.setdefault(str(kind), []).append(int(layer))
    return found


def describe_sites(rows: pd.DataFrame) -> str:
    """``3 sites: resid_pre at layers 0–1, resid_post at layer 1`` for the rows given."""
    found = object_sites(rows)
    n = sum(len(v) for v in found.values())
    if not n:
        return "no site"
    parts = ", ".join(f"{kind} at {describe_layers(layers)}" for kind, layers in found.items())
    return f"{n} site{'s' if n > 1 else ''}: {parts}"


def describe_steps(steps: Iterable[int]) -> str:
    """``step 8`` or ``steps 0–2 (3 checkpoints)``."""
    values = sorted({int(s) for s in steps})
    if not values:
        return "no checkpoint"
    if len(values) == 1:
        return f"step {values[0]}"
    return f"steps {values[0]}–{values[-1]} ({len(values)} checkpoints)"


def object_steps(rows: pd.DataFrame, window: str) -> list[int]:
    """The steps of ``window`` (early / late) among the rows given."""
    if "window" not in rows.columns or "step" not in rows.columns:
        return []
    found = rows.loc[rows["window"] == window, "step"].dropna()
    return sorted({int(s) for s in found})


def _object_rows(table: pd.DataFrame, obj: str, rank: int | None) -> pd.DataFrame:
    probe, statistic = OBJECT_ROWS[obj]
    where = {"probe": probe, "statistic": statistic}
    if rank is not None and "rank" in table.columns:
        where["rank"] = rank
    return select(table, **where)


def window_numbers(table: pd.DataFrame, obj: str, rank: int | None) -> dict[str, Estimate]:
    """The window means a study wrote for ``obj`` (``early``, ``late``, ``late-early``),
    each with its interval over probe tokens: the very numbers a verdict reads. A
    table without window rows gets the means of its per-checkpoint rows in each window
    (no interval: NaN bounds), over the same sites and checkpoints."""
    statistic = _WINDOW_STATISTIC[obj]
    out: dict[str, Estimate] = {}
    if "window" in table.columns:
        where = {"probe": "window"} | ({"rank": rank} if rank is not None else {})
        rows = select(table, **where)
        for window, name in (("early", statistic), ("late", statistic),
                             ("late-early", f"{statistic}_late_minus_early")):  # fmt: skip
            found = rows[(rows["statistic"] == name) & (rows["window"] == window)]
            if len(found):
                r = found.iloc[0]
                out[window] = Estimate(float(r["value"]), float(r["ci_low"]), float(r["ci_high"]))
    if out:
        return out
    rows = _object_rows(table, obj, rank)
    if obj == "isotropy":
        return {}  # the excess needs both removals per row; the study writes it
    for window in ("early", "late"):
        steps = object_steps(rows, window)
        values = rows.loc[rows["step"].isin(steps), "value"].astype(float)
        values = values[values.map(math.isfinite)]
        if len(values):
            out[window] = Estimate(float(values.mean()), math.nan, math.nan)
    if "early" in out and "late" in out:
        out["late-early"] = Estimate(out["late"].value - out["early"].value, math.nan, math.nan)
    return out


def claim_scope(table: pd.DataFrame, name: str, obj: str, rank: int | None) -> str:
    """What the number a claim reads averages: its sites and checkpoints, in the words
    the figures use (``name`` and ``obj`` as in `tangentlens.report.Claim`)."""
    if name == "frequency":
        rows = select(table, probe="embedding", statistic="pearson_weighted")
        steps = rows["step"].dropna() if "step" in rows.columns else pd.Series(dtype=float)
        at = f"at the last checkpoint ({describe_steps([steps.max()])})" if len(steps) else ""
        return f"embedding rows of the tokens seen in the corpus, {at}".rstrip(", ")
    key = "isotropy" if name == "isotropy" else obj
    if key not in OBJECT_ROWS:
        return ""
    rows = _object_rows(table, key, rank)
    if rows.empty:
        return ""
    windows = ("early", "late") if name == "energy_late" else ("early",)
    spans = "; ".join(f"{w} window {describe_steps(object_steps(rows, w))}" for w in windows)
    return f"mean over {describe_sites(rows)}; {spans}"
