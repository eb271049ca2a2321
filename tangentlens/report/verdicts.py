"""Verdicts against the paper, from intervals: ``agrees`` or ``disagrees`` only when the
95 % interval excludes the paper's null line, ``inconclusive`` otherwise.

A study's table holds window rows (``probe="window"``, `tangentlens.study.windows`): the
early- and late-window means of each gradient object's ``energy_ratio`` and their
difference, with jackknife intervals over groups of probe sequences. `paper_claims` reads them
for each model and sets a decoder's early energy ratio against an encoder's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pandas as pd

from ..core.results import select
from .claims import OBJECTS, Claim, Estimate

__all__ = ["paper_claims"]


def _verdict(low: float, high: float, line: float, above_agrees: bool) -> str:
    """Where the interval [low, high] lies against ``line``."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return "inconclusive"
    if low > line:
        return "agrees" if above_agrees else "disagrees"
    if high < line:
        return "disagrees" if above_agrees else "agrees"
    return "inconclusive"


def _estimate(row: pd.Series) -> Estimate:
    return Estimate(float(row["value"]), float(row["ci_low"]), float(row["ci_high"]))


def _window(table: pd.DataFrame, statistic: str, window: str, rank: int) -> Estimate | None:
    rows = select(table, probe="window", statistic=statistic, window=window, rank=rank)
    return None if rows.empty else _estimate(rows.iloc[0])


def _for_model(table: pd.DataFrame, model: str) -> list[Claim]:
    """Each claim of the paper this study's window rows speak to, per gradient object,
    at the smallest rank. The frequency claim reads the frequency-weighted centre's
    Pearson r at the last checkpoint (Fisher interval); the paper's sign depends on the
    centre, which the report shows."""
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
            verdict = _verdict(early.low, early.high, line=1.0, above_agrees=True)
            out.append(Claim("energy_early", model, obj, stat, rank, early, verdict))
        if diff is not None:
            verdict = _verdict(diff.low, diff.high, line=0.0, above_agrees=False)
            out.append(Claim("energy_late", model, obj, f"{stat}_late_minus_early", rank,
                             diff, verdict, (("early", early), ("late", late))))  # fmt: skip
    weighted = select(table, probe="embedding", statistic="pearson_weighted").dropna(
        subset=["step"]
    )
    if len(weighted):
        last = _estimate(weighted[weighted["step"] == weighted["step"].max()].iloc[0])
        verdict = _verdict(last.low, last.high, line=0.0, above_agrees=False)
        out.append(Claim("frequency", model, "embedding", "pearson_weighted", rank, last,
                         verdict))  # fmt: skip
    iso = _window(table, "gradient_delta_iso_excess", "early", rank)
    if iso is not None:
        verdict = _verdict(iso.low, iso.high, line=0.0, above_agrees=True)
        out.append(Claim("isotropy", model, "gradient", "gradient_delta_iso_excess", rank, iso,
                         verdict))  # fmt: skip
    return out


def _compare(decoder: list[Claim], encoder: list[Claim]) -> list[Claim]:
    """Decoder against encoder: agrees when the decoder's early energy ratio interval lies
    wholly above the encoder's, disagrees when wholly below, else inconclusive."""
    out = []
    for obj in OBJECTS:
        dec = next((c for c in decoder if c.name == "energy_early"
                    and c.gradient_object == obj), None)  # fmt: skip
        enc = next((c for c in encoder if c.name == "energy_early"
                    and c.gradient_object == obj), None)  # fmt: skip
        if dec is None or enc is None:
            continue
        d, e = dec.estimate, enc.estimate
        if d.low > e.high:
            verdict = "agrees"
        elif d.high < e.low:
            verdict = "disagrees"
        else:
            verdict = "inconclusive"
        out.append(Claim("encoders_weaker", "decoder vs encoder", obj, f"{obj}_energy_ratio",
                         dec.rank, d, verdict, (("encoder", e),)))  # fmt: skip
    return out


def paper_claims(tables: Mapping[str, pd.DataFrame]) -> list[Claim]:
    """The paper's claims against each study table (``{model: table}``, model ``decoder``
    or ``encoder``, in order), then, when both are there, the decoder against the
    encoder: the one list the summary, the pages, ``summary.json`` and the CLI show."""
    # SEEDS SHIM, the line below: a {model: {seed: table}} mapping reads its smallest seed
    tables = {m: t if isinstance(t, pd.DataFrame) else min(t.items())[1] for m, t in tables.items()}
    per_model = {model: _for_model(table, model) for model, table in tables.items()}
    out = [c for found in per_model.values() for c in found]
    if "decoder" in per_model and "encoder" in per_model:
        out += _compare(per_model["decoder"], per_model["encoder"])
    return out
