"""A study's analysis: the results table from the part files alone (deterministic).

Per site one rank-k PCA Q_T of the pooled early-window activations
(``bases/rank{k}.safetensors``), then per checkpoint the energy and isotropy tests
(IsoScore* reference: the trace-normalised gradient covariance averaged over all
checkpoints at that site, scaled to each checkpoint's trace), activation shares (the
depth profile), intrinsic dimension, effective rank, IsoScore, frequency–distance
correlations and the tangent share of the embedding update.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pandas as pd
from torch import Tensor
from tqdm.auto import tqdm

from ..analysis.embedding_geometry import frequency_distance, update_split
from ..core import results
from ..core.errors import UnstableBasisWarning
from ..core.metrics import effective_rank, isoscore, participation_ratio, twonn_dimension
from ..core.significance import pooled_shape, reference_at
from ..core.stats import Moments
from ..core.subspace import (
    TangentBasis,
    near_chance,
    split_half_overlap,
    subspace_overlap,
)
from ..hooks.sites import INPUT_KINDS, RESIDUAL_KINDS, WRITE_KINDS, Site
from ..probes.bases import BasisSet
from ..probes.residual import write_basis_site
from ..version import __version__
from .collect import Part
from .config import StudyConfig
from .windows import WindowSummary, refit_bases

__all__ = ["analyse", "fit_bases"]

_Z95 = 1.959963984540054


def _fisher_ci(r: float, n: int, spearman: bool) -> tuple[float, float]:
    """95 % interval of a correlation by Fisher's z (Fieller's variance for Spearman)."""
    if n <= 3 or not math.isfinite(r) or abs(r) >= 1:
        return math.nan, math.nan
    se = math.sqrt((1.06 if spearman else 1.0) / (n - 3))
    z = math.atanh(r)
    return math.tanh(z - _Z95 * se), math.tanh(z + _Z95 * se)


class _Rows:
    """Accumulates table rows of one checkpoint at a time."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.step: int | None = 0
        self.window = ""

    def at(self, step: int | None, window: str) -> _Rows:
        """Rows that follow belong to checkpoint ``step`` (None: the whole study)."""
        self.step, self.window = step, window
        return self

    def add(
        self,
        probe: str,
        values: Mapping[str, Any],
        *,
        rank: int | None = None,
        site: Site | None = None,
        cis: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        checkpoint = None if self.step is None else f"step{self.step}"
        for stat, value in values.items():
            low, high = (cis or {}).get(stat, (math.nan, math.nan))
            self.rows.append(
                results.row(
                    probe,
                    site,
                    stat,
                    math.nan if value is None else float(value),
                    checkpoint=checkpoint,
                    step=self.step,
                    window=self.window,
                    rank=rank,
                    ci_low=low,
                    ci_high=high,
                )
            )

    def extend(self, probe_rows: list[dict[str, Any]], *, rank: int) -> dict[Site, dict]:
        """A probe's rows (`MomentProbe.compute`) at this checkpoint and ``rank``; returns
        them as site → statistic → value, for the window summaries."""
        checkpoint = None if self.step is None else f"step{self.step}"
        where = {"checkpoint": checkpoint, "step": self.step, "window": self.window}
        by_site: dict[Site, dict[str, float]] = {}
        for r in probe_rows:
            self.rows.append({**r, **where, "rank": rank})
            by_site.setdefault(Site.parse(r["hook"]), {})[r["statistic"]] = r["value"]
        return by_site

    def frame(self) -> pd.DataFrame:
        return results.frame(self.rows, results.COLUMNS)


def _sites(part: Part) -> tuple[list[Site], list[Site], list[Site]]:
    """A part's residual sites (gradients too), block writes and linear-map inputs."""
    sites = sorted(part.gradient.sites, key=lambda s: (s.layer, RESIDUAL_KINDS.index(s.kind)))
    writes = sorted(
        (s for s in part.residual.sites if s.kind in WRITE_KINDS), key=lambda s: s.hook_name
    )
    inputs = sorted(
        part.weight.sites if part.weight else [], key=lambda s: (s.layer, INPUT_KINDS.index(s.kind))
    )
    return sites, writes, inputs


def fit_bases(
    cfg: StudyConfig,
    series: Any,
    windows: dict[str, list[int]],
    parts: dict[int, Part],
    out: Path,
) -> dict[int, dict[Site, TangentBasis]]:
    """Rank → site → Q_T at the residual sites and linear-map inputs, from the pooled
    early-window activations (``parts`` needs only the early window's: so the bases exist,
    and the heads can be measured, before the later checkpoints are collected); saved as
    ``bases/rank{k}.safetensors``."""
    early = [series.steps[i] for i in windows["early"]]
    first = parts[early[0]]
    cfg.check_ranks(first.meta["d_model"])
    sites, _, inputs = _sites(first)
    return _fit_bases(cfg, series, early, parts, sites + inputs, out)


def _fit_bases(
    cfg: StudyConfig,
    series: Any,
    early: list[int],
    parts: dict[int, Part],
    sites: list[Site],
    out: Path,
) -> dict[int, dict[Site, TangentBasis]]:
    """Rank → site → Q_T from the pooled early-window activations; saved as `BasisSet`s."""
    pooled = {s: Moments.merged([parts[t].acts[s] for t in early]) for s in sites}
    provenance = {
        "model": series.name,
        "early_steps": early,
        "weights_hashes": {str(t): parts[t].meta["weights_hash"] for t in early},
        "sites": [s.hook_name for s in sites],
        "seed": cfg.seed,
        "library": f"tangentlens {__version__}",
        "n_tokens": pooled[sites[0]].count,
    }
    halves = {s: _halves([parts[t].act_groups[s] for t in early]) for s in sites}
    bases = {}
    for k in cfg.ranks:
        info = {**provenance, "rank": k}
        bases[k] = {}
        for s in sites:
            split = split_half_overlap(*halves[s], k) if halves[s] else math.nan
            bases[k][s] = TangentBasis.fit(
                pooled[s], k, provenance={"site": s.hook_name, "split_half_overlap": split, **info}
            )
        BasisSet(bases[k], provenance=info).save(out / "bases" / f"rank{k}.safetensors")
    return bases


def _halves(groups_by_step: list[list[Moments]]) -> tuple[Moments, Moments] | None:
    """The early-window activations of the even and of the odd groups of sequences."""
    even = Moments.merged([g[i] for g in groups_by_step for i in range(0, len(g), 2)])
    odd = Moments.merged([g[i] for g in groups_by_step for i in range(1, len(g), 2)])
    return (even, odd) if min(even.count, odd.count) >= 2 else None


def _basis_rows(rows: _Rows, bases: dict[int, dict[Site, TangentBasis]]) -> None:
    """Basis diagnostics (probe ``basis``, no checkpoint): eigengap λ_k/λ_{k+1},
    split-half overlap and its chance level k/d; warns once when a basis is unstable."""
    unstable = []
    for k, by_site in bases.items():
        for site, basis in by_site.items():
            values = basis.diagnostics()
            split = values.get("split_half_overlap", math.nan)
            rows.add("basis", values, rank=k, site=site)
            if math.isfinite(split) and near_chance(split, basis.k, basis.d):
                unstable.append(f"{site.hook_name} (rank {k}: {split:.2f})")
    if unstable:
        warnings.warn(
            f"Q_T fitted on two halves of the probe sequences barely overlaps at {unstable} "
            "(chance is k/d): these bases are mostly sampling noise; use more sequences.",
            UnstableBasisWarning,
            stacklevel=3,
        )


def _free_rows(rows: _Rows, part: Part, site: Site) -> None:
    """The basis-free activation and gradient statistics at one residual site."""
    act, grad = part.acts[site], part.grads[site]
    free = {}
    if site in part.samples:
        # neighbours from other sequences only: within a sequence, attention over the
        # prefix makes consecutive positions near-duplicates (TwoNN would measure the
        # sequence, not the cloud); the plain estimate stays as twonn_dimension_within
        sample = part.samples[site]
        free["twonn_dimension"] = twonn_dimension(sample, groups=part.sample_sequence)
        free["twonn_dimension_within"] = twonn_dimension(sample)
    free |= {
        "effective_rank": effective_rank(act),
        "participation_ratio": participation_ratio(act),
        "isoscore": isoscore(act),
        "mean_sq_norm": act.trace_second_moment(),
        "n_tokens": act.count,
    }
    rows.add("activation", free, site=site)
    grad_free = {
        "grad_isoscore": isoscore(grad),
        "grad_effective_rank": effective_rank(grad),
        "n_tokens": grad.count,
    }
    rows.add("gradient", grad_free, site=site)


def _drift_row(rows: _Rows, act: Moments, basis: TangentBasis, k: int, site: Site) -> None:
    """``drift_overlap``: Q_T against this checkpoint's own top-k PCA subspace."""
    drift = TangentBasis.fit(act, basis.k)
    rows.add("basis", {"drift_overlap": subspace_overlap(basis, drift)}, rank=k, site=site)


def _probe_rows(
    rows: _Rows,
    cfg: StudyConfig,
    part: Part,
    k: int,
    bases: dict[Site, TangentBasis],
    shapes: dict[Site, Tensor],
    summary: WindowSummary,
    refits: dict[Site, list[TangentBasis] | None],
) -> None:
    """The part's probes computed against the rank-``k`` bases (`MomentProbe.compute`, as
    a probe session computes them), drift of each basis, and the window summaries' terms."""
    n_layers = part.meta["n_layers"]
    sites, writes, inputs = _sites(part)
    tests = rows.extend(part.gradient.compute(bases, references=shapes), rank=k)
    for site in sites:
        if site in tests and len(part.grad_groups[site]) >= 2:
            reference = reference_at(shapes[site], part.grads[site])
            groups = part.grad_groups[site]
            summary.activation_gradient(
                rows.window, k, groups, bases[site], tests[site], cfg.zeta, reference,
                refits[site],
            )  # fmt: skip
    measured = {s: bases[s] for s in sites}
    for write in writes:
        target = write_basis_site(write, bases, n_layers)
        if target is not None:
            measured[write] = bases[target]
    rows.extend(part.residual.compute(measured), rank=k)
    if part.weight is not None:
        matrices = rows.extend(part.weight.compute(bases), rank=k)
        for site in matrices:
            summary.weight_gradient(
                rows.window, k, part.wgrad_groups[site], bases[site],
                matrices[site]["energy_ratio"], part.act_groups.get(site),
                matrices[site].get("normalized_ratio"), refits[site],
            )  # fmt: skip
    for site in [*sites, *inputs]:
        if part.acts[site].count:
            _drift_row(rows, part.acts[site], bases[site], k, site)


def _embedding_rows(
    rows: _Rows,
    cfg: StudyConfig,
    embed: Tensor,
    prev: Tensor | None,
    counts: Any,
    bases: dict[int, Any] | None,
) -> None:
    """Frequency–distance statistics, and the split of the update since ``prev``."""
    site = Site(0, "embed")
    table = frequency_distance(embed, counts, n_permutations=cfg.n_permutations, seed=cfg.seed)
    values = dict(zip(table["statistic"], table["value"], strict=True))
    n_seen = int(values["n_seen"])
    cis = {
        stat: _fisher_ci(values[stat], n_seen, stat.startswith("spearman"))
        for stat in values
        if re.fullmatch(r"(pearson|spearman)_(mean_all|mean_seen|weighted|norm)", stat)
    }
    rows.add("embedding", values, site=site, cis=cis)
    if prev is None or bases is None:
        return
    for k, basis in bases.items():
        split = update_split(prev, embed, basis, counts)
        named = {
            f"update_{stat}" + ("" if bucket == "all" else f"_{bucket}"): value
            for bucket, stat, value in split.itertuples(index=False)
        }
        rows.add("embedding", named, rank=k, site=site)


def analyse(
    cfg: StudyConfig,
    series: Any,
    windows: dict[str, list[int]],
    parts: dict[int, Part],
    counts: Tensor,
    bases: dict[int, dict[Site, TangentBasis]],
    progress: bool,
) -> tuple[Any, dict[str, Any]]:
    """The results table from the parts and the bases `fit_bases` made of them
    (deterministic), and the manifest's facts."""
    start = time.perf_counter()
    steps = series.steps
    window = {s: "middle" for s in steps}
    for name in ("early", "late"):
        for i in windows[name]:
            window[steps[i]] = name
    hashes = {s: parts[s].meta["weights_hash"] for s in steps}
    first_with = {}
    for s in steps:
        first_with.setdefault(hashes[s], s)
    duplicates = {s: first_with[hashes[s]] for s in steps if first_with[hashes[s]] != s}
    first = parts[steps[0]]
    d = first.meta["d_model"]
    cfg.check_ranks(d)
    sites, writes, _ = _sites(first)
    shapes = {s: pooled_shape([parts[t].grads[s] for t in steps]) for s in sites}
    embed_site = Site(0, "resid_pre")
    embed_bases = {k: b[embed_site] for k, b in bases.items()} if embed_site in sites else None

    rows = _Rows()
    summary = WindowSummary()
    early = [steps[i] for i in windows["early"]]
    refits = {
        k: {s: refit_bases([parts[t].act_groups[s] for t in early], k) for s in by_site}
        for k, by_site in bases.items()
    }
    _basis_rows(rows.at(None, "early"), bases)
    counts_np = counts.numpy()
    prev: Tensor | None = None
    for step in tqdm(steps, desc="study: statistics", disable=not progress):
        part = parts[step]
        rows.at(step, window[step])
        losses = ("probe_loss", "train_loss", "eval_loss")
        rows.add("checkpoint", {k: part.meta[k] for k in losses if part.meta.get(k) is not None})
        if step in duplicates:
            rows.add("checkpoint", {"duplicate_of": duplicates[step]})
        for site in sites:
            _free_rows(rows, part, site)
        for k in cfg.ranks:
            _probe_rows(rows, cfg, part, k, bases[k], shapes, summary, refits[k])
        embed = part.embed.double()
        _embedding_rows(rows, cfg, embed, prev, counts_np, embed_bases)
        prev = embed

    for record in summary.values():  # study-level: no checkpoint, no site
        rows.rows.append({"probe": "window", **record})
    frame = rows.frame()
    notes = []
    if max(cfg.ranks) / d >= 0.05:  # where `energy_test` warns
        notes.append(
            f"k/d up to {max(cfg.ranks)}/{d}: normal controls are not exchangeable with Q_T, "
            "so p_value_normal and isotropy_p_value_normal are anti-conservative; p_value "
            "and isotropy_p_value (uniform controls) are exact (see tangentlens.core.significance)."
        )
    info = {
        "library": f"tangentlens {__version__}",
        "versions": _versions(),
        "series": series.name,
        "steps": steps,
        "windows": {name: [steps[i] for i in idx] for name, idx in windows.items()},
        "weights_hashes": {str(s): hashes[s] for s in steps},
        "duplicates": {str(s): t for s, t in duplicates.items()},
        "sites": [s.hook_name for s in sites],
        "write_sites": [s.hook_name for s in writes],
        "bases": [f"bases/rank{k}.safetensors" for k in cfg.ranks],
        "n_rows": len(frame),
        "notes": notes,
        "timings": {
            "checkpoint_s": {str(s): parts[s].meta["seconds"] for s in steps},
            "analysis_s": time.perf_counter() - start,
        },
    }
    return frame, info


def _versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "transformers", "transformer-lens", "nnsight"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out
