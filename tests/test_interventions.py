"""Interventions: exact ablation hooks, per-head score edits, causal effects with a null."""

from __future__ import annotations

import pytest
import torch
from models import tl_bridge, tokens

from tangentlens.analysis.interventions import (
    _default_metric,
    ablate,
    causal_effects,
    head_effects,
    keep_terms,
)
from tangentlens.core.decompose import decompose_parts
from tangentlens.core.errors import UsageError
from tangentlens.hooks import get_backend
from tangentlens.probes import fit_bases


@pytest.fixture(scope="module")
def llama():
    model = tl_bridge("llama")
    batches = [tokens("llama", seed=s) for s in range(4)]
    return model, batches, fit_bases(model, batches[:2], rank=4, progress=False)


def test_ablate_turns_the_activation_into_the_other_part_exactly(llama, one_thread) -> None:
    model, batches, bases = llama
    name = "blocks.1.hook_resid_pre"
    basis, seen = bases[name], {}

    def before(x, hook):
        seen["x"] = x.detach().clone()

    def after(x, hook):
        seen["after"] = x.detach().clone()

    hooks = [(name, before), (name, ablate(basis, "tangent")), (name, after)]
    model.run_with_hooks(batches[2], fwd_hooks=hooks)
    assert torch.equal(seen["after"], basis.split(seen["x"])[1].to(seen["x"].dtype))
    tangent, normal = (ablate(basis, p)(seen["x"]) for p in ("normal", "tangent"))
    torch.testing.assert_close(tangent + normal, seen["x"], rtol=0, atol=1e-6)
    with pytest.raises(UsageError, match="part must be one of"):
        ablate(basis, "both")


@pytest.mark.parametrize("part", ["tangent", "normal"])
def test_keep_terms_leaves_the_other_parts_score(llama, part: str, one_thread) -> None:
    """With the q/k edits of one head, its pattern is softmax of the kept part's terms."""
    model, batches, bases = llama
    basis = bases["blocks.0.ln1.hook_out"]
    params = get_backend(model).attention_params(0)
    head, seen = 1, {}
    capture, q_hook, k_hook = keep_terms(basis, params, head, part)

    def record(x, hook):
        seen[hook.name] = x.detach().clone()

    hooks = [
        ("blocks.0.attn.hook_in", capture),
        ("blocks.0.attn.hook_in", record),
        ("blocks.0.attn.hook_q", q_hook),
        ("blocks.0.attn.hook_k", k_hook),
        ("blocks.0.attn.hook_pattern", record),
    ]
    clean = {}
    model.run_with_hooks(batches[2], fwd_hooks=[("blocks.0.attn.hook_pattern", record)])
    clean["pattern"] = seen["blocks.0.attn.hook_pattern"]
    model.run_with_hooks(batches[2], fwd_hooks=hooks)
    x_t, x_n = basis.split(seen["blocks.0.attn.hook_in"])
    kept = (x_t, torch.zeros_like(x_n)) if part == "normal" else (torch.zeros_like(x_t), x_n)
    terms = decompose_parts(*kept, params)
    score = sum(terms.values())[:, head]
    n = score.shape[-1]
    score = score.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    want = score.softmax(-1)
    got = seen["blocks.0.attn.hook_pattern"]
    torch.testing.assert_close(got[:, head].double(), want, rtol=1e-4, atol=1e-5)
    # heads sharing no kv head with it are untouched (GQA: heads 0,1 share kv head 0)
    torch.testing.assert_close(got[:, 2:], clean["pattern"][:, 2:])


def test_causal_and_head_effects_report_a_null(llama, one_thread) -> None:
    model, batches, bases = llama
    layer_rows = causal_effects(model, batches[2:], bases, n_null=3, progress=False)
    stats = set(layer_rows["statistic"])
    assert {"delta_metric", "delta_metric_null_mean", "delta_metric_null_std", "z"} <= stats
    assert set(layer_rows["probe"]) == {"intervention"}
    assert set(layer_rows["hook"]) == set(bases)
    p = layer_rows[layer_rows["statistic"] == "p_value"]["value"]
    assert ((p > 0) & (p <= 1)).all()
    heads = head_effects(model, batches[2:], bases, layers=[0], n_null=2, progress=False)
    assert sorted(heads["head"].dropna().unique()) == [0, 1, 2, 3]
    with pytest.raises(UsageError, match="no site with a basis"):
        causal_effects(model, batches, bases, sites=lambda name: False)
    with pytest.raises(UsageError, match="no token to predict"):  # not a loss change of 0
        causal_effects(model, [batches[0][:, :1]], bases, n_null=2, progress=False)


def test_nulls_share_passes_and_state_their_floor(llama, one_thread) -> None:
    """Frames stacked in one pass give the numbers of one frame per pass (a custom metric
    runs them apart), and the default null can reach p = 0.01."""
    from tangentlens.analysis.interventions import _default_metric

    model, batches, bases = llama
    sites = lambda name: name == "blocks.1.hook_resid_pre"  # noqa: E731
    stacked = causal_effects(model, batches[2:], bases, sites=sites, n_null=5, progress=False)
    apart = causal_effects(
        model,
        batches[2:],
        bases,
        sites=sites,
        n_null=5,
        metric=lambda m, b: _default_metric(m, b),
        progress=False,
    )
    torch.testing.assert_close(
        torch.tensor(stacked["value"].to_numpy()),
        torch.tensor(apart["value"].to_numpy()),
        rtol=1e-4,
        atol=1e-6,
    )
    floor = stacked.query("statistic == 'p_value_floor'")["value"]
    assert (floor == 1 / 6).all()
    default = causal_effects(model, batches[2:3], bases, sites=sites, progress=False)
    assert float(default.query("statistic == 'p_value_floor'")["value"].iloc[0]) == 0.01


def test_head_effects_run_on_nnsight_as_on_the_bridge(one_thread) -> None:
    """The per-head edit goes through the backend: an nnsight model of the same weights
    gives the bridge's numbers (GPT-2: fused c_attn; Llama: GQA q_proj/k_proj)."""
    import nnsight
    from models import hf_model

    for arch in ("gpt2", "llama"):
        bridge, hf = tl_bridge(arch), nnsight.NNsight(hf_model(arch))
        batches = [tokens(arch, seed=s) for s in range(3)]
        bases = fit_bases(bridge, batches[:2], rank=4, layers=[0], progress=False)
        kwargs = {"layers": [0], "n_null": 3, "progress": False}
        ours = head_effects(hf, batches[2:], bases, **kwargs)
        theirs = head_effects(bridge, batches[2:], bases, **kwargs)
        assert sorted(ours["head"].dropna().unique()) == [0, 1, 2, 3]
        assert ours[["head", "statistic"]].equals(theirs[["head", "statistic"]])
        # the tiny random models' effects are ~1e-5 nats: the backends' float32 losses
        # agree to ~1e-7, and z divides those differences by a null spread of ~1e-5
        z = (ours["statistic"] == "z").to_numpy()
        a, b = (torch.tensor(t["value"].to_numpy()) for t in (ours, theirs))
        torch.testing.assert_close(a[~z], b[~z], rtol=0, atol=5e-7)
        # so z may move by (the metrics' 5e-7 per term, over the null's own spread)
        spread = ours.loc[ours["statistic"] == "delta_metric_null_std", "value"].to_numpy()
        allowed = torch.tensor(4 * 5e-7 / spread) * (1 + a[z].abs())
        assert bool(((a[z] - b[z]).abs() <= allowed).all()), (a[z], b[z], allowed)


def test_head_effects_edit_equals_keep_terms(llama, one_thread) -> None:
    """The column edit on the q/k linear maps is the `keep_terms` edit of hook_q/hook_k."""
    from tangentlens.analysis.interventions import _default_metric

    model, batches, bases = llama
    table = head_effects(model, batches[2:3], bases, layers=[1], n_null=2, progress=False)
    got = table.query("statistic == 'delta_metric' and head == 2")["value"].iloc[0]
    params = get_backend(model).attention_params(1)
    capture, q_hook, k_hook = keep_terms(bases["blocks.1.ln1.hook_out"], params, 2)
    hooks = [
        ("blocks.1.attn.hook_in", capture),
        ("blocks.1.attn.hook_q", q_hook),
        ("blocks.1.attn.hook_k", k_hook),
    ]
    with torch.no_grad():
        clean = float(_default_metric(model, batches[2]))
        with model.hooks(fwd_hooks=hooks):
            edited = float(_default_metric(model, batches[2]))
    assert got == pytest.approx(edited - clean, abs=1e-7)


def test_removing_a_part_at_resid_mid_edits_the_stream_not_only_the_mlp_input(
    llama, one_thread
) -> None:
    """At resid_mid the hook point is the MLP branch's input: the effect must be that of
    the stream itself losing the part (skip path included), as a hand edit of the HF
    model's attention output gives, on the bridge and on nnsight alike."""
    import nnsight
    from models import hf_model

    model, batches, bases = llama
    name, batch = "blocks.1.hook_resid_mid", batches[2]
    q = bases[name].basis_.float()
    hf = hf_model("llama")

    def loss() -> float:
        with torch.no_grad():
            logits = hf(batch).logits[:, :-1]
        targets = batch[:, 1:].flatten()
        return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets))

    clean, kept = loss(), {}
    layer = hf.model.layers[1]

    def attn_out(module, args, out):  # resid_mid' = resid_mid − resid_mid Q Qᵀ, by hand
        mid = kept["pre"] + out[0]
        return (mid - mid @ q @ q.T - kept["pre"], *out[1:])

    handles = [
        layer.register_forward_pre_hook(
            lambda m, a, kw: kept.update(pre=a[0] if a else kw["hidden_states"]), with_kwargs=True
        ),
        layer.self_attn.register_forward_hook(attn_out),
    ]
    try:
        by_hand = loss() - clean
    finally:
        for handle in handles:
            handle.remove()
    for subject in (model, nnsight.NNsight(hf_model("llama"))):
        found = causal_effects(subject, [batch], bases, sites=name, n_null=2, progress=False)
        effect = float(found.set_index("statistic")["value"]["delta_metric"])
        assert effect == pytest.approx(by_hand, rel=1e-4, abs=1e-6)
    assert abs(by_hand) > 1e-3  # the stream's edit, far from the MLP input's alone


def test_removing_a_part_at_bert_resid_mid_edits_the_stream_once(one_thread) -> None:
    """BERT's resid_mid is its output LayerNorm's input, the stream itself: the edit there
    reaches resid_post through the LayerNorm, and nothing is added after it (a change
    re-added at resid_post would count twice), on the bridge and on nnsight alike."""
    import nnsight
    from models import hf_model

    from tangentlens.core.subspace import TangentBasis

    name, batch = "blocks.1.hook_resid_mid", tokens("bert", seed=3)
    q = torch.linalg.qr(torch.randn(32, 4, generator=torch.Generator().manual_seed(4)))[0]
    bases = {name: TangentBasis(q.double())}

    def metric(model, batch):  # the logits' energy: any encoder output will do
        out = model(batch["input_ids"] if isinstance(batch, dict) else batch)
        return getattr(out, "logits", out).float().pow(2).mean()

    hf = hf_model("bert")
    with torch.no_grad():
        clean = float(metric(hf, batch))
        norm = hf.bert.encoder.layer[1].output.LayerNorm
        handle = norm.register_forward_pre_hook(lambda m, a: (a[0] - a[0] @ q @ q.T,))
        try:
            by_hand = float(metric(hf, batch)) - clean
        finally:
            handle.remove()
    for subject in (tl_bridge("bert"), nnsight.NNsight(hf)):
        assert not get_backend(subject).mid_on_branch(1)
        found = causal_effects(
            subject, [batch], bases, sites=name, n_null=2, metric=metric, progress=False
        )
        effect = float(found.set_index("statistic")["value"]["delta_metric"])
        assert effect == pytest.approx(by_hand, rel=1e-4, abs=1e-7)
    assert abs(by_hand) > 1e-5
    assert get_backend(tl_bridge("llama")).mid_on_branch(1)


def test_the_default_metric_counts_the_pairs_it_sums_and_refuses_an_encoder(
    llama, one_thread
) -> None:
    """Left padding: the next-token loss sums the pairs of two real tokens, and the mean
    divides by as many; an encoder predicts no next token, so the default metric is
    refused there (a metric of one's own runs)."""
    model, batches, _ = llama
    ids = batches[2].clone()
    mask = torch.ones_like(ids)
    mask[1, :4] = mask[2, :2] = 0
    batch = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=mask, return_type="logits")
    nll = (
        -logits[:, :-1].float().log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    )
    pairs = mask[:, 1:].bool() & mask[:, :-1].bool()
    by_hand = float((nll * pairs).sum()) / int(pairs.sum())
    with torch.no_grad():
        found = float(_default_metric(model, batch))
    assert found == pytest.approx(by_hand, rel=1e-6)
    encoder = tl_bridge("bert")
    enc_bases = fit_bases(encoder, [tokens("bert", seed=0)], rank=2, layers=[0], progress=False)
    with pytest.raises(UsageError, match="metric="):
        causal_effects(encoder, [tokens("bert", seed=1)], enc_bases, n_null=2, progress=False)
    mean_norm = lambda m, b: m(b, return_type="logits").norm()  # noqa: E731
    found = causal_effects(
        encoder, [tokens("bert", seed=1)], enc_bases, metric=mean_norm, n_null=2, progress=False
    )
    assert {"delta_metric", "p_value"} <= set(found["statistic"])
