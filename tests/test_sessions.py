"""Sessions for real workflows: tags per step, reset, and no silent empty results."""

from __future__ import annotations

import pytest
from models import tl_bridge, tokens

from tangentlens.core.errors import UsageError
from tangentlens.probes import fit_bases, probe, run

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
