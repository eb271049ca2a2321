"""The shared probe tester: every registered probe (a new one gets these tests by
registering) keeps a state that merges exactly, round-trips through `state_dict`, and
computes the same rows twice. One model and one set of bases serve every probe."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from models import tl_bridge, tokens

from tangentlens.core.errors import UsageError
from tangentlens.probes import fit_bases, registry, run

OPTS = {"n_controls": 30, "head_null": 2, "progress": False}
KEY = ["probe", "hook", "head", "statistic"]


@pytest.fixture(scope="module")
def setup():
    model = tl_bridge("llama")
    batches = [tokens("llama", seed=s) for s in range(4)]
    return model, batches, fit_bases(model, batches[:1], rank=4, progress=False)


def _rows(session, name: str) -> pd.DataFrame:
    table = session.results(progress=False)
    mine = table[table["probe"] == name]
    return mine.sort_values(KEY, na_position="first").reset_index(drop=True)


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a[KEY], b[KEY])
    for column in ("value", "ci_low", "ci_high"):
        if column in a:
            np.testing.assert_allclose(a[column], b[column], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", registry.names())
def test_merge_over_any_split_equals_one_pass(name, setup, one_thread) -> None:
    model, batches, bases = setup
    # a bounded head null takes each shard's first sequences (per process, as a
    # distributed run's ranks do): merging equals one pass for the unbounded null
    opts = OPTS | ({"head_null_sequences": None} if name == "attention" else {})
    whole = run(model, batches[1:], bases, (name,), **opts)
    first = run(model, batches[1:2], bases, (name,), **opts)
    # batch i of the whole run is group i: the second shard's batches keep their groups
    rest = run(model, batches[2:], bases, (name,), group_of=lambda i: i + 1, **opts)
    first.probes[name].merge(rest.probes[name])
    _same(_rows(first, name), _rows(whole, name))


@pytest.mark.parametrize("name", registry.names())
def test_state_round_trips_and_compute_is_deterministic(name, setup, one_thread) -> None:
    model, batches, bases = setup
    session = run(model, batches[1:3], bases, (name,), **OPTS)
    rows = _rows(session, name)
    _same(_rows(session, name), rows)  # computing twice changes nothing
    probe = session.probes[name]
    state = probe.state_dict()
    probe.reset()
    probe.load_state_dict(state)
    _same(_rows(session, name), rows)


@pytest.mark.parametrize("name", ["residual", "gradient"])
def test_a_basis_free_state_computes_the_rows_of_one_kept_for_its_bases(
    name, setup, one_thread
) -> None:
    """Collect, then compute: built on the sites alone (per-group second moments), a probe
    computes against bases given afterwards the same rows as one built on those bases
    (which keeps their projections only), intervals included; the free state also gives
    ``delta_iso_tangent`` an interval. One implementation of each statistic."""
    model, batches, bases = setup
    session = run(model, batches[1:], bases, (name,), **OPTS)
    based = session.probes[name]
    cls = type(based)
    options = {"n_controls": OPTS["n_controls"]} if name == "gradient" else {}
    free = cls(list(based.sites), n_groups=based.n_groups, **options)
    run(model, batches[1:], None, [free], progress=False)
    assert free.basis_free and free.rows() == []
    ours = pd.DataFrame(free.compute(based.bases)).sort_values(KEY[1:]).reset_index(drop=True)
    theirs = _rows(session, name).sort_values(KEY[1:]).reset_index(drop=True)
    pd.testing.assert_frame_equal(ours[KEY], theirs[KEY], check_dtype=False)
    np.testing.assert_allclose(ours["value"], theirs["value"], rtol=1e-9, atol=1e-12)
    for column in ("ci_low", "ci_high"):
        both = theirs[column].notna()
        assert both.sum() > 0
        np.testing.assert_allclose(ours.loc[both, column], theirs.loc[both, column], rtol=1e-9)
        extra = set(ours.loc[ours[column].notna() & ~both, "statistic"])
        assert extra == ({"delta_iso_tangent"} if name == "gradient" else set())
    with pytest.raises(UsageError, match="bases"):
        based.compute(
            {s: fit_bases(model, batches[:1], rank=3, progress=False)[s] for s in based.sites[:1]}
        )
