"""Architectures beyond the original four: block layouts, causality from the config,
the built-in masked-token loss, graceful partial runs and the bridge's limits."""

from __future__ import annotations

import math
import tempfile
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from models import BRIDGE_FAMILIES, ENCODERS, FAMILIES, hf_folder, hf_model, padded_batch
from torch import Tensor, nn

from tangentlens.core.decompose import decompose_scores
from tangentlens.core.errors import UnstableBasisWarning, UsageError
from tangentlens.core.subspace import TangentBasis
from tangentlens.hooks import Site, families, get_backend, layouts
from tangentlens.hooks.families import FamilySpec, family_of, is_causal, register_family
from tangentlens.hooks.huggingface import norm_from_hf
from tangentlens.hooks.transformer_lens import boot_bridge
from tangentlens.models import loading
from tangentlens.probes import fit_bases, mlm_loss, run

nnsight = pytest.importorskip("nnsight")


def _nnsight(arch: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nnsight.NNsight(hf_model(arch, sharp=True))


def _activations(model: Any, sites: list[Site], batch: dict) -> dict[Site, Tensor]:
    backend = get_backend(model)
    seen: dict[Site, Tensor] = {}
    handles = [backend.add_forward_hook(s, lambda x, s=s: seen.update({s: x})) for s in sites]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return seen


# ------------------------------------------------------------------ layouts
def test_parallel_and_post_norm_layouts() -> None:
    """GPT-J: ln_1 feeds attention and the MLP (no resid_mid); OLMo 2 and ModernBERT's
    layer 0: attention reads the residual stream; Gemma 3: the input norm's output."""
    batch = padded_batch("llama")
    gptj = _nnsight("gptj")
    assert Site(0, "resid_mid") not in get_backend(gptj).sites()
    got = _activations(gptj, [Site(0, "attn_in"), Site(0, "mlp_in")], batch)
    assert got[Site(0, "attn_in")] is got[Site(0, "mlp_in")]
    for arch, layer in (("olmo2", 1), ("modernbert", 0), ("modernbert", 1)):
        pre, attn_in = Site(layer, "resid_pre"), Site(layer, "attn_in")
        got = _activations(_nnsight(arch), [pre, attn_in], batch)
        same = torch.allclose(got[attn_in], got[pre])
        assert same == (layer == 0 or arch == "olmo2")  # ModernBERT's layer 1 has attn_norm


def test_gemma_norm_linearised_from_the_residual_stream() -> None:
    """A basis at resid_pre through Gemma 3's (1 + weight) input norm, frozen at its scale:
    the same scores as at the attention input."""
    model = _nnsight("gemma3")
    backend = get_backend(model)
    got = _activations(model, [Site(1, "resid_pre"), Site(1, "attn_in")], padded_batch("llama"))
    params = backend.attention_params(1)
    gen = torch.Generator().manual_seed(0)
    basis = TangentBasis(torch.linalg.qr(torch.randn(32, 8, generator=gen, dtype=torch.float64)).Q)
    at_resid = decompose_scores(
        got[Site(1, "resid_pre")], basis, params, norm=norm_from_hf(model, 1)
    )
    at_input = decompose_scores(got[Site(1, "attn_in")], basis, params)
    torch.testing.assert_close(sum(at_resid.values()), sum(at_input.values()), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ causality
def test_causality_comes_from_config_and_class() -> None:
    """EuroBERT has Llama's layout but attends both ways; a BERT decoder is causal; Gemma 3
    with use_bidirectional_attention is not."""
    import transformers as tf

    eurobert = get_backend(_nnsight("eurobert"))
    assert not eurobert.causal and not eurobert.attention_params(0).causal
    assert not get_backend(_nnsight("modernbert")).causal
    assert get_backend(_nnsight("gemma3")).causal
    small = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    small |= {"intermediate_size": 16, "vocab_size": 20}
    decoder = tf.BertLMHeadModel(tf.BertConfig(**small, is_decoder=True))
    assert is_causal(decoder) and is_causal(nnsight.NNsight(decoder))
    config = tf.Gemma3TextConfig(**small, head_dim=8, use_bidirectional_attention=True)
    assert not is_causal(tf.Gemma3ForCausalLM(config))


# ------------------------------------------------------------------ losses
class _Recorder(nn.Module):
    """A masked LM that records the ids it is called with (uniform logits)."""

    def __init__(self, architectures: list[str] | None = None) -> None:
        super().__init__()
        self.config = SimpleNamespace(
            vocab_size=20, mask_token_id=4, pad_token_id=0, architectures=architectures
        )
        self.head = nn.Linear(1, 20)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.seen: list[Tensor] = []

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        self.seen.append(ids.clone())
        return self.head(torch.ones(*ids.shape, 1))


def test_mlm_loss_masks_a_seeded_sample_of_real_tokens() -> None:
    model = _Recorder(["RecorderForMaskedLM"])
    ids = torch.randint(5, 20, (3, 40), generator=torch.Generator().manual_seed(1))
    ids[0, :2] = 0  # special tokens are never masked
    mask = torch.ones_like(ids)
    mask[2, 3:] = 0  # row 2 has 3 tokens: at least one is masked anyway
    batch = {"input_ids": ids, "attention_mask": mask}
    loss = mlm_loss(model, batch)
    chosen = model.seen[0] != ids
    assert (model.seen[0][chosen] == 4).all()
    assert not chosen[mask == 0].any() and not chosen[0, :2].any()
    assert chosen.any(1).all() and 5 <= int(chosen.sum()) <= 35
    torch.testing.assert_close(loss, torch.tensor(float(chosen.sum()) * math.log(20)))
    mlm_loss(model, batch)
    assert torch.equal(model.seen[1], model.seen[0])  # same seed and ids: same mask
    mlm_loss(model, batch, seed=1)
    assert not torch.equal(model.seen[2], model.seen[0])


def test_mlm_loss_needs_a_head_and_a_mask_token() -> None:
    import transformers as tf

    folder = tempfile.mkdtemp()
    tf.BertModel.from_pretrained(hf_folder("bert")).save_pretrained(folder)
    tf.AutoTokenizer.from_pretrained(hf_folder("bert")).save_pretrained(folder)
    ids = torch.randint(5, 30, (2, 8))
    bridge = boot_bridge(folder, device="cpu")  # boots BertModel with a fresh MLM head
    with pytest.raises(UsageError, match=r"masked-LM head, and the checkpoint \(BertModel\)"):
        mlm_loss(bridge, ids)
    with pytest.raises(UsageError, match="masked-LM head"):
        mlm_loss(nnsight.NNsight(tf.BertModel.from_pretrained(folder)), ids)
    with pytest.raises(UsageError, match="mask token id"):  # BertConfig has none
        mlm_loss(nnsight.NNsight(hf_model("bert")), ids)
    mlm_loss(nnsight.NNsight(hf_model("bert")), ids, mask_token_id=4).backward()


def test_encoders_need_a_loss_and_take_mlm() -> None:
    model = _nnsight("eurobert")
    batches = [padded_batch("llama", seed=s) for s in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnstableBasisWarning)
        bases = fit_bases(model, batches, rank=4, sites="blocks.1.hook_resid_post")
    with pytest.raises(UsageError, match="loss='mlm'"):
        run(model, batches, bases, ("gradient",), progress=False)
    with pytest.raises(UsageError, match="loss must be one of"):
        run(model, batches, bases, ("gradient",), loss="mse", progress=False)
    session = run(model, batches, bases, ("gradient",), loss="mlm", n_controls=10, progress=False)
    assert "gradient" in set(session.results()["probe"])


# ------------------------------------------------------------------ partial runs
def test_unsupported_attention_is_skipped_with_one_warning() -> None:
    """Gemma 2 soft-caps its scores: the attention probe is skipped, once, by name; the
    residual and gradient probes still run."""
    import transformers as tf

    config = tf.Gemma2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=50,
        attn_logit_softcapping=50.0,
    )
    torch.manual_seed(0)
    model = nnsight.NNsight(tf.Gemma2ForCausalLM(config).eval())
    batches = [padded_batch("llama", seed=s) for s in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnstableBasisWarning)
        bases = fit_bases(model, batches, rank=4, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = run(model, batches, bases, n_controls=10, progress=False)
    skips = [str(w.message) for w in caught if "cannot run" in str(w.message)]
    assert len(skips) == 1 and "Gemma2ForCausalLM" in skips[0] and "soft-caps" in skips[0]
    assert set(session.skipped) == {"attention"}
    assert {"residual", "gradient"} <= set(session.results()["probe"])
    with (
        pytest.raises(UsageError, match="nothing to probe on Gemma2ForCausalLM: attention:"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        run(model, batches, bases, ("attention",), progress=False)


# ------------------------------------------------------------------ bridges
def test_boot_bridge_names_the_backend_for_what_it_cannot_boot() -> None:
    for arch in ("eurobert", "modernbert"):
        with pytest.raises(UsageError, match="use the nnsight backend") as err:
            boot_bridge(str(hf_folder(arch)))
        assert "\n" not in str(err.value)
    assert not boot_bridge(str(hf_folder("qwen3")), device="cpu").training


def test_load_refuses_what_the_bridge_cannot_boot_before_transformer_lens_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformer_lens.model_bridge import TransformerBridge

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("TransformerLens was asked")

    monkeypatch.setattr(TransformerBridge, "boot_transformers", never)
    for arch in ("eurobert", "modernbert"):
        with pytest.raises(UsageError) as err:
            loading.load(str(hf_folder(arch)), backend="transformer_lens")
        assert "nnsight" in str(err.value) and "\n" not in str(err.value)
        with pytest.raises(UsageError, match="nnsight"):
            loading.wrap(hf_model(arch), None, "transformer_lens", source=str(hf_folder(arch)))


# ------------------------------------------------------------------ the family registry
def test_every_family_fact_matches_its_models() -> None:
    """What each FamilySpec says (causal, bridge, q/k norms, windows) against the tiny
    models: the registry is the one answer, and it is right for every family tested."""
    for arch in FAMILIES:
        model = hf_model(arch, sharp=True)
        spec = family_of(model)
        assert spec is not None and family_of(model.config) is spec, arch
        assert spec.causal == (arch not in ENCODERS) == is_causal(model), arch
        assert spec.bridge == (arch in BRIDGE_FAMILIES), arch
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            backend = get_backend(nnsight.NNsight(model))
        params = [backend.attention_params(layer) for layer in range(backend.n_layers)]
        assert any(p.q_norm is not None for p in params) == spec.qk_norm, arch
        assert any(p.window is not None for p in params) <= spec.local_windows, arch


def test_every_layout_comes_from_a_family() -> None:
    named = [spec.block_layout(SimpleNamespace()) for spec in families.families()]
    named.append(layouts.neox(parallel=False))
    for value in vars(layouts).values():
        assert not isinstance(value, layouts.Layout) or value in named


def test_a_family_is_one_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model_type no family lists is recognised by its blocks' shape; one FamilySpec
    makes it a family of its own, and every question (causality, layout, sites, the
    bridge) is answered from that spec."""
    monkeypatch.setattr(families, "_REGISTRY", dict(families._REGISTRY))
    model = hf_model("llama")
    model.config.model_type = "toy-llama"
    sites = get_backend(nnsight.NNsight(model)).sites()
    assert family_of(model).name == "Llama" and family_of(model.config) is None
    assert is_causal(model)

    toy = register_family(
        FamilySpec("Toy", ("toy-llama",), layouts.LLAMA, causal=False, bridge=False)
    )
    assert family_of(model) is toy and family_of(model.config) is toy
    assert not is_causal(model) and not is_causal(model.config)
    backend = get_backend(nnsight.NNsight(model))
    assert not backend.causal and not backend.attention_params(0).causal
    assert backend.sites() == sites
    with pytest.raises(UsageError, match="nnsight"):
        boot_bridge(str(hf_folder("llama")), hf_model=model)
    with pytest.raises(UsageError, match="already belongs to the 'Toy' family"):
        register_family(FamilySpec("Toy 2", ("toy-llama",), layouts.LLAMA))
    assert register_family(FamilySpec("Toy", ("toy-llama",), layouts.LLAMA)).causal
    assert is_causal(model) and [s.name for s in families.families()].count("Toy") == 1
