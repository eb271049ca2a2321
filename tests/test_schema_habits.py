"""Stable columns whatever the tags, every bar silenced by progress=False, one rank rule
with a word when the normal-control statistics are left out."""

from __future__ import annotations

import pytest
import torch
from models import tl_bridge, tokens

import tangentlens
from tangentlens.core.significance import matrix_tests
from tangentlens.core.subspace import TangentBasis


def test_a_session_tagged_by_step_keeps_every_column(capsys) -> None:
    model = tl_bridge("llama")
    batches = [tokens("llama", seed=s) for s in range(2)]
    bases = tangentlens.fit_bases(model, batches, rank=2, layers=[0], progress=False)
    plain = tangentlens.probes.run(model, batches, bases, ("residual",), progress=False)
    with tangentlens.probe(model, bases, ("residual",)) as session:
        session.tag(step=3)
        model(batches[0])
    capsys.readouterr()
    tagged = session.results(progress=False)
    assert {"component", "ci_low", "ci_high"} <= set(plain.results().columns)
    assert {"tag", "step", "component", "ci_low", "ci_high"} <= set(tagged.columns)
    assert "probe" not in capsys.readouterr().err  # run(progress=False): results() is quiet too
    assert plain.progress is False


def test_rank_above_half_d_warns_that_normal_statistics_are_left_out() -> None:
    d, k = 8, 6
    basis = TangentBasis(torch.linalg.qr(torch.randn(d, k, dtype=torch.float64))[0])
    with pytest.warns(UserWarning, match="p_value_normal.*left out"):
        out = matrix_tests(torch.eye(d, dtype=torch.float64), basis, n_controls=5)
    assert "p_value" in out and "p_value_normal" not in out
