"""Verdicts across training seeds: the between-seed interval, verdicts that only suggest
with one seed, the window panel, Holm's correction, the random-backprop null of the weight
gradient, every embedding centre, and the JSON record."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from tangentlens import report
from tangentlens.core import results
from tangentlens.core.significance import matrix_tests
from tangentlens.core.stats import Moments
from tangentlens.core.subspace import TangentBasis, subspace_overlap
from tangentlens.report.panel import object_rows, window_mean, windows_by
from tangentlens.report.replication import holm, t_interval
from tangentlens.study.windows import WindowSummary, refit_bases

KEYS = ("checkpoint", "step", "window", "rank")
HOOK = "blocks.0.hook_resid_pre"


def _frame(rows: list[dict]) -> pd.DataFrame:
    return results.frame(pd.DataFrame(rows), KEYS)


def _window_row(stat: str, window: str, v: float, half: float = 0.1) -> dict:
    return {"probe": "window", "window": window, "rank": 4, "statistic": stat, "value": v,
            "ci_low": v - half, "ci_high": v + half}  # fmt: skip


def _seed_table(early: float, diff: float, *, half: float = 0.1) -> pd.DataFrame:
    """Window rows of both gradient objects (early, late, late − early)."""
    rows = []
    for stat in ("gradient_energy_ratio", "weight_gradient_normalized_ratio"):
        rows += [_window_row(stat, "early", early, half),
                 _window_row(stat, "late", early + diff, half),
                 _window_row(f"{stat}_late_minus_early", "late-early", diff, half)]  # fmt: skip
    return _frame(rows)


def test_between_seed_interval_is_the_t_interval_over_seeds() -> None:
    """Three seeds: mean ± t_{0.975,2}·sd/√3, by hand."""
    values = (3.0, 2.0, 4.5)
    tables = {s: _seed_table(v, -1.0) for s, v in enumerate(values)}
    found = report.paper_claims({"decoder": tables})
    early = next(c for c in found if c.name == "energy_early" and c.gradient_object == "gradient")
    mean = sum(values) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 2)
    half = 4.302652729911275 * sd / math.sqrt(3)  # t quantile 0.975, 2 degrees of freedom
    assert early.between is not None and early.estimate == early.between
    assert early.between.value == pytest.approx(mean)
    assert early.between.low == pytest.approx(mean - half)
    assert early.between.high == pytest.approx(mean + half)
    assert early.seeds == (0, 1, 2) and early.interval_covers == "training seeds"
    assert [e.estimate.value for e in early.per_seed] == list(values)  # each seed's own
    assert t_interval([1.0]) is None


def test_the_comparison_shows_the_difference_it_tests() -> None:
    """Decoder against encoder over seeds: the number shown is Welch's decoder − encoder
    (the tested one), each model's own mean beside it."""
    from scipy import stats

    dec, enc = (3.0, 2.5, 3.5), (1.2, 1.0, 1.5, 1.1)
    tables = {
        "decoder": {s: _seed_table(v, -1.0) for s, v in enumerate(dec)},
        "encoder": {s: _seed_table(v, -0.1) for s, v in enumerate(enc)},
    }
    pair = next(c for c in report.paper_claims(tables) if c.name == "encoders_weaker")
    welch = stats.ttest_ind(dec, enc, equal_var=False)
    low, high = welch.confidence_interval(0.95)
    assert pair.estimate == pair.between
    assert pair.estimate.value == pytest.approx(sum(dec) / 3 - sum(enc) / 4)
    assert (pair.estimate.low, pair.estimate.high) == pytest.approx((low, high))
    assert pair.p_value == pytest.approx(welch.pvalue)
    numbers = pair.numbers()
    assert list(numbers) == ["difference", "decoder", "encoder"]
    assert numbers["decoder"].value == pytest.approx(3.0)  # the decoder's own early ratio
    assert pair.measured.startswith(str(pair.between))


def test_one_seed_only_suggests() -> None:
    """A bare table is one seed: its intervals cover probe tokens, so nothing is stronger
    than "suggests"; the same numbers over three near-identical seeds decide."""
    one = report.paper_claims({"decoder": _seed_table(5.0, -1.0, half=0.01)})
    assert {c.verdict for c in one} == {"suggests agrees"}
    assert all(c.between is None and c.interval_covers == "probe tokens" for c in one)
    assert all(c.p_value is None and c.p_holm is None for c in one)
    three = {s: _seed_table(5.0 + 0.01 * s, -1.0 - 0.01 * s) for s in range(3)}
    assert {c.verdict for c in report.paper_claims({"decoder": three})} == {"agrees"}


def test_holm_adjusts_planted_p_values() -> None:
    assert holm([0.01, 0.04, 0.03, None]) == pytest.approx([0.03, 0.06, 0.06, None])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])


def test_holm_across_the_claims_of_one_call() -> None:
    """Each late − early interval excludes 0 (p ≈ 0.035), but four claims are tested and
    two are borderline: after Holm neither is decided."""
    diffs = (-1.0, -0.5, -0.75)
    early = (5.0, 5.1, 4.9)
    tables = {s: _seed_table(e, d) for s, (e, d) in enumerate(zip(early, diffs, strict=True))}
    found = report.paper_claims({"decoder": tables})
    late = [c for c in found if c.name == "energy_late"]
    assert len(late) == 2 and len(found) == 4
    for c in late:
        assert c.between.high < 0 and c.p_value == pytest.approx(0.0351, abs=1e-3)
        assert c.p_holm == pytest.approx(2 * c.p_value)  # the two largest of four p-values
        assert c.verdict == "inconclusive"
    assert all(c.verdict == "agrees" for c in found if c.name == "energy_early")


def test_pages_show_the_test_an_inconclusive_verdict_turns_on(tmp_path) -> None:
    """An interval that excludes the line with an inconclusive verdict: the overview page
    and the terminal summary show the p-value and its Holm adjustment beside it."""
    pairs = zip((5.0, 5.1, 4.9), (-1.0, -0.5, -0.75), strict=True)
    tables = {s: _seed_table(e, d) for s, (e, d) in enumerate(pairs)}
    found = report.paper_claims({"decoder": tables})
    late = next(c for c in found if c.name == "energy_late")
    assert late.verdict == "inconclusive" and late.between.high < 0
    shown = late.describe_test()
    assert f"{late.p_value:.3g}" in shown and f"{late.p_holm:.3g}" in shown
    page = report.write_overview({}, found, tmp_path / "overview.html").read_text()
    assert f"test: {shown}" in page
    text = report.format_summary([report.SummaryRow.of(c) for c in found])
    assert f"      test: {shown}" in text
    one = report.paper_claims({"decoder": tables[0]})
    assert all(c.describe_test() == "" for c in one)  # one seed: no test, the interval decides


def _per_checkpoint(values: dict[int, float], diff_window: float) -> pd.DataFrame:
    """Per-checkpoint gradient energy ratios at one site, and the study's window rows
    (study windows by step) saying late − early is ``diff_window``."""
    rows = [{"probe": "gradient", "hook": HOOK, "site": "resid_pre", "layer": 0, "rank": 4,
             "step": s, "checkpoint": f"step{s}", "statistic": "energy_ratio", "value": v}
            for s, v in values.items()]  # fmt: skip
    diff = "gradient_energy_ratio_late_minus_early"
    rows += [_window_row("gradient_energy_ratio", "early", 3.0),
             _window_row(diff, "late-early", diff_window)]  # fmt: skip
    return _frame(rows)


# steps bunched early: the first 30 % of the steps hold most checkpoints, the first 30 %
# of the checkpoints only the first three
STEPS = (0, 1, 2, 3, 4, 5, 100, 200, 300, 1000)
RATIOS = (3, 3, 3, 3, 3, 3, 5, 5, 5, 1)


def test_window_definitions_and_the_one_window_mean() -> None:
    steps = list(STEPS)
    assert windows_by("checkpoints", steps, 0.3) == {"early": [0, 1, 2], "late": [200, 300, 1000]}
    by_step = windows_by("steps", steps, 0.3)
    assert by_step == {"early": steps[:9], "late": [300, 1000]}
    losses = {0: 10.0, 1: 9.0, 2: 8.0, 3: 5.0, 4: 4.0, 5: 3.0, 100: 2.5, 200: 2.2, 300: 2.1,
              1000: 2.0}  # fmt: skip
    progress = windows_by("progress", steps, 0.3, losses)  # drop 8: 30 % at 7.6, 70 % at 4.4
    assert progress == {"early": [0, 1, 2], "late": [4, 5, 100, 200, 300, 1000]}
    assert windows_by("progress", steps, 0.3, {s: 1.0 for s in steps}) is None  # no drop
    rows = object_rows(_per_checkpoint(dict(zip(STEPS, RATIOS, strict=True)), -0.6), "gradient", 4)
    assert window_mean(rows, [0, 1, 2]) == 3.0
    assert window_mean(rows, [200, 300, 1000]) == pytest.approx(11 / 3)
    assert window_mean(rows, [7]) is None


def test_window_dependent_when_definitions_disagree() -> None:
    """By steps late − early is negative (the paper's direction), by checkpoint index it is
    positive: the verdict is window-dependent, with each definition's value shown."""
    values = dict(zip(STEPS, RATIOS, strict=True))
    one = report.paper_claims({"decoder": _per_checkpoint(values, -0.67)})
    late = next(c for c in one if c.name == "energy_late")
    panel = {p.definition: p for p in late.panel}
    assert set(panel) == {"steps", "checkpoints"}  # no probe_loss rows: no progress window
    assert panel["steps"].value == pytest.approx(3 - 33 / 9)
    assert panel["checkpoints"].value == pytest.approx(11 / 3 - 3)
    assert panel["steps"].verdict == "suggests agrees"
    assert panel["checkpoints"].verdict == "suggests disagrees"
    assert late.verdict == "window-dependent"
    assert "checkpoints 0.667" in late.describe_panel()
    seeds = {}
    for s in range(3):
        shifted = {step: v + 0.01 * s for step, v in values.items()}
        seeds[s] = _per_checkpoint(shifted, -0.67 - 0.01 * s)
    late = next(c for c in report.paper_claims({"decoder": seeds}) if c.name == "energy_late")
    assert late.verdict == "window-dependent" and late.between is not None
    assert {p.definition: p.verdict for p in late.panel}["checkpoints"] == "disagrees"
    assert report.Claim.from_dict(late.to_dict()) == late


def _null_seed(seed: int, n_checkpoints: int = 6, d: int = 16, k: int = 2) -> pd.DataFrame:
    """The random-backprop null at one input site: anisotropic activations X, output
    gradients Δ white noise independent of X, S_g = Σ G Gᵀ with G = XᵀΔ per group,
    Q_T the PCA of the activations; the study's window rows and per-checkpoint rows."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, -1.5, d, dtype=torch.float64)
    summary, rows = WindowSummary(), []
    basis = None
    for i in range(n_checkpoints):
        window = "early" if i < 2 else ("late" if i >= n_checkpoints - 2 else "middle")
        acts, mats = [], []
        for _ in range(4):  # groups of sequences
            s = torch.zeros(d, d, dtype=torch.float64)
            m = Moments()
            for _ in range(8):  # passes
                x = torch.randn(64, d, generator=gen, dtype=torch.float64) * scales
                delta = torch.randn(64, 8, generator=gen, dtype=torch.float64)
                g = x.T @ delta
                s += g @ g.T
                m.update(x)
            acts.append(m)
            mats.append(s)
        if basis is None:  # Q_T from the first (early) checkpoint's activations
            basis = TangentBasis.fit(Moments.merged(acts), k)
            refits = refit_bases([acts], k)  # and without each group, as a study fits it
        total = Moments.merged(acts)
        tests = matrix_tests(sum(mats), basis, n_controls=20, seed=0, activation_moments=total)
        summary.weight_gradient(window, k, mats, basis, tests["energy_ratio"], acts,
                                tests["normalized_ratio"], refits)  # fmt: skip
        for stat in ("energy_ratio", "normalized_ratio"):
            rows.append({"probe": "weight_gradient", "hook": "blocks.0.ln1.hook_out",
                         "site": "attn_in", "layer": 0, "rank": k, "step": 10 * i,
                         "checkpoint": f"step{10 * i}", "window": window, "statistic": stat,
                         "value": tests[stat]})  # fmt: skip
    rows += [{"probe": "window", **r} for r in summary.values()]
    return _frame(rows)


def test_random_backprop_null_never_agrees_for_weight_gradients() -> None:
    """Under white-noise output gradients the raw energy ratio is far above 1 (Q_T holds
    most of the activations' energy, so most of S's), the normalised ratio is 1 within its
    interval, and no weight-gradient claim agrees, even with one seed (the early ratio may
    sit a little above 1 by chance, "weak", never above τ)."""
    seeds = {s: _null_seed(s) for s in range(3)}
    window = results.select(seeds[0], probe="window")
    raw = window[window["statistic"] == "weight_gradient_energy_ratio"]
    normalized = window[window["statistic"] == "weight_gradient_normalized_ratio"]
    assert set(normalized["window"]) == {"early", "late"}
    assert (raw["value"] > 3).all()  # the raw ratio would call this concentrated
    assert (normalized["value"] - 1).abs().max() < 0.3
    assert ((normalized["ci_low"] < normalized["value"])
            & (normalized["value"] < normalized["ci_high"])).all()  # fmt: skip
    for tables in (seeds, seeds[0]):
        found = report.paper_claims({"decoder": tables, "encoder": tables})
        weight = [c for c in found if c.gradient_object == "weight_gradient"]
        assert weight and not any(c.verdict.endswith("agrees") and "dis" not in c.verdict
                                  for c in weight)  # fmt: skip
        early = next(c for c in weight if c.name == "energy_early")
        assert early.strength != "strong" and early.statistic.endswith("normalized_ratio")
        assert early.between is None or early.between.high < 2  # well below τ
        assert [p.definition for p in early.panel] == ["steps", "checkpoints"]


def _centres(weighted: float, others: dict[str, float], seed: int = 0) -> pd.DataFrame:
    rows = [_window_row("gradient_energy_ratio", "early", 5.0)]
    for centre, v in {"weighted": weighted, **others}.items():
        v += 0.01 * seed
        rows.append({"probe": "embedding", "site": "embed", "layer": 0, "step": 8,
                     "statistic": f"pearson_{centre}", "value": v, "ci_low": v - 0.05,
                     "ci_high": v + 0.05})  # fmt: skip
    return _frame(rows)


def test_frequency_claim_needs_every_centre() -> None:
    agree = _centres(-0.5, {"mean_all": -0.3, "mean_seen": -0.4, "norm": -0.2})
    mixed = _centres(-0.5, {"mean_all": 0.3, "mean_seen": -0.4, "norm": -0.2})
    weak = _centres(-0.5, {"mean_all": 0.01, "mean_seen": -0.4, "norm": -0.2})

    def frequency(table):
        return next(c for c in report.paper_claims({"decoder": table}) if c.name == "frequency")

    assert frequency(agree).verdict == "suggests agrees"
    claim = frequency(mixed)
    assert claim.verdict == "centre-dependent"
    assert "mean_all 0.3 [0.25, 0.35]" in claim.measured  # each centre's value shown
    assert frequency(weak).verdict == "inconclusive"
    seeds = {s: _centres(-0.5, {"mean_all": -0.3, "norm": -0.2}, s) for s in range(3)}
    claim = frequency(seeds)
    assert claim.verdict == "agrees" and claim.between is not None
    assert report.Claim.from_dict(claim.to_dict()) == claim


def test_strength_against_tau() -> None:
    def early(v: float, half: float, **kw) -> report.Claim:
        found = report.paper_claims({"decoder": _seed_table(v, -1.0, half=half)}, **kw)
        return next(c for c in found if c.name == "energy_early")

    assert early(3.0, 0.5).strength == "strong"
    assert early(1.8, 0.5).strength == "weak" and early(1.8, 0.5).verdict == "inconclusive"
    assert early(1.2, 0.5).strength == "none"
    assert early(1.8, 0.5, tau=1.2).verdict == "suggests agrees"
    with pytest.raises(ValueError, match="tau"):
        report.paper_claims({"decoder": _seed_table(3.0, -1.0)}, tau=1.0)


def test_pages_show_each_seed_and_the_panel(tmp_path) -> None:
    """The pooled verdict first, each seed's number and each window definition beside it."""
    values = dict(zip(STEPS, RATIOS, strict=True))
    seeds = {s: _per_checkpoint({k: v + 0.01 * s for k, v in values.items()}, -0.6 - 0.01 * s)
             for s in range(3)}  # fmt: skip
    found = report.paper_claims({"decoder": seeds})
    page = report.write_overview({}, found, tmp_path / "overview.html").read_text()
    assert "per seed: seed 0 " in page and "windows: steps " in page
    assert '<td class="window-dependent">' in page
    text = report.format_summary([report.SummaryRow.of(c) for c in found])
    assert "      per seed: seed 0" in text and "      windows: steps" in text


def test_results_doc_shows_each_claim_with_its_seeds_and_version(tmp_path) -> None:
    """docs/RESULTS.md's generator: every claim's verdict, its per-seed values and what its
    interval covers, dated and tied to the version; the committed page names the command
    that made it."""
    from tangentlens.report import results_doc
    from tangentlens.version import __version__

    tables = {s: _seed_table(v, -1.0) for s, v in enumerate((3.0, 2.0, 4.5))}
    claims = report.paper_claims({"decoder": tables})
    summary = {"claims": [c.to_dict() for c in claims], "models": ["decoder"], "seeds": [0, 1, 2]}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    page = results_doc.results_markdown(summary, made="2026-12-02", source="runs/demo")
    rows = [line for line in page.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == len(claims) + 1  # the header, then one row per claim
    for claim, row in zip(claims, rows[1:], strict=True):
        assert claim.verdict in row and claim.interval_covers in row
        assert "seed 0" in row or not claim.describe_seeds()
        assert claim.describe_test() in row and "Holm-adjusted" in row  # what decides it
    assert f"tangentlens {__version__}" in page and "2026-12-02" in page
    assert results_doc.main([str(tmp_path)]) == 0
    committed = Path(__file__).resolve().parents[1] / "docs" / "RESULTS.md"
    first = committed.read_text(encoding="utf-8").splitlines()[0]
    assert results_doc.COMMAND in first


def test_refit_bases_leave_each_group_out_of_the_early_pool() -> None:
    """Q_T without group g, by removal from the pool, spans what a fit on the other
    groups' merge spans (to rounding)."""
    gen = torch.Generator().manual_seed(3)
    scales = torch.logspace(0, -1, 12, dtype=torch.float64)
    early = [
        [Moments().update(torch.randn(40, 12, generator=gen, dtype=torch.float64) * scales)
         for _ in range(4)]
        for _ in range(2)
    ]  # fmt: skip
    refits = refit_bases(early, 3)
    assert refits is not None and len(refits) == 4
    for g, basis in enumerate(refits):
        rest = Moments.merged([m for groups in early for i, m in enumerate(groups) if i != g])
        assert subspace_overlap(basis, TangentBasis.fit(rest, 3)) == pytest.approx(1, abs=1e-9)
    early[0][2], early[1][2] = Moments(), Moments()
    assert refit_bases(early, 3) is None  # a group with no vectors: nothing to leave out


def test_window_intervals_carry_the_basis_noise_when_q_t_is_refitted() -> None:
    """Nearly isotropic activations make Q_T mostly sampling noise: leaving a group out
    of its fit too moves each leave-one-out value more than the gradients alone do, so
    the window interval is wider than with Q_T held fixed."""
    gen = torch.Generator().manual_seed(0)
    d, k = 16, 2
    scales = torch.linspace(1.0, 0.9, d, dtype=torch.float64)
    acts = [Moments().update(torch.randn(30, d, generator=gen, dtype=torch.float64) * scales)
            for _ in range(6)]  # fmt: skip
    grads = [Moments().update(torch.randn(30, d, generator=gen, dtype=torch.float64) * scales)
             for _ in range(6)]  # fmt: skip
    basis = TangentBasis.fit(Moments.merged(acts), k)
    refits = refit_bases([acts], k)
    tests = {"energy_ratio": 1.0}
    widths = []
    for loo in (None, refits):
        summary = WindowSummary()
        summary.activation_gradient("early", k, grads, basis, tests, 0.0, None, loo)
        (record,) = [r for r in summary.values() if r["statistic"] == "gradient_energy_ratio"]
        widths.append(record["ci_high"] - record["ci_low"])
    assert widths[1] > 1.5 * widths[0]
