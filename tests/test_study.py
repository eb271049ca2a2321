"""The study end to end on a tiny trained series: table, files, resume after SIGKILL,
duplicates, configuration checks and bad input."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from tangentlens import models
from tangentlens.core import catalogue, results
from tangentlens.core.errors import CorruptFileError, UsageError
from tangentlens.core.files import (
    load_tensors,
    read_checked_json,
    save_tensors,
    write_checked_json,
    write_json,
)
from tangentlens.data import checkpoints
from tangentlens.data.train import TrainConfig, train
from tangentlens.hooks.sites import RESIDUAL_KINDS, Site
from tangentlens.probes import registry, run
from tangentlens.probes.base import Observation, Probe, Sum, row
from tangentlens.probes.bases import BasisSet
from tangentlens.study import Study, StudyConfig, collect, pipeline
from tangentlens.study.collect import PART_KEY, load_part
from tangentlens.study.config import open_series

D_MODEL, N_LAYERS = 32, 2  # TrainConfig.tiny()


@pytest.fixture(scope="module")
def series_dir(tmp_path_factory) -> Path:
    """The tiny run, plus step10: a copy of step8 (a duplicate checkpoint)."""
    run = train(TrainConfig.tiny(), tmp_path_factory.mktemp("tiny"), progress=False)
    shutil.copytree(run / "step8", run / "step10")
    return run


def _config(series_dir: Path, **overrides) -> StudyConfig:
    base = dict(
        checkpoints=str(series_dir),
        rank=(2, 4),
        n_controls=50,
        n_sequences=8,
        seq_len=32,
        batch_size=4,
        max_chars=40_000,
        reservoir=64,
        n_permutations=20,
        windows="index",  # the paper's rule: the assertions below count checkpoints
        progress=False,
    )
    base.update(overrides)
    return StudyConfig(**base)


@pytest.fixture(scope="module")
def study(series_dir, tmp_path_factory) -> tuple[StudyConfig, Path, pd.DataFrame]:
    cfg = _config(series_dir)
    out = tmp_path_factory.mktemp("study")
    return cfg, out, Study(cfg).run(out)


# ----------------------------------------------------------------------- config
def test_config_round_trip_and_normalisation(series_dir):
    cfg = _config(series_dir, rank=[4, 2, 4], sites=["resid_post", "resid_pre"], early=[0, 4])
    assert cfg.rank == (2, 4) and cfg.ranks == (2, 4) and cfg.early == (0, 4)
    assert cfg.sites == ("resid_pre", "resid_post")
    again = StudyConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert _config(series_dir, rank=16).ranks == (16,)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("backend", "jax", "backend"),
        ("sites", ("attn_out",), "sites"),
        ("rank", 0, "rank"),
        ("rank", [], "rank"),
        ("window_fraction", 0.6, "window_fraction"),
        ("early", (5, 1), "early"),
        ("zeta", 1.5, "zeta"),
        ("controls", "gaussian", "controls"),
        ("n_controls", 0, "n_controls"),
        ("reservoir", 2, "reservoir"),
        ("seq_len", 1, "seq_len"),
        ("head_null", 1, "head_null"),
    ],
)
def test_config_rejects_bad_values(series_dir, field, value, match):
    with pytest.raises(ValueError, match=match):
        _config(series_dir, **{field: value})


def test_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown StudyConfig keys"):
        StudyConfig.from_dict({"checkpoints": "x", "rnak": 4})


# ----------------------------------------------------------------------- table
STEPS = [0, 1, 2, 4, 8, 10, 16, 24]
RES_SITES = [(0, "resid_pre"), (1, "resid_pre"), (1, "resid_post")]
INPUT_HOOKS = ("ln1.hook_out", "ln2.hook_out")  # attn_in, mlp_in: the weight gradients
GRADIENT_TESTS = (
    "tangent_share",
    "chance_share",
    "energy_ratio",
    "p_value",
    "normalized_ratio",
    "delta_iso_tangent",
    "delta_iso_normal",
    "iso_statistic",
    "isotropy_p_value",
)
ACTIVATION = (
    "twonn_dimension",
    "effective_rank",
    "participation_ratio",
    "isoscore",
    "mean_sq_norm",
    "n_tokens",
)


def _stats(frame: pd.DataFrame, **where) -> set[str]:
    mask = np.ones(len(frame), dtype=bool)
    for col, value in where.items():
        mask &= (frame[col] == value).fillna(False).to_numpy(dtype=bool)
    return set(frame.loc[mask, "statistic"])


def test_table_columns_windows_and_statistics(study):
    _, _, table = study
    assert list(table.columns) == list(results.COLUMNS)
    study_level = table[table["step"].isna()]  # basis diagnostics, window summaries
    assert set(study_level["probe"]) == {"basis", "window"}
    window = study_level[study_level["probe"] == "window"]
    for stat in ("gradient_energy_ratio", "weight_gradient_energy_ratio",
                 "weight_gradient_normalized_ratio"):  # fmt: skip
        here = window[window["statistic"] == stat]
        assert set(here["window"]) == {"early", "late"}
        assert ((here["ci_low"] <= here["value"]) & (here["value"] <= here["ci_high"])).all()
        diff = window[window["statistic"] == f"{stat}_late_minus_early"]
        assert len(diff) == 2 and set(diff["window"]) == {"late-early"}  # ranks 2 and 4
    frame = table[table["step"].notna()]
    assert sorted(frame["step"].unique()) == STEPS
    assert (frame["checkpoint"] == "step" + frame["step"].astype(str)).all()
    windows = frame.groupby("step")["window"].first().to_dict()
    # 8 checkpoints, fraction 0.3: ceil(2.4) = 3 per window
    assert [windows[s] for s in STEPS] == ["early"] * 3 + ["middle"] * 2 + ["late"] * 3
    # per-head shares at every checkpoint (the null's sample size is a row of the layer)
    heads = frame[(frame["probe"] == "attention") & (frame["statistic"] != "head_null_sequences")]
    assert frame.loc[frame["probe"] != "attention", "head"].isna().all()
    assert set(heads["step"]) == set(STEPS) and heads["head"].notna().all()
    assert set(heads["rank"]) == {2}  # the smallest rank
    tt = heads[heads["statistic"] == "score_share_TT"]["value"]
    assert ((tt >= 0) & (tt <= 1)).all()
    for term in ("TT", "TN", "NT", "NN"):  # every share with its null, at every checkpoint
        for suffix in ("_null", "_null_std", "_p_value", "_z"):
            rows = heads[heads["statistic"] == f"score_share_{term}{suffix}"]
            assert set(rows["step"]) == set(STEPS) and rows["value"].notna().all()
    for step in STEPS:
        for layer, site in RES_SITES:
            here = dict(step=step, layer=layer, site=site)
            for k in (2, 4):
                assert set(GRADIENT_TESTS) <= _stats(frame, probe="gradient", rank=k, **here)
                assert {"tangent_share", "share_ratio"} <= _stats(
                    frame, probe="residual", rank=k, **here
                )
            assert set(ACTIVATION) <= _stats(frame, probe="activation", **here)
            assert {"grad_isoscore", "grad_effective_rank", "n_tokens"} <= _stats(
                frame, probe="gradient", **here
            )
        for layer in range(N_LAYERS):
            for write in ("attn_out", "mlp_out"):
                assert "share_ratio" in _stats(
                    frame, probe="residual", step=step, layer=layer, site=write, rank=4
                )
        embedding = _stats(frame, probe="embedding", step=step)
        assert {"pearson_weighted", "spearman_norm", "pearson_weighted_p_value"} <= embedding
        assert ("update_tangent_share_q1" in embedding) == (step != 0)
        assert "probe_loss" in _stats(frame, probe="checkpoint", step=step)
    # one rank column per basis-dependent number, NA for basis-free ones
    assert frame.loc[frame["statistic"] == "energy_ratio", "rank"].notna().all()
    assert frame.loc[frame["statistic"] == "twonn_dimension", "rank"].isna().all()


def test_every_statistic_is_catalogued(study):
    """Each name of the study's table has a catalogue entry that lists its probe."""
    from tangentlens.core.catalogue import STATISTICS

    _, out, table = study
    on_disk = results.read(out)
    assert set(on_disk["statistic"]) == set(table["statistic"])
    for (probe, name), _ in table.groupby(["probe", "statistic"]):
        assert name in STATISTICS, name
        assert probe in STATISTICS[name].probes, (name, probe)


def test_intervals_basis_diagnostics_and_grouped_twonn(study):
    """In the study: jackknife intervals contain their values, basis rows exist,
    TwoNN is measured across sequences with the within-sequence estimate beside it."""
    _, _, frame = study
    for stat in ("tangent_share", "energy_ratio", "normalized_ratio", "delta_iso_tangent"):
        rows = frame[(frame["probe"] == "gradient") & (frame["statistic"] == stat)]
        assert len(rows) and rows["ci_low"].notna().all(), stat
        assert (rows["ci_low"] <= rows["value"] + 1e-12).all(), stat
        assert (rows["value"] <= rows["ci_high"] + 1e-12).all(), stat
    basis = frame[frame["probe"] == "basis"]
    assert {"eigengap", "split_half_overlap", "chance_overlap", "drift_overlap"} <= set(
        basis["statistic"]
    )
    overlap = basis[basis["statistic"].isin(["split_half_overlap", "drift_overlap"])]["value"]
    assert ((overlap >= 0) & (overlap <= 1 + 1e-9)).all()
    drift = basis[basis["statistic"] == "drift_overlap"]
    assert drift["step"].notna().all() and len(drift["step"].unique()) == len(STEPS)
    twonn = set(frame[frame["probe"] == "activation"]["statistic"])
    assert {"twonn_dimension", "twonn_dimension_within"} <= twonn


def test_values_are_finite_and_in_range(study):
    _, _, frame = study
    value = frame["value"]
    nan_ok = frame["statistic"].str.startswith("update_tangent_share")  # a zero update
    assert np.isfinite(value[~nan_ok]).all()

    def vals(stat: str) -> pd.Series:
        return value[frame["statistic"] == stat]

    for stat in ("p_value", "isotropy_p_value", "pearson_weighted_p_value"):
        assert ((vals(stat) > 0) & (vals(stat) <= 1)).all()
    for stat in ("tangent_share", "isoscore", "grad_isoscore", "chance_share"):
        assert ((vals(stat) >= 0) & (vals(stat) <= 1 + 1e-12)).all()
    assert ((vals("effective_rank") >= 1) & (vals("effective_rank") <= D_MODEL)).all()
    assert (vals("twonn_dimension") > 0).all()
    assert (vals("energy_ratio") > 0).all()
    corr = frame["statistic"].str.match(r"^(pearson|spearman)_(mean_all|mean_seen|weighted|norm)$")
    assert (value[corr].abs() <= 1).all()
    jackknifed = frame["statistic"].isin(
        [
            "tangent_share",
            "energy_ratio",
            "normalized_ratio",
            "delta_iso_tangent",
            "share_ratio",
            "share_amplification",
            "energy_amplification",
        ]
    ) & frame["probe"].isin(["gradient", "residual", "weight_gradient"]) | frame["probe"].eq(
        "window"
    )
    ci = frame[corr | (jackknifed & frame["ci_low"].notna())]
    tol = 1e-12
    assert ((ci["ci_low"] <= ci["value"] + tol) & (ci["value"] <= ci["ci_high"] + tol)).all()
    assert frame.loc[~(corr | jackknifed), ["ci_low", "ci_high"]].isna().all().all()
    activation_gradient = frame["probe"].isin(["gradient", "residual"])  # writes included
    assert frame.loc[jackknifed & activation_gradient, "ci_low"].notna().all()
    chance = frame[(frame["statistic"] == "chance_share") & (frame["probe"] == "gradient")]
    assert np.allclose(chance["value"], chance["rank"].astype(float) / D_MODEL)


def test_files_bases_and_manifest(study, series_dir):
    cfg, out, frame = study
    pd.testing.assert_frame_equal(results.read(out / "results.csv"), frame, check_dtype=False)
    records = json.loads((out / "results.json").read_text())
    assert len(records) == len(frame) and set(records[0]) == set(results.COLUMNS)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"] == cfg.to_dict()
    assert manifest["steps"] == STEPS
    assert manifest["windows"] == {"early": [0, 1, 2], "late": [10, 16, 24]}
    assert set(manifest["weights_hashes"]) == {str(s) for s in STEPS}
    assert manifest["library"].startswith("tangentlens ")
    assert manifest["timings"]["total_s"] > 0
    used = manifest["probe_set"]  # the heads read the first sequences, at most the set
    assert used["head_sequences"] == min(cfg.head_sequences, used["n_sequences"])
    for k in (2, 4):
        bases = BasisSet.load(out / "bases" / f"rank{k}.safetensors")
        inputs = {f"blocks.{layer}.{n}" for layer in range(2) for n in INPUT_HOOKS}
        assert set(bases) == {Site(layer, kind).hook_name for layer, kind in RES_SITES} | inputs
        prov = bases.provenance
        assert prov["rank"] == k and prov["early_steps"] == [0, 1, 2] and prov["seed"] == 0
        assert set(prov["weights_hashes"]) == {"0", "1", "2"}
        assert prov["model"] == str(series_dir)
        assert bases["blocks.0.hook_resid_pre"].basis_.shape == (D_MODEL, k)
    assert sorted(p.name for p in (out / "parts").iterdir()) == sorted(
        f"step{s}.safetensors" for s in STEPS
    )


def test_depth_profile_reads_a_checkpoint_slice(study):
    from tangentlens.analysis.depth import DepthProfile

    _, _, frame = study
    one = frame[(frame["step"] == 24) & ((frame["rank"] == 4) | frame["rank"].isna())]
    profile = DepthProfile(one).to_frame()
    assert profile.index.tolist() == list(range(N_LAYERS))
    assert profile[["share_ratio", "energy_ratio", "attn_write_ratio"]].notna().all().all()


def test_duplicate_checkpoint_is_flagged(study):
    _, out, frame = study
    dup = frame[frame["statistic"] == "duplicate_of"]
    assert dup[["step", "value"]].values.tolist() == [[10, 8.0]]
    assert json.loads((out / "manifest.json").read_text())["duplicates"] == {"10": 8}
    # identical weights give identical statistics, and a zero embedding update
    update = frame[(frame["statistic"] == "update_total") & (frame["step"] == 10)]
    assert (update["value"] == 0).all()


def test_probe_loss_matches_the_trainers_eval_loss(study):
    """The default probe set is the trainer's held-out split (same seed and seq_len);
    tiny eval_blocks=4 of the 8 probe sequences: the losses differ but are close."""
    _, _, frame = study
    losses = frame[frame["probe"] == "checkpoint"].pivot_table(
        index="step", columns="statistic", values="value"
    )
    assert (losses["probe_loss"].diff().dropna().iloc[:4] < 0).all()
    assert np.allclose(losses["probe_loss"], losses["eval_loss"], rtol=0.1)


def test_the_written_table_is_the_returned_table(study):
    _, out, frame = study
    pd.testing.assert_frame_equal(results.read(out), frame, check_exact=True)


# ----------------------------------------------------------------------- loads
def _count_loads(monkeypatch) -> dict[str, list[int]]:
    """Steps loaded by the series, steps whose weights the loader read, hashes taken."""
    seen: dict[str, list[int]] = {"load": [], "weights": [], "hash": []}
    load, loader, digest = (
        checkpoints.CheckpointSeries.load,
        checkpoints._hf_loader,
        checkpoints.tensor_hash,
    )

    def counted_load(self, i, **kwargs):
        seen["load"].append(self[i].step)
        return load(self, i, **kwargs)

    def counted_loader(ckpt):
        seen["weights"].append(ckpt.step)
        return loader(ckpt)

    def counted_hash(state):
        seen["hash"].append(1)
        return digest(state)

    monkeypatch.setattr(checkpoints.CheckpointSeries, "load", counted_load)
    monkeypatch.setattr(checkpoints, "_hf_loader", counted_loader)
    monkeypatch.setattr(checkpoints, "tensor_hash", counted_hash)
    return seen


def test_each_checkpoint_is_loaded_once(series_dir, tmp_path, monkeypatch):
    """One load (and one hash) of a checkpoint serves its collection and its probe pass:
    the early window's models wait for Q_T (fitted from every early part) instead of
    being loaded again. The probe set takes the tokenizer alone. A resumed run loads each
    checkpoint once, for its probe pass."""
    cfg = _config(series_dir)
    series = open_series(cfg.checkpoints)
    seen = _count_loads(monkeypatch)
    out = tmp_path / "out"
    frame = Study(cfg).run(out)
    once = Counter(series.steps)
    assert Counter(seen["load"]) == once
    assert Counter(seen["weights"]) == Counter(seen["load"])  # no load for the tokenizer
    assert len(seen["hash"]) == len(seen["load"])
    assert set(frame.loc[frame["probe"] == "attention", "step"]) == set(series.steps)
    for found in seen.values():
        found.clear()
    assert Study(cfg).run(out).equals(frame)
    assert Counter(seen["load"]) == once and len(seen["hash"]) == len(series)


def test_without_heads_each_checkpoint_is_loaded_once(series_dir, tmp_path, monkeypatch):
    cfg = _config(series_dir, head_sequences=0)
    seen = _count_loads(monkeypatch)
    out = tmp_path / "out"
    Study(cfg).run(out)
    assert Counter(seen["load"]) == Counter(open_series(cfg.checkpoints).steps)
    seen["load"].clear()
    Study(cfg).run(out)
    assert seen["load"] == []


def test_without_attn_in_bases_the_pass_loads_nothing_more(series_dir, tmp_path, monkeypatch):
    """Without weight gradients there is no attn_in basis, so the attention probe reads no
    site: the first checkpoint the pass sees turns it off, and no checkpoint is loaded
    for it after that."""
    cfg = _config(series_dir, weight_gradient=False)
    series = open_series(cfg.checkpoints)
    early = [series.steps[i] for i in series.windows(cfg.window_fraction, by=cfg.windows)["early"]]
    seen = _count_loads(monkeypatch)
    out = tmp_path / "out"
    frame = Study(cfg).run(out)
    assert "attention" not in set(frame["probe"])
    assert Counter(seen["load"]) == Counter(series.steps)
    seen["load"].clear()
    Study(cfg).run(out)
    assert seen["load"] == [early[0]]  # the first one the pass sees turns it off


def test_a_part_of_another_source_is_recomputed(study, tmp_path, monkeypatch):
    """The source that collected a part is in its digest: one written by another
    tangentlens (here under another naming scheme) is made again, never misread (and read
    directly, it is refused)."""
    cfg, out, frame = study
    copied = tmp_path / "out"
    shutil.copytree(out, copied)
    path = copied / "parts" / "step8.safetensors"
    tensors, header = load_tensors(path)
    tokens = load_tensors(copied / "probe_set.safetensors")[0]["tokens"]
    meta = json.loads(header[PART_KEY])
    with monkeypatch.context() as m:
        m.setattr(collect, "source_digest", lambda: "another tangentlens")
        meta["collect"] = collect._part_digest(cfg, tokens)
    renamed = {
        (f"wg/{k}" if k.startswith("weight_gradient/") else k): t for k, t in tensors.items()
    }
    save_tensors(path, renamed, {PART_KEY: json.dumps(meta)})
    with pytest.raises(CorruptFileError, match="unknown tensor"):
        load_part(path)
    again = Study(cfg).run(copied)
    pd.testing.assert_frame_equal(again, frame, check_exact=True)
    assert json.loads((copied / "manifest.json").read_text())["timings"]["resumed_checkpoints"] == 7


# ----------------------------------------------------------------------- resume
def test_rerun_reuses_parts_and_is_identical(study):
    cfg, out, frame = study
    before = {p.name: p.stat().st_mtime_ns for p in (out / "parts").iterdir()}
    csv = (out / "results.csv").read_bytes()
    again = Study(cfg).run(out)
    pd.testing.assert_frame_equal(again, frame)
    assert (out / "results.csv").read_bytes() == csv
    assert {p.name: p.stat().st_mtime_ns for p in (out / "parts").iterdir()} == before
    assert json.loads((out / "manifest.json").read_text())["timings"]["resumed_checkpoints"] == 8


def test_a_rerun_stopped_after_its_table_leaves_nothing_of_the_old_one(study, tmp_path):
    """A rerun that replaces the table and stops before its manifest and page leaves the
    new table alone: the old page and manifest, and the files named in ``also_retire``
    (figures, claims elsewhere), went first (never beside a table they do not describe);
    nothing else did. A refused rerun retires nothing; the next rerun writes the manifest
    again."""
    cfg, out, frame = study
    copied = tmp_path / "out"
    shutil.copytree(out, copied)
    (copied / "report.html").write_text("the page of the replaced table")
    (copied / "figures").mkdir()
    for name in ("depth_profile.png", "my_notes.png"):
        (copied / "figures" / name).write_bytes(b"old")
    claims = tmp_path / "summary.json"
    claims.write_text("the claims of the replaced table")
    also = [copied / "figures" / "depth_profile.png", claims]
    with pytest.raises(UsageError, match="another configuration"):
        Study(replace(cfg, zeta=0.2)).run(copied, also_retire=also)
    assert all(p.exists() for p in also) and (copied / "report.html").exists()

    class Stopped(Exception):
        pass

    def stop(path, obj):
        if Path(path).name == "manifest.json":
            raise Stopped(path)
        return write_json(path, obj)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "write_json", stop)
        with pytest.raises(Stopped, match=r"manifest\.json"):
            Study(cfg).run(copied, also_retire=also)
    pd.testing.assert_frame_equal(results.read(copied), frame)
    assert not any(p.exists() for p in also)
    assert not (copied / "report.html").exists() and not (copied / "manifest.json").exists()
    assert (copied / "figures" / "my_notes.png").exists()  # not named: not the run's
    Study(cfg).run(copied)
    assert json.loads((copied / "manifest.json").read_text())["command"] == "study"


def test_other_configuration_is_refused(study):
    cfg, out, _ = study
    with pytest.raises(ValueError, match=r"another configuration \(differs in \['zeta'\]\)"):
        Study(replace(cfg, zeta=0.2)).run(out)
    Study(replace(cfg, progress=True)).run(out, progress=False)  # progress is not a result


def test_windows_by_step_reuse_the_parts(study, tmp_path):
    """Parts do not depend on the windows: a study with step windows over copied parts
    only reruns the analysis."""
    cfg, out, _ = study
    new = tmp_path / "by_step"
    shutil.copytree(out / "parts", new / "parts")
    shutil.copy(out / "probe_set.safetensors", new)
    frame = Study(replace(cfg, early=(0, 8), late=(16, 24))).run(new)
    windows = frame.groupby("step")["window"].first().to_dict()
    assert [windows[s] for s in STEPS] == ["early"] * 5 + ["middle"] + ["late"] * 2
    manifest = json.loads((new / "manifest.json").read_text())
    assert manifest["timings"]["resumed_checkpoints"] == len(STEPS)
    assert BasisSet.load(new / "bases" / "rank4.safetensors").provenance["early_steps"] == [
        0,
        1,
        2,
        4,
        8,
    ]


_RUN = (
    "import json, sys\n"
    "from tangentlens.study import Study, StudyConfig\n"
    "Study(StudyConfig.from_dict(json.loads(sys.argv[1]))).run(sys.argv[2])\n"
)


def _final_files_are_whole(out: Path) -> None:
    """Every file under a final (non-temporary) name is complete and readable."""
    for path in out.rglob("*"):
        if path.is_dir() or path.name.startswith("."):
            continue
        if path.parent.name == "parts":
            load_part(path)
        elif path.parent.name == "bases":
            BasisSet.load(path)
        elif path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".csv":
            results.read(path)


def test_sigkill_at_random_moments_then_resume_is_identical(study, tmp_path):
    cfg, reference, _ = study
    out = tmp_path / "killed"
    rng = np.random.default_rng(7)
    n_parts = len(STEPS)

    def parts_done() -> int:
        return len(list((out / "parts").glob("step*.safetensors"))) if out.exists() else 0

    # kill once the probe set exists, once mid-way through the checkpoints, once in the analysis
    conditions = [
        lambda: (out / "probe_set.safetensors").exists(),
        lambda: parts_done() >= n_parts // 2,
        lambda: parts_done() == n_parts,
    ]
    killed_at = []
    for condition in conditions:
        proc = subprocess.Popen(
            [sys.executable, "-c", _RUN, json.dumps(cfg.to_dict()), str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while not condition() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(float(rng.uniform(0.0, 0.2)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at.append(parts_done())
        _final_files_are_whole(out)
    assert killed_at[0] < n_parts  # the first kill lands before the checkpoints are done
    done = {p.name: p.stat().st_mtime_ns for p in (out / "parts").iterdir()}
    Study(cfg).run(out)
    kept = {p.name: p.stat().st_mtime_ns for p in (out / "parts").iterdir() if p.name in done}
    assert kept == done  # finished checkpoints are not redone
    for name in ("results.csv", "results.json"):
        assert (out / name).read_bytes() == (reference / name).read_bytes()
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


# ----------------------------------------------------------------------- bad input
def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        Study(StudyConfig(checkpoints=str(tmp_path / "nope"))).run(tmp_path / "out")
    _one_line(err)
    assert not (tmp_path / "out").exists()


def test_folder_without_checkpoints(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no checkpoints") as err:
        Study(StudyConfig(checkpoints=str(tmp_path / "empty"))).run(tmp_path / "out")
    _one_line(err)


def _linked_series(tmp_path: Path, source: Path, steps: list[int]) -> Path:
    folder = tmp_path / "series"
    folder.mkdir()
    for step in steps:
        (folder / f"step{step}").symlink_to(source / f"step{step}")
    (folder / "tokenizer").symlink_to(source / "tokenizer")
    return folder


def test_checkpoint_with_other_shapes(series_dir, tmp_path):
    odd = train(
        TrainConfig.tiny(d_model=16, d_mlp=32, max_steps=1, warmup_steps=1),
        tmp_path / "odd",
        progress=False,
    )
    folder = _linked_series(tmp_path, series_dir, [0, 1, 2, 4])
    (folder / "step100").symlink_to(odd / "step1")
    with pytest.raises(ValueError, match="does not match step 0") as err:
        Study(_config(folder)).run(tmp_path / "out")
    _one_line(err)


def test_window_with_fewer_than_two_checkpoints(series_dir, tmp_path):
    folder = _linked_series(tmp_path, series_dir, [0, 8, 24])
    with pytest.raises(ValueError, match="early window holds 1") as err:
        Study(_config(folder)).run(tmp_path / "out")
    _one_line(err)


@pytest.mark.parametrize("rank", [16, 20])
def test_rank_too_large_for_the_model(series_dir, tmp_path, rank):
    """Normal controls must vary in the complement: 2k < d, so d = 32 takes rank 15."""
    with pytest.raises(ValueError, match=f"rank {rank} is too large for d_model=32") as err:
        Study(_config(series_dir, rank=rank)).run(tmp_path / "out")
    _one_line(err)


def test_world_size_must_be_positive(series_dir, tmp_path):
    with pytest.raises(ValueError, match="world_size"):
        Study(_config(series_dir)).run(tmp_path / "out", world_size=0)


def test_a_failed_first_run_does_not_lock_the_folder(series_dir, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="too large"):
        Study(_config(series_dir, rank=20)).run(out)
    frame = Study(_config(series_dir, rank=4, n_controls=20)).run(out)  # nothing was computed
    assert (frame["rank"] == 4).any()


def test_a_part_of_retrained_weights_is_recomputed_and_lying_metadata_refused(
    series_dir, study, tmp_path
):
    """A checkpoint retrained in place (new weights, new weights_hash) gets its part
    recomputed on resume; a checkpoint whose metadata names a hash its weights do not
    have is refused, naming that checkpoint."""
    cfg, out, _ = study
    series = tmp_path / "series"
    shutil.copytree(series_dir, series)
    copied = tmp_path / "out"
    shutil.copytree(out, copied)
    (copied / ".tangentlens-folder.json").unlink()  # a folder from before records
    (copied / "study_config.json").write_text(
        json.dumps(
            {**json.loads((copied / "study_config.json").read_text()), "checkpoints": str(series)}
        )
    )
    meta = series / "step8" / "tangentlens.json"
    old = read_checked_json(meta)  # lying, as a consistent writer would record it
    write_checked_json(meta, {**old, "weights_hash": "0" * 64})
    with pytest.raises(CorruptFileError, match="step8 holds other weights"):
        Study(replace(cfg, checkpoints=str(series))).run(copied)
    # retrained in place: step8 now holds step4's weights, and its metadata says so
    shutil.copy(series / "step4" / "model.safetensors", series / "step8" / "model.safetensors")
    step4 = json.loads((series / "step4" / "tangentlens.json").read_text())["weights_hash"]
    write_checked_json(meta, {**old, "weights_hash": step4})
    Study(replace(cfg, checkpoints=str(series))).run(copied)
    assert load_part(copied / "parts" / "step8.safetensors").meta["weights_hash"] == step4


# ----------------------------------------------------------------------- one pipeline
def test_a_probe_session_and_a_study_give_one_table_on_one_checkpoint(series_dir, tmp_path):
    """Every row the study and `probes.run` share is the same number, intervals included
    where both give one: on one checkpoint (copied, so the study has its windows) the
    study's pooled ΔIsoScore* reference is that checkpoint's own, as the probe's is."""
    single = tmp_path / "single"
    for step in (8, 9, 10, 11):
        shutil.copytree(series_dir / "step8", single / f"step{step}")
    cfg = _config(single, rank=4)
    study = Study(cfg).run(tmp_path / "study")
    tokens = load_tensors(tmp_path / "study" / "probe_set.safetensors")[0]["tokens"]
    bases = BasisSet.load(tmp_path / "study" / "bases" / "rank4.safetensors")
    model = models.load(str(single / "step8"), backend=cfg.backend).model
    session = run(
        model,
        list(tokens.split(cfg.batch_size)),
        bases,
        ("residual", "gradient"),
        progress=False,
        n_controls=cfg.n_controls,
        zeta=cfg.zeta,
        seed=cfg.seed,
        n_groups=cfg.n_groups,
    )
    probed = session.results(progress=False)
    at = study[(study["step"] == 8) & study["probe"].isin(["residual", "gradient"])]
    key = ["probe", "hook", "statistic"]
    both = probed.merge(at, on=key, suffixes=("_probe", "_study"))
    assert set(both["probe"]) == {"residual", "gradient"}
    assert {"delta_iso_tangent", "isotropy_p_value", "energy_ratio"} <= set(both["statistic"])
    np.testing.assert_allclose(both["value_probe"], both["value_study"], rtol=1e-9, atol=1e-12)
    for end in ("ci_low", "ci_high"):
        shared = both[f"{end}_probe"].notna() & both[f"{end}_study"].notna()
        assert shared.sum() >= 10
        np.testing.assert_allclose(
            both.loc[shared, f"{end}_probe"], both.loc[shared, f"{end}_study"], rtol=1e-9
        )


# ----------------------------------------------------------------------- probes
class TangentEnergyProbe(Probe):
    """E‖Q_Tᵀ x‖² over the tokens at each residual site with a basis: a toy probe."""

    name = "toy"

    def __init__(self, sites) -> None:
        super().__init__()
        self.bases = dict(sites)
        for site in self.bases:
            self.add_state(site.hook_name, lambda: Sum((2,)))

    @property
    def forward_sites(self):
        return list(self.bases)

    def update(self, obs: Observation) -> None:
        q = self.bases[obs.site].basis_.double()
        energy = (obs.tensor.detach().double() @ q).pow(2).sum(-1).flatten()
        self.state(obs.site.hook_name).add(
            torch.stack([energy.sum(), energy.new_tensor(energy.numel())])
        )

    def rows(self):
        out = []
        for site in self.bases:
            total, count = self.state(site.hook_name).value.tolist()
            out.append(row(self.name, site, "toy_tangent_energy", total / count))
        return out


TOY = registry.ProbeSpec(
    "toy",
    TangentEnergyProbe,
    lambda plan: {s: b for s, b in plan.scoped.items() if s.kind in RESIDUAL_KINDS},
)
TOY_STAT = catalogue.Statistic(
    "toy_tangent_energy", "toy", "E‖Q_Tᵀ x‖²", "site, Q_T", "energy in the tangent subspace"
)


@pytest.fixture
def toy(monkeypatch):
    """The toy probe registered for one test (both registries are restored after)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(catalogue, "STATISTICS", dict(catalogue.STATISTICS))
    registry.register(TOY)
    return TOY


def test_probes_are_checked_when_the_config_is_made(series_dir, toy):
    with pytest.raises(UsageError, match=r"\['nope'\].*registered probes are \(.*'toy'"):
        _config(series_dir, probes=("nope",))
    with pytest.raises(UsageError, match="makes from its parts"):
        _config(series_dir, probes=("attention", "gradient"))
    cfg = _config(series_dir, probes=["toy", "attention", "toy"])
    assert cfg.probes == ("attention", "toy")  # table order, each once
    assert StudyConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert _config(series_dir, probes="toy").probes == ("toy",)


def test_a_registered_probe_runs_on_every_checkpoint(study, series_dir, tmp_path, toy):
    """A probe registered here runs through the study, with the study's smallest-rank
    Q_T, on every checkpoint; the rows of the default study stay as they were; its
    statistics must be catalogued (checked at the first checkpoint); a folder made with
    other probes is not resumed with these."""
    default_cfg, default_out, default = study
    cfg = replace(default_cfg, probes=("attention", "toy"))
    out = tmp_path / "toy"
    with pytest.raises(UsageError, match="toy_tangent_energy"):
        Study(cfg).run(out)
    catalogue.register(TOY_STAT)
    frame = Study(cfg).run(out)
    assert (out / "results.csv").is_file()
    mine = frame[frame["probe"] == "toy"]
    assert set(mine["step"]) == set(STEPS) and set(mine["rank"]) == {2}
    assert (mine["checkpoint"] == "step" + mine["step"].astype(str)).all()
    assert set(mine["statistic"]) == {"toy_tangent_energy"}
    assert sorted(set(zip(mine["layer"], mine["site"], strict=True))) == sorted(RES_SITES)
    assert mine.groupby("step").size().eq(len(RES_SITES)).all()
    windows = frame.groupby("step")["window"].first()
    assert (mine["window"].to_numpy() == windows[mine["step"]].to_numpy()).all()
    others = frame[frame["probe"] != "toy"].reset_index(drop=True)
    pd.testing.assert_frame_equal(others, default, check_exact=True)

    # independently: the cached activations of step 8 against its row
    tokens = load_tensors(out / "probe_set.safetensors")[0]["tokens"][: cfg.head_sequences]
    bases = BasisSet.load(out / "bases" / "rank2.safetensors")
    model = models.load(str(series_dir / "step8"), backend=cfg.backend).model
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    at8 = mine[mine["step"] == 8]
    for layer, kind in RES_SITES:
        hook = Site(layer, kind).hook_name
        x = cache[hook].double().reshape(-1, D_MODEL)
        expected = (x @ bases[hook].basis_.double()).pow(2).sum(-1).mean().item()
        (value,) = at8.loc[at8["hook"] == hook, "value"]
        assert value == pytest.approx(expected, rel=1e-9)

    with pytest.raises(ValueError, match=r"differs in \['probes'\]"):
        Study(cfg).run(default_out)  # a rerun with other probes never reuses stale rows
