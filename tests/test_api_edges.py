"""The Python API at the edges a notebook meets: inference mode, a loss of one's own, layer
lists of every form, batches as a DataLoader or a list of sequences, a basis moved to
another site, a tagged training loop, and a mask of the wrong shape inside an nnsight
trace. Each gives the numbers of the plain call or one typed error naming the argument."""

from __future__ import annotations

import warnings
from typing import Any

import nnsight
import numpy as np
import pandas as pd
import pytest
import torch
from models import hf_model, tl_bridge, tokens
from torch.utils.data import DataLoader, TensorDataset

from tangentlens.analysis.interventions import head_effects
from tangentlens.core.errors import BasisSiteWarning, UsageError
from tangentlens.hooks.nnsight import trace_moments
from tangentlens.hooks.sites import Site
from tangentlens.probes import fit_bases, lm_loss, probe, run
from tangentlens.probes.residual import ResidualProbe


@pytest.fixture(scope="module")
def llama() -> dict[str, Any]:
    model = tl_bridge("llama")
    ids = tokens("llama", batch=4, pos=12)
    bases = fit_bases(model, [ids, tokens("llama", 4, 12, seed=1)], rank=4, progress=False)
    return {"model": model, "ids": ids, "bases": bases}


def _run(llama: dict[str, Any], batches: Any, probes: tuple[str, ...], **kw: Any) -> Any:
    return run(llama["model"], batches, llama["bases"], probes, progress=False, **kw).results()


def test_inference_mode_gives_the_tables_of_a_plain_call(llama: dict[str, Any]) -> None:
    probes = ("residual", "gradient", "attention")
    plain = _run(llama, [llama["ids"]], probes)
    with torch.inference_mode():
        inside = _run(llama, [llama["ids"]], probes)
        made_inside = _run(llama, [llama["ids"].clone()], probes)  # inference-tensor ids
        refit = fit_bases(llama["model"], [llama["ids"]] * 2, rank=4, progress=False)
        with probe(llama["model"], llama["bases"], ("residual",)) as session:
            llama["model"](llama["ids"])
        own = session.results()
    pd.testing.assert_frame_equal(plain, inside)
    pd.testing.assert_frame_equal(plain, made_inside)
    share = "statistic == 'tangent_share' and probe == 'residual'"
    assert np.allclose(own.query(share).value, plain.query(share).value, rtol=1e-6)
    assert set(refit.keys()) == set(llama["bases"].keys())


@pytest.mark.parametrize(
    "loss",
    [
        lambda m, b: lm_loss(m, b, per_sequence=True),  # one loss per sequence
        lambda m, b: lm_loss(m, b).item(),  # a Python float
        lambda m, b: lm_loss(m, b).detach(),  # no graph
        lambda m, b: torch.ones((), requires_grad=True),  # never runs the model
    ],
    ids=["per-sequence", "float", "detached", "no-model"],
)
def test_a_loss_without_a_scalar_graph_is_named(llama: dict[str, Any], loss: Any) -> None:
    with pytest.raises(UsageError, match="loss must be callable"):
        _run(llama, [llama["ids"]], ("gradient",), loss=loss)


def test_head_effects_reads_layers_as_run_does(llama: dict[str, Any]) -> None:
    common = {"n_null": 2, "progress": False}
    model, ids, bases = llama["model"], [llama["ids"]], llama["bases"]
    one = head_effects(model, ids, bases, layers=1, **common)
    assert set(one.layer) == {1}
    pd.testing.assert_frame_equal(
        one, head_effects(model, ids, bases, layers=np.array([1]), **common)
    )
    with pytest.raises(UsageError, match=r"layers \[7\] do not exist"):
        head_effects(model, ids, bases, layers=[7], **common)


def test_no_layer_at_all_is_named(llama: dict[str, Any]) -> None:
    with pytest.raises(UsageError, match="layers names no layer"):
        fit_bases(llama["model"], [llama["ids"]], rank=4, layers=[], progress=False)


def test_batches_as_a_dataloader_pairs_sequences_and_small_ints(llama: dict[str, Any]) -> None:
    ids = llama["ids"]
    mask = torch.ones_like(ids)
    for pairs in (DataLoader(TensorDataset(ids, mask), batch_size=2), [(ids, mask)], (ids, mask)):
        with pytest.raises(UsageError, match="attention_mask"):
            _run(llama, pairs, ("residual",))
    pd.testing.assert_frame_equal(  # a DataLoader over ids alone yields one-tensor lists
        _run(llama, DataLoader(TensorDataset(ids), batch_size=4), ("residual",)),
        _run(llama, [ids], ("residual",)),
    )
    one_by_one = _run(llama, [ids[0], ids[1, :7]], ("residual",))
    tokens_seen = one_by_one.query("statistic == 'n_tokens'").value
    assert (tokens_seen == 19).all()  # 12 + 7 tokens, two batches of one sequence
    small = torch.tensor(ids.numpy() % 100, dtype=torch.int8)  # ids a uint8/int8 can hold
    pd.testing.assert_frame_equal(
        _run(llama, [small], ("residual",)), _run(llama, [small.long()], ("residual",))
    )


def test_a_basis_moved_to_another_site_warns_in_every_probe(llama: dict[str, Any]) -> None:
    moved = {"blocks.1.hook_resid_pre": llama["bases"]["blocks.0.hook_resid_pre"]}
    with pytest.warns(BasisSiteWarning, match=r"blocks\.1\.hook_resid_pre.*blocks\.0") as seen:
        run(llama["model"], [llama["ids"]], moved, ("residual", "gradient"), progress=False)
    assert {w.filename for w in seen} == {__file__}  # reported at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error", BasisSiteWarning)
        _run(llama, [llama["ids"]], ("residual", "gradient"))  # each basis at its own site
        run(llama["model"], [llama["ids"]], moved, ("residual",), layers=[0], progress=False)


def test_a_probe_built_by_hand_with_a_moved_basis_warns(llama: dict[str, Any]) -> None:
    """The session checks the bases a hand-built probe carries as it checks its own: a
    basis at another site warns; a block's write read in the basis of the residual site
    it lands in (as the residual probe reads writes) does not."""
    bases = llama["bases"]
    first = bases["blocks.0.hook_resid_pre"]
    moved = ResidualProbe({Site(1, "resid_pre"): first})
    with pytest.warns(BasisSiteWarning, match=r"blocks\.1\.hook_resid_pre.*blocks\.0"):
        run(llama["model"], [llama["ids"]], None, (moved,), progress=False)
    # a misplaced basis of the session's stays named beside a hand-built probe's own
    right = ResidualProbe({Site(1, "resid_pre"): bases["blocks.1.hook_resid_pre"]})
    session_moved = {"blocks.1.hook_resid_pre": first}
    with pytest.warns(BasisSiteWarning, match=r"blocks\.1\.hook_resid_pre.*blocks\.0"):
        run(llama["model"], [llama["ids"]], session_moved, ("gradient", right), progress=False)
    writes = {Site(0, "attn_out"): bases["blocks.0.hook_resid_mid"], Site(0, "resid_pre"): first}
    with warnings.catch_warnings():
        warnings.simplefilter("error", BasisSiteWarning)
        run(llama["model"], [llama["ids"]], None, (ResidualProbe(writes),), progress=False)


def test_a_tagged_training_loop_has_no_empty_block(llama: dict[str, Any]) -> None:
    model, ids = llama["model"], llama["ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with probe(model, llama["bases"], ("residual",)) as session:
            for step in range(2):
                session.tag(step=step)
                model(ids)
        table = session.results()
    assert set(table.step.dropna()) == {0, 1}
    measured = table[table.probe != "basis"]  # the bases' own rows belong to no tag
    assert measured.step.notna().all()  # no rows of the untagged block before the loop
    with warnings.catch_warnings():  # tagged after each step: the live block is empty
        warnings.simplefilter("error")
        with probe(model, llama["bases"], ("residual",)) as session:
            session.tag(step=0)
            for step in range(2):
                model(ids)
                session.tag(step=step + 1)
        after = session.results()
    assert set(after.step.dropna()) == {0, 1}


def test_trace_moments_names_a_mask_of_another_shape() -> None:
    lm = nnsight.NNsight(hf_model("llama"))
    ids = tokens("llama", 3, 12)
    with pytest.raises(UsageError, match=r"mask \(3, 5\).*\(3, 12\)"), lm.trace(ids):
        trace_moments(lm, ["blocks.0.hook_resid_pre"], torch.ones(3, 5))


def test_a_dict_batch_reaches_a_loss_of_ones_own_as_given(llama: dict[str, Any]) -> None:
    class Encoding(dict):  # a tokenizer's BatchEncoding: a dict with attribute access
        def __getattr__(self, key: str) -> Any:
            return self[key]

    seen: list[type] = []

    def loss(model: Any, batch: Any) -> torch.Tensor:
        seen.append(type(batch))
        return lm_loss(model, batch.input_ids)

    batch = Encoding(input_ids=llama["ids"], attention_mask=torch.ones_like(llama["ids"]))
    _run(llama, [batch], ("gradient",), loss=loss)
    assert seen == [Encoding]
