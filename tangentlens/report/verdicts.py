"""Verdicts against the paper, from intervals: ``agrees`` or ``disagrees`` only when the
95 % interval excludes the paper's null line, ``inconclusive`` otherwise.

A study's table holds window rows (``probe="window"``, `tangentlens.study.windows`): the
early- and late-window means of each gradient object's ``energy_ratio`` and their
difference, with jackknife intervals over groups of probe sequences. `verdicts` reads
them; `compare_models` sets a decoder's early energy ratio against an encoder's.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from ..results import select
from .table import PAPER

__all__ = ["OBJECTS", "compare_models", "verdicts"]

OBJECTS = {
    "gradient": "activation gradient ∂L/∂h (residual stream)",
    "weight_gradient": "weight gradient Σ G Gᵀ of W_Q/W_K/W_V and the MLP input maps",
}
PAPER_ENCODERS = "the effect is weaker in encoders than in decoders"


def _verdict(low: float, high: float, line: float, above_agrees: bool) -> str:
    """Where the interval [low, high] lies against ``line``."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return "inconclusive"
    if low > line:
        return "agrees" if above_agrees else "disagrees"
    if high < line:
        return "disagrees" if above_agrees else "agrees"
    return "inconclusive"


def _window(table: pd.DataFrame, statistic: str, window: str, rank: int) -> dict | None:
    rows = select(table, probe="window", statistic=statistic, window=window, rank=rank)
    if rows.empty:
        return None
    r = rows.iloc[0]
    return {"value": float(r["value"]), "ci": [float(r["ci_low"]), float(r["ci_high"])]}


def _claim(model: str, obj: str, name: str, stat: str, rank: int, **numbers: Any) -> dict:
    return {"claim": name, "paper": PAPER[name], "statistic": stat, "model": model,
            "gradient_object": obj, "rank": rank, **numbers}  # fmt: skip


def verdicts(table: pd.DataFrame, *, model: str = "decoder") -> list[dict[str, Any]]:
    """Each claim of the paper this study's window rows speak to, per gradient object,
    with the numbers (value and 95 % interval) and a verdict; the smallest rank. The
    frequency claim reads the frequency-weighted centre's Pearson r at the last checkpoint
    (Fisher interval); the paper's sign depends on the centre, which the report shows."""
    windows = select(table, probe="window")
    if windows.empty:
        return []
    rank = int(windows["rank"].dropna().min())
    out = []
    for obj in OBJECTS:
        stat = f"{obj}_energy_ratio"
        early = _window(table, stat, "early", rank)
        late = _window(table, stat, "late", rank)
        diff = _window(table, f"{stat}_late_minus_early", "late-early", rank)
        if early is not None:
            verdict = _verdict(*early["ci"], line=1.0, above_agrees=True)
            out.append(_claim(model, obj, "energy_early", stat, rank, early=early,
                              verdict=verdict))  # fmt: skip
        if diff is not None:
            verdict = _verdict(*diff["ci"], line=0.0, above_agrees=False)
            name = f"{stat}_late_minus_early"
            out.append(_claim(model, obj, "energy_late", name, rank, early=early, late=late,
                              difference=diff, verdict=verdict))  # fmt: skip
    weighted = select(table, probe="embedding", statistic="pearson_weighted").dropna(
        subset=["step"]
    )
    if len(weighted):
        last = weighted[weighted["step"] == weighted["step"].max()].iloc[0]
        numbers = {"value": float(last["value"]), "ci": [float(last["ci_low"]),
                                                          float(last["ci_high"])]}  # fmt: skip
        verdict = _verdict(*numbers["ci"], line=0.0, above_agrees=False)
        out.append(_claim(model, "embedding", "frequency", "pearson_weighted", rank,
                          last=numbers, verdict=verdict))  # fmt: skip
    iso = _window(table, "gradient_delta_iso_excess", "early", rank)
    if iso is not None:
        verdict = _verdict(*iso["ci"], line=0.0, above_agrees=True)
        out.append(_claim(model, "gradient", "isotropy", "gradient_delta_iso_excess", rank,
                          early=iso, verdict=verdict))  # fmt: skip
    return out


def compare_models(decoder: list[dict], encoder: list[dict]) -> list[dict[str, Any]]:
    """Decoder against encoder: agrees when the decoder's early energy ratio interval lies
    wholly above the encoder's, disagrees when wholly below, else inconclusive."""
    out = []
    for obj in OBJECTS:
        dec = next((c for c in decoder if c["claim"] == "energy_early"
                    and c["gradient_object"] == obj), None)  # fmt: skip
        enc = next((c for c in encoder if c["claim"] == "energy_early"
                    and c["gradient_object"] == obj), None)  # fmt: skip
        if dec is None or enc is None:
            continue
        (d_low, d_high), (e_low, e_high) = dec["early"]["ci"], enc["early"]["ci"]
        if d_low > e_high:
            verdict = "agrees"
        elif d_high < e_low:
            verdict = "disagrees"
        else:
            verdict = "inconclusive"
        out.append({"claim": "encoders_weaker", "paper": PAPER_ENCODERS,
                    "statistic": f"{obj}_energy_ratio", "model": "decoder vs encoder",
                    "gradient_object": obj, "rank": dec["rank"], "decoder": dec["early"],
                    "encoder": enc["early"], "verdict": verdict})  # fmt: skip
    return out
