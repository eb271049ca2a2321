"""Verdicts against the paper, with training seeds as the unit of replication.

A study's table holds window rows (``probe="window"``, `tangentlens.study.windows`): the
early- and late-window means of each gradient object's ratio and their difference, with
jackknife intervals over groups of probe sequences. Those intervals hold the weights
fixed, and retraining with another seed moves the numbers further than resampling tokens
does; so `paper_claims` takes one table per training seed and decides from the spread
across seeds (docs/VERDICTS.md states the whole rule):

- per seed, the tested number with its token interval (as the study wrote it);
- across seeds, Student's t-interval over the per-seed numbers (`replication`), a t-test
  against the claim's line, and Holm's correction over every claim of the call: a claim
  agrees or disagrees only when its Holm-adjusted p-value is below ``alpha``. With one seed
  there is no between-seed spread: the token interval can only *suggest* a verdict;
- the weight gradient is read through ``normalized_ratio``, its energy ratio over the
  random-backprop null: a Q_T fitted on the activations makes the raw weight-gradient
  energy ratio large even when the output gradients are noise;
- "concentrated early" (ratio ≫ 1) is tested against τ > 1, not 1: a ratio of 1.3 is above
  1 yet is not what the paper describes; the claim is ``strong`` when the interval is
  above τ, ``weak`` when above 1 only, ``none`` otherwise;
- a dynamics claim holds only if it holds under every window definition of the panel
  (`panel`), else it is ``window-dependent``; the frequency claim only if it holds for
  every embedding centre, else ``centre-dependent`` (when centres disagree in sign) or
  ``inconclusive``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import pandas as pd

from ..core.results import select
from ..core.settings import STUDY
from .claims import OBJECTS, Claim, Estimate, PanelEntry, SeedEstimate
from .panel import DEFINITIONS, object_rows, panel_windows, window_mean
from .replication import holm, t_interval, t_p_value, welch_interval, welch_p_value
from .scope import claim_scope

__all__ = ["TAU", "combined_verdict", "interval_side", "paper_claims"]

TAU = 2.0
# the window statistic each gradient object's claims read (the weight gradient's over the
# random-backprop null; its raw energy ratio stays in the table)
_RATIO = {"gradient": "energy_ratio", "weight_gradient": "normalized_ratio"}
_CENTRES = ("weighted", "mean_all", "mean_seen", "norm")  # "weighted" is the claim's own
_CENTRE_KEY = {"weighted": "last", "mean_all": "mean_all", "mean_seen": "mean_seen",
               "norm": "norm"}  # fmt: skip
Seeds = Mapping[int, pd.DataFrame]


@dataclass
class _Draft:
    """A claim before Holm's correction: its numbers, line and direction."""

    claim: Claim
    line: float
    above_agrees: bool
    values: list[float]  # per-seed tested values (decoder's for a comparison)
    others: list[float] = field(default_factory=list)  # the encoder's, for a comparison
    sides: list[int] = field(default_factory=list)  # per-centre sides (frequency)


def _side(low: float | None, high: float | None, line: float, above_agrees: bool) -> int:
    """+1 where [low, high] lies on the claim's side of ``line``, −1 on the other, 0 else."""
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return 0
    if low > line:
        return 1 if above_agrees else -1
    if high < line:
        return -1 if above_agrees else 1
    return 0


def interval_side(low: float | None, high: float | None, line: float, above_agrees: bool) -> int:
    """+1 where the interval [low, high] lies on the claim's side of ``line``, −1 where it
    lies on the other side, 0 where it crosses the line or is missing."""
    return _side(low, high, line, above_agrees)


def combined_verdict(sides: list[int]) -> str:
    """One checkpoint of one model, several sites or centres: each interval can only
    suggest (docs/VERDICTS.md, one seed), and the claim is suggested only where every
    interval lies on the same side, else ``inconclusive``."""
    if sides and all(s == 1 for s in sides):
        return "suggests agrees"
    if sides and all(s == -1 for s in sides):
        return "suggests disagrees"
    return "inconclusive"


def _word(side: int, *, suggests: bool) -> str:
    if side == 0:
        return "inconclusive"
    word = "agrees" if side > 0 else "disagrees"
    return f"suggests {word}" if suggests else word


def _direction(verdict: str) -> int:
    return {"agrees": 1, "disagrees": -1}.get(verdict.removeprefix("suggests "), 0)


def _estimate(row: pd.Series) -> Estimate:
    return Estimate(float(row["value"]), float(row["ci_low"]), float(row["ci_high"]))


def _window(table: pd.DataFrame, statistic: str, window: str, rank: int) -> Estimate | None:
    rows = select(table, probe="window", statistic=statistic, window=window, rank=rank)
    return None if rows.empty else _estimate(rows.iloc[0])


def _last(table: pd.DataFrame, statistic: str) -> Estimate | None:
    rows = select(table, probe="embedding", statistic=statistic).dropna(subset=["step"])
    if rows.empty:
        return None
    return _estimate(rows[rows["step"] == rows["step"].max()].iloc[0])


def _between(values: list[float]) -> Estimate | None:
    found = t_interval(values)
    return None if found is None else Estimate(*found)


def _pooled(per_seed: list[Estimate | None]) -> tuple[Estimate | None, Estimate | None]:
    """(the number shown, the between-seed interval): the t-interval over the seeds'
    values with two or more seeds, else the one seed's token estimate."""
    found = [e for e in per_seed if e is not None]
    between = _between([e.value for e in found]) if len(found) > 1 else None
    if between is not None:
        return between, between
    return (found[0] if len(found) == 1 else None), None


def _strength(low: float, tau: float) -> str:
    return "strong" if low > tau else ("weak" if low > 1 else "none")


def _rank(seeds: Seeds) -> int | None:
    found = [select(t, probe="window")["rank"].dropna() for t in seeds.values()]
    found = [int(r.min()) for r in found if len(r)]
    return min(found) if found else None


def _panel_values(
    seeds: Seeds, obj: str, rank: int, fraction: float, what: str
) -> dict[str, dict[int, float | None]]:
    """Definition → seed → the window mean (``what``: early, or late − early)."""
    out: dict[str, dict[int, float | None]] = {}
    for seed, table in seeds.items():
        rows = object_rows(table, obj, rank)
        if rows.empty:
            continue
        for definition, spans in panel_windows(table, fraction).items():
            early = window_mean(rows, spans["early"])
            late = window_mean(rows, spans["late"])
            value = early
            if what == "difference":
                value = None if early is None or late is None else late - early
            out.setdefault(definition, {})[seed] = value
    return out


def _panel_entry(
    definition: str,
    values: Mapping[str, Mapping[int, float | None]],
    line: float,
    above_agrees: bool,
) -> PanelEntry:
    """One definition's entry: ``values`` is model → seed → value (two models: the
    decoder's minus the encoder's, Welch's interval across seeds)."""
    per_seed = tuple((m, s, v) for m, by in values.items() for s, v in sorted(by.items()))
    found = [[v for v in by.values() if v is not None] for by in values.values()]
    if any(not f for f in found):
        return PanelEntry(definition, None, None, per_seed, "inconclusive")
    if len(found) == 2:
        value = sum(found[0]) / len(found[0]) - sum(found[1]) / len(found[1])
        interval = welch_interval(found[0], found[1])
        line = 0.0
    else:
        value = sum(found[0]) / len(found[0])
        interval = t_interval(found[0])
    if interval is None:  # one seed: the point's side only suggests
        side = 0 if value == line else _side(value, value, line, above_agrees)
        return PanelEntry(definition, value, None, per_seed, _word(side, suggests=True))
    low, high = interval[1], interval[2]
    side = _side(low, high, line, above_agrees)
    return PanelEntry(definition, value, (low, high), per_seed, _word(side, suggests=False))


def _panel(
    by_model: Mapping[str, Mapping[str, Mapping[int, float | None]]],
    line: float,
    above_agrees: bool,
) -> tuple[PanelEntry, ...]:
    """The entries of the definitions every model has (model → definition → seed → value)."""
    common = set.intersection(*(set(v) for v in by_model.values())) if by_model else set()
    order = [d for d in DEFINITIONS if d in common]
    return tuple(
        _panel_entry(d, {m: by[d] for m, by in by_model.items()}, line, above_agrees) for d in order
    )


def _for_model(model: str, seeds: Seeds, tau: float, fraction: float) -> list[_Draft]:
    """Each claim this model's window rows speak to, per gradient object, at the smallest
    rank, with every seed's numbers."""
    rank = _rank(seeds)
    if rank is None:
        return []
    out = []
    for obj in OBJECTS:
        stat = f"{obj}_{_RATIO[obj]}"
        early = [_window(t, stat, "early", rank) for t in seeds.values()]
        late = [_window(t, stat, "late", rank) for t in seeds.values()]
        diff = [_window(t, f"{stat}_late_minus_early", "late-early", rank) for t in seeds.values()]
        if any(e is not None for e in early):
            out.append(_draft("energy_early", model, obj, stat, rank, seeds, early, (),
                              tau, True, fraction, tau))  # fmt: skip
        if any(d is not None for d in diff):
            context = (("early", _pooled(early)[0]), ("late", _pooled(late)[0]))
            out.append(_draft("energy_late", model, obj, f"{stat}_late_minus_early", rank,
                              seeds, diff, context, 0.0, False, fraction, None))  # fmt: skip
    iso = [_window(t, "gradient_delta_iso_excess", "early", rank) for t in seeds.values()]
    if any(e is not None for e in iso):
        out.append(_draft("isotropy", model, "gradient", "gradient_delta_iso_excess", rank,
                          seeds, iso, (), 0.0, True, fraction, None))  # fmt: skip
    frequency = _frequency(model, seeds, rank)
    return out + ([frequency] if frequency else [])


def _draft(
    name: str,
    model: str,
    obj: str,
    statistic: str,
    rank: int,
    seeds: Seeds,
    per_seed: list[Estimate | None],
    context: tuple[tuple[str, Estimate | None], ...],
    line: float,
    above_agrees: bool,
    fraction: float,
    tau: float | None,
) -> _Draft:
    shown, between = _pooled(per_seed)
    shown = shown or Estimate(math.nan, math.nan, math.nan)
    values = [e.value for e in per_seed if e is not None]
    panel_obj = "isotropy" if name == "isotropy" else obj
    what = "difference" if name == "energy_late" else "early"
    panel = _panel({model: _panel_values(seeds, panel_obj, rank, fraction, what)},
                   line, above_agrees)  # fmt: skip
    claim = Claim(
        name, model, obj, statistic, rank, shown, "inconclusive", context,
        per_seed=tuple(SeedEstimate(model, s, e) for s, e in zip(seeds, per_seed, strict=True)),
        between=between, panel=panel, threshold=tau,
        strength=None if tau is None else _strength(shown.low, tau),
        p_value=t_p_value(values, line) if between is not None else None,
        scope=claim_scope(_first(seeds), name, obj, rank),
    )  # fmt: skip
    return _Draft(claim, line, above_agrees, values)


def _first(seeds: Seeds) -> pd.DataFrame:
    """The first seed's table: the seeds of one design share sites and windows, so its
    scope is every seed's."""
    return next(iter(seeds.values()))


def _frequency(model: str, seeds: Seeds, rank: int) -> _Draft | None:
    """Frequency vs distance at the last checkpoint, one Pearson r per embedding centre
    (Fisher intervals per seed); the claim holds only where every centre's does. Its
    p-value is the largest of the centres' two-sided ones: the intersection–union test
    that every centre's r differs from 0, whose sides then decide agrees, disagrees or
    centre-dependent (which centre decides the sign is itself what the claim asks)."""
    centres = {c: [_last(t, f"pearson_{c}") for t in seeds.values()] for c in _CENTRES}
    centres = {c: v for c, v in centres.items() if any(e is not None for e in v)}
    if "weighted" not in centres:
        return None
    numbers, sides, ps = {}, [], []
    for centre, per_seed in centres.items():
        shown, between = _pooled(per_seed)
        numbers[centre] = shown
        sides.append(0 if shown is None else _side(shown.low, shown.high, 0.0, False))
        values = [e.value for e in per_seed if e is not None]
        ps.append(t_p_value(values, 0.0) if between is not None else None)
    weighted = centres["weighted"]
    shown, between = _pooled(weighted)
    context = tuple((_CENTRE_KEY[c], e) for c, e in numbers.items() if c != "weighted")
    p = None if between is None or None in ps else max(p for p in ps if p is not None)
    claim = Claim(
        "frequency", model, "embedding", "pearson_weighted", rank,
        shown or Estimate(math.nan, math.nan, math.nan), "inconclusive", context,
        per_seed=tuple(SeedEstimate(model, s, e) for s, e in zip(seeds, weighted, strict=True)),
        between=between, p_value=p,
        scope=claim_scope(_first(seeds), "frequency", "embedding", rank),
    )  # fmt: skip
    return _Draft(claim, 0.0, False, [e.value for e in weighted if e], sides=sides)


def _compare(
    decoder: list[_Draft],
    encoder: list[_Draft],
    tables: Mapping[str, Seeds],
    fraction: float,
) -> list[_Draft]:
    """Decoder against encoder, per gradient object: the early ratio's difference. With
    two or more seeds per model, Welch's interval for decoder − encoder across seeds; with
    one, whether the two token intervals are disjoint (which can only suggest)."""
    out = []
    for obj in OBJECTS:
        dec = next((d for d in decoder if d.claim.name == "energy_early"
                    and d.claim.gradient_object == obj), None)  # fmt: skip
        enc = next((d for d in encoder if d.claim.name == "energy_early"
                    and d.claim.gradient_object == obj), None)  # fmt: skip
        if dec is None or enc is None:
            continue
        d, e = dec.claim, enc.claim
        found = welch_interval(dec.values, enc.values)
        between = None if found is None else Estimate(*found)
        # the tested number: Welch's difference across seeds; with one seed per model the
        # test is whether the token intervals are disjoint, so the difference has none
        shown = between or Estimate(d.estimate.value - e.estimate.value, math.nan, math.nan)
        context = (("decoder", d.estimate), ("encoder", e.estimate))
        panels = {
            m: _panel_values(tables[m], obj, d.rank, fraction, "early")
            for m in ("decoder", "encoder")
        }
        claim = Claim(
            "encoders_weaker", "decoder vs encoder", obj, f"{obj}_{_RATIO[obj]}", d.rank,
            shown, "inconclusive", context, per_seed=d.per_seed + e.per_seed,
            between=between, panel=_panel(panels, 0.0, True),
            p_value=welch_p_value(dec.values, enc.values),
            scope=f"decoder: {d.scope}; encoder: {e.scope}" if d.scope else "",
        )  # fmt: skip
        draft = _Draft(claim, 0.0, True, dec.values, enc.values)
        if between is None:  # one seed: disjoint token intervals
            a, b = d.estimate, e.estimate
            draft.sides = [1 if a.low > b.high else (-1 if a.high < b.low else 0)]
        out.append(draft)
    return out


def _decide(draft: _Draft, p_holm: float | None, alpha: float) -> Claim:
    """The verdict: from the Holm-adjusted between-seed test with seeds, from the token
    interval (suggests) with one; then the panel's and the centres' agreement."""
    c = draft.claim
    if c.between is not None:
        side = _side(c.between.low, c.between.high, draft.line, draft.above_agrees)
        if p_holm is None or not p_holm < alpha:
            side = 0
        verdict = _word(side, suggests=False)
    elif draft.sides and c.name == "encoders_weaker":
        verdict = _word(draft.sides[0], suggests=True)
    else:
        side = _side(c.estimate.low, c.estimate.high, draft.line, draft.above_agrees)
        verdict = _word(side, suggests=True)
    if c.name == "frequency" and draft.sides:
        if 1 in draft.sides and -1 in draft.sides:
            verdict = "centre-dependent"
        elif any(s != _direction(verdict) for s in draft.sides):
            verdict = "inconclusive"
    if _direction(verdict) and any(_direction(p.verdict) != _direction(verdict) for p in c.panel):
        verdict = "window-dependent"
    return replace(c, verdict=verdict, p_holm=p_holm)


def _as_seeds(tables: Mapping[str, pd.DataFrame | Seeds]) -> dict[str, dict[int, pd.DataFrame]]:
    out = {}
    for model, found in tables.items():
        if isinstance(found, pd.DataFrame):
            out[model] = {0: found}
        else:
            out[model] = {int(s): t for s, t in sorted(found.items())}
    return out


def paper_claims(
    tables: Mapping[str, pd.DataFrame | Mapping[int, pd.DataFrame]],
    *,
    tau: float = TAU,
    window_fraction: float = STUDY.window_fraction.default,
    alpha: float = 0.05,
) -> list[Claim]:
    """The paper's claims against each model's study tables, then, when both are there,
    the decoder against the encoder: the one list the summary, the pages,
    ``summary.json`` and the CLI show.

    ``tables``: model (``decoder`` or ``encoder``) → {training seed: that seed's table},
    or → one table (one seed, numbered 0). ``tau``: the threshold (> 1) the early energy
    ratio must exceed for "concentrated". ``window_fraction``: the fraction of training
    each window of the panel takes. ``alpha``: the family-wise level of Holm's correction
    over all the claims returned.
    """
    if not tau > 1:
        raise ValueError(f"tau must be above 1 (the claim is ratio ≫ 1); got {tau}.")
    seeds = _as_seeds(tables)
    per_model = {m: _for_model(m, s, tau, window_fraction) for m, s in seeds.items()}
    drafts = [d for found in per_model.values() for d in found]
    if "decoder" in per_model and "encoder" in per_model:
        drafts += _compare(per_model["decoder"], per_model["encoder"], seeds, window_fraction)
    adjusted = holm([d.claim.p_value for d in drafts])
    return [_decide(d, p, alpha) for d, p in zip(drafts, adjusted, strict=True)]
