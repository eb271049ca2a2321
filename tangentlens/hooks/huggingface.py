"""Hugging Face modules: block layouts and attention parameters.

Shared by the nnsight backend and by anything else that reads plain HF models: where
each `Site` lives in a block (`layout`), which linear maps read it (`input_linears`),
and what the score decomposition needs from an attention module (`params_from_hf`,
`norm_from_hf`, `hf_attention_module`).

Site → HF module (``in`` = the module's first input, ``out`` = its first output), matching
TransformerLens 4.x bridges of the same weights:

==========  ===========  =========================  =====================  ===================
site        GPT-2 h[l]   GPT-NeoX layers[l]         Llama layers[l]        BERT layer[l]
==========  ===========  =========================  =====================  ===================
embed       wte out      embed_in out               embed_tokens out       embeddings out
resid_pre   block in     block in                   block in               block in
attn_in     ln_1 out     input_layernorm out        input_layernorm out    attention in
attn_out    attn out     attention out              self_attn out          attention out
resid_mid   ln_2 in      (none: parallel residual)  post_attention_ln in   output.LayerNorm in
mlp_in      ln_2 out     post_attention_ln out      post_attention_ln out  intermediate in
mlp_out     mlp out      mlp out                    mlp out                output.dense out
resid_post  block out    block out                  block out              block out
==========  ===========  =========================  =====================  ===================

BERT is post-norm: its attention input is the block input, ``attn_out`` is the attention
block's (normalised) output, which is also ``mlp_in``, and ``resid_mid`` the sum entering
the second LayerNorm, exactly as on the TransformerLens BERT bridge.

The linear maps that read a site (`input_linears`: the weights whose gradients have the
site's activation on their input side):

==========  ===========  =========================  =====================  ===================
site        GPT-2        GPT-NeoX                   Llama                  BERT
==========  ===========  =========================  =====================  ===================
attn_in     attn.c_attn  attention.query_key_value  self_attn.q/k/v_proj   attention.self.
                                                                           query/key/value
mlp_in      mlp.c_fc     mlp.dense_h_to_4h          mlp.gate/up_proj       intermediate.dense
==========  ===========  =========================  =====================  ===================
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as _llama_rotary

from ..decompose import AttentionParams, NormParams, RotaryFn
from ..errors import UsageError

__all__ = [
    "Layout",
    "first_tensor",
    "hf_attention_module",
    "input_linears",
    "layout",
    "norm_from_hf",
    "norm_from_module",
    "params_from_hf",
    "unwrap",
]

# (module path relative to the block, "in" | "out") per site kind, per block layout.
_Where = tuple[str, str]


@dataclass(frozen=True)
class Layout:
    layers: str  # path from the base model to the ModuleList of blocks
    embed: _Where  # path from the base model
    block: Mapping[str, _Where]
    order: tuple[str, ...]  # block kinds in forward execution order
    linears: Mapping[str, tuple[str, ...]]  # site kind -> paths of the linear maps reading it
    causal: bool = True


_PRE_NORM_ORDER = (
    "resid_pre",
    "attn_in",
    "attn_out",
    "resid_mid",
    "mlp_in",
    "mlp_out",
    "resid_post",
)


_GPT2 = Layout(
    "h",
    ("wte", "out"),
    {
        "resid_pre": ("", "in"),
        "attn_in": ("ln_1", "out"),
        "attn_out": ("attn", "out"),
        "resid_mid": ("ln_2", "in"),
        "mlp_in": ("ln_2", "out"),
        "mlp_out": ("mlp", "out"),
        "resid_post": ("", "out"),
    },
    _PRE_NORM_ORDER,
    {"attn_in": ("attn.c_attn",), "mlp_in": ("mlp.c_fc",)},
)


_NEOX_BLOCK = {
    "resid_pre": ("", "in"),
    "attn_in": ("input_layernorm", "out"),
    "attn_out": ("attention", "out"),
    "resid_mid": ("post_attention_layernorm", "in"),
    "mlp_in": ("post_attention_layernorm", "out"),
    "mlp_out": ("mlp", "out"),
    "resid_post": ("", "out"),
}
_NEOX_LINEARS = {"attn_in": ("attention.query_key_value",), "mlp_in": ("mlp.dense_h_to_4h",)}


_NEOX = Layout("layers", ("embed_in", "out"), _NEOX_BLOCK, _PRE_NORM_ORDER, _NEOX_LINEARS)


_NEOX_PARALLEL = Layout(
    "layers",
    ("embed_in", "out"),
    {k: v for k, v in _NEOX_BLOCK.items() if k != "resid_mid"},
    tuple(k for k in _PRE_NORM_ORDER if k != "resid_mid"),
    _NEOX_LINEARS,
)


_LLAMA = Layout(
    "layers",
    ("embed_tokens", "out"),
    {
        "resid_pre": ("", "in"),
        "attn_in": ("input_layernorm", "out"),
        "attn_out": ("self_attn", "out"),
        "resid_mid": ("post_attention_layernorm", "in"),
        "mlp_in": ("post_attention_layernorm", "out"),
        "mlp_out": ("mlp", "out"),
        "resid_post": ("", "out"),
    },
    _PRE_NORM_ORDER,
    {
        "attn_in": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp_in": ("mlp.gate_proj", "mlp.up_proj"),
    },
)


_BERT_BLOCK = {
    "resid_pre": ("", "in"),
    "attn_in": ("attention", "in"),
    "attn_out": ("attention", "out"),
    "mlp_in": ("intermediate", "in"),
    "mlp_out": ("output.dense", "out"),
    "resid_mid": ("output.LayerNorm", "in"),
    "resid_post": ("", "out"),
}


_BERT_ORDER = (
    "resid_pre",
    "attn_in",
    "attn_out",
    "mlp_in",
    "mlp_out",
    "resid_mid",
    "resid_post",
)
_BERT_LINEARS = {
    "attn_in": ("attention.self.query", "attention.self.key", "attention.self.value"),
    "mlp_in": ("intermediate.dense",),
}


def submodule(module: nn.Module, path: str) -> nn.Module:
    return module.get_submodule(path) if path else module


def layout(hf: nn.Module) -> tuple[Layout, nn.Module]:
    """The block layout of a Hugging Face model and its base model (the layer stack)."""
    base = getattr(hf, "base_model", hf)
    config = getattr(hf, "config", None)
    model_type = getattr(config, "model_type", "")
    if model_type == "gpt2" or (hasattr(base, "wte") and hasattr(base, "h")):
        return _GPT2, base
    if model_type == "gpt_neox" or hasattr(base, "embed_in"):
        parallel = bool(getattr(config, "use_parallel_residual", True))
        return (_NEOX_PARALLEL if parallel else _NEOX), base
    encoder = getattr(base, "encoder", None)
    if model_type == "bert" or (
        hasattr(base, "embeddings") and isinstance(getattr(encoder, "layer", None), nn.ModuleList)
    ):
        causal = bool(getattr(config, "is_decoder", False))
        return Layout(
            "encoder.layer", ("embeddings", "out"), _BERT_BLOCK, _BERT_ORDER, _BERT_LINEARS, causal
        ), base
    layers = getattr(base, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) and hasattr(base, "embed_tokens"):
        block = layers[0]
        parts = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
        extra = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        if all(hasattr(block, p) for p in parts) and not any(hasattr(block, p) for p in extra):
            return _LLAMA, base
    raise UsageError(
        f"the nnsight backend does not know the layout of {type(hf).__name__} "
        f"(model_type {model_type!r}): supported are GPT-2, GPT-NeoX, Llama-style "
        "(input_layernorm/self_attn/post_attention_layernorm/mlp) and BERT encoders. "
        "Load it as a TransformerLens bridge instead (tangentlens.models.load(...))."
    )


def input_linears(
    blocks: nn.ModuleList, layout: Layout, layer: int, kind: str
) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of each linear map of block ``layer`` that reads site ``kind``:
    the weights whose gradients have that site's activation on their input side."""
    if kind not in layout.linears:
        raise UsageError(
            f"only {sorted(layout.linears)} sites are read by linear maps; got {kind!r}."
        )
    return [
        (f"{layout.layers}.{layer}.{path}", submodule(blocks[layer], path))
        for path in layout.linears[kind]
    ]


def first_tensor(value: Any, where: str) -> Tensor:
    """The activation in a module output or input: the tensor itself or the first element."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return value[0]
    raise TypeError(f"expected a tensor (or a tuple starting with one) at {where}; got {value!r}.")


def norm_from_module(module: nn.Module) -> NormParams:
    name = type(module).__name__
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    weight = None if weight is None else weight.detach()
    bias = None if bias is None else bias.detach()
    if isinstance(module, nn.LayerNorm) or name.endswith("LayerNormPre"):
        return NormParams("layernorm", weight, bias, float(module.eps))
    if "RMSNorm" in name:
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None:
            raise UsageError(f"cannot find the epsilon of {name}.")
        if "Gemma" in name:
            raise UsageError(f"{name} scales by (1 + weight); it is not supported.")
        return NormParams("rmsnorm", weight, None, float(eps))
    raise UsageError(
        f"cannot linearize a {name}: only LayerNorm and RMSNorm are supported; "
        "fit the basis at the attention input instead."
    )


def _module_apply_rotary(module: nn.Module) -> Callable[..., tuple[Tensor, Tensor]]:
    fn = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
    return _llama_rotary if fn is None else fn


def _hf_rotary(rotary_emb: nn.Module, apply: Callable[..., tuple[Tensor, Tensor]]) -> RotaryFn:
    """Rotary from the model's own ``rotary_emb`` (cos, sin) and ``apply_rotary_pos_emb``;
    partial rotary (cos narrower than d_head) rotates only the leading dims."""

    def rotary(q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = rotary_emb(q, positions)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        rd = cos.shape[-1]
        if rd == q.shape[-1]:
            return apply(q, k, cos, sin)
        q_r, k_r = apply(q[..., :rd], k[..., :rd], cos, sin)
        return torch.cat([q_r, q[..., rd:]], -1), torch.cat([k_r, k[..., rd:]], -1)

    return rotary


def _heads(weight_out_in: Tensor, n: int) -> Tensor:
    """nn.Linear weight (n*e, d) -> (n, d, e)."""
    return rearrange(weight_out_in, "(h e) d -> h d e", h=n)


def _bias_heads(bias: Tensor | None, n: int) -> Tensor | None:
    return None if bias is None else rearrange(bias, "(h e) -> h e", h=n)


def _reject_nonlinear(module: nn.Module) -> None:
    for attr in ("q_norm", "k_norm", "q_layernorm", "k_layernorm"):
        if getattr(module, attr, None) is not None:
            raise UsageError(
                f"{type(module).__name__} normalises q/k ({attr}); the score is not bilinear in "
                "the input and cannot be split into TT/TN/NT/NN."
            )
    if getattr(module, "attn_logit_softcapping", None) or getattr(
        getattr(module, "config", None), "attn_logit_softcapping", None
    ):
        raise UsageError(f"{type(module).__name__} soft-caps scores; the split is not additive.")


def params_from_hf(module: nn.Module, *, rotary_emb: nn.Module | None = None) -> AttentionParams:
    """:class:`AttentionParams` from a plain Hugging Face attention module.

    Supports GPT2Attention (fused ``c_attn`` Conv1D), GPTNeoXAttention (fused
    ``query_key_value`` with heads interleaved as [q_h, k_h, v_h]), Llama-style
    ``q_proj``/``k_proj`` modules (GQA) and BertAttention/BertSelfAttention. Rotary
    models need the model's ``rotary_emb`` (e.g. ``model.model.rotary_emb``,
    ``model.gpt_neox.rotary_emb``; :func:`hf_attention_module` finds it).
    """
    rotary = None if rotary_emb is None else unwrap(rotary_emb)
    return _params_from_hf(unwrap(module), rotary).detached()


def _params_from_hf(module: nn.Module, rotary_emb: nn.Module | None) -> AttentionParams:
    if hasattr(module, "self") and hasattr(module.self, "query"):  # BertAttention
        module = module.self
    _reject_nonlinear(module)
    name = type(module).__name__
    if hasattr(module, "c_attn"):  # GPT-2: Conv1D, x @ W + b, W (d, 3d)
        if getattr(module, "is_cross_attention", False):
            raise UsageError("GPT-2 cross-attention is not supported; pass a self-attention.")
        n = int(module.num_heads)
        w, b = module.c_attn.weight, module.c_attn.bias
        w_q, w_k, _ = rearrange(w, "d (three h e) -> three h d e", three=3, h=n)
        b_q, b_k, _ = rearrange(b, "(three h e) -> three h e", three=3, h=n)
        return AttentionParams(w_q, w_k, b_q, b_k, float(module.scaling), None, True)
    if hasattr(module, "query_key_value") and hasattr(module, "rotary_ndims"):  # GPT-NeoX
        # fused rows are laid out (head, [q|k|v], d_head)
        n = int(module.config.num_attention_heads)
        lin = module.query_key_value
        w_q, w_k, _ = rearrange(lin.weight, "(h three e) d -> three h d e", h=n, three=3)
        b_q = b_k = None
        if lin.bias is not None:
            b_q, b_k, _ = rearrange(lin.bias, "(h three e) -> three h e", h=n, three=3)
        rot = _require_rotary(module, rotary_emb)
        return AttentionParams(w_q, w_k, b_q, b_k, float(module.scaling), rot, True)
    if hasattr(module, "q_proj") and hasattr(module, "k_proj"):  # Llama family
        cfg = module.config
        n = int(cfg.num_attention_heads)
        n_kv = int(getattr(cfg, "num_key_value_heads", None) or n)
        w_q, w_k = _heads(module.q_proj.weight, n), _heads(module.k_proj.weight, n_kv)
        b_q, b_k = _bias_heads(module.q_proj.bias, n), _bias_heads(module.k_proj.bias, n_kv)
        rot = _require_rotary(module, rotary_emb)
        causal = bool(getattr(module, "is_causal", True))
        return AttentionParams(w_q, w_k, b_q, b_k, float(module.scaling), rot, causal)
    if hasattr(module, "query") and hasattr(module, "key"):  # BertSelfAttention
        pe = getattr(module, "position_embedding_type", "absolute")
        if pe not in (None, "absolute"):
            raise UsageError(f"{name} uses {pe!r} position scores; only 'absolute' is supported.")
        n = int(module.num_attention_heads)
        w_q, w_k = _heads(module.query.weight, n), _heads(module.key.weight, n)
        b_q, b_k = _bias_heads(module.query.bias, n), _bias_heads(module.key.bias, n)
        scale = float(getattr(module, "scaling", module.attention_head_size**-0.5))
        causal = bool(getattr(module, "is_causal", False))
        return AttentionParams(w_q, w_k, b_q, b_k, scale, None, causal)
    raise UsageError(
        f"unsupported attention module {name}: expected GPT2Attention, GPTNeoXAttention, a "
        "q_proj/k_proj (Llama-style) module or BertAttention. Build AttentionParams by hand."
    )


def _require_rotary(module: nn.Module, rotary_emb: nn.Module | None) -> RotaryFn:
    if rotary_emb is None:
        raise UsageError(
            f"{type(module).__name__} uses rotary positions: pass rotary_emb=<the model's "
            "rotary_emb module> (hf_attention_module(model, layer) returns it)."
        )
    return _hf_rotary(rotary_emb, _module_apply_rotary(module))


def unwrap(model: Any) -> nn.Module:
    """The torch module inside an nnsight ``NNsight``/``LanguageModel`` or ``Envoy``."""
    inner = model if isinstance(model, nn.Module) else getattr(model, "_module", None)
    if not isinstance(inner, nn.Module):
        raise TypeError(
            f"expected a torch module or an nnsight wrapper; got {type(model).__name__}."
        )
    return inner


def hf_attention_module(model: Any, layer: int) -> tuple[nn.Module, nn.Module | None]:
    """``(attention_module, rotary_emb)`` of ``layer`` in a Hugging Face model.

    The module's first input (``hidden_states``) is the exact input to its q/k
    projections: capture it there for :func:`decompose_scores`. ``rotary_emb`` is the
    model-level rotary module or None. Accepts an nnsight wrapper too.
    """
    hf = unwrap(model)
    base = getattr(hf, "base_model", hf)
    layers = None
    for path in ("h", "layers", "encoder.layer", "decoder.layers"):
        obj: Any = base
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList):
            layers = obj
            break
    if layers is None:
        raise UsageError(f"cannot find the layer list of {type(hf).__name__}.")
    if not 0 <= layer < len(layers):
        raise UsageError(f"layer must be in [0, {len(layers)}); got {layer}.")
    block = layers[layer]
    for attr in ("attn", "self_attn", "attention"):
        attn = getattr(block, attr, None)
        if isinstance(attn, nn.Module):
            return attn, getattr(base, "rotary_emb", None)
    raise UsageError(f"cannot find the attention module of {type(block).__name__}.")


def norm_from_hf(model: Any, layer: int) -> NormParams:
    """The pre-attention norm of ``layer`` in a pre-norm Hugging Face model."""
    attn, _ = hf_attention_module(model, layer)
    for block in unwrap(model).modules():
        if any(m is attn for m in block.children()):
            for attr in ("ln_1", "input_layernorm"):
                if isinstance(getattr(block, attr, None), nn.Module):
                    return norm_from_module(getattr(block, attr))
    raise UsageError(
        "no pre-attention norm (ln_1 / input_layernorm) found: a post-norm model's attention "
        "input is the residual stream itself; fit the basis there."
    )
