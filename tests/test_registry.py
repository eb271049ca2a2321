"""The probe registry: a probe defined and registered here, in a few lines, runs through
the session and `run` with no edit of the package; options belong to their probes."""

from __future__ import annotations

import inspect

import pytest
import torch
from models import tl_bridge, tokens

from tangentlens.core import catalogue, results
from tangentlens.core.errors import UsageError
from tangentlens.hooks.sites import RESIDUAL_KINDS
from tangentlens.probes import GradientProbe, ProbeSession, fit_bases, probe, registry, run
from tangentlens.probes.base import Observation, Probe, Sum, row


class NormProbe(Probe):
    """Mean squared norm of the activations at residual sites: a toy probe."""

    name = "toy_norm"

    def __init__(self, sites, *, scale: float = 1.0) -> None:
        super().__init__()
        self.sites, self.scale = list(sites), scale
        for site in self.sites:
            self.add_state(site.hook_name, lambda: Sum((2,)))

    @property
    def forward_sites(self):
        return self.sites

    def update(self, obs: Observation) -> None:
        x = obs.tensor.detach().double()
        keep = torch.ones(x.shape[:-1], dtype=torch.bool) if obs.mask is None else obs.mask
        sq = x.pow(2).sum(-1)[keep]
        self.state(obs.site.hook_name).add(torch.stack([sq.sum(), sq.new_tensor(sq.numel())]))

    def rows(self):
        out = []
        for site in self.sites:
            total, count = self.state(site.hook_name).value.tolist()
            out.append(row(self.name, site, "toy_mean_sq_norm", self.scale * total / count))
        return out


def _residual(plan):
    return {s: b for s, b in plan.scoped.items() if s.kind in RESIDUAL_KINDS}


TOY = registry.ProbeSpec("toy_norm", NormProbe, _residual, options=("scale",))


@pytest.fixture
def toy(monkeypatch):
    """The toy probe registered for one test (the registry is restored after)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register(TOY)
    return TOY


@pytest.fixture(scope="module")
def setup():
    model = tl_bridge("llama")
    batches = [tokens("llama", seed=s) for s in range(3)]
    return model, batches, fit_bases(model, batches[:1], rank=4, progress=False)


def test_a_registered_probe_runs_through_the_session_and_run(
    toy, setup, tmp_path, monkeypatch
) -> None:
    model, batches, bases = setup
    session = run(model, batches[1:], bases, ("residual", "toy_norm"), progress=False, scale=2.0)
    table = session.results(progress=False)
    mine = table[table["probe"] == "toy_norm"]
    assert set(mine["hook"]) == {h for h in bases if "hook_resid_" in h}
    # against the same number computed by hand from TransformerLens' own cache
    hook = "blocks.1.hook_resid_pre"
    expected = []
    for batch in batches[1:]:
        _, cache = model.run_with_cache(batch, names_filter=hook)
        expected.append(cache[hook].double().pow(2).sum(-1).flatten())
    want = 2.0 * torch.cat(expected).mean().item()
    got = mine.loc[mine["hook"] == hook, "value"].item()
    assert got == pytest.approx(want, rel=1e-9)
    # the results writer takes its statistic once the catalogue has it
    with pytest.raises(UsageError, match="toy_mean_sq_norm"):
        results.write(table, tmp_path / "refused")
    assert not (tmp_path / "refused" / "results.csv").exists()
    monkeypatch.setattr(catalogue, "STATISTICS", dict(catalogue.STATISTICS))
    catalogue.register(
        catalogue.Statistic(
            "toy_mean_sq_norm", "toy_norm", "scale · E‖x‖²", "site", "a norm, scaled"
        )
    )
    assert results.read(results.write(table, tmp_path / "written")[0]).equals(table)
    # its state merges and round-trips like every probe's
    probe_ = session.probes["toy_norm"]
    clone = NormProbe(probe_.sites, scale=2.0).load_state_dict(probe_.state_dict())
    assert clone.rows() == probe_.rows()


def test_tables_come_in_registry_order_whatever_the_order_asked(setup) -> None:
    model, batches, bases = setup
    one = run(model, batches[1:2], bases, ("gradient", "residual"), progress=False, n_controls=9)
    two = run(model, batches[1:2], bases, ("residual", "gradient"), progress=False, n_controls=9)
    assert list(one.probes) == list(two.probes) == ["residual", "gradient"]


def test_options_belong_to_probes(setup) -> None:
    model, _, bases = setup
    with pytest.raises(UsageError, match="n_contrls"):
        probe(model, bases, ("residual",), n_contrls=10)
    # one default per option, and it is the probe class's own
    defaults = registry.option_defaults()
    params = inspect.signature(GradientProbe).parameters
    assert defaults["n_controls"] == params["n_controls"].default
    session = ProbeSession(model, bases, ("gradient",))
    assert session.probes["gradient"].n_controls == defaults["n_controls"]


def test_a_name_is_registered_once(toy) -> None:
    registry.register(TOY)  # the same spec again is harmless
    with pytest.raises(UsageError, match="toy_norm"):
        registry.register(registry.ProbeSpec("toy_norm", NormProbe, lambda plan: {}))
    with pytest.raises(UsageError, match="bogus"):
        registry.ProbeSpec("bogus", NormProbe, _residual, options=("bogus",))
    with pytest.raises(UsageError, match="nope"):
        registry.get("nope")
