"""The report's view of a results table: one rank, finite values, window helpers."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..core.errors import UsageError
from ..core.results import frame, select

__all__ = [
    "ALPHA",
    "CENTRES",
    "PAPER",
    "centres_text",
    "correlations",
    "final",
    "gradient",
    "per_step",
    "pick",
    "prepare",
    "ranks",
    "residual_site",
    "steps",
    "window_means",
    "window_spans",
]
ALPHA = 0.05
CENTRES = {
    "mean_all": "mean of all rows",
    "mean_seen": "mean of seen rows",
    "weighted": "frequency-weighted mean",
    "norm": "origin (norm)",
}


PAPER = {
    "frequency": "strong negative frequency–distance correlation for decoders",
    "energy_early": "gradient energy concentrated in Q_T early in training (ratio ≫ 1)",
    "energy_late": "weaker late in training than early",
    "isotropy": "removing Q_T raises IsoScore* more than removing a normal control",
    "encoders_weaker": "the effect is weaker in encoders than in decoders",
}


def ranks(results: pd.DataFrame) -> list[int]:
    """The ranks k of Q_T a table holds (a study may sweep several)."""
    if "rank" not in results.columns:
        return []
    return sorted(int(r) for r in results["rank"].dropna().unique())


def prepare(results: pd.DataFrame, *, rank: int | None = None) -> pd.DataFrame:
    """The table in the results schema, reduced to one rank of Q_T: ``rank``, or the
    smallest when the table holds several (the report says which it shows). Rows
    without a rank (per-checkpoint losses, embedding correlations) are kept; a table
    without intervals gets empty ``ci_low``/``ci_high`` columns."""
    if not isinstance(results, pd.DataFrame):
        raise TypeError(f"results must be a pandas DataFrame; got {type(results).__name__}.")
    try:
        t = frame(results, ("checkpoint", "step", "window", "rank"))
    except (UsageError, ValueError, TypeError) as err:
        raise UsageError(
            f"not a tangentlens results table ({err}); re-create it with `tangentlens study` "
            "or `tangentlens probe`."
        ) from err
    for column in ("ci_low", "ci_high"):  # a table without intervals draws none
        if column not in t.columns:
            t = t.assign(**{column: np.nan})
    present = ranks(t)
    if rank is not None and rank not in present:
        raise UsageError(f"the table has no rows of rank {rank}; it holds ranks {present}.")
    if present:
        chosen = present[0] if rank is None else rank
        t = select(t, rank=[None, chosen])
    _check_drawable(t)  # what the figures draw: the rows of the chosen rank
    return t


# Far beyond any statistic the tool writes (sums of float32 squares stay below 1e77 a
# token), and far enough inside float64 that an axis spanning two values cannot overflow.
_DRAWABLE = 1e150


def _check_drawable(t: pd.DataFrame) -> None:
    """Refuse finite values no figure can draw (an axis whose span overflows float64 is a
    singular transform inside matplotlib, not a page) and p-values outside [0, 1]."""
    values = t[["value", "ci_low", "ci_high"]].apply(pd.to_numeric, errors="coerce")
    # inf is a value some statistics take on purpose (a ratio over 0), and figures skip it
    huge = (values.abs().gt(_DRAWABLE) & np.isfinite(values)).any(axis=1).to_numpy()
    # a p-value's axis is logarithmic: one outside [0, 1] is no p-value
    p_values = t["statistic"].astype(str).str.contains(r"(?:^|_)p_value(?:$|_)").to_numpy()
    outside = p_values & ~values["value"].between(0, 1).to_numpy() & values["value"].notna()
    for bad, what in ((huge, f"beyond ±{_DRAWABLE:.0e}"), (outside, "outside [0, 1]")):
        if bad.any():
            first = t[bad].iloc[0]
            raise UsageError(
                f"the table's {first['statistic']} at {first['hook']} is {what}, which no "
                "statistic of the tool reaches and no figure can draw: re-create the table "
                "with `tangentlens study` or `tangentlens probe`."
            )


def pick(
    t: pd.DataFrame, statistic: str, *, site: str | None = None, probe: str | None = None
) -> pd.DataFrame:
    """Finite rows of one statistic (optionally at one site kind, from one probe)."""
    keep = (t["statistic"] == statistic) & np.isfinite(t["value"].astype(float))
    if site is not None:
        keep &= t["site"] == site
    if probe is not None:
        keep &= (t["probe"] == probe).fillna(False) | t["probe"].isna()
    return t[keep]


def residual_site(t: pd.DataFrame) -> str:
    present = set(t["site"].dropna().unique())
    return next((s for s in ("resid_pre", "resid_mid", "resid_post") if s in present), "resid_pre")


def steps(t: pd.DataFrame) -> list[int]:
    return sorted(int(s) for s in t["step"].dropna().unique())


def window_spans(t: pd.DataFrame) -> dict[str, tuple[float, float]]:
    spans = {}
    for name in ("early", "late"):
        in_window = t.loc[t["window"] == name, "step"].dropna()
        if len(in_window):
            spans[name] = (float(in_window.min()), float(in_window.max()))
    return spans


def per_step(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean, min and max over layers per step."""
    return frame.groupby("step")["value"].agg(["mean", "min", "max"])


def window_means(frame: pd.DataFrame) -> tuple[float | None, float | None]:
    out = []
    for name in ("early", "late"):
        v = frame.loc[frame["window"] == name, "value"]
        out.append(float(v.mean()) if len(v) else None)
    return out[0], out[1]


def final(t: pd.DataFrame, statistic: str) -> float | None:
    """Mean of ``statistic`` at the last step (or over the whole table without steps)."""
    rows = pick(t, statistic)
    if rows.empty:
        return None
    seen = steps(rows)
    if seen:
        rows = rows[rows["step"] == seen[-1]]
    return float(rows["value"].mean())


def gradient(t: pd.DataFrame, statistic: str) -> pd.DataFrame:
    """Finite rows of one statistic of the activation-gradient probe at the table's
    residual site: the rows every energy and isotropy number of the report is read from."""
    return pick(t, statistic, site=residual_site(t), probe="gradient")


def correlations(t: pd.DataFrame, kind: str = "pearson") -> dict[str, float]:
    """Each embedding centre's correlation (``kind``: pearson or spearman) at the last
    step, for the centres the table has."""
    found = {c: final(t, f"{kind}_{c}") for c in CENTRES}
    return {c: v for c, v in found.items() if v is not None}


def centres_text(values: dict[str, float]) -> str:
    """``frequency-weighted mean -0.56, ...``: the centres' correlations as one line."""
    return ", ".join(f"{CENTRES[c]} {v:+.2f}" for c, v in values.items())
