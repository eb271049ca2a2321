"""Probes on TransformerLens bridges: exactness against a by-hand reference, planted
truth, streaming and padding invariance, gradients, BasisSet files, bad input."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import hook_counts
from models import ALL_MODELS, CAUSAL, padded_batch, tl_bridge, tokens
from torch import Tensor

from tangentlens.analysis.depth import DepthProfile
from tangentlens.core.errors import UsageError
from tangentlens.core.subspace import TangentBasis
from tangentlens.hooks import Site, get_backend
from tangentlens.probes import BasisSet, fit_bases, lm_loss, probe, run
from tangentlens.probes.activation import FixedSample, Reservoir
from tangentlens.probes.base import Probe, first_equal
from tangentlens.probes.session import open_sessions

OPTS = {"n_controls": 50, "progress": False}
RANK = 4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def fitted() -> dict[str, BasisSet]:
    return {
        a: fit_bases(tl_bridge(a), [tokens(a, 4, 12, seed=1)], rank=RANK, progress=False)
        for a in ALL_MODELS
    }


def _stat(frame: pd.DataFrame, probe_: str, site: str, stat: str) -> pd.Series:
    rows = frame[(frame.probe == probe_) & (frame.site == site) & (frame.statistic == stat)]
    return rows.set_index(["layer", "head"])["value"].sort_index()


def _encoder_loss(model, batch):
    return model(batch["input_ids"], attention_mask=batch["attention_mask"]).pow(2).sum()


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("arch", ALL_MODELS)
def test_residual_probe_matches_a_by_hand_reference(arch: str, fitted: dict) -> None:
    """tangent + normal == x exactly; the streamed shares equal shares computed from
    run_with_cache over the unpadded tokens (writes in the downstream stream's basis)."""
    model, bases = tl_bridge(arch), fitted[arch]
    batch = padded_batch(arch)
    session = run(model, [batch], bases, ("residual",), **OPTS)
    frame = session.results()
    _, cache = model.run_with_cache(batch["input_ids"], attention_mask=batch["attention_mask"])
    keep = batch["attention_mask"].bool()
    for kind in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"):
        got = _stat(frame, "residual", kind, "tangent_share")
        if kind == "resid_mid" and arch == "neox":
            assert got.empty
            continue
        for layer in range(2):
            x = cache[Site(layer, kind).hook_name][keep]
            if kind in ("attn_out", "mlp_out"):
                mid = "resid_mid" if kind == "attn_out" and arch != "neox" else "resid_post"
                basis = bases[Site(layer, mid)]
            else:
                basis = bases[Site(layer, kind)]
            tangent, normal = basis.split(x)  # float32 in, float64 out: the sum is exact
            assert torch.equal(tangent + normal, x.double())
            want = float(tangent.pow(2).sum() / x.double().pow(2).sum())
            assert got[(layer, pd.NA)] == pytest.approx(want, rel=1e-6)  # float32 model noise
    chance = frame.query("statistic == 'chance_share'")["value"]
    assert np.allclose(chance, RANK / 32)
    assert frame[frame.probe == "residual"]["head"].isna().all()


@pytest.mark.parametrize("arch", ALL_MODELS)
def test_attention_probe_matches_score_terms(arch: str, fitted: dict) -> None:
    from tangentlens.probes.attention import AttentionAccumulator, score_terms

    model, bases = tl_bridge(arch), fitted[arch]
    batch = padded_batch(arch)
    frame = run(model, [batch], bases, ("attention",), **OPTS).results()
    for layer in range(2):
        terms = score_terms(
            model,
            batch["input_ids"],
            layer,
            bases[Site(layer, "attn_in")],
            attention_mask=batch["attention_mask"],
        )
        acc = AttentionAccumulator().update(terms, batch["attention_mask"], causal=arch != "bert")
        for stat, per_head in acc.results().items():
            got = _stat(frame, "attention", "attn_in", stat).loc[layer]
            np.testing.assert_allclose(got.to_numpy(), per_head.numpy(), rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------ planted truth
def _planting_hook(replace):
    def hook(x, hook):
        return replace(x)

    return hook


def test_planted_subspace_gives_share_one_and_random_bases_chance() -> None:
    model = tl_bridge("native")
    gen = torch.Generator().manual_seed(3)
    q = torch.linalg.qr(torch.randn(32, RANK, generator=gen, dtype=torch.float64))[0]
    planted = {"blocks.1.hook_resid_pre": TangentBasis(q)}
    ids = tokens("native", 8, 16)
    name = "blocks.1.hook_resid_pre"
    project = _planting_hook(lambda x: (x.double() @ q @ q.T).to(x.dtype))
    # the planting hook is attached first, so it runs before the probe's
    with model.hooks(fwd_hooks=[(name, project)]), probe(model, planted, ("residual",)) as s:
        model(ids)
    session = s
    share = _stat(session.results(), "residual", "resid_pre", "tangent_share")
    assert share.iloc[0] == pytest.approx(1.0, abs=1e-6)

    # isotropic residuals: any basis, here 20 random ones, holds k/d of the energy
    noise = _planting_hook(lambda x: torch.randn(x.shape, generator=gen).to(x.dtype))
    shares = []
    for i in range(20):
        qr = torch.linalg.qr(torch.randn(32, RANK, generator=gen, dtype=torch.float64))[0]
        with (
            model.hooks(fwd_hooks=[(name, noise)]),
            probe(model, {name: TangentBasis(qr)}, ("residual",)) as session,
        ):
            model(tokens("native", 8, 16, seed=i))
        shares.append(_stat(session.results(), "residual", "resid_pre", "tangent_share").iloc[0])
    assert np.mean(shares) == pytest.approx(RANK / 32, abs=0.01)


# ------------------------------------------------------------------ streaming
@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_results_do_not_depend_on_batch_split(arch: str, fitted: dict) -> None:
    model, bases = tl_bridge(arch), fitted[arch]
    full = padded_batch(arch, batch=4, pos=12)
    halves = [{k: v[i : i + 2] for k, v in full.items()} for i in (0, 2)]
    singles = [{k: v[i : i + 1] for k, v in full.items()} for i in range(4)]
    probes = ("residual", "attention", "gradient", "activation")
    loss = None if arch != "bert" else _encoder_loss
    sessions = [
        run(model, split, bases, probes, loss=loss, reservoir=16, **OPTS)
        for split in ([full], halves, singles)
    ]
    frames = [session.results() for session in sessions]
    samples = [s.activation.reservoirs[Site(1, "resid_pre")].sample() for s in sessions]
    assert samples[0].shape == (16, 32)
    for other in samples[1:]:
        torch.testing.assert_close(other, samples[0], rtol=1e-5, atol=1e-6)
    key = ["probe", "site", "layer", "head", "statistic"]
    ref = frames[0].sort_values(key).reset_index(drop=True)
    assert len(ref) > 100
    for other in frames[1:]:
        other = other.sort_values(key).reset_index(drop=True)
        pd.testing.assert_frame_equal(ref[key], other[key])
        np.testing.assert_allclose(other["value"], ref["value"], rtol=2e-5, atol=1e-9)


def test_padding_is_masked_out_of_every_statistic(fitted: dict) -> None:
    """Right-padded rows give the same numbers as the same tokens without padding."""
    model, bases = tl_bridge("gpt2"), fitted["gpt2"]
    batch = padded_batch("gpt2", batch=3, pos=12)
    lengths = batch["attention_mask"].sum(1).tolist()
    unpadded = [batch["input_ids"][i : i + 1, :n] for i, n in enumerate(lengths)]
    probes = ("residual", "attention", "gradient")
    padded = run(model, [batch], bases, probes, **OPTS).results()
    plain = run(model, unpadded, bases, probes, **OPTS).results()
    # z-scores over a few null frames divide float32 null terms by a spread near 1e-6 of
    # them, and means over the controls come from float32 traces: those are compared as
    # the nnsight/TransformerLens agreement test compares them (z: 1e-3 relative; control
    # means: 1e-8 absolute, or float32's relative precision summed over the traces)
    stat = padded["statistic"]
    z = stat.str.endswith("_z").to_numpy()
    mc = stat.isin(["iso_statistic", "delta_iso_normal"]).to_numpy()
    exact = ~(z | mc)
    np.testing.assert_allclose(plain["value"][exact], padded["value"][exact], rtol=2e-5, atol=1e-9)
    np.testing.assert_allclose(plain["value"][z], padded["value"][z], rtol=1e-3)
    np.testing.assert_allclose(plain["value"][mc], padded["value"][mc], rtol=1e-5, atol=1e-8)


def test_reservoir_is_uniform_bounded_and_split_invariant() -> None:
    x = torch.arange(3000, dtype=torch.float32)[:, None].repeat(1, 2)
    one = Reservoir(100, seed=1).update(x)
    many = Reservoir(100, seed=1)
    for chunk in x.split(7):
        many.update(chunk)
    assert torch.equal(one.sample(), many.sample())
    assert one.sample().shape == (100, 2) and one.seen == 3000
    assert 1000 < one.sample()[:, 0].mean() < 2000  # uniform over the stream, not a prefix


def test_fixed_sample_is_the_same_whatever_the_batches_and_their_order() -> None:
    site, (n_seq, seq_len) = Site(0, "resid_pre"), (12, 5)
    x = torch.arange(n_seq * seq_len, dtype=torch.float32).view(n_seq, seq_len, 1)
    whole = FixedSample(20, 3, (n_seq, seq_len), [site], 1)
    whole.hook(site)(x)
    split = FixedSample(20, 3, (n_seq, seq_len), [site], 1)
    for start in (8, 0, 4):  # any batches, in any order (other processes, resumed parts)
        split.start = start
        split.hook(site)(x[start : start + 4])
    assert torch.equal(whole.buffers[site], split.buffers[site])
    picked = whole.buffers[site][:, 0].long()
    assert torch.equal(picked, whole.seq * seq_len + whole.pos) and picked.unique().numel() == 20


# ------------------------------------------------------------------ gradients
@pytest.mark.parametrize("arch", CAUSAL)
def test_gradient_moments_match_autograd(arch: str, fitted: dict) -> None:
    """Gradient Moments equal ∂(summed LM loss)/∂x at the site, over unpadded tokens whose
    gradient is not zero by construction (each sequence's last position is not)."""
    model, bases = tl_bridge(arch), fitted[arch]
    batch = padded_batch(arch)
    session = run(model, [batch], bases, ("gradient",), **OPTS)
    name = "blocks.1.hook_resid_pre"
    saved = {}

    def keep_grad(x, hook):
        x.retain_grad()
        saved["x"] = x

    model.zero_grad(set_to_none=True)
    with model.hooks(fwd_hooks=[(name, keep_grad)]):
        lm_loss(model, batch).backward()
    model.zero_grad(set_to_none=True)
    grads = saved["x"].grad[batch["attention_mask"].bool()].double()
    nonzero = grads.ne(0).any(-1)
    assert int((~nonzero).sum()) == batch["attention_mask"].shape[0]  # one last position each
    grads = grads[nonzero]
    got = session.gradient_moments[name]
    assert got.count == grads.shape[0]
    want = grads.T @ grads / grads.shape[0]
    torch.testing.assert_close(got.second_moment(), want, rtol=1e-4, atol=1e-6 * want.abs().max())
    frame = session.results()
    stats = set(frame[frame.probe == "gradient"]["statistic"])
    assert {
        "energy_ratio",
        "p_value",
        "tangent_share",
        "normalized_ratio",
        "delta_iso_tangent",
        "delta_iso_normal",
    } <= stats
    assert all(p.grad is None for p in model.parameters())  # run() leaves .grad alone


@pytest.mark.parametrize("arch", ALL_MODELS)
@pytest.mark.parametrize(
    "site", [Site(1, "resid_pre"), Site(1, "resid_mid"), Site(0, "resid_post")]
)
def test_residual_gradients_are_the_full_derivative(arch: str, site: Site) -> None:
    """The gradient read at a site is ∂L/∂(residual stream): a finite difference of the
    loss along it, with the whole stream moved, gives its norm. (On TL bridges resid_mid's
    own hook point sees only the MLP branch; the backend reads attn_out instead.)"""
    model, be = tl_bridge(arch), get_backend(tl_bridge(arch))
    if site not in be.sites():
        pytest.skip(f"{arch} has no {site.kind}")
    ids = tokens(arch, 2, 8)

    def loss() -> Tensor:
        return model(ids).pow(2).sum() if arch == "bert" else lm_loss(model, ids)

    seen = {}
    handle = be.add_backward_hook(site, lambda g: seen.setdefault("g", g.detach().double()))
    try:
        loss().backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    g = seen["g"]
    v = g / g.norm()
    # move the whole stream: resid_mid = resid_pre + attn_out in a pre-norm block
    moved = site.hook_name
    if site.kind == "resid_mid" and arch != "bert":
        moved = f"blocks.{site.layer}.hook_attn_out"

    def shifted(eps: float) -> float:
        def hook(x, hook):
            return x + (eps * v).to(x.dtype)

        with torch.no_grad(), model.hooks(fwd_hooks=[(moved, hook)]):
            return float(loss())

    eps = 1e-2
    derivative = (shifted(eps) - shifted(-eps)) / (2 * eps)
    assert derivative == pytest.approx(float(g.norm()), rel=2e-3)


def test_encoder_gradient_needs_a_loss(fitted: dict) -> None:
    with pytest.raises(ValueError, match="needs a loss: pass loss="):
        run(tl_bridge("bert"), [tokens("bert")], fitted["bert"], ("gradient",), **OPTS)
    frame = run(
        tl_bridge("bert"),
        [padded_batch("bert")],
        fitted["bert"],
        ("gradient",),
        loss=_encoder_loss,
        **OPTS,
    ).results()
    assert frame["value"].notna().all() and len(frame) > 0


def test_layers_and_sites_restrict_the_probes(fitted: dict) -> None:
    model, bases = tl_bridge("gpt2"), fitted["gpt2"]
    probes = ("residual", "attention", "gradient")
    frame = run(model, [tokens("gpt2")], bases, probes, layers=1, **OPTS).results()
    assert set(frame["layer"]) == {1} and set(frame["probe"]) == {*probes, "basis"}
    only = run(
        model, [tokens("gpt2")], bases, ("residual",), sites="blocks.0.hook_resid_post", **OPTS
    ).results()
    assert set(zip(only["site"], only["layer"], strict=True)) == {("resid_post", 0)}


@pytest.mark.filterwarnings("ignore:Q_T fitted on even and on odd")
@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_a_forward_only_run_stops_after_the_last_layer_it_reads(arch: str) -> None:
    """fit_bases on layer 0 runs neither the last block nor the unembedding, its bases are
    the full fit's bit for bit, no hook is left behind and the model runs whole after."""
    model = tl_bridge(arch)
    assert model.cfg.n_layers > 1
    batches = [tokens(arch, seed=s) for s in range(4)]
    full = fit_bases(model, batches, rank=2, progress=False)
    before, fired = hook_counts(model), []
    handles = [
        module.register_forward_hook(lambda *_, name=name: fired.append(name))
        for name, module in (("last block", model.blocks[-1]), ("unembed", model.unembed))
    ]
    try:
        part = fit_bases(model, batches, rank=2, layers=0, progress=False)
    finally:
        for handle in handles:
            handle.remove()
    assert fired == [] and hook_counts(model) == before  # the stop's hook is gone too
    assert set(part) == {s for s in full if Site.from_hook_name(s).layer == 0}
    assert all(torch.equal(part[s].basis_, full[s].basis_) for s in part)
    assert torch.isfinite(model(batches[0])).all()
    # inside another open session, which reads every layer of these passes: whole forwards
    with probe(model, full, ("residual",)) as outer:
        assert open_sessions(model) == 1
        with pytest.raises(UsageError, match=r"probe\(\)"):
            outer.__enter__()  # an open session is not entered twice
        fit_bases(model, batches, rank=2, layers=0, progress=False)
    assert open_sessions(model) == 0 and hook_counts(model) == before
    n = outer.results().query("statistic == 'n_tokens'")
    assert set(n["layer"]) == set(range(model.cfg.n_layers))
    assert (n["value"] == sum(b.numel() for b in batches)).all()


def test_the_last_layer_a_probe_reads() -> None:
    """`Probe.last_layer`: the deepest forward site; None (the whole forward) for a probe
    with hooks of its own, and for a session holding one."""

    class Plain(Probe):
        forward_sites = (Site(0, "resid_pre"), Site(1, "attn_in"))

    class Hooked(Plain):
        def attach(self, backend):
            return []

    assert Plain().last_layer == 1 and Hooked().last_layer is None
    session = probe(tl_bridge("gpt2"), None, ("activation",), layers=0)
    assert session.last_layer == 0
    session.probes["other"] = Hooked()
    assert session.last_layer is None


# ------------------------------------------------------------------ bases
def test_fit_bases_and_basis_set_round_trip(tmp_path, fitted: dict) -> None:
    bases = fitted["llama"]
    assert set(bases) == {
        f"blocks.{layer}.{n}"
        for layer in range(2)
        for n in (
            "hook_resid_pre",
            "ln1.hook_out",
            "hook_resid_mid",
            "ln2.hook_out",
            "hook_resid_post",
        )
    }
    assert bases["blocks.0.hook_in"] is bases[Site(0, "resid_pre")]
    assert bases.moments["blocks.0.hook_resid_pre"].count == 48
    assert bases.provenance["rank"] == RANK and bases.provenance["weight_hash"]
    path = bases.save(tmp_path / "bases.safetensors")
    loaded = BasisSet.load(path)
    assert list(loaded) == list(bases) and loaded.provenance == bases.provenance
    for name in bases:
        assert torch.equal(loaded[name].basis_, bases[name].basis_)
    # resid_post[0] and resid_pre[1] are one tensor: fitted once, each with its own site
    post, pre = bases["blocks.0.hook_resid_post"], bases["blocks.1.hook_resid_pre"]
    assert torch.equal(post.basis_, pre.basis_)
    assert post.provenance["site"] == "blocks.0.hook_resid_post"
    assert pre.provenance["site"] == "blocks.1.hook_resid_pre"
    assert post.provenance.get("split_half_overlap") == pre.provenance.get("split_half_overlap")
    for name, basis in bases.items():  # every basis equals its own fit
        assert torch.equal(basis.basis_, TangentBasis.fit(bases.moments[name], RANK).basis_)
    padded = padded_batch("llama")
    by_variance = fit_bases(
        tl_bridge("llama"),
        [padded],
        variance=0.5,
        sites="blocks.0.hook_resid_pre",
        progress=False,
    )
    assert list(by_variance) == ["blocks.0.hook_resid_pre"]
    assert 1 <= by_variance["blocks.0.hook_resid_pre"].k < 32
    assert by_variance.moments["blocks.0.hook_resid_pre"].count == padded["attention_mask"].sum()


def test_bad_input_names_the_fix(fitted: dict) -> None:
    model, bases = tl_bridge("neox"), fitted["neox"]
    q = bases["blocks.0.hook_resid_pre"]
    with pytest.raises(ValueError, match="no resid_mid"):
        probe(model, {"blocks.0.hook_resid_mid": q}, ("residual",))
    with pytest.raises(ValueError, match="does not exist on this model"):
        probe(model, {"blocks.7.hook_resid_pre": q}, ("residual",))
    with pytest.raises(ValueError, match=r"layers \[5\] do not exist.*layers 0..1"):
        probe(model, bases, ("residual",), layers=5)
    with pytest.raises(ValueError, match="not a probe site"):
        probe(model, {"blocks.0.attn.hook_pattern": q}, ("residual",))
    with pytest.raises(ValueError, match="probes must be a non-empty mix of names"):
        probe(model, bases, ("residuals",))
    with pytest.raises(ValueError, match="integer token ids"):
        run(model, [torch.randn(2, 3)], bases, ("residual",), progress=False)
    with pytest.raises(ValueError, match="exactly one of rank"):
        fit_bases(model, [tokens("neox")], progress=False)
    with (
        pytest.warns(UserWarning, match="attention probe has no site"),
        pytest.raises(ValueError, match="nothing to probe"),
    ):
        probe(model, {"blocks.0.hook_resid_pre": q}, ("attention",))


def test_gradient_tests_name_what_they_cannot_test() -> None:
    """Too few gradient vectors, or a rank that leaves ΔIsoScore* under two dimensions: a
    `UsageError` naming the site or the fix, not a Moments message or missing rows."""
    model = tl_bridge("gpt2")
    batches = [tokens("gpt2", seed=s) for s in range(2)]
    d = model.cfg.d_model
    wide = fit_bases(model, batches, rank=d - 1, layers=0, progress=False)
    with pytest.raises(UsageError, match=f"fit with rank <= {d - 2}"):
        run(model, batches[:1], wide, ("gradient",), progress=False).results()
    bases = fit_bases(model, batches, rank=2, layers=0, progress=False)
    with pytest.raises(UsageError, match="hook_resid_pre: one gradient vector"):
        run(model, [batches[0][:1, :2]], bases, ("gradient",), progress=False).results()


# ------------------------------------------------------------------ depth profile
def _synthetic(energy: list[float], p: list[float]) -> pd.DataFrame:
    rows = []
    for layer, (e, pv) in enumerate(zip(energy, p, strict=True)):
        share = 0.125 * (1 + layer)
        for probe_, stat, v in [
            ("residual", "tangent_share", share),
            ("residual", "chance_share", 0.125),
            ("residual", "share_ratio", share / 0.125),
            ("gradient", "energy_ratio", e),
            ("gradient", "p_value", pv),
        ]:
            rows.append(
                {
                    "probe": probe_,
                    "site": "resid_pre",
                    "layer": layer,
                    "head": pd.NA,
                    "statistic": stat,
                    "value": v,
                }
            )
    return pd.DataFrame(rows)


def test_depth_profile_onset_amplification_and_plot(fitted: dict) -> None:
    profile = DepthProfile(_synthetic([2.0, 1.0, 1.6, 2.4, 3.0], [0.01, 0.5, 0.01, 0.01, 0.001]))
    assert profile.onset_layer == 2  # layer 0 is biased but the bias does not stay
    table = profile.to_frame()
    assert table.loc[3, "energy_amplification"] == pytest.approx(2.4 / 1.6)
    assert table.loc[1, "share_amplification"] == pytest.approx(2.0)
    assert np.isnan(table.loc[0, "energy_amplification"])
    assert DepthProfile(_synthetic([2.0, 3.0], [0.5, 0.5])).onset_layer is None
    fig = profile.plot()
    assert fig.axes and fig.axes[0].get_xlabel() == "layer"
    # and from a real session
    session = run(
        tl_bridge("llama"),
        [padded_batch("llama")],
        fitted["llama"],
        ("residual", "gradient"),
        **OPTS,
    )
    real = DepthProfile(session.results())
    assert real.layers == [0, 1]
    assert real.to_frame()[["tangent_share", "energy_ratio", "mlp_write_ratio"]].notna().all().all()
    with pytest.raises(ValueError, match="no residual share_ratio"):
        DepthProfile(session.results(), site="embed")
    with pytest.raises(ValueError, match="filter them to one first"):
        DepthProfile(pd.concat([session.results(), session.results()]))


def test_head_null_rows_and_switch(fitted: dict) -> None:
    """Per-head shares come with their matched-rank null (mean, spread, p-value and, at the
    default 99 frames, z); head_null=0 turns it off."""
    model, bases = tl_bridge("gpt2"), fitted["gpt2"]
    table = run(model, [tokens("gpt2")], bases, ("attention",), **OPTS).results()
    for t in ("TT", "TN", "NT", "NN", "bias"):
        null = table[table["statistic"] == f"score_share_{t}_null"]
        assert len(null) == 2 * 4 and null["head"].notna().all()  # 2 layers × 4 heads
        assert ((null["value"] >= 0) & (null["value"] <= 1)).all()
    z = table[table["statistic"] == "score_share_TT_z"]["value"]
    assert len(z) == 8 and z.notna().all()
    p = table[table["statistic"] == "score_share_TT_p_value"]["value"]
    assert len(p) == 8 and ((p >= 1 / 100) & (p <= 1)).all()
    off = run(model, [tokens("gpt2")], bases, ("attention",), head_null=0, **OPTS).results()
    assert not off["statistic"].str.endswith(("_null", "_p_value", "_z")).any()


def test_two_names_of_one_tensor_are_tested_once(fitted: dict, monkeypatch) -> None:
    """resid_post[0] and resid_pre[1] hold the same gradients and basis: one batch product
    per backward pass, one test, the same values under both names; resid_mid[1] is
    measured on its own (the gradient probe forms no activation product)."""
    from tangentlens.core import stats
    from tangentlens.probes import gradient

    calls = {"tests": 0, "products": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(gradient, "tangent_tests", counted("tests", gradient.tangent_tests))
    monkeypatch.setattr(stats, "batch_statistics", counted("products", stats.batch_statistics))
    names = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_pre", "blocks.1.hook_resid_mid"]
    batch = tokens("llama", 2, 12, seed=3)
    session = run(tl_bridge("llama"), [batch], fitted["llama"], ("gradient",), sites=names, **OPTS)
    frame = session.results()
    assert calls == {"tests": 2, "products": 2}
    g = frame[frame.probe == "gradient"]
    post = g[(g.site == "resid_post") & (g.layer == 0)].set_index("statistic")["value"]
    pre = g[(g.site == "resid_pre") & (g.layer == 1)].set_index("statistic")["value"]
    stats = ["tangent_share", "p_value", "p_value_normal", "delta_iso_normal", "isotropy_p_value"]
    assert post[stats].tolist() == pre[stats].tolist()


def test_sites_tested_side_by_side_equal_one_after_another(fitted: dict) -> None:
    """Two workers of one thread (`compute.site_map`) give the table one thread gives."""
    batch = tokens("llama", 2, 12, seed=4)
    session = run(tl_bridge("llama"), [batch], fitted["llama"], ("gradient",), **OPTS)
    tables = []
    for n in (1, 2):
        torch.set_num_threads(n)
        tables.append(session.results().set_index(["hook", "statistic"])["value"])
    torch.set_num_threads(1)
    pd.testing.assert_series_equal(tables[0], tables[1], rtol=0, atol=0)


def test_first_equal_points_each_item_at_the_first_of_its_kind() -> None:
    calls: list[tuple[int, int]] = []

    def same(a: int, b: int) -> bool:
        calls.append((a, b))
        return a % 3 == b % 3

    assert first_equal([0, 4, 3, 1, 7, 2], same) == [0, 1, 0, 1, 1, 5]
    # later items meet only the first of each kind, never a later twin
    assert all(a in (0, 4) for a, _ in calls)
