"""Report: figures from long results tables, summary claims, the self-contained HTML,
and its rendering in headless Chromium."""

from __future__ import annotations

import html
import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure

from tangentlens import report
from tangentlens.core import results
from tangentlens.core.errors import CorruptFileError
from tangentlens.hooks.sites import Site
from tangentlens.report.claims import VERDICTS
from tangentlens.report.scope import describe_steps

STUDY_COLUMNS = list(results.COLUMNS)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def synthetic_results(
    n_layers: int = 3, n_heads: int = 4, steps: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 24)
) -> pd.DataFrame:
    """A study-shaped table (tangentlens.core.results) with planted trends: the energy ratio
    falls over training, removing Q_T beats a control, the weighted centre is negative."""
    rng = np.random.default_rng(0)
    n, k = len(steps), max(2, round(0.3 * len(steps)))
    rows: list[dict] = []
    for i, step in enumerate(steps):
        window = "early" if i < k else ("late" if i >= n - k else "middle")
        decay = 1.0 / (1 + i)

        def add(probe, site, layer, statistic, value, head=pd.NA, rank=4, step=step, w=window):
            hook = Site(layer, site).hook_name if isinstance(site, str) else None
            rows.append({"checkpoint": f"step{step}", "step": step, "window": w,
                         "rank": rank, "layer": layer, "head": head, "site": site, "hook": hook,
                         "probe": probe, "statistic": statistic, "value": value})  # fmt: skip

        for layer in range(n_layers):
            for probe, stat, v in [
                ("residual", "tangent_share", 0.3 + 0.05 * layer),
                ("residual", "chance_share", 0.125),
                ("gradient", "tangent_share", 0.2),
                ("gradient", "energy_ratio", 1 + 2 * decay + 0.1 * layer),
                ("gradient", "p_value", 0.001 + 0.2 * (1 - decay)),
                ("gradient", "delta_iso_tangent", 0.05 + 0.1 * decay),
                ("gradient", "delta_iso_normal", 0.01),
                ("gradient", "isotropy_p_value", 0.01),
            ]:
                v += 0.002 * rng.standard_normal()
                add(probe, "resid_pre", layer, stat, abs(v) if "p_value" in stat else v)
            add("activation", "resid_pre", layer, "twonn_dimension", 5 + i + layer, rank=pd.NA)
            add("activation", "resid_pre", layer, "effective_rank", 10 + 2 * i, rank=pd.NA)
            for head in range(n_heads):
                add("attention", "attn_in", layer, "score_share_TT", rng.uniform(0.1, 0.6), head)
        embed = {"mean_all": 0.3, "mean_seen": 0.2, "weighted": -0.3 - 0.02 * i, "norm": -0.2}
        embed |= {"weighted_null_mean": -0.2, "weighted_null_std": 0.03, "weighted_p_value": 0.01}
        for name, v in embed.items():
            for kind in ("pearson", "spearman"):
                add("embedding", "embed", 0, f"{kind}_{name}", v, rank=pd.NA)
        add("checkpoint", pd.NA, pd.NA, "probe_loss", 6 - 0.3 * i, rank=pd.NA)
    table = pd.DataFrame(rows).reindex(columns=STUDY_COLUMNS)
    # intervals where the probes give them: ±10 % (and a little) around the value
    ci = table["statistic"].isin(INTERVALS) | table["statistic"].str.startswith("pearson_")
    ci &= ~table["statistic"].str.contains("null|p_value")
    half = 0.1 * table["value"].abs() + 0.01
    table.loc[ci, "ci_low"] = table.loc[ci, "value"] - half[ci]
    table.loc[ci, "ci_high"] = table.loc[ci, "value"] + half[ci]
    return table.astype({"rank": "Int64", "layer": "Int64", "head": "Int64"})


INTERVALS = ("tangent_share", "share_ratio", "energy_ratio", "delta_iso_tangent")


def with_windows(table: pd.DataFrame) -> pd.DataFrame:
    """The study's window rows (`tangentlens.study.windows`) of a synthetic table: each
    window's mean over every site and checkpoint of the activation gradient, an interval
    around it, and late − early."""
    grad = table[(table["probe"] == "gradient")]
    ratio = grad[grad["statistic"] == "energy_ratio"]
    keys = ["step", "window", "site", "layer"]
    iso = grad[grad["statistic"] == "delta_iso_tangent"].merge(
        grad[grad["statistic"] == "delta_iso_normal"][[*keys, "value"]], on=keys
    )
    iso = iso.assign(value=iso["value_x"] - iso["value_y"])
    rows = []
    for name, rows_of in (("gradient_energy_ratio", ratio), ("gradient_delta_iso_excess", iso)):
        means = {w: float(rows_of.loc[rows_of["window"] == w, "value"].mean())
                 for w in ("early", "late")}  # fmt: skip
        for window, stat, v in [("early", name, means["early"]), ("late", name, means["late"]),
                                ("late-early", f"{name}_late_minus_early",
                                 means["late"] - means["early"])]:  # fmt: skip
            rows.append({"probe": "window", "window": window, "rank": 4, "statistic": stat,
                         "value": v, "ci_low": v - 0.05, "ci_high": v + 0.05})  # fmt: skip
    windows = pd.DataFrame(rows).reindex(columns=STUDY_COLUMNS)
    both = pd.concat([table, windows], ignore_index=True)
    return results.frame(both, ("checkpoint", "step", "window", "rank"))


def one_checkpoint(table: pd.DataFrame) -> pd.DataFrame:
    """A probe-shaped table: the last step, without the study's columns."""
    last = table[table["step"] == table["step"].max()]
    return last.drop(columns=["checkpoint", "step", "window", "rank", "ci_low", "ci_high"])


PLOTS = {
    "depth_profile": report.plot_depth_profile,
    "head_heatmap": report.plot_head_heatmap,
    "energy_over_training": report.plot_energy_over_training,
    "isotropy_removal": report.plot_isotropy_removal,
    "frequency_distance": report.plot_frequency_distance,
    "intrinsic_dimension": report.plot_intrinsic_dimension,
}


@pytest.mark.parametrize("name", list(PLOTS))
def test_each_plot_returns_a_labelled_figure(name: str) -> None:
    fig = PLOTS[name](synthetic_results())
    assert isinstance(fig, Figure)
    axes = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert all(ax.get_title() or fig._suptitle for ax in axes)
    assert all(ax.get_xlabel() for ax in axes)


@pytest.mark.parametrize("name", list(PLOTS))
def test_plots_without_their_data_are_skipped(name: str) -> None:
    unrelated = synthetic_results()
    unrelated = unrelated[unrelated["statistic"] == "probe_loss"]
    assert PLOTS[name](unrelated) is None


def test_one_checkpoint_has_no_training_curve() -> None:
    table = one_checkpoint(synthetic_results())
    assert report.plot_energy_over_training(table) is None
    made = [f.name for f in report.render_figures(table)]
    assert made == [n for n in PLOTS if n != "energy_over_training"]


def test_rank_sweep_plots_the_smallest_rank() -> None:
    table = synthetic_results()
    other = table[table["rank"] == 4].assign(rank=8, value=99.0)
    claims = report.summary(pd.concat([table, other]))
    assert claims == report.summary(table)


def _one_checkpoint_with(low: list[float], high: list[float]) -> pd.DataFrame:
    """A probe-shaped table whose gradient energy ratio at each layer has the interval
    [low[l], high[l]] (its value in the middle)."""
    table = one_checkpoint(synthetic_results())
    table["ci_low"], table["ci_high"] = np.nan, np.nan
    for layer, (lo, hi) in enumerate(zip(low, high, strict=True)):
        at = (table["statistic"] == "energy_ratio") & (table["layer"] == layer)
        table.loc[at, ["value", "ci_low", "ci_high"]] = [(lo + hi) / 2, lo, hi]
    return table


@pytest.mark.parametrize(
    ("low", "high", "verdict"),
    [
        ([2.5, 3.0, 2.2], [4.0, 5.0, 3.0], "suggests agrees"),  # every site above τ = 2
        ([0.5, 0.6, 0.4], [1.5, 1.9, 1.0], "suggests disagrees"),  # every site below τ
        ([2.5, 1.0, 2.2], [4.0, 5.0, 3.0], "inconclusive"),  # one crosses τ
    ],
)
def test_one_checkpoint_decides_from_each_sites_interval(
    low: list[float], high: list[float], verdict: str
) -> None:
    """A probe's page (one checkpoint, no window) reads each site's interval against the
    claim's line, in the study's vocabulary: one model's token intervals only suggest,
    and only where every site agrees; it never says "last checkpoint" for one model."""
    rows = report.summary(_one_checkpoint_with(low, high))
    energy = next(r for r in rows if r.paper.startswith(report.PAPER["energy_early"]))
    assert energy.agrees == verdict
    assert "this checkpoint" in energy.quantity and "τ = 2" in energy.quantity
    assert energy.scope == "each of 3 sites: resid_pre at layers 0–2; this checkpoint"
    assert f"[{low[1]:.3g}, {high[1]:.3g}]" in energy.measured
    assert {r.agrees for r in rows} <= {*VERDICTS, "—"}
    text = report.format_summary(rows)
    assert "[verdict: yes]" not in text and "[verdict: no]" not in text
    assert "last checkpoint" not in text


def test_without_intervals_nothing_is_decided() -> None:
    """A table whose rows carry no interval (too few groups of sequences) decides nothing."""
    table = one_checkpoint(synthetic_results())
    table["ci_low"], table["ci_high"] = np.nan, np.nan
    rows = [r for r in report.summary(table) if r.paper != "—"]
    assert rows and {r.agrees for r in rows} == {"inconclusive"}
    assert all("no interval" in r.measured for r in rows)


def _check_html(page: Path, n_figures: int) -> str:
    text = page.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    assert len(re.findall(r'<img src="data:image/png;base64,', text)) == n_figures
    assert not re.search(r'(src|href)="(https?:)?//', text)  # nothing from the network
    assert "<script" not in text and "<link" not in text
    order = [text.index(h) for h in ("Summary", "Figures", "Configuration", "Provenance")]
    assert order == sorted(order)
    return text


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One report from the synthetic study (rendering is the slow part; shared)."""
    manifest = {"tangentlens_version": "0.1.0", "weights": {"0": "ab12"}, "config": {"rank": 4},
                "timings": {"checkpoint_s": {"10": 0.5, "2": 0.25}}}  # fmt: skip
    return report.write_report(
        with_windows(synthetic_results()), tmp_path_factory.mktemp("report") / "report.html",
        manifest=manifest,
    )  # fmt: skip


def test_configuration_and_provenance_are_tables_shown_once(written: Path) -> None:
    """Settings as HTML tables (no JSON dump), the configuration once (not again inside the
    provenance) and step-numbered keys in number order."""
    text = written.read_text(encoding="utf-8")
    config, provenance = text.split("<h2>Configuration</h2>")[1].split("<h2>Provenance</h2>")
    assert config.count("<th>rank</th><td>4</td>") == 1 and "<th>rank</th>" not in provenance
    assert '<table class="kv">' in provenance and "<pre>" not in text
    assert provenance.index("<th>2</th>") < provenance.index("<th>10</th>")


def test_each_verdict_and_caption_names_what_it_averages(written: Path) -> None:
    """One number per name: each verdict says which sites and window it averages, the
    figures over training quote the very window means the verdicts read, over the same
    sites, and the page shows both."""
    table = with_windows(synthetic_results())
    claims = {c.name: c for c in report.paper_claims({"decoder": table})}
    readings = {f.name: f.reading for f in report.render_figures(table)}
    ratio = table[(table["probe"] == "gradient") & (table["statistic"] == "energy_ratio")]
    spans = {w: describe_steps(ratio.loc[ratio["window"] == w, "step"]) for w in ("early", "late")}
    sites = "3 sites: resid_pre at layers 0–2"
    early, late, iso = claims["energy_early"], claims["energy_late"], claims["isotropy"]
    assert early.scope == f"mean over {sites}; early window {spans['early']}"
    assert late.scope == f"{early.scope}; late window {spans['late']}"
    energy = readings["energy_over_training"]
    assert f"mean over {sites}" in energy
    assert f"early window {spans['early']} {early.estimate}" in energy
    assert f"late − early {late.estimate}" in energy
    assert f"early window {spans['early']} {iso.estimate}" in readings["isotropy_removal"]
    assert all(r.scope for r in report.summary(table))
    page = html.unescape(written.read_text(encoding="utf-8"))
    assert f"averages: {early.scope}" in page and str(early.estimate) in page


def test_figures_draw_their_intervals() -> None:
    """Bands and window boxes on the curves over training, bars on the depth profile's
    ratios, and hatching on heads indistinguishable from their random-frame null."""
    table = with_windows(synthetic_results())
    ax_r, ax_p = report.plot_energy_over_training(table).axes[:2]
    assert len(ax_r.collections) >= 3 + 2  # a band per site, a box per window
    assert "energy_ratio" in ax_r.get_title() and "p_value" in ax_p.get_title()
    depth = report.plot_depth_profile(one_checkpoint(table).assign(
        ci_low=table["ci_low"], ci_high=table["ci_high"]))  # fmt: skip
    assert any(isinstance(c, LineCollection) for c in depth.axes[1].collections)
    tt = table[table["statistic"] == "score_share_TT"]
    z = tt.assign(statistic="score_share_TT_z", value=np.where(tt["head"] == 0, 0.5, 5.0))
    heat = report.plot_head_heatmap(pd.concat([table, z], ignore_index=True))
    hatched = [p for ax in heat.axes for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 2 * 3  # head 0 of each layer, in both panels


def test_write_report_from_a_table(written: Path) -> None:
    tmp_path = written.parent
    text = _check_html(written, len(PLOTS))
    assert report.PAPER["isotropy"] in text and "ab12" in text
    assert "<th>rank</th><td>4</td>" in text and "<pre>" not in text
    assert sorted(p.stem for p in (tmp_path / "figures").glob("*.png")) == sorted(PLOTS)
    assert not list(tmp_path.glob(".*.tmp"))


def test_write_report_from_a_folder(tmp_path: Path) -> None:
    table = synthetic_results()
    table[table["probe"] == "residual"].to_csv(tmp_path / "results.csv", index=False)
    (tmp_path / "heads").mkdir()
    table[table["probe"] == "attention"].to_csv(tmp_path / "heads" / "results.csv", index=False)
    (tmp_path / "manifest.json").write_text('{"config": {"n_controls": 50}, "steps": [0]}')
    page = report.write_report(tmp_path, tmp_path)
    assert page == tmp_path / "report.html"
    text = _check_html(page, 2)  # depth profile and heads: the table has nothing else
    assert "n_controls" in text and 'id="head_heatmap"' in text
    assert (
        len(report.load_results(tmp_path)) == (table["probe"].isin(["residual", "attention"])).sum()
    )


def test_load_results_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tangentlens study"):
        report.load_results(tmp_path)
    (tmp_path / "results.csv").write_text("garbage\x00,\n1,2,3\n")
    with pytest.raises(ValueError, match="re-create it"):
        report.load_results(tmp_path)
    (tmp_path / "results.csv").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="re-create it"):
        report.load_results(tmp_path)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (setup.sh --dev)")
def test_report_renders_in_headless_chromium(written: Path, tmp_path: Path) -> None:
    from matplotlib.image import imread

    page = written
    shot = tmp_path / "shot.png"
    flags = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
    ]  # fmt: skip
    url = page.resolve().as_uri()
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert len(re.findall(r'<img src="data:image/png;base64,', dom.stdout)) == len(PLOTS)
    run = subprocess.run(
        [*flags, f"--screenshot={shot}", "--window-size=1200,3000", url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0 and shot.is_file(), run.stderr[-2000:]
    pixels = imread(shot)
    assert pixels.shape[:2] == (3000, 1200)
    rgb = pixels[..., :3].reshape(-1, 3)
    assert rgb.std() > 0.05  # not blank
    # figures bring colour: Okabe-Ito blue or the cividis heatmap, not only black text
    assert (np.abs(rgb[:, 0] - rgb[:, 2]) > 0.2).mean() > 0.01


def _windows(early: tuple[float, float, float], diff: tuple[float, float, float]) -> pd.DataFrame:
    """Window rows of a study (tangentlens.study.windows) for both gradient objects, with
    the frequency-weighted centre's correlation at two checkpoints."""
    rows = []
    # the weight gradient's claims read its ratio over the random-backprop null
    for obj, ratio in (("gradient", "energy_ratio"), ("weight_gradient", "normalized_ratio")):
        stat = f"{obj}_{ratio}"
        late = (early[0] + diff[0], early[1] + diff[0], early[2] + diff[0])
        for window, name, (v, lo, hi) in [
            ("early", stat, early),
            ("late", stat, late),
            ("late-early", f"{stat}_late_minus_early", diff),
        ]:
            rows.append({"probe": "window", "window": window, "rank": 4, "statistic": name,
                         "value": v, "ci_low": lo, "ci_high": hi})  # fmt: skip
    rows.append({"probe": "window", "window": "early", "rank": 4, "value": 0.1, "ci_low": 0.05,
                 "ci_high": 0.2, "statistic": "gradient_delta_iso_excess"})  # fmt: skip
    for step, v in ((0, -0.1), (8, -0.5)):
        rows.append({"probe": "embedding", "site": "embed", "layer": 0, "step": step,
                     "statistic": "pearson_weighted", "value": v, "ci_low": v - 0.1,
                     "ci_high": v + 0.1})  # fmt: skip
    return results.frame(pd.DataFrame(rows), ("checkpoint", "step", "window", "rank"))


def test_paper_claims_are_typed_and_round_trip_through_json() -> None:
    """One `Claim` per claim and gradient object; with one seed per model the token
    intervals can only suggest a verdict, and "concentrated early" is tested against τ;
    each claim's JSON record reads back to the same claim and keeps the record's keys."""
    decoder = _windows(early=(3.0, 2.0, 4.0), diff=(-1.0, -1.5, -0.5))
    encoder = _windows(early=(1.2, 0.9, 1.5), diff=(0.1, -0.4, 0.6))
    found = report.paper_claims({"decoder": decoder, "encoder": encoder})
    by = {(c.model, c.gradient_object, c.name): c for c in found}
    early = by["decoder", "gradient", "energy_early"]
    # [2, 4] is above 1 but not above τ = 2: weak, and no verdict
    assert early.verdict == "inconclusive" and early.interval == (2.0, 4.0)
    assert early.strength == "weak" and early.threshold == 2.0
    assert early.paper == report.PAPER["energy_early"]
    assert early.interval_covers == "probe tokens" and early.seeds == (0,)
    lower = report.paper_claims({"decoder": decoder}, tau=1.5)
    assert lower[0].verdict == "suggests agrees" and lower[0].strength == "strong"
    assert by["decoder", "gradient", "energy_late"].verdict == "suggests agrees"  # below 0
    assert by["encoder", "gradient", "energy_early"].verdict == "suggests disagrees"  # < τ
    frequency = by["decoder", "embedding", "frequency"]
    assert frequency.estimate.value == -0.5  # last checkpoint
    assert frequency.interval_covers == "embedding rows"  # Fisher's, over the vocabulary
    pair = by["decoder vs encoder", "weight_gradient", "encoders_weaker"]
    assert pair.verdict == "suggests agrees" and pair.statistic.endswith("normalized_ratio")
    # the tested number is the difference (one seed each: no interval), then each model's
    assert pair.measured == "1.8; decoder 3 [2, 4]; encoder 1.2 [0.9, 1.5]"
    assert pair.interval_covers == "probe tokens of each model"
    assert "nan" not in pair.describe_numbers()  # a number without interval shows alone
    late = by["decoder", "weight_gradient", "energy_late"]
    assert late.measured == "-1 [-1.5, -0.5]; late 2 [1, 3]"
    record = late.to_dict()
    assert set(record) == {"claim", "paper", "statistic", "model", "gradient_object", "rank",
                           "early", "late", "difference", "verdict", "interval_covers",
                           "seeds", "per_seed", "between", "panel", "threshold", "strength",
                           "p_value", "p_holm", "scope"}  # fmt: skip
    assert record["difference"] == {"value": -1.0, "ci": [-1.5, -0.5]}
    for claim in found:
        assert report.Claim.from_dict(claim.to_dict()) == claim
    # a one-seed comparison recorded without its difference reads back with it
    bare = report.Claim.from_dict({k: v for k, v in pair.to_dict().items() if k != "difference"})
    assert bare.estimate.value == pytest.approx(1.8) and math.isnan(bare.estimate.low)
    assert bare.context == pair.context
    with pytest.raises(CorruptFileError):
        report.Claim.from_dict({"claim": "energy_early", "model": "decoder"})
    rows = report.summary(decoder)  # a lone study: its claims as the summary's rows
    late_paper = report.PAPER["energy_late"]
    assert [r.agrees for r in rows if r.paper == late_paper] == ["suggests agrees"] * 2


def test_a_study_page_reads_its_claims_with_the_study_window_fraction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page's summary builds its window panel with the fraction in the study's config,
    as the study's summary and overview do; without one, `paper_claims`' default."""
    import importlib

    summary_module = importlib.import_module("tangentlens.report.summary")  # not the function
    seen: list[object] = []
    real = summary_module.paper_claims

    def spy(tables, **options):
        seen.append(options.get("window_fraction"))
        return real(tables, **options)

    monkeypatch.setattr(summary_module, "paper_claims", spy)
    page_module = importlib.import_module("tangentlens.report.page")
    monkeypatch.setattr(page_module, "_write_figures", lambda table, folder: [])
    table = _windows(early=(3.0, 2.0, 4.0), diff=(-1.0, -1.5, -0.5))
    report.write_report(table, tmp_path / "a.html", config={"window_fraction": 0.3})
    report.write_report(table, tmp_path / "b.html")
    assert seen == [0.3, None]


def test_overview_shows_each_claim(tmp_path: Path) -> None:
    decoder = _windows(early=(3.0, 2.0, 4.0), diff=(-1.0, -1.5, -0.5))
    found = report.paper_claims({"decoder": decoder})
    page = report.write_overview({}, found, tmp_path / "overview.html").read_text()
    for verdict in {c.verdict for c in found}:
        assert page.count(f'<td class="{verdict}">') == sum(c.verdict == verdict for c in found)
    assert "early 3 [2, 4]; late 2 [1, 3]; difference -1 [-1.5, -0.5]" in page


def test_degenerate_twonn_estimates_are_left_out() -> None:
    """A TwoNN estimate below 1 measures near-ties, not the cloud: the figure's means skip
    it and its caption says how many went."""
    table = synthetic_results()
    twonn = table.index[table["statistic"] == "twonn_dimension"]
    table.loc[twonn[:2], "value"] = 0.2
    _fig, reading = report.FIGURES["intrinsic_dimension"][1](table)
    assert "2 TwoNN estimates below 1 left out as degenerate" in reading
