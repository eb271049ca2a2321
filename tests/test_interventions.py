"""Interventions: exact ablation hooks, per-head score edits, causal effects with a null."""

from __future__ import annotations

import pytest
import torch
from models import tl_bridge, tokens

from tangentlens.analysis.interventions import ablate, causal_effects, head_effects, keep_terms
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
