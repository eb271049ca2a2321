"""The report's summary: each claim of the paper next to what this table measures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from .claims import Claim
from .table import (
    ALPHA,
    PAPER,
    centres_text,
    correlations,
    final,
    gradient,
    pick,
    prepare,
    steps,
    window_means,
)
from .verdicts import paper_claims

__all__ = ["SummaryRow", "format_summary", "summary"]


@dataclass(frozen=True)
class SummaryRow:
    """One row of the summary: what was measured here next to what the paper reports
    (a study's claims come as `Claim` objects; a row is how the page and the terminal
    show one, beside numbers no claim turns on)."""

    quantity: str
    measured: str
    paper: str
    agrees: str  # a claim's verdict (claims.VERDICTS); else yes/no/partly/n/a
    seeds: str = ""  # each training seed's own number, where there are several
    windows: str = ""  # the claim under each window definition of the panel

    @classmethod
    def of(cls, claim: Claim) -> SummaryRow:
        return cls(claim.quantity, claim.measured, claim.paper, claim.verdict,
                   claim.describe_seeds(), claim.describe_panel())  # fmt: skip


def _agree(ok: bool | None) -> str:
    return "n/a" if ok is None else ("yes" if ok else "no")


def _significant(frame: pd.DataFrame) -> str:
    return f"p < {ALPHA} in {(frame['value'] < ALPHA).mean():.0%}" if len(frame) else ""


def summary(results: Any) -> list[SummaryRow]:
    """Headline numbers next to the paper's claims (rows only where data exists)."""
    t = prepare(results)
    rows: list[SummaryRow] = []
    found = paper_claims({"decoder": t})

    r = correlations(t)
    if r:
        shown = centres_text(r)
        weighted = r.get("weighted")
        null_m, p = final(t, "pearson_weighted_null_mean"), final(t, "pearson_weighted_p_value")
        if weighted is not None and null_m is not None:
            shown += f" (weighted null {null_m:+.2f}"
            shown += f", p = {p:.3g})" if p is not None else ")"
        values = list(r.values())
        # "partly": strongly negative for some centre, but the sign depends on the centre
        strong = min(values) <= -0.3
        ok = "no" if not strong else ("yes" if max(values) < 0 else "partly")
        ok = "n/a" if found else ok  # a study: the verdict below comes from an interval
        rows.append(SummaryRow("Frequency vs distance, Pearson r (last step)", shown,
                               PAPER["frequency"], ok))  # fmt: skip

    ratio, pval = gradient(t, "energy_ratio"), gradient(t, "p_value")
    early, late = window_means(ratio)
    if found:  # a study: verdicts from the window intervals
        rows += [SummaryRow.of(c) for c in found]
    elif early is not None and late is not None:
        sig_e = _significant(pval[pval["window"] == "early"])
        sig_l = _significant(pval[pval["window"] == "late"])
        rows.append(SummaryRow("Gradient energy ratio, early window (mean over layers)",
                               f"{early:.2f}× controls" + (f"; {sig_e}" if sig_e else ""),
                               PAPER["energy_early"], _agree(early > 1)))  # fmt: skip
        rows.append(SummaryRow("Gradient energy ratio, late window",
                               f"{late:.2f}× controls" + (f"; {sig_l}" if sig_l else ""),
                               PAPER["energy_late"], _agree(late < early)))  # fmt: skip
    elif len(ratio):
        mean = float(ratio["value"].mean())
        sig = _significant(pval)
        rows.append(SummaryRow("Gradient energy ratio (one checkpoint, mean over layers)",
                               f"{mean:.2f}× controls" + (f"; {sig}" if sig else ""),
                               f"{PAPER['energy_early']}; {PAPER['energy_late']}",
                               "n/a"))  # fmt: skip

    d_t, d_n = gradient(t, "delta_iso_tangent"), gradient(t, "delta_iso_normal")
    if len(d_t) and len(d_n) and not found:
        mt, mn = float(d_t["value"].mean()), float(d_n["value"].mean())
        sig = _significant(gradient(t, "isotropy_p_value"))
        rows.append(SummaryRow("ΔIsoScore*: remove Q_T vs a normal control (mean)",
                               f"{mt:+.3f} vs {mn:+.3f}" + (f"; {sig}" if sig else ""),
                               PAPER["isotropy"], _agree(mt > mn)))  # fmt: skip

    loss = pick(t, "probe_loss").groupby("step")["value"].mean()
    if len(loss) >= 2:
        shown = f"{loss.iloc[0]:.2f} → {loss.iloc[-1]:.2f}"
        rows.append(SummaryRow("Probe-set loss (nats), first → last checkpoint", shown, "—", "n/a"))

    tt = pick(t, "score_share_TT")
    if len(tt):
        seen = steps(tt)
        last = tt[tt["step"] == seen[-1]] if seen else tt
        what = "Attention: TT share of the score (last checkpoint, mean over heads)"
        shown = f"{last['value'].mean():.3f} (max {last['value'].max():.3f})"
        rows.append(SummaryRow(what, shown, "—", "n/a"))
    return rows


def format_summary(rows: list[SummaryRow]) -> str:
    """The summary as plain text lines, for the terminal."""
    if not rows:
        return "  (no headline numbers in these results)"
    lines = []
    for c in rows:
        lines.append(f"  {c.quantity}: {c.measured}")
        if c.seeds:
            lines.append(f"      per seed: {c.seeds}")
        if c.windows:
            lines.append(f"      windows: {c.windows}")
        if c.paper != "—":
            lines.append(f"      paper: {c.paper}  [verdict: {c.agrees}]")
    return "\n".join(lines)
