"""The weight-gradient probe: Σ G Gᵀ of the q/k/v and MLP-input weight gradients, checked
against autograd's own ``.grad`` on both backends, the closed forms, hook hygiene and
exact merging."""

from __future__ import annotations

import re
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import hook_counts
from models import hf_model, padded_batch, tl_bridge, tokens

import tangentlens.probes.weight_gradient as wg
from tangentlens.core.compute import syrk
from tangentlens.core.errors import UsageError
from tangentlens.core.significance import energy_ratio, matrix_tests, tangent_tests
from tangentlens.core.stats import Moments, in_float32_range
from tangentlens.core.subspace import TangentBasis, tangent_share
from tangentlens.hooks import INPUT_KINDS, Site, get_backend
from tangentlens.hooks.families import unwrap
from tangentlens.probes import WeightGradientProbe, fit_bases, lm_loss, probe, run
from tangentlens.probes.weight_gradient import (
    fold_flops,
    group_energies,
    matrix_intervals,
    pooled_weight_gram,
    weight_gram,
)

nnsight = pytest.importorskip("nnsight")

pytestmark = pytest.mark.usefixtures("one_thread")

OPTS = {"n_controls": 50, "progress": False}
PROBE = ("weight_gradient",)

# Which weights read each site, by parameter name (bridge names without
# "._original_component"): written out here, independently of `input_linears`.
_WEIGHTS = {
    ("tl", "gpt2"): (r"h\.{l}\.attn\.[qkv]\.weight", r"h\.{l}\.mlp\.c_fc\.weight"),
    ("nnsight", "gpt2"): (r"h\.{l}\.attn\.c_attn\.weight", r"h\.{l}\.mlp\.c_fc\.weight"),
    ("tl", "llama"): (
        r"layers\.{l}\.self_attn\.[qkv]_proj\.weight",
        r"layers\.{l}\.mlp\.(gate|up)_proj\.weight",
    ),
    ("tl", "neox"): (
        r"layers\.{l}\.attention\.[qkv]\.weight",
        r"layers\.{l}\.mlp\.dense_h_to_4h\.weight",
    ),
    ("nnsight", "neox"): (
        r"layers\.{l}\.attention\.query_key_value\.weight",
        r"layers\.{l}\.mlp\.dense_h_to_4h\.weight",
    ),
    ("nnsight", "bert"): (
        r"layer\.{l}\.attention\.self\.(query|key|value)\.weight",
        r"layer\.{l}\.intermediate\.dense\.weight",
    ),
}
_WEIGHTS[("nnsight", "llama")] = _WEIGHTS[("tl", "llama")]
_WEIGHTS[("tl", "bert")] = _WEIGHTS[("nnsight", "bert")]
_WEIGHTS[("tl", "native")] = (
    r"layers\.{l}\.attn\.[qkv]\.weight",
    r"layers\.{l}\.mlp\.fc_in\.weight",
)


def _nnsight(arch: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BERT's `output` submodules are renamed E_output
        return nnsight.NNsight(hf_model(arch))


def _model(kind: str, arch: str) -> Any:
    return tl_bridge(arch) if kind == "tl" else _nnsight(arch)


def _torch_module(model: Any) -> torch.nn.Module:
    return model if isinstance(model, torch.nn.Module) else unwrap(model)


def _loss(arch: str):
    if arch != "bert":
        return lm_loss

    def masked_loss(model: Any, batch: dict) -> torch.Tensor:
        out = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        logits = getattr(out, "logits", out)
        return logits.float().log_softmax(-1)[..., 3][batch["attention_mask"].bool()].sum()

    return masked_loss


def _batches(arch: str) -> list[dict]:
    return [padded_batch(arch, batch=3, pos=12, seed=s) for s in range(3)]


def _input_bases(model: Any, batches: list) -> Any:
    def inputs(name: str) -> bool:
        return Site.from_hook_name(name).kind in INPUT_KINDS

    return fit_bases(model, batches, rank=4, sites=inputs, progress=False)


def _autograd_matrices(kind: str, arch: str, model: Any, batches: list) -> dict[Site, torch.Tensor]:
    """Σ over batches and weights of G Gᵀ, G the input side of each weight's ``.grad``."""
    module = _torch_module(model)
    params = dict(module.named_parameters())
    out: dict[Site, torch.Tensor] = {}
    for batch in batches:
        module.zero_grad(set_to_none=True)
        _loss(arch)(model, batch).backward()
        for layer in range(2):
            for kind_, pattern in zip(INPUT_KINDS, _WEIGHTS[(kind, arch)], strict=True):
                regex = re.compile(r"(^|\.)" + pattern.format(l=layer) + "$")
                names = [n for n in params if regex.search(n.replace("._original_component", ""))]
                assert names, (kind, arch, pattern)
                for name in names:
                    owner = module.get_submodule(name.rsplit(".", 1)[0])
                    grad = params[name].grad.double()
                    # nn.Linear stores (out, in); GPT-2's Conv1D stores (in, out)
                    g = grad if type(owner).__name__ == "Conv1D" else grad.T
                    site = Site(layer, kind_)
                    out[site] = out.get(site, 0) + g @ g.T
    module.zero_grad(set_to_none=True)
    return out


# ------------------------------------------------------------------ autograd reference
@pytest.mark.parametrize(
    ("kind", "arch"),
    [
        ("tl", "gpt2"),
        ("nnsight", "gpt2"),
        ("tl", "llama"),
        ("nnsight", "llama"),
        ("tl", "neox"),
        ("nnsight", "neox"),
        ("tl", "bert"),
        ("nnsight", "bert"),
        ("tl", "native"),
    ],
)
def test_tangent_share_matches_autograd_weight_gradients(kind: str, arch: str) -> None:
    """Per batch, the weights' own ``.grad`` (model.zero_grad, loss.backward) give Σ G Gᵀ;
    the probe, fed by hooks inside `run`, reproduces it and its tangent share."""
    model, batches = _model(kind, arch), _batches(arch)
    bases = _input_bases(model, batches)
    session = run(model, batches, bases, PROBE, loss=_loss(arch), **OPTS)
    probe_ = session.probes["weight_gradient"]
    expected = _autograd_matrices(kind, arch, model, batches)
    table = session.results()
    worst_share = worst_matrix = 0.0
    for site, s in probe_.matrices().items():
        ref = expected[site]
        worst_matrix = max(worst_matrix, float((s - ref).norm() / ref.norm()))
        got = table.query(f"hook == '{site.hook_name}' and statistic == 'tangent_share'")
        want = tangent_share(ref, bases[site])
        worst_share = max(worst_share, abs(float(got["value"].item()) - want) / want)
    print(f"\n{kind}/{arch}: max rel. error S {worst_matrix:.1e}, tangent_share {worst_share:.1e}")
    assert worst_share < 1e-6
    assert worst_matrix < 1e-5
    passes = table.query("statistic == 'n_passes'")["value"]
    assert len(passes) == 4 and (passes == len(batches)).all()


def _folds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the passes folded from X and Δ (`pooled_weight_gram`), not from G."""
    calls: list[int] = []
    fold = wg.pooled_weight_gram

    def counted(x: torch.Tensor, deltas: list[torch.Tensor]) -> torch.Tensor:
        calls.append(len(deltas))
        return fold(x, deltas)

    monkeypatch.setattr(wg, "pooled_weight_gram", counted)
    return calls


@pytest.mark.parametrize(
    ("kind", "arch", "padded"),
    [
        ("tl", "gpt2", False),  # the bridge's q, k, v split from the fused Conv1D
        ("nnsight", "gpt2", False),  # Conv1D: the weight's gradient is G itself
        ("tl", "llama", False),
        ("nnsight", "neox", False),  # fused query_key_value, nn.Linear
        ("nnsight", "bert", False),
        ("tl", "llama", True),
    ],
)
def test_a_user_backward_gives_g_from_the_weights(
    kind: str, arch: str, padded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Around a user's ``loss.backward()`` the weights' own gradients are G: the probe
    reads S from them (no fold of X and Δ) and matches autograd's ``.grad``, which it
    leaves as the unprobed backward makes them. A padded batch folds X and Δ over the
    kept positions instead (the weight's gradient sums over the padded ones too)."""
    model = _model(kind, arch)
    if padded:
        batches = _batches(arch)
    else:
        batches = [
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            for ids in (tokens(arch, 3, 12, seed=s) for s in range(3))
        ]
    bases = _input_bases(model, batches)
    expected = _autograd_matrices(kind, arch, model, batches)
    module = _torch_module(model)
    plain = {n: p.grad for n, p in module.named_parameters()}  # after the last batch
    folds = _folds(monkeypatch)
    with probe(model, bases, PROBE, n_controls=10) as session:
        for batch in batches:
            module.zero_grad(set_to_none=True)
            _loss(arch)(model, batch).backward()
    probed = {n: p.grad for n, p in module.named_parameters()}
    assert all(torch.equal(plain[n], probed[n]) for n in plain if plain[n] is not None)
    module.zero_grad(set_to_none=True)
    assert (len(folds) > 0) == padded
    probe_ = session.probes["weight_gradient"]
    for site, s in probe_.matrices().items():
        error = float((s - expected[site]).norm() / expected[site].norm())
        assert error < (1e-5 if padded else 1e-6), (site, error)
    passes = session.results().query("statistic == 'n_passes'")["value"]
    assert len(passes) == 4 and (passes == len(batches)).all()


def test_weights_serve_one_pass_per_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two forwards under one backward give each weight G_1 + G_2: both passes fold X and
    Δ, so S is still Σ_pass G Gᵀ. Without ``zero_grad`` between passes the hook reads
    each backward's own gradient, not ``.grad``'s running sum; a frozen map (W_K) folds
    X and Δ beside the others' G."""
    gen = torch.Generator().manual_seed(1)
    d = 6
    maps, p, handles = _maps_probe(d)
    site, folds = Site(0, "attn_in"), _folds(monkeypatch)
    xs = [torch.randn(2, 5, d, generator=gen) + 2 for _ in range(4)]

    def loss(x: torch.Tensor) -> torch.Tensor:
        q, k, v = maps(x)
        return q.square().sum() + (k * v).sum()

    def per_pass(x: torch.Tensor) -> torch.Tensor:
        grads = torch.autograd.grad(loss(x), [m.weight for m in (maps.q, maps.k, maps.v)])
        return sum(g.double().T @ g.double() for g in grads)

    try:
        want = sum(per_pass(x) for x in xs)  # `autograd.grad`: folded, then forgotten
        p.reset()
        folds.clear()
        (loss(xs[0]) + loss(xs[1])).backward()
        assert len(folds) == 2  # one fold per pass, each with its three Δ
        loss(xs[2]).backward()
        loss(xs[3]).backward()  # .grad accumulates; the hooks see each backward alone
        assert len(folds) == 2
        torch.testing.assert_close(p.matrices()[site], want, rtol=1e-6, atol=0)
        assert float(p.state(f"passes/{site.hook_name}").value) == 4

        maps.k.weight.requires_grad_(False)
        p.reset()
        x = xs[0].clone().requires_grad_()  # so W_K's output still gets its Δ
        loss(x).backward()
        assert folds[-1] == 1  # W_K's Δ alone; W_Q's and W_V's G from their weights
        got = p.matrices()[site]  # before the reference's passes reach the hooks
        q, k, v = maps(x)
        delta_k = torch.autograd.grad(q.sum() + (k * v).sum(), k)[0].reshape(-1, 4).double()
        g_k = x.detach().reshape(-1, d).double().T @ delta_k
        grads = torch.autograd.grad(loss(x), [maps.q.weight, maps.v.weight])
        want = sum(g.double().T @ g.double() for g in grads) + g_k @ g_k.T
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    finally:
        for handle in handles:
            handle.remove()
        maps.k.weight.requires_grad_(True)
    assert all(not m.weight._backward_hooks for m in (maps.q, maps.k, maps.v))


def test_a_padded_and_a_whole_pass_under_one_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A padded pass never reads its weights, yet its Δ is in their gradient: a whole pass
    backpropagated with it folds X and Δ too, so neither counts the other's G."""
    arch = "llama"
    model = tl_bridge(arch)
    padded = padded_batch(arch, batch=3, pos=12, seed=0)
    ids = tokens(arch, 3, 12, seed=1)
    whole = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    bases = _input_bases(model, [padded, whole])
    expected = _autograd_matrices("tl", arch, model, [padded, whole])
    folds = _folds(monkeypatch)
    with probe(model, bases, PROBE, n_controls=10) as session:
        (lm_loss(model, padded) + lm_loss(model, whole)).backward()
    model.zero_grad(set_to_none=True)
    assert len(folds) == 2 * len(bases)  # each site's two passes, from X and Δ
    for site, s in session.probes["weight_gradient"].matrices().items():
        assert float((s - expected[site]).norm() / expected[site].norm()) < 1e-5, site


def test_autocast_folds_and_create_graph_keeps_no_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under autocast a weight's gradient is a product of bfloat16-rounded factors: the
    pass folds X and Δ instead. A backward with ``create_graph`` runs the weight hooks
    with grad on: the Grams they add carry no graph."""
    gen = torch.Generator().manual_seed(3)
    d = 16
    maps, p, handles = _maps_probe(d)
    site, folds = Site(0, "attn_in"), _folds(monkeypatch)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q, k, v = maps(torch.randn(2, 40, d, generator=gen))
            loss = q.float().square().sum() + (k * v).float().sum()
        loss.backward()
        assert len(folds) == 1
        p.reset()
        maps.zero_grad(set_to_none=True)
        q, k, v = maps(torch.randn(2, 40, d, generator=gen))
        (q.square().sum() + (k * v).sum()).backward(create_graph=True)
        s = p.matrices()[site]
        assert len(folds) == 1 and not s.requires_grad and s.grad_fn is None
        grads = [m.weight.grad.detach().double() for m in (maps.q, maps.k, maps.v)]
        want = sum(g.T @ g for g in grads)
        assert float((s - want).norm() / want.norm()) < 1e-6
    finally:
        for handle in handles:
            handle.remove()
        maps.zero_grad(set_to_none=True)


@pytest.mark.parametrize(("tokens_", "folded"), [(3, True), (200, False)])
def test_the_cheaper_of_weights_and_fold(
    tokens_: int, folded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass of few tokens against d folds X and Δ (`fold_flops`: the token Gram is
    cheaper than the weights' d × d Grams); a long one reads the weights' gradients.
    Either way S is the weights' Σ G Gᵀ."""
    gen = torch.Generator().manual_seed(2)
    d = 64
    maps, p, handles = _maps_probe(d)
    folds = _folds(monkeypatch)
    try:
        q, k, v = maps(torch.randn(1, tokens_, d, generator=gen) + 1)
        (q.square().sum() + (k * v).sum()).backward()
        got = p.matrices()[Site(0, "attn_in")]
    finally:
        for handle in handles:
            handle.remove()
    assert (len(folds) == 1) == folded
    want = sum(m.weight.grad.double().T @ m.weight.grad.double() for m in (maps.q, maps.k, maps.v))
    assert float((got - want).norm() / want.norm()) < 1e-6


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_closed_forms(arch: str) -> None:
    """energy_ratio is the closed form of the share; normalized_ratio divides by the same
    ratio of the inputs' uncentred second moment, computed here from run_with_cache."""
    model, batches = tl_bridge(arch), _batches(arch)
    bases = _input_bases(model, batches)
    table = run(model, batches, bases, PROBE, **OPTS).results()
    inputs = {Site(layer, k): Moments() for layer in range(2) for k in INPUT_KINDS}
    for batch in batches:
        names = {s: f"blocks.{s.layer}.{s.kind[:-3]}.hook_in" for s in inputs}
        _, cache = model.run_with_cache(
            batch["input_ids"],
            attention_mask=batch["attention_mask"],
            names_filter=list(names.values()),
        )
        for site, name in names.items():
            inputs[site].update(cache[name], batch["attention_mask"])
    for site, moments in inputs.items():
        stats = table[table.hook == site.hook_name].set_index("statistic")["value"]
        k, d = bases[site].k, bases[site].d
        ratio = energy_ratio(float(stats["tangent_share"]), k, d)
        assert abs(stats["energy_ratio"] - ratio) <= 1e-9 * ratio
        activation_ratio = energy_ratio(tangent_share(moments, bases[site]), k, d)
        assert stats["normalized_ratio"] == pytest.approx(ratio / activation_ratio, rel=1e-9)
        assert stats["chance_share"] == k / d
        assert 0 < stats["p_value"] <= 1 and 0 < stats["p_value_normal"] <= 1


def test_matrix_tests_equal_tangent_tests_on_a_second_moment() -> None:
    """The matrix entry of `significance` is the energy test of `tangent_tests`: same
    controls, same frames, same numbers."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(500, 24, generator=gen, dtype=torch.float64) * torch.linspace(0.2, 2, 24)
    moments = Moments().update(x)
    basis = TangentBasis.fit(Moments().update(x[:250]), 3)
    acts = Moments().update(x[250:] + 1)
    opts = {"n_controls": 200, "seed": 3, "activation_moments": acts}
    by_matrix = matrix_tests(moments.second_moment(), basis, **opts)
    by_moments = tangent_tests(moments, basis, **opts)
    assert set(by_matrix) == {
        "tangent_share",
        "chance_share",
        "energy_ratio",
        "p_value",
        "p_value_normal",
        "normalized_ratio",
    }
    for key, value in by_matrix.items():
        assert value == pytest.approx(by_moments[key], rel=1e-12, abs=0), key
    # what a probe with a fixed basis keeps of the activations: their tangent share
    share = tangent_share(acts, basis)
    by_share = matrix_tests(
        moments.second_moment(), basis, n_controls=200, seed=3, activation_share=share
    )
    assert by_share == by_matrix
    with pytest.raises(UsageError, match="activation_share"):
        matrix_tests(moments.second_moment(), basis, activation_share=share, **opts)
    with pytest.raises(UsageError, match="finite square"):
        matrix_tests(torch.ones(3, 4), basis)
    with pytest.raises(UsageError, match="basis has d=24"):
        matrix_tests(torch.eye(8), basis)


# ------------------------------------------------------------------ hygiene
def test_parameters_grad_and_hooks_are_untouched() -> None:
    """`run` leaves every ``.grad`` None and every hook as it was; around a user's
    backward the ``.grad`` are exactly the unprobed ones; a graph built in the session
    and backpropagated after it is not seen (its tensor hooks are gone)."""
    arch = "llama"
    model, batches = tl_bridge(arch), _batches(arch)
    bases = _input_bases(model, batches)
    model.zero_grad(set_to_none=True)
    before = hook_counts(model)
    try:
        session = run(model, batches, bases, PROBE, **OPTS)
        assert all(p.grad is None for p in model.parameters())
        assert hook_counts(model) == before
        assert (session.results().query("statistic == 'n_passes'")["value"] == 3).all()

        lm_loss(model, batches[0]).backward()
        plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        with probe(model, bases, PROBE, n_controls=10) as session:
            assert hook_counts(model) != before
            lm_loss(model, batches[0]).backward()
            late = lm_loss(model, batches[1])
        assert hook_counts(model) == before
        probed = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert plain.keys() == probed.keys()
        assert all(torch.equal(plain[n], probed[n]) for n in plain)
        state = session.probes["weight_gradient"].state_dict()
        late.backward()
        after = session.probes["weight_gradient"].state_dict()
        assert all(torch.equal(state[k], after[k]) for k in state)

        with pytest.raises(RuntimeError, match="boom"), probe(model, bases, PROBE):
            lm_loss(model, batches[0])
            raise RuntimeError("boom")
        assert hook_counts(model) == before
    finally:
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", ["tl", "nnsight"])
def test_a_graph_kept_past_later_passes_is_not_seen_after_the_session(kind: str) -> None:
    """A graph built first in the session and backpropagated after it, once later passes
    have run (its outputs' tensors freed, its hooks alive in the graph): its gradients do
    not reach the closed session, and no hook of it is left."""
    arch = "gpt2"
    model, batches = _model(kind, arch), _batches(arch)
    bases = _input_bases(model, batches)
    before = hook_counts(model)
    try:
        with probe(model, bases, PROBE, n_controls=10) as session:
            kept = lm_loss(model, batches[0])
            lm_loss(model, batches[1]).backward()
        assert hook_counts(model) == before
        state = session.probes["weight_gradient"].state_dict()
        kept.backward()
        after = session.probes["weight_gradient"].state_dict()
        assert all(torch.equal(state[k], after[k]) for k in state)
        passes = session.results().query("statistic == 'n_passes'")["value"]
        assert len(passes) == 4 and (passes == 1).all()
    finally:
        unwrap(model).zero_grad(set_to_none=True)


def test_frozen_model_inside_a_user_backward() -> None:
    """On a frozen model the session's embedding leaf carries the gradient to the maps."""
    arch = "gpt2"
    model, batches = _nnsight(arch), _batches(arch)
    bases = _input_bases(model, batches)
    unwrap(model).requires_grad_(False)
    with probe(model, bases, PROBE, n_controls=10) as session:
        for batch in batches:
            lm_loss(model, batch).backward()
    assert all(p.grad is None for p in unwrap(model).parameters())
    passes = session.results().query("statistic == 'n_passes'")["value"]
    assert len(passes) == 4 and (passes == 3).all()


# ------------------------------------------------------------------ state
def test_merge_of_two_half_runs_equals_one_run() -> None:
    arch = "gpt2"
    model, batches = tl_bridge(arch), _batches(arch)
    bases = _input_bases(model, batches)
    whole = run(model, batches, bases, PROBE, **OPTS).probes["weight_gradient"]
    first = run(model, batches[:1], bases, PROBE, **OPTS).probes["weight_gradient"]
    second = run(model, batches[1:], bases, PROBE, **OPTS).probes["weight_gradient"]
    other = _input_bases(model, batches[1:])  # another Q_T: its energies are not these
    with pytest.raises(UsageError, match="same bases"):
        first.merge(run(model, batches[1:], other, PROBE, **OPTS).probes["weight_gradient"])
    merged = first.merge(second)
    assert whole.state_dict().keys() == merged.state_dict().keys()
    # groups follow each run's own passes; the totals are what must agree
    for site, total in whole.matrices().items():
        torch.testing.assert_close(merged.matrices()[site], total, rtol=1e-12, atol=0)
    read = {site: bases[site] for site in whole.bases}
    with pytest.raises(ValueError, match="n_groups"):  # another number of groups
        WeightGradientProbe(read, get_backend(model)).load_state_dict(merged.state_dict())
    loaded = WeightGradientProbe(read, get_backend(model), n_controls=50, n_groups=10)
    loaded.load_state_dict(merged.state_dict())
    rows, loaded_rows = merged.rows(), loaded.rows()
    assert rows == loaded_rows and len(rows) == 4 * 7


def test_sites_without_bases_collect_what_computes_the_same_rows() -> None:
    """S is basis-free: a probe given only the sites (a study fits Q_T afterwards) keeps
    each group's S_g and activations whole; one given bases keeps the total S and each
    group's two energies tr(Q_TᵀS_gQ_T), tr(S_g). `compute` against the same bases gives
    the same rows from both; the free one has no rows of its own (no basis)."""
    arch = "gpt2"
    model, batches = tl_bridge(arch), _batches(arch)
    bases = _input_bases(model, batches)
    based = run(model, batches, bases, PROBE, **OPTS).probes["weight_gradient"]
    free = WeightGradientProbe(
        list(bases.by_site()),
        get_backend(model),
        n_groups=based.n_groups,
        n_controls=based.n_controls,
    )
    run(model, batches, None, [free], progress=False)
    assert free.basis_free and free.rows() == []
    ours, theirs = free.state_dict(), based.state_dict()
    assert {k for k in ours if k.startswith("passes")} == {k for k in theirs if "passes" in k}
    for key in (k for k in theirs if k.startswith("passes")):
        assert torch.equal(ours[key], theirs[key]), key
    computed = {(r["hook"], r["statistic"]): r for r in free.compute(bases.by_site())}
    rows = {(r["hook"], r["statistic"]): r for r in based.rows()}
    assert computed.keys() == rows.keys()
    for key, r in rows.items():
        for column in ("value", "ci_low", "ci_high"):
            mine, expected = computed[key].get(column), r.get(column)
            if expected is None:
                assert mine is None, (key, column)
            else:
                assert mine == pytest.approx(expected, rel=1e-9, nan_ok=True), (key, column)
    for site, total in free.matrices().items():
        torch.testing.assert_close(based.matrices()[site], total, rtol=1e-12, atol=0)
        groups = free.group_matrices(site)
        torch.testing.assert_close(
            based.group_energies(site), group_energies(groups, bases[site]), rtol=1e-12, atol=0
        )
        cis = matrix_intervals(groups, bases[site])
        for statistic, (low, high) in cis.items():
            r = rows[(site.hook_name, statistic)]
            assert r["ci_low"] == pytest.approx(low, rel=1e-12)
            assert r["ci_high"] == pytest.approx(high, rel=1e-12)
    with pytest.raises(UsageError, match="group_energies"):
        based.group_matrices(next(iter(based.bases)))
    n = sum(t.numel() for k, t in theirs.items() if k.startswith("wgrad"))
    d = next(iter(bases.values())).d
    assert n == len(based.sites) * (d * d + 2 * based.n_groups)  # S, and two energies a group


# ------------------------------------------------------------------ sites and errors
@pytest.mark.parametrize("arch", ["gpt2", "llama", "neox", "bert", "native"])
def test_input_linears_read_the_site(arch: str) -> None:
    """Every map `input_linears` names takes the site's activation as its input."""
    backends = [get_backend(tl_bridge(arch))]
    if arch != "native":
        backends.append(get_backend(_nnsight(arch)))
    for be in backends:
        for kind in INPUT_KINDS:
            seen = _inputs_seen(be, Site(1, kind), tokens(arch))
            assert len(seen) > 1, (arch, kind)
            for name, x in seen.items():
                assert torch.equal(x, seen["site"]), (type(be).__name__, arch, name)


def _inputs_seen(be: Any, site: Site, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The site's activation and each input linear's input, in one forward pass."""
    seen: dict[str, torch.Tensor] = {}
    handles = [be.add_forward_hook(site, lambda x: seen.update(site=x))]
    for name, module in be.input_linears(site):
        hook = module.register_forward_hook(lambda m, a, o, n=name: seen.update({n: a[0]}))
        handles.append(hook)
    try:
        with torch.no_grad():
            be.model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_bad_sites_name_the_fix() -> None:
    model = tl_bridge("gpt2")
    be = get_backend(model)
    basis = TangentBasis(torch.eye(32, dtype=torch.float64)[:, :4])
    with pytest.raises(UsageError, match="inputs of linear maps"):
        WeightGradientProbe({Site(0, "resid_pre"): basis}, be)
    for backend in (be, get_backend(_nnsight("gpt2"))):
        with pytest.raises(UsageError, match="read by linear maps"):
            backend.input_linears(Site(0, "resid_post"))
    with pytest.warns(UserWarning, match="weight_gradient probe has no site.*mlp_in"):
        probe(model, {"blocks.0.hook_resid_pre": basis}, ("residual", "weight_gradient"))


# ------------------------------------------------------------------ pooled fold
def test_token_gram_form_equals_direct_form() -> None:
    """Σ_m G_mG_mᵀ from the token Gram K = Σ_m Δ_mΔ_mᵀ equals the one from each G_m,
    both against float64, on inputs far from zero mean, Δ with an offset per output, and
    padded positions dropped as the probe drops them."""
    gen = torch.Generator().manual_seed(0)
    for n, d, outs in ((60, 48, (48, 16, 16)), (300, 40, (96, 96)), (7, 64, (64,))):
        x = torch.randn(n, d, generator=gen) * 0.3 + 5 * torch.randn(d, generator=gen)
        deltas = [
            torch.randn(n, o, generator=gen) * 1e-3 + 2e-4 * torch.randn(o, generator=gen)
            for o in outs
        ]
        keep = torch.rand(n, generator=gen) > 0.2
        x, deltas = x[keep], [t[keep] for t in deltas]
        grams = [(x.double().T @ t.double()) for t in deltas]
        want = sum(g @ g.T for g in grams)
        forms = {f: pooled_weight_gram(x, deltas, f) for f in ("direct", "token", "auto")}
        forms["per map"] = sum(weight_gram(x, t) for t in deltas)
        for form, got in forms.items():
            assert torch.equal(got, got.T), form
            error = float((got - want).norm() / want.norm())
            assert error < 1e-6, (n, d, form, error)
        token, direct = forms["token"], forms["direct"]
        assert float((token - direct).norm() / direct.norm()) < 1e-6
        cheaper = min(("direct", "token"), key=lambda f: fold_flops(len(x), d, sum(outs), f))
        assert torch.equal(forms["auto"], forms[cheaper])
    x64, d64 = x.double(), [t.double() for t in deltas]  # no float32 products: float64
    for form in ("direct", "token"):
        got = pooled_weight_gram(x64, d64, form)
        assert torch.equal(got, got.T)
        assert float((got - want).norm() / want.norm()) < 1e-12, form
    empty = pooled_weight_gram(torch.ones(0, 4), [torch.ones(0, 3)])
    assert torch.equal(empty, torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(UsageError, match="form must be"):
        pooled_weight_gram(x, deltas, "gram")


def test_gradient_gram_unscaled_in_range_and_scaled_outside() -> None:
    """G Gᵀ of a float32 G: inside float32's range formed unscaled, equal bit for bit to
    the scaled product (2^64·G is scaled: 2^128 times the same); far outside it (squares
    past float32's range, or below its normal numbers) scaled, within 1e-6 of float64."""
    gen = torch.Generator().manual_seed(3)
    g = (torch.randn(96, 40, generator=gen) * torch.logspace(-2, 0, 40)).T * 1e-3  # a view
    gram = wg.gradient_gram(g, torch.float32)
    assert torch.equal(gram, gram.T) and gram.dtype == torch.float64
    assert in_float32_range(syrk([g])) and not in_float32_range(syrk([g * 2.0**64]))
    assert torch.equal(wg.gradient_gram(g * 2.0**64, torch.float32), gram * 2.0**128)
    for factor in (1e30, 1e-28):
        big = (g.double() * factor).float()
        want = big.double() @ big.double().T
        got = wg.gradient_gram(big, torch.float32)
        assert float((got - want).norm() / want.norm()) < 1e-6, factor


@pytest.mark.parametrize("form", ["direct", "token"])
def test_each_form_matches_autograd_weight_gradients(
    form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe with every pass folded in one form reproduces the weights' ``.grad``."""
    fold = wg.pooled_weight_gram
    monkeypatch.setattr(wg, "pooled_weight_gram", lambda x, deltas: fold(x, deltas, form))
    kind, arch = "tl", "llama"
    model, batches = _model(kind, arch), _batches(arch)
    bases = _input_bases(model, batches)
    session = run(model, batches, bases, PROBE, loss=_loss(arch), **OPTS)
    expected = _autograd_matrices(kind, arch, model, batches)
    for site, s in session.probes["weight_gradient"].matrices().items():
        assert float((s - expected[site]).norm() / expected[site].norm()) < 1e-5, site


class _Maps(torch.nn.Module):
    """Three maps reading one input, as W_Q, W_K, W_V read ``attn_in``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, o, bias=False) for o in (d, 4, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.q(x), self.k(x), self.v(x)


def _maps_probe(d: int) -> tuple[_Maps, WeightGradientProbe, Any]:
    maps = _Maps(d)
    backend = SimpleNamespace(
        d_model=d, input_linears=lambda site: [("q", maps.q), ("k", maps.k), ("v", maps.v)]
    )
    p = WeightGradientProbe([Site(0, "attn_in")], backend)  # type: ignore[arg-type]
    return maps, p, p.attach(backend)  # type: ignore[arg-type]


def test_a_map_without_a_gradient_loses_and_repeats_no_pass() -> None:
    """A map a backward does not reach (W_K unused) sends no Δ: each pass is still folded
    once, with the Δ that came, at the next forward or when the state is read; a Δ that
    comes after its pass was folded (a second backward of a kept graph) is added alone."""
    gen = torch.Generator().manual_seed(0)
    d = 8
    maps, p, handles = _maps_probe(d)
    site, want = Site(0, "attn_in"), torch.zeros(d, d, dtype=torch.float64)

    def grams() -> torch.Tensor:
        out = torch.zeros(d, d, dtype=torch.float64)
        for m in (maps.q, maps.k, maps.v):
            if m.weight.grad is not None:
                g = m.weight.grad.double().T
                out += g @ g.T
                m.weight.grad = None
        return out

    def passes() -> float:
        return float(p.state(f"passes/{site.hook_name}").value)

    for _ in range(3):  # W_K unused: each pass waits until the next forward
        q, _, v = maps(torch.randn(5, d, generator=gen) + 3)
        (q.square().sum() + v.sin().sum()).backward()
        want += grams()
    assert passes() == 3
    torch.testing.assert_close(p.matrices()[site], want, rtol=1e-6, atol=0)

    q, k, v = maps(torch.randn(2, 6, d, generator=gen))  # q first; k, v after the read
    q.square().sum().backward(retain_graph=True)
    want += grams()
    assert passes() == 4
    (k.cos().sum() + v.sum()).backward(retain_graph=True)
    want += grams()
    (k.cos().sum() + v.sum()).backward()  # a second backward of the graph is not read
    grams()
    for handle in handles:
        handle.remove()
    assert passes() == 4
    torch.testing.assert_close(p.matrices()[site], want, rtol=1e-6, atol=0)
    state = p.state_dict()
    maps(torch.randn(3, d, generator=gen))[0].sum().backward()  # hooks gone: not seen
    assert all(torch.equal(t, p.state_dict()[key]) for key, t in state.items())
