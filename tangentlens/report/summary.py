"""The report's summary: each claim of the paper next to what this table measures.

A study's table holds window rows, and its claims come from `paper_claims` (intervals
over probe tokens per seed, over seeds where there are several). A table of one
checkpoint (`tangentlens probe`, or a session's results) has no windows: its rows read
each site's interval at that checkpoint and decide in the same vocabulary
(docs/VERDICTS.md): one model's token intervals can only *suggest*, and only where every
site's interval lies on the same side of the claim's line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from .claims import Claim
from .scope import describe_layers, describe_sites, describe_steps
from .table import CENTRES, PAPER, pick, prepare, ranks, steps
from .verdicts import TAU, combined_verdict, interval_side, paper_claims

__all__ = ["SummaryRow", "format_summary", "summary"]

_MAX_SITES_LISTED = 6  # beyond this many sites a row counts the sides instead of listing them


@dataclass(frozen=True)
class SummaryRow:
    """One row of the summary: what was measured here next to what the paper reports
    (a study's claims come as `Claim` objects; a row is how the page and the terminal
    show one, beside numbers no claim turns on)."""

    quantity: str
    measured: str
    paper: str
    agrees: str  # a verdict (claims.VERDICTS), or "—" where no claim is tested
    seeds: str = ""  # each training seed's own number, where there are several
    windows: str = ""  # the claim under each window definition of the panel
    scope: str = ""  # the sites and checkpoints the number averages
    test: str = ""  # the between-seed test behind the verdict, where there is one

    @classmethod
    def of(cls, claim: Claim) -> SummaryRow:
        return cls(claim.quantity, claim.measured, claim.paper, claim.verdict,
                   claim.describe_seeds(), claim.describe_panel(), claim.scope,
                   claim.describe_test())  # fmt: skip


def _interval(row: pd.Series, shift: float = 0.0) -> str:
    value, low, high = (float(row[c]) - shift for c in ("value", "ci_low", "ci_high"))
    if not (math.isfinite(low) and math.isfinite(high)):
        return f"{value:.3g} (no interval)"
    return f"{value:.3g} [{low:.3g}, {high:.3g}]"


def _at_checkpoint(t: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The rows of the table's one checkpoint (its last, when it has several) and its name."""
    seen = steps(t)
    if not seen:
        return t, "this checkpoint"
    at = t[(t["step"] == seen[-1]) | t["step"].isna()]
    return at, f"the last checkpoint ({describe_steps([seen[-1]])})"


def _per_site(
    rows: pd.DataFrame, line: float, above_agrees: bool, shift: pd.Series | None = None
) -> tuple[str, str]:
    """(what was measured, the verdict) from each site's interval against ``line``."""
    shifts = shift if shift is not None else pd.Series(0.0, index=rows.index)
    sides, shown = [], []
    for i, r in rows.iterrows():
        low, high = float(r["ci_low"]) - shifts[i], float(r["ci_high"]) - shifts[i]
        ok = math.isfinite(low) and math.isfinite(high)
        sides.append(interval_side(low, high, line, above_agrees) if ok else 0)
        shown.append(f"{r['site']} {int(r['layer'])} {_interval(r, shifts[i])}")
    mean = float((rows["value"].astype(float) - shifts).mean())
    if len(rows) <= _MAX_SITES_LISTED:
        text = "; ".join(shown)
    else:
        counts = {s: sides.count(s) for s in (1, -1, 0)}
        text = (f"agreeing side at {counts[1]} of {len(rows)} sites, the other side at "
                f"{counts[-1]}, crossing the line or without interval at {counts[0]}")  # fmt: skip
    return f"{text}; mean over the sites {mean:.3g}", combined_verdict(sides)


def _checkpoint_rows(t: pd.DataFrame) -> list[SummaryRow]:
    """The claims one checkpoint can speak to, each decided from its sites' intervals."""
    at, where = _at_checkpoint(t)
    rank = ranks(t)
    k = f"; rank {rank[0]}" if rank else ""
    note = "one checkpoint, no training window: concentration tested at this checkpoint"
    out: list[SummaryRow] = []
    for probe, statistic, what in (
        ("gradient", "energy_ratio", "Activation-gradient energy ratio"),
        ("weight_gradient", "normalized_ratio",
         "Weight-gradient energy ratio over the random-backprop null"),
    ):  # fmt: skip
        rows = pick(at, statistic, probe=probe)
        rows = rows[rows["probe"] == probe].dropna(subset=["site", "layer"])
        if rows.empty:
            continue
        measured, verdict = _per_site(rows, TAU, True)
        out.append(SummaryRow(
            f"{what} at {where} vs τ = {TAU:g}, 95 % CI over probe tokens per site{k}",
            measured, f"{PAPER['energy_early']} ({note})", verdict,
            scope=f"each of {describe_sites(rows)}; {where}",
        ))  # fmt: skip
    tangent = pick(at, "delta_iso_tangent", probe="gradient").dropna(subset=["site", "layer"])
    normal = pick(at, "delta_iso_normal", probe="gradient").dropna(subset=["site", "layer"])
    if len(tangent) and len(normal):
        keys = ["site", "layer"]
        both = tangent.merge(normal[[*keys, "value"]], on=keys, suffixes=("", "_normal"))
        measured, verdict = _per_site(both, 0.0, True, shift=both["value_normal"])
        out.append(SummaryRow(
            f"ΔIsoScore*: remove Q_T minus a normal control at {where}, 95 % CI over probe "
            f"tokens per site{k}",
            measured, PAPER["isotropy"], verdict,
            scope=f"each of {describe_sites(both)}; {where}",
        ))  # fmt: skip
    out += _frequency(at, where)
    return out


def _frequency(at: pd.DataFrame, where: str) -> list[SummaryRow]:
    """Pearson r of each embedding centre at the checkpoint; every centre must agree."""
    found = {c: pick(at, f"pearson_{c}") for c in CENTRES}
    found = {c: rows.iloc[0] for c, rows in found.items() if len(rows)}
    if "weighted" not in found:
        return []
    sides = []
    for r in found.values():
        low, high = float(r["ci_low"]), float(r["ci_high"])
        ok = math.isfinite(low) and math.isfinite(high)
        sides.append(interval_side(low, high, 0.0, False) if ok else 0)
    verdict = combined_verdict(sides)
    if 1 in sides and -1 in sides:
        verdict = "centre-dependent"
    measured = "; ".join(f"{CENTRES[c]} {_interval(r)}" for c, r in found.items())
    return [SummaryRow(
        f"Frequency vs distance to the embedding centres, Pearson r at {where}, 95 % CI",
        measured, PAPER["frequency"], verdict,
        scope=f"embedding rows of the tokens seen in the corpus; {where}",
    )]  # fmt: skip


def summary(results: Any, *, window_fraction: float | None = None) -> list[SummaryRow]:
    """Headline numbers next to the paper's claims (rows only where data exists);
    ``window_fraction``: the study's own (its config's), so the page's window panel is the
    one its summary and overview use (default: `paper_claims`')."""
    t = prepare(results)
    options = {} if window_fraction is None else {"window_fraction": window_fraction}
    found = paper_claims({"decoder": t}, **options)
    rows = [SummaryRow.of(c) for c in found] if found else _checkpoint_rows(t)

    loss = pick(t, "probe_loss").groupby("step")["value"].mean()
    if len(loss) >= 2:
        shown = f"{loss.iloc[0]:.2f} → {loss.iloc[-1]:.2f}"
        rows.append(SummaryRow("Probe-set loss (nats), first → last checkpoint", shown, "—", "—",
                               scope=describe_steps(loss.index)))  # fmt: skip

    tt = pick(t, "score_share_TT").dropna(subset=["head", "layer"])
    if len(tt):
        at, where = _at_checkpoint(tt)
        what = f"Attention: TT share of the score at {where}, mean over heads"
        shown = f"{at['value'].mean():.3f} (max {at['value'].max():.3f})"
        heads = f"{len(at)} heads at {describe_layers(at['layer'])} (attention input); {where}"
        rows.append(SummaryRow(what, shown, "—", "—", scope=heads))
    return rows


def format_summary(rows: list[SummaryRow]) -> str:
    """The summary as plain text lines, for the terminal."""
    if not rows:
        return "  (no headline numbers in these results)"
    lines = []
    for c in rows:
        lines.append(f"  {c.quantity}: {c.measured}")
        if c.scope:
            lines.append(f"      averages: {c.scope}")
        if c.seeds:
            lines.append(f"      per seed: {c.seeds}")
        if c.windows:
            lines.append(f"      windows: {c.windows}")
        if c.test:
            lines.append(f"      test: {c.test}")
        if c.paper != "—":
            lines.append(f"      paper: {c.paper}  [verdict: {c.agrees}]")
    return "\n".join(lines)
