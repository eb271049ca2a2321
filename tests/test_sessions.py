"""Sessions for real workflows: tags per step, reset, and no silent empty results."""

from __future__ import annotations

import pytest
import torch
from models import tl_bridge, tokens

from tangentlens.core.errors import UsageError
from tangentlens.probes import base, fit_bases, probe, run
from tangentlens.probes.base import BASES_KEY

OPTS = {"n_controls": 20}


@pytest.fixture(scope="module")
def setup():
    model = tl_bridge("llama")
    batches = [tokens("llama", seed=s) for s in range(4)]
    return model, batches, fit_bases(model, batches[:2], rank=4, progress=False)


def _step(model, batch) -> None:
    model(batch, return_type="loss").backward()


def test_tags_split_a_training_loop_by_step(setup, one_thread) -> None:
    model, batches, bases = setup
    with probe(model, bases, ("residual", "gradient"), **OPTS) as session:
        for step, batch in enumerate(batches[2:]):
            session.tag(step=step)
            _step(model, batch)
        session.tag("final")
        _step(model, batches[2])
    table = session.results()
    tagged = table[table["probe"] != "basis"]
    assert sorted(tagged["step"].dropna().unique()) == [0, 1]
    assert set(tagged["tag"].dropna()) == {"final"}
    one = session.results(step=1)
    alone = run(model, [batches[3]], bases, ("residual", "gradient"), progress=False, **OPTS)
    key = ["probe", "hook", "statistic"]
    want = alone.results()
    want = want[(want["probe"] != "basis") & ~want["statistic"].str.contains("p_value")]
    want = want.set_index(key)["value"]
    got = one[one["probe"] != "basis"].set_index(key)["value"]
    # the same statistics (a mean loss here, a summed one in run: float32 rounding only);
    # means over the controls (float32 traces) agree to 1e-8 absolute, far inside their
    # Monte-Carlo error, not relative to an iso_statistic near 0
    mc = want.index.get_level_values("statistic").isin(["iso_statistic", "delta_iso_normal"])
    tol = 1e-5 * want.abs() + 1e-9 + mc * 1e-8
    assert ((got.loc[want.index] - want).abs() <= tol).all()
    final = session.results(tag="final")
    assert final.loc[final["statistic"] == "n_tokens", "value"].notna().all()
    with pytest.raises(UsageError, match="tag='fnal'"):  # a misspelt tag: not basis rows alone
        session.results(tag="fnal")
    session.reset()
    with pytest.raises(UsageError, match="no forward pass"):
        session.results()


def test_no_forward_no_backward_or_lost_hooks_raise(setup, one_thread) -> None:
    model, batches, bases = setup
    with probe(model, bases, ("residual",)) as session:
        pass
    with pytest.raises(UsageError, match="no forward pass"):
        session.results()
    with probe(model, bases, ("gradient",), **OPTS) as session:
        model(batches[2], return_type="loss")
    with pytest.raises(UsageError, match="no backward pass"):
        session.results()
    with probe(model, bases, ("residual",)) as session:
        model(batches[2])
        model.reset_hooks()  # a notebook habit: removes the session's hooks too
        model(batches[3])
    with pytest.raises(UsageError, match="hooks were removed"):
        session.results()


def test_a_backward_after_the_block_is_not_counted(setup, one_thread) -> None:
    model, batches, bases = setup
    with probe(model, bases, ("gradient",), **OPTS) as session:
        _step(model, batches[2])
        late = model(batches[3], return_type="loss")
    before = session.gradient_moments["blocks.0.hook_resid_pre"].count
    late.backward()
    assert session.gradient_moments["blocks.0.hook_resid_pre"].count == before


def test_energies_are_shared_by_the_probes_and_twin_sites(setup, one_thread, monkeypatch):
    """The residual, gradient and weight-gradient probes read one activation at a site,
    and resid_post[l] / resid_pre[l + 1] are one tensor with equal bases: each (tensor,
    basis) gets its energies once, and the results are those computed every time."""
    model, batches, bases = setup
    energies, cache = base.energy_sums, base.SharedEnergies()
    basis = bases["blocks.0.hook_resid_pre"]
    x = torch.randn(2, 3, basis.d)
    first = cache(x, None, basis)
    assert cache(x.view(6, -1).view(2, 3, -1), None, basis.relabelled(site="twin")) is first
    x.add_(1.0)  # an in-place edit: computed again
    again = cache(x, None, basis)
    assert again is not first and torch.equal(again, energies(x, basis))
    other = bases["blocks.1.hook_resid_pre"]
    assert torch.equal(cache(x, None, other), energies(x, other))

    names = ("residual", "gradient", "weight_gradient")
    calls: list[int] = []

    def counted(x, basis, mask=None):
        calls.append(1)
        return energies(x, basis, mask)

    def results():
        calls.clear()
        with probe(model, bases, names, **OPTS) as session:
            _step(model, batches[2])
        return session.results().sort_values(["probe", "hook", "statistic"]), len(calls)

    monkeypatch.setattr(base, "energy_sums", counted)
    shared, n_shared = results()
    monkeypatch.setattr(base.SharedEnergies, "__call__", lambda self, x, m, b: counted(x, b, m))
    every, n_every = results()
    assert 0 < n_shared < n_every
    assert shared["value"].equals(every["value"])


def test_a_saved_state_loads_only_where_it_was_measured(setup, one_thread) -> None:
    model, batches, bases = setup
    names = ("residual", "attention", "gradient", "weight_gradient")
    opts = {**OPTS, "head_null": 5}
    done = run(model, batches[2:], bases, names, progress=False, **opts)
    other = fit_bases(model, batches[2:], rank=4, progress=False)  # another Q_T
    fresh = probe(model, bases, names, **opts)
    for name, p in done.probes.items():
        state = p.state_dict()
        with pytest.raises(UsageError, match="other bases"):  # not silently relabelled
            probe(model, other, names, **opts).probes[name].load_state_dict(state)
        unmarked = {k: t for k, t in state.items() if k != BASES_KEY}
        with pytest.raises(UsageError, match=BASES_KEY):  # bases unknown: not assumed
            probe(model, bases, names, **opts).probes[name].load_state_dict(unmarked)
        fresh.probes[name].load_state_dict(state)
    # a session given its state, with no pass of its own, reads it back as it was
    key = ["probe", "site", "layer", "head", "statistic"]
    want, got = (s.results().set_index(key) for s in (done, fresh))
    assert want["value"].equals(got.loc[want.index, "value"])
    seeded = probe(model, bases, names, **{**opts, "seed": 9})  # other null frames
    with pytest.raises(UsageError, match="other bases"):
        seeded.probes["attention"].load_state_dict(done.probes["attention"].state_dict())
    state = done.probes["attention"].state_dict()
    energy = next(k for k in state if k.endswith("/energy"))
    for bad in ({energy: state[energy][..., :1]}, {energy: state[energy] * torch.nan}):
        heads = fresh.probes["attention"]
        before = heads.state_dict()
        with pytest.raises(ValueError, match=r"heads|NaN"):  # a usage or a corrupt-file error
            heads.load_state_dict(state | bad)
        assert all(torch.equal(t, before[k]) for k, t in heads.state_dict().items())
