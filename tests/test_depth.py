"""Depth profile: planted amplification on a subset of layers, the joint jackknife against
brute-force leave-one-batch-out runs, its coverage, and a clean plot."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from models import native_config, tokens

from tangentlens.analysis.depth import DepthProfile, plot_profiles
from tangentlens.core.uncertainty import jackknife_interval
from tangentlens.hooks import Site
from tangentlens.probes import fit_bases, run
from tangentlens.probes.residual import amplification_rows

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = [0, 2, 5, 9]  # a subset: "previous" is the previous layer present
SHARE = {0: 2.0, 2: 2.4, 5: 6.0, 9: 6.6}  # share_ratio; its interval ± 0.1 * value
ENERGY = {0: 1.0, 2: 1.1, 5: 1.1, 9: 2.2}  # energy_ratio; its interval ± 0.05
# joint rows as a probe writes them: layer -> (value, ci_low, ci_high)
JOINT = {2: (1.2, 0.9, 1.5), 5: (2.5, 2.1, 2.9), 9: (1.1, 1.02, 1.18)}
WRITES = {0: 3.0, 1: 4.0, 2: 5.0, 5: 7.0, 8: 8.0}  # block -> attn and mlp write share_ratio


def _row(probe: str, site: str, layer: int, stat: str, value: float, half: float = math.nan):
    return {
        "probe": probe,
        "site": site,
        "layer": layer,
        "head": pd.NA,
        "statistic": stat,
        "value": value,
        "ci_low": value - half,
        "ci_high": value + half,
    }


def _planted(joint: dict = JOINT) -> pd.DataFrame:
    rows = []
    for layer in LAYERS:
        s, e = SHARE[layer], ENERGY[layer]
        rows += [
            _row("residual", "resid_pre", layer, "tangent_share", s / 32, s / 320),
            _row("residual", "resid_pre", layer, "chance_share", 1 / 32),
            _row("residual", "resid_pre", layer, "share_ratio", s, s / 10),
            _row("gradient", "resid_pre", layer, "energy_ratio", e, 0.05),
            _row("gradient", "resid_pre", layer, "p_value", 0.01),
        ]
    for layer, (v, lo, hi) in joint.items():
        rows.append(
            {
                **_row("residual", "resid_pre", layer, "share_amplification", v),
                "ci_low": lo,
                "ci_high": hi,
            }
        )
    for block, w in WRITES.items():
        for site in ("attn_out", "mlp_out"):
            rows.append(_row("residual", site, block, "share_ratio", w, 0.5))
            rows.append(_row("residual", site, block, "tangent_share", w / 32, 0.01))
    return pd.DataFrame(rows)


def test_planted_amplification_on_a_subset_of_layers() -> None:
    profile = DepthProfile(_planted())
    table = profile.to_frame()
    assert profile.layers == LAYERS
    assert not table.drop(columns="biased").isna().all().any()  # no NaN column
    assert table["share_amplification"].tolist()[1:] == pytest.approx([1.2, 2.5, 1.1])
    assert table["energy_amplification"].tolist()[1:] == pytest.approx([1.1, 1.0, 2.0])
    assert table.loc[5, "attn_write_ratio"] == 7.0 and table.loc[9, "mlp_write_ratio"] != 8.0

    amp = profile.amplification()
    share = amp[amp.quantity == "share"].set_index("layer")
    assert share["from_layer"].tolist() == [0, 2, 5]
    assert share["interval"].tolist() == ["jackknife"] * 3  # the probes' joint rows
    assert share.loc[5, ["ci_low", "ci_high"]].tolist() == [2.1, 2.9]
    assert share["above_null"].tolist() == [False, True, True]
    # energy has no joint rows: the box of the two layers' own intervals
    energy = amp[amp.quantity == "energy"].set_index("layer")
    assert energy["interval"].tolist() == ["bounds"] * 3
    assert energy.loc[9, "ci_low"] == pytest.approx(2.15 / 1.15)
    assert energy.loc[9, "ci_high"] == pytest.approx(2.25 / 1.05)
    assert energy["above_null"].tolist() == [False, False, True]
    # writes go to the change they land in: blocks 0 and 1 between layers 0 and 2, ...
    writes = amp[amp.quantity == "attn_write"]
    assert writes.groupby("layer")["block"].apply(list).to_dict() == {2: [0, 1], 5: [2], 9: [5, 8]}
    assert (writes["value"] == writes["block"].map(WRITES)).all()
    assert ((amp.ci_low <= amp.value) & (amp.value <= amp.ci_high)).all()

    assert profile.amplification_onset("share") == 5  # 2.4 / 2.0 is within its interval
    assert profile.amplification_onset() == 9  # energy, the default where it has intervals
    assert profile.onset_layer == 9  # biased (energy ratio >= 1.5) only at the last layer
    with pytest.raises(ValueError, match="quantity must be one of"):
        profile.amplification_onset("attn_write")


def test_a_sliced_table_falls_back_to_bounds() -> None:
    # layer 5 dropped after the run: the joint row at 9 compares 9 with 5, not with 2
    sliced = _planted()[lambda t: t.layer != 5]
    amp = DepthProfile(sliced).amplification()
    at9 = amp[(amp.quantity == "share") & (amp.layer == 9)].iloc[0]
    assert at9["from_layer"] == 2 and at9["value"] == pytest.approx(6.6 / 2.4)
    assert at9["interval"] == "bounds"
    assert at9["ci_low"] == pytest.approx(6.6 * 0.9 / (2.4 * 1.1))


def test_plot_has_one_continuous_line_per_series_and_integer_ticks() -> None:
    profile = DepthProfile(_planted())
    fig = profile.plot()
    ax_s = fig.axes[0]
    assert [ax.get_yscale() for ax in fig.axes] == ["linear", "log", "log"]
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    assert lines["resid_pre"].get_xdata().tolist() == LAYERS
    assert lines["attn write share / chance"].get_xdata().tolist() == list(WRITES)
    assert lines["share amplification"].get_xdata().tolist() == LAYERS[1:]
    for line in lines.values():
        assert np.isfinite(np.asarray(line.get_ydata(), dtype=float)).all()
    assert [line.get_label() for line in ax_s.get_lines()].count("resid_pre") == 1
    fig.canvas.draw()
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert all(float(t).is_integer() for t in ticks) and len(ticks) <= 12
    with pytest.raises(ValueError, match="three Axes"):
        profile.plot(axes=[ax_s])


def test_joint_jackknife_covers_a_planted_ratio() -> None:
    """Coverage of ``amplification_rows``' interval for a known ratio of share ratios."""
    gen = np.random.default_rng(0)
    k, d, groups, truth = 4, 32, 10, (0.5 / 0.25)
    before, now = Site(0, "resid_pre"), Site(1, "resid_pre")
    covered = 0
    for _ in range(300):
        total = gen.gamma(20.0, 1.0, size=(2, groups))
        noise = gen.normal(0, 0.05, size=(2, groups))
        sums = {
            before: torch.tensor(np.stack([total[0] * (0.25 + noise[0]), total[0]], 1)),
            now: torch.tensor(np.stack([total[1] * (0.5 + noise[1] + noise[0]), total[1]], 1)),
        }
        (r,) = amplification_rows(
            "residual", "share_amplification", sums, lambda s, t, e: t / e * d / k
        )
        covered += r["ci_low"] <= truth <= r["ci_high"]
    assert 0.88 <= covered / 300 <= 0.99


@pytest.fixture(scope="module")
def four_layers():
    from transformer_lens.model_bridge import TransformerBridge

    model = TransformerBridge.boot_native(native_config(n_layers=4)).eval()
    batches = [tokens("native", 3, 12, seed=s) for s in range(4)]
    bases = fit_bases(model, batches[:2], rank=4, layers=[0, 2, 3], progress=False)
    return model, batches, bases


def test_joint_jackknife_matches_leave_one_batch_out_runs(four_layers) -> None:
    model, batches, bases = four_layers
    opts = {"n_controls": 20, "progress": False, "layers": [0, 2, 3]}
    table = run(model, batches, bases, ("residual", "gradient"), **opts).results()
    profile = DepthProfile(table)
    assert profile.layers == [0, 2, 3]
    assert not profile.to_frame().drop(columns="biased").isna().all().any()
    amp = profile.amplification()
    assert set(amp[amp.quantity.isin(["share", "energy"])]["interval"]) == {"jackknife"}
    assert ((amp.ci_low <= amp.value) & (amp.value <= amp.ci_high)).all()
    # writes measured at the probed blocks only: block 1's lies between 0 and 2, unmeasured
    writes = amp[amp.quantity == "mlp_write"].groupby("layer")["block"].apply(list)
    assert writes.to_dict() == {2: [0], 3: [2]}

    def ratios(frame: pd.DataFrame, stat: str, probe: str) -> dict[int, float]:
        rows = frame[
            (frame.site == "resid_mid") & (frame.statistic == stat) & (frame.probe == probe)
        ]
        return dict(zip(rows.layer, rows.value, strict=True))

    left_out = [
        run(
            model, batches[:g] + batches[g + 1 :], bases, ("residual", "gradient"), **opts
        ).results()
        for g in range(len(batches))
    ]
    for stat, probe, amp_stat in [
        ("share_ratio", "residual", "share_amplification"),
        ("energy_ratio", "gradient", "energy_amplification"),
    ]:
        full = ratios(table, stat, probe)
        joint = table[(table.site == "resid_mid") & (table.statistic == amp_stat)].set_index(
            "layer"
        )
        for p, layer in [(0, 2), (2, 3)]:
            loo = [ratios(t, stat, probe)[layer] / ratios(t, stat, probe)[p] for t in left_out]
            value = full[layer] / full[p]
            low, high = jackknife_interval(loo, value, log_scale=True)
            assert joint.loc[layer, "value"] == pytest.approx(value, rel=1e-7)
            assert joint.loc[layer, "ci_low"] == pytest.approx(low, rel=1e-6)
            assert joint.loc[layer, "ci_high"] == pytest.approx(high, rel=1e-6)
    fig = profile.plot()
    labels = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    series = [label for label in labels if not label.startswith("_")]  # not the 1 lines
    onset = profile.amplification_onset() is not None  # its red line
    assert len(series) == len(set(series)) == 10 + onset  # one line per series


def test_several_profiles_share_one_figure_one_colour_each() -> None:
    """The report's depth figure: a study's checkpoints as profiles on the same three
    panels, each profile's stream in its own colour, the writes left to a lone profile."""
    early, late = DepthProfile(_planted()), DepthProfile(_planted(joint={}))
    fig = plot_profiles([("early", early), ("late", late)], colours=["#0072B2", "#E69F00"])
    ax_s, ax_r, ax_a = fig.axes
    stream = ax_s.get_lines()[:2]
    assert [line.get_label() for line in stream] == ["early", "late"]
    assert [line.get_color() for line in stream] == ["#0072B2", "#E69F00"]
    markers = {line.get_marker() for line in ax_r.get_lines() if not len(line.get_xdata())}
    assert markers == {"o", "s"}  # one legend entry per marker, not per profile
    assert not any("write" in line.get_label() for ax in fig.axes for line in ax.get_lines())
    drawn = [line for line in ax_a.get_lines() if line.get_marker() in ("o", "s")]
    assert len(drawn) == 4  # share and energy amplification per profile
    assert ax_s.get_xlim() == ax_a.get_xlim()
    with pytest.raises(ValueError, match="at least one"):
        plot_profiles([])
