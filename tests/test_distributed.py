"""Data-parallel runs on gloo: 2 processes give the single-process answer (within 1e-10)."""

from __future__ import annotations

import functools
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from tangentlens.core.errors import UsageError
from tangentlens.core.stats import Moments
from tangentlens.data.train import TrainConfig, train
from tangentlens.hooks.sites import Site
from tangentlens.probes import ActivationProbe, Observation
from tangentlens.probes.distributed import launch, run_probe, shard

TOL = 1e-10


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    return train(TrainConfig.tiny(), tmp_path_factory.mktemp("tiny"), progress=False)


def test_shard_is_contiguous_balanced_and_complete():
    items = list(range(11))
    parts = [shard(items, r, 3) for r in range(3)]
    assert parts == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert shard(items, 0, 1) == items
    assert [shard([1], r, 2) for r in range(2)] == [[1], []]
    for rank, world in ((0, 0), (2, 2), (-1, 2)):
        with pytest.raises(ValueError, match=r"rank|world_size"):
            shard(items, rank, world)


def _data() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 50, 8, generator=g, dtype=torch.float64) * 3 + 1e3


def _moments_worker(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    m = Moments()
    for x in shard(list(_data()), rank, world_size):
        m.update(x)
    site = Site(0, "resid_pre")
    probe = ActivationProbe([site])  # a rank without data still takes part
    if rank == 0:
        probe.update(Observation(site, _data()[0]))
    m.all_reduce_()
    probe.all_reduce_(d=8)
    empty = probe.moments[site]
    return {"count": torch.tensor(m.count), "cov": m.covariance(), "mean": m.mean, "e": empty.mean}


def _failing_worker(rank: int, world_size: int) -> None:
    if rank == 1:
        raise UsageError("planted failure")


def _crashing_worker(rank: int, world_size: int) -> None:
    if rank == 0:
        raise KeyError("planted bug")


def _crashing_peer(rank: int, world_size: int) -> None:
    if rank == 1:
        raise KeyError("planted bug on rank 1")
    dist.all_reduce(torch.zeros(1))  # rank 0 then fails too, on the lost peer


def test_moments_all_reduce_on_two_processes_equals_one_pass():
    out = launch(_moments_worker, 2)
    one = Moments().update(_data())
    assert int(out["count"]) == one.count == 300
    torch.testing.assert_close(out["mean"], one.mean, rtol=0, atol=TOL)
    torch.testing.assert_close(out["cov"], one.covariance(), rtol=TOL, atol=TOL)
    torch.testing.assert_close(out["e"], _data()[0].mean(0), rtol=0, atol=TOL)


def test_launch_reports_a_failing_rank():
    with pytest.raises(ValueError, match="planted failure"):  # a user error keeps its type
        launch(_failing_worker, 2)
    with pytest.raises(RuntimeError, match="planted bug"):  # anything else: RuntimeError
        launch(_crashing_worker, 2)
    with pytest.raises(RuntimeError, match="planted bug on rank 1"):  # the cause, not its echo
        launch(_crashing_peer, 2)


def _nnsight_model(folder: str):
    from tangentlens import models

    return models.load(folder, "nnsight").model


def test_run_probe_two_processes_equal_one(tiny_run):
    from tangentlens.probes import fit_bases

    torch.set_num_threads(1)
    factory = functools.partial(_nnsight_model, str(tiny_run / "step24"))
    model = factory()
    g = torch.Generator().manual_seed(1)
    batches = list(torch.randint(0, 300, (6, 3, 16), generator=g))
    sites = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_post", "blocks.1.ln1.hook_out"]
    bases = fit_bases(model, batches, rank=4, sites=sites, progress=False)
    probes = ("residual", "attention", "gradient", "activation")
    # the head null unbounded: a bounded one takes each process's first sequences
    options = dict(n_controls=100, seed=3, head_null_sequences=None)
    one = run_probe(factory, batches, bases, probes, world_size=1, **options)
    two = run_probe(factory, batches, bases, probes, world_size=2, **options)
    keys = ["probe", "site", "layer", "head", "statistic"]
    merged = one.merge(two, on=keys, suffixes=("_one", "_two"), validate="1:1")
    assert len(merged) == len(one) == len(two)
    assert {"score_share_TT", "energy_ratio", "tangent_share", "n_tokens"} <= set(one["statistic"])
    for column in ("value", "ci_low", "ci_high"):  # the intervals' groups as in one process
        pd.testing.assert_series_equal(
            merged[f"{column}_one"], merged[f"{column}_two"], check_names=False, rtol=TOL, atol=TOL
        )


def test_run_probe_refuses_too_few_batches(tiny_run):
    with pytest.raises(ValueError, match="1 batches cannot feed 2 processes"):
        run_probe(lambda: None, [torch.zeros(1, 4, dtype=torch.long)], None, world_size=2)


def test_text_is_read_into_one_process_passes_before_sharding(tiny_run, monkeypatch):
    """Each rank reads text into the batches one process would run, then takes its share:
    the global pass indices (each interval's group) are one process's, and too few
    batches after reading are refused, however many texts there were."""
    from tangentlens.probes import distributed

    model = _nnsight_model(str(tiny_run / "step24"))
    texts = [f"in the beginning {i} was the word and the word was {i}" for i in range(20)]
    monkeypatch.setattr(distributed, "all_reduce_session", lambda session: session)
    seen: dict[tuple[int, int], list[int]] = {}
    for world in (1, 2):
        for rank in range(world):
            got = seen.setdefault((world, rank), [])
            group_of = functools.partial(lambda got, i: got.append(i) or i, got)
            options = {"group_of": group_of, "progress": False}
            distributed._probe_worker(
                rank, world, lambda: model, texts, None, ("activation",), options
            )
    assert seen[1, 0] == [0, 1, 2] == seen[2, 0] + seen[2, 1]  # 20 texts, 8 a batch
    with pytest.raises(UsageError, match="1 batches cannot feed 2 processes"):
        distributed._probe_worker(0, 2, lambda: model, texts[:5], None, ("activation",), {})


def test_study_on_two_processes_equals_one(tiny_run, tmp_path):
    from tangentlens.study import Study, StudyConfig

    cfg = StudyConfig(
        checkpoints=str(tiny_run),
        backend="nnsight",
        rank=4,
        n_controls=50,
        n_sequences=8,
        seq_len=32,
        batch_size=2,
        max_chars=40_000,
        reservoir=64,
        n_permutations=20,
        progress=False,
    )
    one = Study(cfg).run(tmp_path / "one")
    two = Study(cfg).run(tmp_path / "two", world_size=2)
    pd.testing.assert_frame_equal(
        one.drop(columns="value"), two.drop(columns="value"), check_exact=False
    )
    pd.testing.assert_series_equal(one["value"], two["value"], rtol=TOL, atol=TOL)


def test_a_registered_probe_runs_on_two_processes(tiny_run, monkeypatch):
    """A probe defined in a test reaches spawned workers as its `ProbeSpec`."""
    from test_registry import TOY

    from tangentlens.probes import fit_bases, registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    torch.set_num_threads(1)
    factory = functools.partial(_nnsight_model, str(tiny_run / "step24"))
    g = torch.Generator().manual_seed(2)
    batches = list(torch.randint(0, 300, (4, 3, 16), generator=g))
    bases = fit_bases(factory(), batches, rank=4, sites=["blocks.1.hook_resid_pre"], progress=False)
    one = run_probe(factory, batches, bases, (TOY,), world_size=1, scale=3.0)
    two = run_probe(factory, batches, bases, (TOY,), world_size=2, scale=3.0)
    assert set(one["probe"]) == {"toy_norm", "basis"}
    mine = [t[t["probe"] == "toy_norm"].reset_index(drop=True) for t in (one, two)]
    pd.testing.assert_series_equal(mine[0]["value"], mine[1]["value"], rtol=TOL, atol=TOL)


def test_a_study_probe_registered_here_needs_no_worker(tiny_run, tmp_path, monkeypatch):
    """The study's probe pass runs in this process; the workers only collect, so a probe
    registered here alone runs on every checkpoint of a two-process study."""
    from test_study import TOY, TOY_STAT

    from tangentlens.core import catalogue
    from tangentlens.probes import registry
    from tangentlens.study import Study, StudyConfig

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(catalogue, "STATISTICS", dict(catalogue.STATISTICS))
    registry.register(TOY)
    catalogue.register(TOY_STAT)
    cfg = StudyConfig(
        checkpoints=str(tiny_run),
        probes=("attention", "toy"),
        rank=4,
        n_controls=20,
        n_sequences=8,
        seq_len=32,
        batch_size=2,
        max_chars=40_000,
        reservoir=64,
        n_permutations=20,
        progress=False,
    )
    frame = Study(cfg).run(tmp_path / "two", world_size=2)
    steps = set(frame["step"].dropna())
    for probe in ("attention", "toy"):
        assert set(frame.loc[frame["probe"] == probe, "step"]) == steps
