"""The report's summary: each claim of the paper next to what this table measures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from .table import ALPHA, CENTRES, PAPER, final, pick, prepare, residual_site, steps, window_means
from .verdicts import verdicts

__all__ = ["Claim", "format_summary", "summary"]


@dataclass(frozen=True)
class Claim:
    """One row of the summary: what was measured here next to what the paper reports."""

    quantity: str
    measured: str
    paper: str
    agrees: str  # "agrees", "disagrees", "inconclusive" (from intervals); else yes/no/partly/n/a


def _agree(ok: bool | None) -> str:
    return "n/a" if ok is None else ("yes" if ok else "no")


def _significant(frame: pd.DataFrame) -> str:
    return f"p < {ALPHA} in {(frame['value'] < ALPHA).mean():.0%}" if len(frame) else ""


def summary(results: Any) -> list[Claim]:
    """Headline numbers next to the paper's claims (rows only where data exists)."""
    t = prepare(results)
    site = residual_site(t)
    claims: list[Claim] = []
    found = verdicts(t)

    r = {c: final(t, f"pearson_{c}") for c in CENTRES}
    if any(v is not None for v in r.values()):
        shown = ", ".join(f"{CENTRES[c]} {v:+.2f}" for c, v in r.items() if v is not None)
        weighted = r["weighted"]
        null_m, p = final(t, "pearson_weighted_null_mean"), final(t, "pearson_weighted_p_value")
        if weighted is not None and null_m is not None:
            shown += f" (weighted null {null_m:+.2f}"
            shown += f", p = {p:.3g})" if p is not None else ")"
        values = [v for v in r.values() if v is not None]
        # "partly": strongly negative for some centre, but the sign depends on the centre
        strong = min(values) <= -0.3
        ok = "no" if not strong else ("yes" if max(values) < 0 else "partly")
        ok = "n/a" if found else ok  # a study: the verdict below comes from an interval
        claims.append(Claim("Frequency vs distance, Pearson r (last step)", shown,
                            PAPER["frequency"], ok))  # fmt: skip

    ratio = pick(t, "energy_ratio", site=site, probe="gradient")
    pval = pick(t, "p_value", site=site, probe="gradient")
    early, late = window_means(ratio)
    if found:  # a study: verdicts from the window intervals
        claims += [_from_verdict(v) for v in found]
    elif early is not None and late is not None:
        sig_e = _significant(pval[pval["window"] == "early"])
        sig_l = _significant(pval[pval["window"] == "late"])
        claims.append(Claim("Gradient energy ratio, early window (mean over layers)",
                            f"{early:.2f}× controls" + (f"; {sig_e}" if sig_e else ""),
                            PAPER["energy_early"], _agree(early > 1)))  # fmt: skip
        claims.append(Claim("Gradient energy ratio, late window",
                            f"{late:.2f}× controls" + (f"; {sig_l}" if sig_l else ""),
                            PAPER["energy_late"], _agree(late < early)))  # fmt: skip
    elif len(ratio):
        mean = float(ratio["value"].mean())
        sig = _significant(pval)
        claims.append(Claim("Gradient energy ratio (one checkpoint, mean over layers)",
                            f"{mean:.2f}× controls" + (f"; {sig}" if sig else ""),
                            f"{PAPER['energy_early']}; {PAPER['energy_late']}",
                            "n/a"))  # fmt: skip

    d_t = pick(t, "delta_iso_tangent", site=site, probe="gradient")
    d_n = pick(t, "delta_iso_normal", site=site, probe="gradient")
    if len(d_t) and len(d_n) and not found:
        mt, mn = float(d_t["value"].mean()), float(d_n["value"].mean())
        sig = _significant(pick(t, "isotropy_p_value", site=site, probe="gradient"))
        claims.append(Claim("ΔIsoScore*: remove Q_T vs a normal control (mean)",
                            f"{mt:+.3f} vs {mn:+.3f}" + (f"; {sig}" if sig else ""),
                            PAPER["isotropy"], _agree(mt > mn)))  # fmt: skip

    loss = pick(t, "probe_loss").groupby("step")["value"].mean()
    if len(loss) >= 2:
        claims.append(Claim("Probe-set loss (nats), first → last checkpoint",
                            f"{loss.iloc[0]:.2f} → {loss.iloc[-1]:.2f}", "—", "n/a"))  # fmt: skip

    tt = pick(t, "score_share_TT")
    if len(tt):
        seen = steps(tt)
        last = tt[tt["step"] == seen[-1]] if seen else tt
        claims.append(Claim("Attention: TT share of the score (last checkpoint, mean over heads)",
                            f"{last['value'].mean():.3f} (max {last['value'].max():.3f})",
                            "—", "n/a"))  # fmt: skip
    return claims


def _interval(numbers: dict) -> str:
    low, high = numbers["ci"]
    return f"{numbers['value']:.3g} [{low:.3g}, {high:.3g}]"


def _from_verdict(v: dict[str, Any]) -> Claim:
    """A summary row from a `verdicts` record."""
    what = {
        "gradient": "activation gradient",
        "weight_gradient": "weight gradient",
        "embedding": "embedding",
    }
    obj = what[v["gradient_object"]]
    if v["claim"] == "energy_early":
        quantity = f"Energy ratio, early window ({obj}), 95 % CI"
        measured = _interval(v["early"])
    elif v["claim"] == "energy_late":
        quantity = f"Energy ratio, late − early ({obj}), 95 % CI"
        measured = _interval(v["difference"])
        if v.get("late") is not None:
            measured += f"; late {_interval(v['late'])}"
    elif v["claim"] == "frequency":
        quantity = "Frequency vs distance to the frequency-weighted centre, Pearson r, 95 % CI"
        measured = _interval(v["last"])
    else:
        quantity = "ΔIsoScore*: remove Q_T minus a normal control, early window, 95 % CI"
        measured = _interval(v["early"])
    return Claim(f"{quantity} (rank {v['rank']})", measured, v["paper"], v["verdict"])


def format_summary(claims: list[Claim]) -> str:
    """The summary as plain text lines, for the terminal."""
    if not claims:
        return "  (no headline numbers in these results)"
    lines = []
    for c in claims:
        lines.append(f"  {c.quantity}: {c.measured}")
        if c.paper != "—":
            lines.append(f"      paper: {c.paper}  [verdict: {c.agrees}]")
    return "\n".join(lines)
