"""Attention-score decomposition: exactness on every architecture, planted truth,
streaming statistics, and agreement of the Hugging Face and TransformerLens paths."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from functools import cache
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
from einops import rearrange
from torch import Tensor

from tangentlens.analysis.interventions import keep_terms
from tangentlens.core.decompose import (
    TERMS,
    AttentionParams,
    NormParams,
    ScoreSplit,
    decompose_parts,
    decompose_scores,
    keep_blocks,
    linearize_norm,
)
from tangentlens.core.decompose import keep_mask as dkeep_mask
from tangentlens.core.errors import UsageError
from tangentlens.core.subspace import TangentBasis, complement
from tangentlens.hooks.huggingface import (
    hf_attention_module,
    norm_from_hf,
    norm_from_module,
    params_from_hf,
)
from tangentlens.hooks.sites import Site
from tangentlens.hooks.transformer_lens import attention_input_hook, params_from_bridge
from tangentlens.probes.attention import (
    STATISTICS,
    AttentionAccumulator,
    AttentionProbe,
    score_terms,
)
from tangentlens.probes.attention_stats import _Block, _logsumexp_
from tangentlens.probes.base import Observation

HF_ARCHS = ("gpt2", "neox", "llama", "bert")
ALL_ARCHS = (*HF_ARCHS, "native")
D, LAYER, POS = 32, 1, 10
TOL = 1e-5

# ----------------------------------------------------------------------------- models
# Tiny random models with O(1) scores (init std 0.2) and random biases and norm weights,
# so that the bias term, the norms and the patterns are all exercised.


def _tokenizer(folder: Path) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i for i in range(2, 64)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(folder)
    return fast


def _hf_config(arch: str) -> Any:
    import transformers as tf

    common = {"vocab_size": 64, "initializer_range": 0.2}
    shape = {
        "hidden_size": D,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 32,
    }
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=D, n_layer=2, n_head=4, n_positions=32, **common)
    if arch == "neox":
        return tf.GPTNeoXConfig(**shape, intermediate_size=64, rotary_pct=0.5, **common)
    if arch == "llama":
        return tf.LlamaConfig(**shape, num_key_value_heads=2, intermediate_size=64, **common)
    return tf.BertConfig(**shape, intermediate_size=64, **common)


_CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "neox": "GPTNeoXForCausalLM",
    "llama": "LlamaForCausalLM",
    "bert": "BertForMaskedLM",
}


@torch.no_grad()
def _randomize_affine(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        elif p.ndim == 1 and ("ln" in name or "norm" in name.lower()):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))


@cache
def _folder(arch: str) -> Path:
    import transformers as tf

    folder = Path(tempfile.mkdtemp(prefix=f"tl-attn-{arch}-"))
    _tokenizer(folder)
    torch.manual_seed(0)
    model = getattr(tf, _CLASSES[arch])(_hf_config(arch))
    _randomize_affine(model, seed=1)
    model.save_pretrained(folder)
    return folder


@cache
def bridge(arch: str) -> Any:
    from transformer_lens.model_bridge import TransformerBridge

    if arch == "native":
        from transformer_lens.config import TransformerBridgeConfig

        cfg = TransformerBridgeConfig(
            d_model=D,
            d_head=8,
            n_heads=4,
            n_layers=2,
            n_ctx=32,
            d_vocab=64,
            d_mlp=64,
            act_fn="gelu",
            positional_embedding_type="rotary",
            rotary_dim=4,
            n_key_value_heads=2,
            normalization_type="LN",
            seed=0,
        )
        model = TransformerBridge.boot_native(cfg)
        with torch.no_grad():  # random attention biases; norms keep w=1, b=0 (planted test)
            gen = torch.Generator().manual_seed(2)
            for block in model.blocks:
                for lin in (block.attn.q, block.attn.k):
                    lin.bias.copy_(0.2 * torch.randn(lin.bias.shape, generator=gen))
    else:
        model = TransformerBridge.boot_transformers(str(_folder(arch)), device="cpu")
    return model.eval()


def hf_model(arch: str) -> Any:
    import transformers as tf

    cls = getattr(tf, _CLASSES[arch])
    return cls.from_pretrained(_folder(arch), attn_implementation="eager").eval()


def batch(arch: str, n: int = 3, seed: int = 0) -> tuple[Tensor, Tensor | None]:
    """Token ids (n, POS); BERT also gets right padding on all but the first row."""
    ids = torch.randint(2, 64, (n, POS), generator=torch.Generator().manual_seed(seed))
    if arch != "bert":
        return ids, None
    mask = torch.ones_like(ids)
    for row in range(1, n):
        mask[row, POS - 2 * row :] = 0
    return ids.masked_fill(mask == 0, 1), mask


def random_basis(k: int, seed: int = 0) -> TangentBasis:
    gen = torch.Generator().manual_seed(seed)
    return TangentBasis(torch.linalg.qr(torch.randn(D, k, generator=gen, dtype=torch.float64)).Q)


def capture(model: Any, tokens: Tensor, names: list[str], mask: Tensor | None) -> dict:
    out: dict[str, Tensor] = {}

    def saver(name: str) -> Any:
        def hook(x: Tensor, hook: Any) -> None:  # hook.name is canonical, not the alias
            out[name] = x.detach()

        return hook

    kwargs = {} if mask is None else {"attention_mask": mask}
    with torch.no_grad(), model.hooks(fwd_hooks=[(n, saver(n)) for n in names]):
        model(tokens, return_type=None, **kwargs)
    return out


def keep_mask(shape: torch.Size, causal: bool, mask: Tensor | None) -> Tensor:
    """Entries the model lets through: (batch, 1, q, k) bool (keys only, as HF masks)."""
    b, _, q, k = shape
    keep = torch.ones(b, 1, q, k, dtype=torch.bool)
    if causal:
        keep &= torch.ones(q, k, dtype=torch.bool).tril()
    if mask is not None:
        keep &= mask.bool()[:, None, None, :]
    return keep


def reference_scores(x: Tensor, params: AttentionParams, *, bias: bool = True) -> Tensor:
    """Scores written out plainly from x: R(x W_Q + b_Q) · R(x W_K + b_K) · scale."""
    x = x.double()
    q = torch.einsum("bpd,hde->bhpe", x, params.W_Q.double())
    k = torch.einsum("bpd,hde->bhpe", x, params.W_K.double())
    if bias and params.b_Q is not None:
        q = q + params.b_Q.double()[None, :, None, :]
    if bias and params.b_K is not None:
        k = k + params.b_K.double()[None, :, None, :]
    return qk_scores(q, k, params)


def qk_scores(q: Tensor, k: Tensor, params: AttentionParams) -> Tensor:
    """(b, h, p, e) q and kv-head k -> rotary, GQA repeat, scaled dot."""
    if params.rotary is not None:
        q, k = params.rotary(q, k, torch.arange(q.shape[2])[None].expand(q.shape[0], -1))
    k = k.repeat_interleave(params.n_heads // params.n_kv_heads, dim=1)
    return torch.einsum("bhqe,bhke->bhqk", q, k) * params.scale


def rel_err(a: Tensor, b: Tensor) -> float:
    """max |a − b| / max |b| (or max |a − b| when b is all zeros)."""
    diff = float((a.double() - b.double()).abs().max())
    return diff / max(float(b.double().abs().max()), 1e-300) if diff else 0.0


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_terms_sum_to_model_scores(arch: str) -> None:
    model = bridge(arch)
    tokens, mask = batch(arch)
    terms = score_terms(model, tokens, LAYER, random_basis(8), attention_mask=mask)
    assert set(terms) == set(TERMS)
    assert all(t.shape == (3, 4, POS, POS) and t.dtype == torch.float64 for t in terms.values())
    total = sum(terms.values())
    params = params_from_bridge(model, LAYER)
    assert params.causal == (arch != "bert")
    if arch == "llama":  # no q/k biases: the bias term is exactly zero
        assert not terms["bias"].any()
    else:  # random biases make it non-trivial
        assert float(terms["bias"].abs().max()) > 1e-2

    a = f"blocks.{LAYER}.attn."
    names = [a + h for h in ("hook_q", "hook_k", "hook_attn_scores", "hook_pattern", "hook_in")]
    names.append(f"blocks.{LAYER}.ln1.hook_out")
    got = capture(model, tokens, names, mask)
    errors: dict[str, float] = {}

    # 1. the model's own projections (hook_q/hook_k, before rotary) give the same scores
    q = got[a + "hook_q"].permute(0, 2, 1, 3).double()
    k = got[a + "hook_k"].permute(0, 2, 1, 3).double()
    errors["hook_qk"] = rel_err(total, qk_scores(q, k, params))
    assert errors["hook_qk"] < TOL

    keep = keep_mask(total.shape, params.causal, mask)
    # 2. hook_attn_scores holds pre-softmax (post-mask) scores on the HF decoder bridges
    if arch in ("gpt2", "neox", "llama"):
        kept = keep.expand_as(total)
        hs = got[a + "hook_attn_scores"].double()
        errors["hook_attn_scores"] = rel_err(total[kept], hs[kept])
        assert errors["hook_attn_scores"] < TOL

    # 3. softmax(sum + mask) is the model's pattern, everywhere
    pattern = torch.softmax(total.masked_fill(~keep, float("-inf")), -1)
    errors["pattern_abs"] = float((pattern - got[a + "hook_pattern"].double()).abs().max())
    assert errors["pattern_abs"] < TOL
    assert float(got[a + "hook_pattern"].amax()) > 0.5  # patterns are far from uniform

    # the decomposed input is the exact input to W_Q/W_K
    site = attention_input_hook(model, LAYER)
    if arch == "bert":  # post-LN: ln1 follows attention
        assert site == a + "hook_in"
    else:
        assert site == f"blocks.{LAYER}.ln1.hook_out"
        torch.testing.assert_close(got[site], got[a + "hook_in"], rtol=0, atol=0)
    print(f"{arch}: {errors}")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_rank_d_minus_one_basis(arch: str) -> None:
    """Q = d−1 columns of an orthogonal matrix: everything but the u-direction is
    tangent; NN is the rank-1 term of u alone, computed independently. (Layer 0: the
    forward stops early there.)"""
    model = bridge(arch)
    tokens, mask = batch(arch)
    gen = torch.Generator().manual_seed(3)
    full = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64)).Q
    basis, u = TangentBasis(full[:, :-1]), full[:, -1]
    terms = score_terms(model, tokens, 0, basis, attention_mask=mask)
    with pytest.raises(UsageError, match="attention_mask"):  # a mask of another shape
        score_terms(model, tokens, 0, basis, attention_mask=torch.ones_like(tokens)[:, :-1])
    params = params_from_bridge(model, 0)
    x = capture(model, tokens, [attention_input_hook(model, 0)], mask).popitem()[1].double()

    unbiased = terms["TT"] + terms["TN"] + terms["NT"] + terms["NN"]
    assert rel_err(unbiased, reference_scores(x, params, bias=False)) < TOL
    assert rel_err(unbiased + terms["bias"], reference_scores(x, params)) < TOL

    c = x @ u  # (b, p): coordinate on the one normal direction
    q_u = c[:, None, :, None] * (u @ params.W_Q.double())[None, :, None, :]
    k_u = c[:, None, :, None] * (u @ params.W_K.double())[None, :, None, :]
    # (TangentBasis.split rounds x_T to x's float32 precision so x_T + x_N == x exactly;
    # hence agreement to float32 relative precision, not float64)
    assert rel_err(terms["NN"], qk_scores(q_u, k_u, params)) < TOL
    x_t = x - c[..., None] * u
    assert rel_err(terms["TT"], reference_scores(x_t, params, bias=False)) < TOL


def test_planted_span_gives_pure_tangent_scores() -> None:
    """Inputs inside span(Q): TN = NT = NN = 0 and TT + bias is the whole score."""
    params = params_from_bridge(bridge("llama"), LAYER)  # rotary + GQA
    gen = torch.Generator().manual_seed(4)
    q = torch.linalg.qr(torch.randn(D, 8, generator=gen, dtype=torch.float64)).Q
    x = torch.randn(2, POS, 5, generator=gen, dtype=torch.float64) @ q[:, :5].T
    terms = decompose_scores(x, TangentBasis(q), params)
    for t in ("TN", "NT", "NN"):
        assert float(terms[t].abs().max()) < 1e-12
    torch.testing.assert_close(terms["TT"] + terms["bias"], reference_scores(x, params))
    acc = AttentionAccumulator().update(terms)
    res = acc.results()
    torch.testing.assert_close(
        res["score_share_TT"] + res["score_share_bias"], torch.ones(4).double()
    )
    assert float(res["pattern_kl_TT"].abs().max()) < 1e-12


def test_planted_span_on_model() -> None:
    """LayerNorm with w = 1, b = 0 outputs vectors orthogonal to 1: the complement of
    1/√d contains every attention input, so TN, NT, NN vanish (up to float32)."""
    model = bridge("native")
    ln = model.blocks[LAYER].ln1.original_component
    assert torch.equal(ln.weight, torch.ones(D)) and torch.equal(ln.bias, torch.zeros(D))
    ones = TangentBasis(torch.ones(D, 1, dtype=torch.float64) / D**0.5)
    basis = TangentBasis(complement(ones))
    tokens, _ = batch("native")
    terms = score_terms(model, tokens, LAYER, basis)
    scale = float(terms["TT"].abs().max())
    for t in ("TN", "NT", "NN"):
        assert float(terms[t].abs().max()) < 1e-5 * scale


@pytest.mark.parametrize("arch", ["gpt2", "neox", "llama", "native"])
def test_resid_pre_site_with_frozen_norm_scale(arch: str) -> None:
    """A basis of hook_resid_pre through the norm frozen at its scale: still exact."""
    model = bridge(arch)
    tokens, mask = batch(arch)
    basis = random_basis(8, seed=5)
    at_input = score_terms(model, tokens, LAYER, basis, attention_mask=mask)
    at_resid = score_terms(model, tokens, LAYER, basis, attention_mask=mask, site="resid_pre")
    assert rel_err(sum(at_resid.values()), sum(at_input.values())) < TOL
    # a basis holding all of resid_pre leaves only TT + bias (bias now has the norm's b)
    everything = score_terms(
        model,
        tokens,
        LAYER,
        TangentBasis(torch.eye(D, dtype=torch.float64)[:, :-1]),
        site="resid_pre",
    )
    assert float(everything["NN"].abs().max()) < float(everything["TT"].abs().max())


@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_left_padded_decoder(arch: str) -> None:
    """Left padding: kept entries are causal and non-padded; rows of padding are dropped."""
    model = bridge(arch)
    tokens, _ = batch(arch)
    mask = torch.ones_like(tokens)
    mask[1, :3], mask[2, :5] = 0, 0
    terms = score_terms(model, tokens, LAYER, random_basis(8), attention_mask=mask)
    total = sum(terms.values())
    keep = keep_mask(total.shape, True, mask)
    pattern = torch.softmax(total.masked_fill(~keep, float("-inf")), -1)
    real = capture(model, tokens, [f"blocks.{LAYER}.attn.hook_pattern"], mask).popitem()[1]
    rows = mask.bool()[:, None, :, None]
    assert float(torch.where(rows, pattern - real.double(), 0).abs().max()) < TOL
    acc = AttentionAccumulator().update(terms, mask, causal=True)
    assert acc.rows == int(mask.sum())
    assert acc.entries == sum(n * (n + 1) // 2 for n in mask.sum(1).tolist())


def test_compatibility_mode_bridge() -> None:
    """After enable_compatibility_mode() (folded LayerNorm, centred weights) the split
    still reproduces the model's pattern, at both sites."""
    from transformer_lens.model_bridge import TransformerBridge

    model = TransformerBridge.boot_transformers(str(_folder("gpt2")), device="cpu").eval()
    model.enable_compatibility_mode()
    tokens, _ = batch("gpt2")
    real = capture(model, tokens, [f"blocks.{LAYER}.attn.hook_pattern"], None).popitem()[1]
    for site in ("attn_in", "resid_pre"):
        total = sum(score_terms(model, tokens, LAYER, random_basis(8), site=site).values())
        keep = keep_mask(total.shape, True, None)
        pattern = torch.softmax(total.masked_fill(~keep, float("-inf")), -1)
        assert float((pattern - real.double()).abs().max()) < TOL, site


def test_resid_pre_rejects_post_norm() -> None:
    with pytest.raises(ValueError, match="post-norm"):
        score_terms(bridge("bert"), batch("bert")[0], LAYER, random_basis(4), site="resid_pre")


# ----------------------------------------------------------------------------- HF path
@pytest.mark.parametrize("arch", HF_ARCHS)
def test_hf_module_path_matches_bridge(arch: str) -> None:
    model, hf = bridge(arch), hf_model(arch)
    tl_params = params_from_bridge(model, LAYER)
    module, rotary_emb = hf_attention_module(hf, LAYER)
    hf_params = params_from_hf(module, rotary_emb=rotary_emb)
    for name in ("W_Q", "W_K", "b_Q", "b_K"):
        a, b = getattr(tl_params, name), getattr(hf_params, name)
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert hf_params.scale == tl_params.scale and hf_params.causal == tl_params.causal
    assert (hf_params.rotary is None) == (arch in ("gpt2", "bert"))

    # end to end on the plain HF model: capture the module's input, compare patterns
    tokens, mask = batch(arch)
    seen: dict[str, Tensor] = {}

    def pre_hook(mod: Any, args: tuple, kwargs: dict) -> None:
        seen["x"] = (args[0] if args else kwargs["hidden_states"]).detach()

    handle = module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        with torch.no_grad():
            out = hf(tokens, attention_mask=mask, output_attentions=True)
    finally:
        handle.remove()
    basis = random_basis(8)
    terms = decompose_scores(seen["x"], basis, hf_params)
    total = sum(terms.values())
    keep = keep_mask(total.shape, hf_params.causal, mask)
    pattern = torch.softmax(total.masked_fill(~keep, float("-inf")), -1)
    assert float((pattern - out.attentions[LAYER].double()).abs().max()) < TOL
    tl_terms = score_terms(model, tokens, LAYER, basis, attention_mask=mask)
    for t in TERMS:
        assert rel_err(terms[t], tl_terms[t]) < TOL, t


@pytest.mark.parametrize("arch", ["gpt2", "neox", "llama"])
def test_hf_resid_pre_and_nnsight_wrapper(arch: str) -> None:
    """The HF path through an nnsight wrapper, and a resid_pre basis through the frozen norm."""
    from nnsight import NNsight

    hf = hf_model(arch)
    module, rotary_emb = hf_attention_module(NNsight(hf), LAYER)
    assert module is hf_attention_module(hf, LAYER)[0]
    params = params_from_hf(module, rotary_emb=rotary_emb)
    norm = norm_from_hf(hf, LAYER)
    ln = next(m for m in hf.modules() if any(c is module for c in m.children()))
    ln = ln.ln_1 if arch == "gpt2" else ln.input_layernorm
    seen: dict[str, Tensor] = {}
    handles = [
        ln.register_forward_hook(lambda m, a, o: seen.update(resid=a[0], x=o)),
    ]
    try:
        with torch.no_grad():
            hf(batch(arch)[0])
    finally:
        for h in handles:
            h.remove()
    basis = random_basis(8, seed=6)
    x_t, x_n, offset = linearize_norm(*basis.split(seen["resid"]), norm)
    assert rel_err(x_t + x_n + (0 if offset is None else offset), seen["x"]) < TOL
    assert (offset is None) == (arch == "llama")  # RMSNorm has no bias
    terms = decompose_scores(seen["resid"], basis, params, norm=norm)
    assert rel_err(sum(terms.values()), reference_scores(seen["x"], params)) < TOL
    u_t, u_n = linearize_norm(*basis.split(seen["resid"]), norm)[:2]
    no_offset = decompose_parts(u_t, u_n, params)
    for t in ("TT", "TN", "NT", "NN"):  # the norm's bias only moves the bias term
        torch.testing.assert_close(terms[t], no_offset[t])


def test_params_from_hf_needs_rotary_emb() -> None:
    module, _ = hf_attention_module(hf_model("llama"), 0)
    with pytest.raises(ValueError, match="rotary_emb"):
        params_from_hf(module)
    with pytest.raises(ValueError, match="unsupported attention module"):
        params_from_hf(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------- statistics
def _terms(arch: str, n: int = 4) -> tuple[dict[str, Tensor], Tensor | None, bool]:
    model = bridge(arch)
    tokens, mask = batch(arch, n=n, seed=7)
    terms = score_terms(model, tokens, LAYER, random_basis(8), attention_mask=mask)
    return terms, mask, params_from_bridge(model, LAYER).causal


def _sliced(terms: dict[str, Tensor], rows: slice) -> dict[str, Tensor]:
    return {t: v[rows] for t, v in terms.items()}


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_accumulator_split_invariance_and_merge(arch: str) -> None:
    terms, mask, causal = _terms(arch)
    one = AttentionAccumulator().update(terms, mask, causal=causal).results()
    assert set(one) == set(STATISTICS) and all(v.shape == (4,) for v in one.values())
    shares = sum(one[f"score_share_{t}"] for t in TERMS)
    torch.testing.assert_close(shares, torch.ones(4, dtype=torch.float64))
    assert bool((one["pattern_kl_TT"] > 0).all())

    def m(rows: slice) -> Tensor | None:
        return None if mask is None else mask[rows]

    for cuts in ([0, 1, 2, 3, 4], [0, 3, 4], [0, 2, 4]):
        parts = [slice(a, b) for a, b in pairwise(cuts)]
        streamed = AttentionAccumulator()
        for p in parts:
            streamed.update(_sliced(terms, p), m(p), causal=causal)
        merged = AttentionAccumulator()
        for p in parts:
            shard = AttentionAccumulator().update(_sliced(terms, p), m(p), causal=causal)
            merged.merge(AttentionAccumulator().load_state_dict(shard.state_dict()))
        for res in (streamed.results(), merged.results()):
            for s in STATISTICS:
                torch.testing.assert_close(res[s], one[s], rtol=1e-12, atol=1e-14)


def _all_reduce_worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        terms = torch.load(out + ".terms")
        mask = torch.load(out + ".mask")
        rows = slice(rank, None, world)  # rank 0: rows 0, 2; rank 1: rows 1, 3
        acc = AttentionAccumulator(n_heads=4)
        acc.update({t: v[rows] for t, v in terms.items()}, mask[rows], causal=False)
        acc.all_reduce_()
        torch.save(acc.state_dict(), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_accumulator_all_reduce(tmp_path: Path) -> None:
    """Two gloo ranks holding different rows reduce to the one-pass statistics."""
    import torch.multiprocessing as mp

    terms, mask, _ = _terms("bert")
    out = str(tmp_path / "acc")
    torch.save(terms, out + ".terms")
    torch.save(mask, out + ".mask")
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_all_reduce_worker, args=(2, init, out), nprocs=2, join=True)
    one = AttentionAccumulator().update(terms, mask, causal=False)
    for rank in range(2):
        reduced = AttentionAccumulator().load_state_dict(torch.load(f"{out}.{rank}"))
        assert (reduced.rows, reduced.entries) == (one.rows, one.entries)
        for s, v in one.results().items():
            torch.testing.assert_close(reduced.results()[s], v, rtol=1e-12, atol=1e-14)
    assert AttentionAccumulator().all_reduce_().n_heads is None  # no process group: no-op


def test_accumulator_independent_of_model_batching() -> None:
    model = bridge("bert")
    tokens, mask = batch("bert", n=4, seed=7)
    basis = random_basis(8)
    whole = AttentionAccumulator().update(
        score_terms(model, tokens, LAYER, basis, attention_mask=mask), mask, causal=False
    )
    halves = AttentionAccumulator()
    for rows in (slice(0, 1), slice(1, 4)):
        terms = score_terms(model, tokens[rows], LAYER, basis, attention_mask=mask[rows])
        halves.update(terms, mask[rows], causal=False)
    assert whole.rows == halves.rows and whole.entries == halves.entries
    for s, v in whole.results().items():
        torch.testing.assert_close(halves.results()[s], v, rtol=1e-6, atol=1e-9)


def test_accumulator_matches_brute_force_on_model_pattern() -> None:
    """Shares by boolean indexing; KL against the model's own hook_pattern (BERT, padded)."""
    model = bridge("bert")
    tokens, mask = batch("bert", n=4, seed=7)
    terms = score_terms(model, tokens, LAYER, random_basis(8), attention_mask=mask)
    res = AttentionAccumulator().update(terms, mask, causal=False).results()
    real = capture(model, tokens, [f"blocks.{LAYER}.attn.hook_pattern"], mask).popitem()[1]
    valid = mask.bool()
    for h in range(4):
        energy = {
            t: sum(float(terms[t][b, h][valid[b]][:, valid[b]].pow(2).sum()) for b in range(4))
            for t in TERMS
        }
        total = sum(energy.values())
        for t in TERMS:
            assert abs(float(res[f"score_share_{t}"][h]) - energy[t] / total) < 1e-12
        kls = []
        for b in range(4):
            n = int(valid[b].sum())
            p = real[b, h, :n, :n].double()
            log_q = torch.log_softmax((terms["TT"] + terms["bias"])[b, h, :n, :n], -1)
            kls.append((p * (p.log() - log_q)).sum(-1))
        assert abs(float(torch.cat(kls).mean()) - float(res["pattern_kl_TT"][h])) < 1e-6


def test_accumulator_errors() -> None:
    acc = AttentionAccumulator()
    with pytest.raises(ValueError, match="update"):
        acc.results()
    with pytest.raises(ValueError, match="lacks"):
        acc.update({"TT": torch.zeros(1, 1, 2, 2)})
    terms = {t: torch.zeros(1, 2, 3, 3) for t in TERMS}
    with pytest.raises(ValueError, match="attention_mask"):
        acc.update(terms, torch.ones(1, 2))
    acc.update(terms)
    with pytest.raises(ValueError, match="heads"):
        acc.update({t: torch.zeros(1, 3, 3, 3) for t in TERMS})


def test_core_validates_inputs() -> None:
    params = params_from_bridge(bridge("gpt2"), 0)
    with pytest.raises(ValueError, match="basis"):
        decompose_parts(torch.zeros(1, 3, 16), torch.zeros(1, 3, 16), params)
    with pytest.raises(ValueError, match="W_K"):
        replace(params, W_K=params.W_K[:3])


# ----------------------------------------------------------------------------- q/k norm
def _qk_params(over_heads: bool, kind: str, seed: int = 8) -> AttentionParams:
    """Random GQA params with q/k norms: RMSNorm (or LayerNorm with a bias) on queries and
    keys, per head or over the whole projection (OLMo 2), random biases, no rotary."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> Tensor:
        return scale * torch.randn(*shape, generator=gen, dtype=torch.float64)

    def norm(heads: int) -> NormParams:
        width = heads * 8 if over_heads else 8
        bias = rand(width, scale=0.2) if kind == "layernorm" else None
        return NormParams(kind, 1 + rand(width, scale=0.2), bias, 1e-6)

    return AttentionParams(
        rand(4, D, 8, scale=0.3),
        rand(2, D, 8, scale=0.3),
        rand(4, 8, scale=0.2),
        rand(2, 8, scale=0.2),
        8**-0.5,
        q_norm=norm(4),
        k_norm=norm(2),
        qk_norm_over_heads=over_heads,
    )


def _normed(t: Tensor, norm: NormParams, over_heads: bool) -> Tensor:
    """The model's q/k norm on (batch, head, pos, e), written out plainly."""
    heads = t.shape[1]
    flat = rearrange(t, "b h p e -> b p (h e)") if over_heads else t
    if norm.kind == "layernorm":
        flat = flat - flat.mean(-1, keepdim=True)
    flat = flat / (flat.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt() * norm.weight
    if norm.bias is not None:
        flat = flat + norm.bias
    return rearrange(flat, "b p (h e) -> b h p e", h=heads) if over_heads else flat


@pytest.mark.parametrize("over_heads", [False, True])
@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_qk_norm_split_is_exact_with_frozen_scale(over_heads: bool, kind: str) -> None:
    """Terms sum to the normalised model score; each term uses the scale of the full
    query/key (frozen), so TT is not the score of x_T pushed through the norm alone."""
    params = _qk_params(over_heads, kind)
    assert params.linearised == "qk_norm"
    x = torch.randn(2, POS, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    basis = random_basis(8, seed=10)
    terms = decompose_scores(x, basis, params)

    def q_k(inp: Tensor) -> tuple[Tensor, Tensor]:
        q = torch.einsum("bpd,hde->bhpe", inp, params.W_Q) + params.b_Q[None, :, None]
        k = torch.einsum("bpd,hde->bhpe", inp, params.W_K) + params.b_K[None, :, None]
        return q, k

    q, k = q_k(x)
    q, k = _normed(q, params.q_norm, over_heads), _normed(k, params.k_norm, over_heads)
    assert rel_err(sum(terms.values()), qk_scores(q, k, params)) < 1e-12

    x_t = basis.split(x)[0].double()  # TT: the tangent projections over the full scale
    dims = (1, 3) if over_heads else (3,)
    q_full, k_full = q_k(x)
    sigma_q, sigma_k = (
        (t - t.mean(dims, keepdim=True) if kind == "layernorm" else t)
        .pow(2)
        .mean(dims, keepdim=True)
        .add(1e-6)
        .sqrt()
        for t in (q_full, k_full)
    )
    q_t = torch.einsum("bpd,hde->bhpe", x_t, params.W_Q)
    k_t = torch.einsum("bpd,hde->bhpe", x_t, params.W_K)
    if kind == "layernorm":
        q_t, k_t = (t - t.mean(dims, keepdim=True) for t in (q_t, k_t))

    def scaled(t: Tensor, sigma: Tensor, norm: NormParams) -> Tensor:
        w = rearrange(norm.weight, "(h e) -> h 1 e", h=t.shape[1]) if over_heads else norm.weight
        return t / sigma * w

    expected = qk_scores(
        scaled(q_t, sigma_q, params.q_norm), scaled(k_t, sigma_k, params.k_norm), params
    )
    assert rel_err(terms["TT"], expected) < 1e-10


def test_qk_norm_params_are_validated() -> None:
    params = _qk_params(False, "rmsnorm")
    with pytest.raises(ValueError, match=r"q_norm\.weight"):
        replace(params, qk_norm_over_heads=True)
    with pytest.raises(ValueError, match="window"):
        replace(params, window=0)
    assert replace(params, q_norm=None, k_norm=None).linearised is None


def test_norm_from_module_reads_gemma_offset() -> None:
    """Gemma's RMSNorm scales by 1 + weight, Llama's by weight: read by what they do."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gemma, llama = Gemma3RMSNorm(8, eps=1e-6), LlamaRMSNorm(8, eps=1e-6)
    with torch.no_grad():
        gemma.weight.normal_(0, 0.3)
        llama.weight.normal_(1, 0.3)
    torch.testing.assert_close(norm_from_module(gemma).weight, 1 + gemma.weight.detach())
    torch.testing.assert_close(norm_from_module(llama).weight, llama.weight.detach())
    x = torch.randn(3, 8)
    for module in (gemma, llama):
        norm = norm_from_module(module)
        u_t, u_n, _ = linearize_norm(x, torch.zeros_like(x), norm)
        assert rel_err(u_t + u_n, module(x).detach()) < 1e-6


def test_keep_terms_refuses_qk_norm() -> None:
    with pytest.raises(ValueError, match="q/k-norm"):
        keep_terms(random_basis(4), _qk_params(False, "rmsnorm"), 0)


# ----------------------------------------------------------------------------- local attention
@pytest.mark.parametrize("causal", [True, False])
def test_keep_mask_window(causal: bool) -> None:
    """Query q sees key k when |q − k| < window (and k ≤ q when causal), minus padding."""
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    keep = dkeep_mask((2, 3, 6, 6), causal=causal, window=3, attention_mask=mask)
    assert keep.shape == (2, 1, 6, 6)
    for b in range(2):
        for q in range(6):
            for k in range(6):
                want = abs(q - k) < 3 and (k <= q or not causal) and bool(mask[b, q] & mask[b, k])
                assert bool(keep[b, 0, q, k]) == want
    assert dkeep_mask((1, 1, 4, 4), causal=False).all()
    with pytest.raises(ValueError, match="local mask"):
        dkeep_mask((1, 1, 3, 4), causal=False, window=2)


def test_attention_probe_respects_the_window() -> None:
    """pattern_kl_TT and the shares run over the entries a sliding window keeps: a
    Mistral-style layer (window 3) counts min(q + 1, 3) keys per query."""
    params = replace(_qk_params(False, "rmsnorm"), q_norm=None, k_norm=None, window=3)
    site = Site(0, "attn_in")
    x = torch.randn(2, POS, D, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    windowed = AttentionProbe({site: (random_basis(8), params)})
    windowed.update(Observation(site, x))
    acc = windowed.state(site.hook_name)
    assert acc.entries == 2 * sum(min(q + 1, 3) for q in range(POS))
    terms = decompose_scores(x, random_basis(8), params)
    full = AttentionAccumulator().update(terms, causal=True).results()
    local = AttentionAccumulator().update(terms, causal=True, window=3).results()
    for stat, value in acc.results().items():
        torch.testing.assert_close(value, local[stat])
    assert not torch.allclose(local["pattern_kl_TT"], full["pattern_kl_TT"])
    assert not any(r["statistic"].startswith("linearised") for r in windowed.rows())
    marked = AttentionProbe({site: (random_basis(8), _qk_params(True, "rmsnorm"))})
    marked.update(Observation(site, x))
    rows = [r for r in marked.rows() if r["statistic"] == "linearised_qk_norm"]
    assert [(r["hook"], r["head"], r["value"]) for r in rows] == [(site.hook_name, None, 1.0)]
    from tangentlens.core import results
    from tangentlens.report.figures import FIGURES

    table = results.frame(marked.rows(), ("checkpoint", "step", "window", "rank"))
    _, reading = FIGURES["head_heatmap"][1](table)
    assert "rest on that linearisation" in reading  # the heatmap's caption says so


# ------------------------------------------------------------------- many bases at once
def _brute_terms(x: Tensor, basis: TangentBasis, params: AttentionParams) -> list[Tensor]:
    """TT, TN, NT, NN written out plainly from x_T = x Q Qᵀ and x_N = x − x_T."""
    q = basis.basis_
    x_t = x @ q @ q.T
    parts = [
        (
            torch.einsum("bpd,hde->bhpe", p, params.W_Q.double()),
            torch.einsum("bpd,hde->bhpe", p, params.W_K.double()),
        )
        for p in (x_t, x - x_t)
    ]
    return [qk_scores(a[0], b[1], params) for a in parts for b in parts]


@pytest.mark.parametrize("case", ["llama", "gpt2", "qk_norm"])
def test_score_split_of_many_bases_matches_each(case: str) -> None:
    """One `ScoreSplit`, bases of ranks 1, 5 and 8: each basis's terms are its own split
    (brute force without q/k norm; the one-basis `decompose_scores` with it), in float64
    to 1e-10 and in float32 to float32 precision, and they sum to `scores`."""
    norm = case == "qk_norm"
    params = _qk_params(True, "layernorm") if norm else params_from_bridge(bridge(case), LAYER)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(2, POS, D, generator=gen, dtype=torch.float64)
    bases = [random_basis(k, seed=k) for k in (1, 5, 8)]
    split = ScoreSplit(x, params)
    many, many32 = split.parts(bases), split.parts(bases, dtype=torch.float32)
    assert len(many) == 3
    for i, basis in enumerate(bases):
        got = many.term_dict(i)
        if norm:
            want = decompose_scores(x, basis, params)
            want_cross = [want[t] for t in TERMS[:4]]
        else:
            want_cross = _brute_terms(x, basis, params)
            assert rel_err(sum(got.values()), reference_scores(x, params)) < 1e-10
        for t, w in zip(TERMS[:4], want_cross, strict=True):
            assert rel_err(got[t], w) < 1e-10, t
        assert rel_err(sum(got.values()), split.scores()) < 1e-12
        cross32 = many32.terms(i)
        assert cross32.dtype == torch.float32
        assert rel_err(cross32, torch.stack(want_cross)) < 1e-5
    with pytest.raises(ValueError, match="d_model"):
        split.parts([TangentBasis(torch.eye(D + 1, 2, dtype=torch.float64))])
    with pytest.raises(ValueError, match="at least one"):
        split.parts([])


@pytest.mark.parametrize(("causal", "window"), [(True, None), (True, 5), (False, 5), (False, None)])
def test_keep_blocks_cover_every_kept_entry(causal: bool, window: int | None) -> None:
    """Every row in exactly one block, every entry `keep_mask` keeps inside its block,
    and (causal or local) most masked entries outside every block."""
    n = 70
    keep = dkeep_mask((1, 1, n, n), causal=causal, window=window)[0, 0]
    covered = torch.zeros_like(keep)
    seen = torch.zeros(n, dtype=torch.int64)
    for rows, keys in keep_blocks(n, causal=causal, window=window, rows=16):
        covered[rows, keys] = True
        seen[rows] += 1
    assert bool((seen == 1).all()) and not bool((keep & ~covered).any())
    if causal or window is not None:
        assert int(covered.sum()) < 0.62 * n * n  # a causal mask keeps 0.51
    else:
        assert bool(covered.all())


@pytest.mark.parametrize(("arch", "window"), [("llama", None), ("llama", 7), ("gpt2", None)])
def test_probe_blocks_match_whole_terms(arch: str, window: int | None) -> None:
    """The probe splits once per layer and accumulates over row blocks (`keep_blocks`),
    the basis in float64 and its null frames in float32: the statistics of
    `AttentionAccumulator.update` on each basis's whole float64 terms, to 1e-10 for the
    basis and 1e-6 for the frames (float32 rounding: ~5e-8), with left and right padding,
    rotary and GQA (llama) or biases (gpt2)."""
    params = replace(params_from_bridge(bridge(arch), LAYER), window=window)
    n = 70  # three blocks of 32 rows
    x = torch.randn(3, n, D, generator=torch.Generator().manual_seed(13))
    mask = torch.ones(3, n, dtype=torch.int64)
    mask[1, :5], mask[2, 60:] = 0, 0
    site, basis = Site(LAYER, "attn_in"), random_basis(4)
    probe = AttentionProbe({site: (basis, params)}, head_null=3)
    probe.update(Observation(site, x, mask))
    nulls = [(f"{site.hook_name}/null", j, b, 1e-6) for j, b in enumerate(probe.null_bases[site])]
    for key, j, b, tol in [(site.hook_name, ..., basis, 1e-10), *nulls]:
        whole = AttentionAccumulator().update(
            decompose_scores(x, b, params), mask, causal=True, window=window
        )
        got = probe.state(key)
        assert (got.rows, got.entries) == (whole.rows, whole.entries)
        for stat, want in whole.results().items():
            torch.testing.assert_close(got.results()[stat][j], want, rtol=tol, atol=1e-12)


def test_head_null_at_half_rank_is_left_out_with_a_warning() -> None:
    """At 2k = d every null frame spans the complement of Q_T itself, so the frames could
    not vary: the probe warns, naming the hook, keeps Q_T's own rows and writes no null
    row, where the same probe one rank lower keeps its null."""
    params = params_from_bridge(bridge("llama"), LAYER)
    site = Site(LAYER, "attn_in")
    x = torch.randn(2, POS, D, generator=torch.Generator().manual_seed(5))
    with pytest.warns(UserWarning, match=site.hook_name):
        half = AttentionProbe({site: (random_basis(D // 2), params)}, head_null=3)
    below = AttentionProbe({site: (random_basis(D // 2 - 1), params)}, head_null=3)
    for probe in (half, below):
        probe.update(Observation(site, x))
    stats = [{r["statistic"] for r in p.rows()} for p in (half, below)]
    assert "score_share_TT" in stats[0] and "score_share_TT" in stats[1]
    assert site not in half.null_bases and len(below.null_bases[site]) == 3
    assert not any("null" in s for s in stats[0])
    assert any("null" in s for s in stats[1])


def test_masked_exp_matches_torch_with_inf_masks() -> None:
    """`_Block`'s pattern and `_logsumexp_` clamp masked entries before exp (whose
    underflow path is slow on CPU) yet give torch's softmax and logsumexp with −inf
    masks: P exactly 0 where masked, no NaN for a padded query (no kept key), and a
    float32 input's log-sum-exp to float32 rounding of its inputs and of the sum of their
    exponentials (kept in float32: a log's absolute error of a few float32 eps)."""
    gen = torch.Generator().manual_seed(14)
    scores = 8 * torch.randn(2, 3, 6, 6, generator=gen, dtype=torch.float64)
    mask = torch.ones(2, 6, dtype=torch.int64)
    mask[1, 0] = 0  # batch 1: query 0 sees no key
    keep = dkeep_mask((2, 1, 6, 6), causal=True, attention_mask=mask)
    rows = keep.any(-1).expand(-1, 3, -1)
    block = _Block(scores, None, keep)
    want = torch.softmax(scores.masked_fill(~keep, -torch.inf), -1)
    assert bool((block.p[~keep.expand_as(scores)] == 0).all())
    torch.testing.assert_close(block.p[rows], want[rows], rtol=1e-14, atol=0)
    want_plogp = torch.special.xlogy(want, want).sum(-1)
    torch.testing.assert_close(block.p_log_p[rows], want_plogp[rows], rtol=1e-14, atol=1e-15)
    assert bool(block.p_log_p.isfinite().all()) and bool(block.p.isfinite().all())
    for dtype, rtol, atol in ((torch.float64, 1e-15, 0.0), (torch.float32, 1e-7, 4e-7)):
        x = scores.to(dtype)
        got = _logsumexp_(x.masked_fill(~keep, torch.finfo(dtype).min))
        want_lse = torch.logsumexp(x.double().masked_fill(~keep, -torch.inf), -1)
        assert got.dtype == torch.float64 and bool(got.isfinite().all())
        torch.testing.assert_close(got[rows], want_lse[rows], rtol=rtol, atol=atol)
