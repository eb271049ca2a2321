"""Layerwise linear probes: a planted decodable label, the exact split, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models import tl_bridge

from tangentlens.analysis.layerwise import layerwise_probe, plot_layerwise
from tangentlens.core.errors import UsageError
from tangentlens.probes import fit_bases


def _batches(n: int = 12, pos: int = 16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    vocab = torch.arange(2, 18)  # 16 distinct tokens in d_model=32: linearly separable
    return [vocab[torch.randint(0, 16, (4, pos), generator=gen)] for _ in range(n)]


def test_a_label_decodable_from_the_embedding_is_found_at_layer_0(one_thread) -> None:
    model = tl_bridge("llama")
    batches = _batches()
    bases = fit_bases(model, batches[:4], rank=4, progress=False)
    parity = [b % 2 for b in batches]  # a property of the token: lives in the embedding
    table = layerwise_probe(model, batches, bases, parity, tokens_per_layer=600, progress=False)
    acc = table[table["statistic"] == "accuracy"]
    full0 = acc[(acc["layer"] == 0) & (acc["component"] == "full")]
    assert float(full0["value"].iloc[0]) >= 0.9
    assert set(acc["component"]) == {"full", "tangent", "normal"}
    assert (acc["ci_low"] <= acc["value"]).all() and (acc["value"] <= acc["ci_high"]).all()
    chance = table[table["statistic"] == "chance_accuracy"]["value"]
    assert ((chance > 0.4) & (chance < 0.6)).all()  # parity of 16 tokens: about half
    assert set(table["hook"]) <= {f"blocks.{layer}.hook_resid_pre" for layer in range(2)}
    assert plot_layerwise(table).axes


def test_built_in_labels_and_bad_input(one_thread) -> None:
    model = tl_bridge("gpt2")
    batches = _batches(6)
    bases = fit_bases(model, batches[:2], rank=4, progress=False)
    table = layerwise_probe(
        model, batches, bases, "position", tokens_per_layer=300, n_folds=3, progress=False
    )
    assert len(table[table["statistic"] == "accuracy"]) == 3 * 2
    with pytest.raises(UsageError, match="built-in labels"):
        layerwise_probe(model, batches, bases, "colour", progress=False)
    with pytest.raises(UsageError, match="labels has 1 tensors for 6 batches"):
        layerwise_probe(model, batches, bases, [batches[0]], progress=False)
    with pytest.raises(UsageError, match="no basis at attn_out"):
        layerwise_probe(model, batches, bases, "position", site="attn_out", layers=[1])
    with pytest.raises(UsageError, match=r"layers \[5\] do not exist"):
        layerwise_probe(model, batches, bases, "position", layers=[5])
    ignored = [torch.full_like(b, -100) for b in batches]  # Hugging Face's "ignore" label
    with pytest.raises(UsageError, match="labels must be integers >= 0"):
        layerwise_probe(model, batches, bases, ignored, progress=False)


def test_balanced_accuracy_and_auc_beside_accuracy_within_0_1(one_thread) -> None:
    """Unbalanced labels (one token in four): balanced accuracy and AUC are reported with
    their chance levels, agree with sklearn's definitions, and no interval leaves [0, 1]."""
    from sklearn.metrics import roc_auc_score

    from tangentlens.analysis.layerwise import _auc

    model = tl_bridge("llama")
    batches = _batches()
    bases = fit_bases(model, batches[:4], rank=4, progress=False)
    rare = [(b % 4 == 0).long() for b in batches]
    table = layerwise_probe(model, batches, bases, rare, tokens_per_layer=600, progress=False)
    stats = set(table["statistic"])
    assert {"balanced_accuracy", "roc_auc", "chance_balanced_accuracy"} <= stats
    scored = table[table["statistic"].isin(["accuracy", "balanced_accuracy", "roc_auc"])]
    assert ((scored["ci_low"] >= 0) & (scored["ci_high"] <= 1)).all()
    assert (scored["ci_low"] <= scored["value"]).all()
    chance = table.query("statistic == 'chance_balanced_accuracy'")["value"]
    assert (chance == 0.5).all()
    full0 = table.query("layer == 0 and component == 'full' and statistic == 'roc_auc'")
    assert float(full0["value"].iloc[0]) >= 0.9
    gen = np.random.default_rng(0)
    y = gen.integers(0, 3, 60)
    proba = gen.dirichlet(np.ones(3), 60)
    want = roc_auc_score(y, proba, multi_class="ovr", average="macro")
    assert _auc(y, proba, np.arange(3)) == pytest.approx(want)


def test_labels_of_real_tokens_and_samples_a_probe_cannot_fold(one_thread) -> None:
    """ "frequency" counts real tokens only (padding is no token of the text); any integer
    class ids work; a sample with one class, or fewer sequences than folds, is refused by
    name instead of failing inside scikit-learn."""
    from tangentlens.analysis.layerwise import _label_tensors

    ids = _batches(1, pos=12)[0].repeat(2, 1)[:6]
    mask = torch.ones_like(ids)
    mask[1:, 4:] = 0  # heavy right padding, pad id 0
    ids = ids.masked_fill(mask == 0, 0)
    found = _label_tensors("frequency", [ids], [mask])[0][mask.bool()]
    real = ids[mask.bool()]
    counts = torch.bincount(real)[real].double()
    edges = torch.quantile(counts, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    assert torch.equal(found, torch.bucketize(counts, edges))
    model = tl_bridge("llama")
    batches = _batches(6)
    bases = fit_bases(model, batches[:2], rank=4, layers=[1], progress=False)
    big = [(b % 2) * 2**40 for b in batches]  # class ids far beyond the class count
    kwargs = {"layers": [1], "tokens_per_layer": 200, "n_folds": 3, "progress": False}
    table = layerwise_probe(model, batches, bases, big, **kwargs)
    assert float(table.set_index("statistic")["value"]["chance_balanced_accuracy"]) == 0.5
    one = [torch.zeros_like(b) for b in batches]
    with pytest.raises(UsageError, match=r"blocks\.1\.hook_resid_pre holds 1 class"):
        layerwise_probe(model, batches, bases, one, **kwargs)
    few = {**kwargs, "tokens_per_layer": 10, "n_folds": 5}  # 10 tokens: 5 sequences at most
    with pytest.raises(UsageError, match="n_folds=5"):
        for seed in range(6):  # some seeds' samples miss a sequence
            layerwise_probe(model, [batches[0][:, :4].repeat(2, 1)[:5]], bases, "position",
                            seed=seed, **few)  # fmt: skip
