"""Sites, the TransformerLens backend, and hook hygiene on every tiny architecture."""

from __future__ import annotations

import pytest
import torch
from helpers import hook_counts
from models import ALL_MODELS, padded_batch, tl_bridge, tokens

from tangentlens.core.subspace import TangentBasis
from tangentlens.hooks import KINDS, Site, get_backend, select_sites
from tangentlens.hooks.sites import write_targets
from tangentlens.probes import fit_bases, probe

ARCH_LOSS = {"bert": lambda logits: logits.pow(2).mean()}


def _loss(arch: str, model, ids):
    logits = model(ids)
    return ARCH_LOSS.get(arch, lambda lg: lg.log_softmax(-1)[..., 0].sum())(logits)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bases_by_arch() -> dict:
    return {
        a: fit_bases(tl_bridge(a), [tokens(a, 4, 12)], rank=4, progress=False) for a in ALL_MODELS
    }


# ------------------------------------------------------------------ sites
@pytest.mark.parametrize("kind", KINDS)
def test_site_names_round_trip(kind: str) -> None:
    site = Site(0 if kind == "embed" else 3, kind)
    assert Site.from_hook_name(site.hook_name) == site
    assert Site.parse(site) is site


@pytest.mark.parametrize(
    ("name", "site"),
    [
        ("blocks.2.hook_in", Site(2, "resid_pre")),
        ("blocks.2.hook_out", Site(2, "resid_post")),
        ("blocks.2.ln2.hook_in", Site(2, "resid_mid")),
        ("blocks.2.attn.hook_in", Site(2, "attn_in")),
        ("blocks.2.ln1.hook_out", Site(2, "attn_in")),
        ("blocks.2.mlp.hook_in", Site(2, "mlp_in")),
        ("blocks.2.ln2.hook_out", Site(2, "mlp_in")),
        ("blocks.2.mlp.hook_out", Site(2, "mlp_out")),
        ("embed.hook_out", Site(0, "embed")),
    ],
)
def test_site_synonyms(name: str, site: Site) -> None:
    assert Site.parse(name) == site


def test_site_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        Site(0, "resid")
    with pytest.raises(ValueError, match="layer must be an int >= 0"):
        Site(-1, "resid_pre")
    with pytest.raises(ValueError, match="not a probe site; use one of"):
        Site.parse("blocks.0.attn.hook_pattern")
    with pytest.raises(TypeError):
        Site.parse(3)


def test_a_write_lands_in_the_residual_sites_after_it() -> None:
    assert write_targets(Site(2, "attn_out")) == [
        Site(2, "resid_mid"),
        Site(2, "resid_post"),
        Site(3, "resid_pre"),
    ]
    assert write_targets(Site(2, "mlp_out")) == [Site(2, "resid_post"), Site(3, "resid_pre")]


def test_select_sites_names_filter_vocabulary() -> None:
    available = [Site(layer, k) for layer in range(2) for k in ("resid_pre", "resid_post")]
    assert select_sites(available) == available
    assert select_sites(available, "blocks.1.hook_resid_pre") == [Site(1, "resid_pre")]
    assert select_sites(available, ["blocks.0.hook_out", "blocks.0.hook_resid_post"]) == [
        Site(0, "resid_post")
    ]
    assert select_sites(available, lambda n: n.endswith("resid_post")) == available[1::2]
    with pytest.raises(ValueError, match="does not exist on this model"):
        select_sites(available, "blocks.5.hook_resid_pre")


# ------------------------------------------------------------------ backend
@pytest.mark.parametrize("arch", ALL_MODELS)
def test_backend_sites_and_attention_input(arch: str) -> None:
    model = tl_bridge(arch)
    be = get_backend(model)
    assert (be.n_layers, be.d_model) == (2, 32)
    assert be.causal == (arch != "bert")
    kinds = {s.kind for s in be.sites()}
    assert ("resid_mid" in kinds) == (arch != "neox")  # NeoX: parallel residual
    if arch == "neox":
        with pytest.raises(ValueError, match="no resid_mid"):
            be.hook_point(Site(0, "resid_mid"))
    # attn_in is the exact input of W_Q (q = attn_in @ W_Q + b_Q), mlp_in that of W_in
    ids = tokens(arch)
    seen = {}
    handles = [
        be.add_forward_hook(Site(1, kind), lambda x, kind=kind: seen.setdefault(kind, x))
        for kind in ("attn_in", "mlp_in")
    ]
    names = ["blocks.1.attn.q.hook_in", "blocks.1.mlp.in.hook_in"]
    try:
        _, cache = model.run_with_cache(ids, names_filter=names)
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(seen["attn_in"], cache[names[0]], rtol=0, atol=0)
    torch.testing.assert_close(seen["mlp_in"], cache[names[1]], rtol=0, atol=0)


def test_unknown_model_type_is_rejected() -> None:
    with pytest.raises(TypeError, match="no tangentlens backend"):
        get_backend(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------ hygiene
@pytest.mark.parametrize("arch", ALL_MODELS)
def test_hook_hygiene(arch: str, bases_by_arch: dict) -> None:
    model, bases = tl_bridge(arch), bases_by_arch[arch]
    ids = tokens(arch)
    fired = {"fwd": 0, "bwd": 0}

    def user_fwd(x, hook):
        fired["fwd"] += 1

    def user_bwd(g, hook):
        fired["bwd"] += 1

    hp = model.hook_dict["blocks.0.hook_resid_pre"]
    user_handles = [hp.add_hook(user_fwd), hp.add_hook(user_bwd, dir="bwd")]
    try:
        before = hook_counts(model)
        probes = ("residual", "gradient", "attention")
        # plain use, forward and backward, nested in a second session
        with probe(model, bases, probes, n_controls=50) as outer:
            with probe(model, bases, ("residual",)) as inner:
                assert hook_counts(model) != before
                _loss(arch, model, ids).backward()
            _loss(arch, model, ids).backward()
        assert hook_counts(model) == before
        assert outer.results()["value"].notna().all()
        assert inner.gradient_moments == {}
        assert fired == {"fwd": 2, "bwd": 2}
        # an exception, then a KeyboardInterrupt, inside the block
        for exc in (RuntimeError("boom"), KeyboardInterrupt()):
            with pytest.raises(type(exc)), probe(model, bases, probes):
                model(ids)
                raise exc
            assert hook_counts(model) == before

        # an exception raised mid-forward, inside the model
        def raiser(x, hook):
            raise ValueError("mid-forward")

        with pytest.raises(ValueError, match="mid-forward"), probe(model, bases, probes):
            model.run_with_hooks(ids, fwd_hooks=[("blocks.1.hook_resid_pre", raiser)])
        assert hook_counts(model) == before
        # the user's TL context managers and reset_hooks inside a session
        with probe(model, bases, ("residual",)) as session:
            model.run_with_hooks(ids, fwd_hooks=[("blocks.1.hook_resid_pre", user_fwd)])
            model.run_with_cache(ids, names_filter="blocks.0.hook_resid_post")
            with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", user_fwd)]):
                model(ids)
        assert hook_counts(model) == before
        n = session.results().query("statistic == 'n_tokens'")["value"]
        assert (n == 3 * ids.numel()).all()
        fired["fwd"] = 0
        model(ids)
        assert fired["fwd"] == 1  # the user's hook is still there and still fires
    finally:
        model.zero_grad(set_to_none=True)
        for h in user_handles:
            h.hook.remove()
        hp.fwd_hooks = [h for h in hp.fwd_hooks if h not in user_handles]
        hp.bwd_hooks = [h for h in hp.bwd_hooks if h not in user_handles]


def test_user_reset_hooks_inside_a_session_does_not_break_exit(bases_by_arch: dict) -> None:
    model, bases = tl_bridge("gpt2"), bases_by_arch["gpt2"]
    before = hook_counts(model)
    with probe(model, bases, ("residual",)):
        model.reset_hooks()
    assert hook_counts(model) == before


def test_backward_hooks_fire_on_a_frozen_model(bases_by_arch: dict) -> None:
    model, bases = tl_bridge("llama"), bases_by_arch["llama"]
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    try:
        model.zero_grad(set_to_none=True)
        model.requires_grad_(False)
        batch = padded_batch("llama")
        with probe(model, bases, ("gradient",)) as session:
            logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
            logits.log_softmax(-1)[..., 0].sum().backward()
        counts = {k: m.count for k, m in session.gradient_moments.items()}
        assert counts and set(counts.values()) == {int(batch["attention_mask"].sum())}
        assert all(p.grad is None for p in model.parameters())
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])


def test_handles_remove_exactly_their_hook() -> None:
    model = tl_bridge("native")
    be = get_backend(model)
    before = hook_counts(model)
    h1 = be.add_forward_hook(Site(0, "resid_pre"), lambda x: None)
    h2 = be.add_forward_hook(Site(0, "resid_pre"), lambda x: None)
    h1.remove()
    h1.remove()  # idempotent
    counts = hook_counts(model)["blocks.0.hook_in"]
    assert counts[1] == before["blocks.0.hook_in"][1] + 1  # one torch forward hook
    assert counts[4] == before["blocks.0.hook_in"][4] + 1  # one TL handle
    h2.remove()
    assert hook_counts(model) == before


def test_basis_for_wrong_width_is_rejected() -> None:
    bad = {"blocks.0.hook_resid_pre": TangentBasis(torch.eye(16)[:, :2])}
    with pytest.raises(ValueError, match=r"d=16 but the model has d_model=32.*fit_bases"):
        probe(tl_bridge("gpt2"), bad, ("residual",))
