"""Per-head attention-score decomposition into tangent and normal parts.

With a tangent basis Q_T fitted at a layer's attention input x (the exact input to
W_Q/W_K), x = x_T + x_N exactly, and since projections and rotary are linear,

    s = (R q)·(R k) · scale = TT + TN + NT + NN + bias,

where TT = (R q_T)·(R k_T)·scale with q_T = x_T W_Q, and so on, and ``bias`` gathers
every term that involves b_Q or b_K. ``s`` is the pre-mask scaled score the model
softmaxes (grouped-query heads repeated as the model repeats them).

Layers:
- :class:`AttentionParams` and :func:`decompose_scores` / :func:`decompose_parts`:
  the backend-agnostic core.
- :func:`params_from_bridge` (TransformerLens bridges), :func:`params_from_hf` and
  :func:`hf_attention_module` (plain Hugging Face modules, for the nnsight backend).
- :func:`score_terms`: one call on a TransformerLens model.
- :class:`AttentionAccumulator`: streaming, mergeable per-head statistics.

Never read ``hook_attn_scores`` to decompose: on HF bridges it is post-mask, on native
and BERT bridges it is the post-softmax pattern.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from ..subspace import TangentBasis

__all__ = [
    "STATISTICS",
    "TERMS",
    "AttentionAccumulator",
    "AttentionParams",
    "NormParams",
    "attention_input_hook",
    "decompose_parts",
    "decompose_scores",
    "hf_attention_module",
    "linearize_norm",
    "norm_from_bridge",
    "norm_from_hf",
    "params_from_bridge",
    "params_from_hf",
    "score_terms",
]

TERMS = ("TT", "TN", "NT", "NN", "bias")
STATISTICS = (*(f"score_share_{t}" for t in TERMS), "pattern_kl_TT")

RotaryFn = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
"""``rotary(q, k, positions) -> (q, k)``: q, k ``(batch, head, pos, d_head)``,
positions ``(batch, pos)`` int64. Must be linear in q and in k (as RoPE is)."""


# --------------------------------------------------------------------------- params
@dataclass(frozen=True)
class AttentionParams:
    """What the score decomposition needs from one attention layer.

    ``W_Q`` is ``(n_heads, d_model, d_head)``, ``W_K`` ``(n_kv_heads, d_model, d_head)``
    (TransformerLens layout: q = x @ W_Q[h] + b_Q[h]); ``b_Q`` ``(n_heads, d_head)`` and
    ``b_K`` ``(n_kv_heads, d_head)`` or None; ``scale`` multiplies q·k (usually
    d_head**-0.5); ``rotary`` is applied to q and k after projection, or None;
    ``causal`` says whether the model applies a causal mask.
    """

    W_Q: Tensor
    W_K: Tensor
    b_Q: Tensor | None
    b_K: Tensor | None
    scale: float
    rotary: RotaryFn | None = None
    causal: bool = True

    def __post_init__(self) -> None:
        if self.W_Q.ndim != 3 or self.W_K.ndim != 3:
            raise ValueError(
                "W_Q and W_K must be (heads, d_model, d_head); got "
                f"{tuple(self.W_Q.shape)} and {tuple(self.W_K.shape)}."
            )
        n, d, e = self.W_Q.shape
        n_kv = self.W_K.shape[0]
        if self.W_K.shape[1:] != (d, e) or n % n_kv:
            raise ValueError(
                f"W_K {tuple(self.W_K.shape)} does not match W_Q {tuple(self.W_Q.shape)}: "
                "it needs the same d_model and d_head and a head count dividing n_heads."
            )
        for name, b, heads in (("b_Q", self.b_Q, n), ("b_K", self.b_K, n_kv)):
            if b is not None and tuple(b.shape) != (heads, e):
                raise ValueError(f"{name} must be ({heads}, {e}) or None; got {tuple(b.shape)}.")
        if not self.scale > 0:
            raise ValueError(f"scale must be positive; got {self.scale}.")

    def detached(self) -> AttentionParams:
        """A copy whose tensors are detached from autograd (a snapshot for analysis)."""
        b_q = None if self.b_Q is None else self.b_Q.detach()
        b_k = None if self.b_K is None else self.b_K.detach()
        return replace(self, W_Q=self.W_Q.detach(), W_K=self.W_K.detach(), b_Q=b_q, b_K=b_k)

    @property
    def n_heads(self) -> int:
        return int(self.W_Q.shape[0])

    @property
    def n_kv_heads(self) -> int:
        return int(self.W_K.shape[0])

    @property
    def d_model(self) -> int:
        return int(self.W_Q.shape[1])

    @property
    def d_head(self) -> int:
        return int(self.W_Q.shape[2])


# --------------------------------------------------------------------------- core
def _project(x: Tensor, w: Tensor) -> Tensor:
    """(batch, pos, d) @ (head, d, e) -> (batch, head, pos, e)."""
    return torch.einsum("bpd,hde->bhpe", x, w)


def _dot(q: Tensor, k: Tensor) -> Tensor:
    return torch.einsum("bhqe,bhke->bhqk", q, k)


@torch.no_grad()
def decompose_parts(
    x_tangent: Tensor,
    x_normal: Tensor,
    params: AttentionParams,
    *,
    positions: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> dict[str, Tensor]:
    """Split scores given the two parts of the attention input.

    ``x_tangent`` and ``x_normal`` are ``(batch, pos, d_model)`` with their sum the
    attention input; ``positions`` ``(batch, pos)`` or ``(pos,)`` feed the rotary
    (default ``arange(pos)``). Returns ``TT, TN, NT, NN, bias``, each
    ``(batch, head, q_pos, k_pos)`` in ``dtype`` (at least float32), summing to the
    pre-mask scaled scores. Runs without autograd: the terms are statistics' inputs.
    """
    if x_tangent.shape != x_normal.shape or x_tangent.ndim != 3:
        raise ValueError(
            "x_tangent and x_normal must both be (batch, pos, d_model); got "
            f"{tuple(x_tangent.shape)} and {tuple(x_normal.shape)}."
        )
    if x_tangent.shape[-1] != params.d_model:
        raise ValueError(
            f"the input has d_model={x_tangent.shape[-1]} but W_Q expects {params.d_model}; "
            "was the basis fitted at another layer's attention input or another model?"
        )
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64; got {dtype}.")
    batch, pos, _ = x_tangent.shape
    dev = x_tangent.device
    xt, xn = x_tangent.to(dev, dtype), x_normal.to(dev, dtype)
    w_q, w_k = params.W_Q.to(dev, dtype), params.W_K.to(dev, dtype)
    n, n_kv, e = params.n_heads, params.n_kv_heads, params.d_head

    q_t, q_n = _project(xt, w_q), _project(xn, w_q)
    k_t, k_n = _project(xt, w_k), _project(xn, w_k)
    has_bias = params.b_Q is not None or params.b_K is not None
    if has_bias:  # biases broadcast over positions; rotary then makes them position-dependent
        q_b, k_b = (
            torch.zeros(batch, heads, pos, e, device=dev, dtype=dtype)
            if b is None
            else b.to(dev, dtype)[None, :, None, :].expand(batch, heads, pos, e).contiguous()
            for b, heads in ((params.b_Q, n), (params.b_K, n_kv))
        )
    if params.rotary is not None:
        if positions is None:
            positions = torch.arange(pos, device=dev)
        positions = torch.as_tensor(positions, device=dev).long()
        if positions.ndim == 1:
            positions = positions[None].expand(batch, pos)
        if tuple(positions.shape) != (batch, pos):
            raise ValueError(
                f"positions must be ({pos},) or ({batch}, {pos}); got {tuple(positions.shape)}."
            )
        q_t, k_t = params.rotary(q_t, k_t, positions)
        q_n, k_n = params.rotary(q_n, k_n, positions)
        if has_bias:
            q_b, k_b = params.rotary(q_b, k_b, positions)
    if n_kv != n:  # grouped-query attention: kv head j serves query heads j*r .. j*r+r-1
        k_t, k_n = k_t.repeat_interleave(n // n_kv, 1), k_n.repeat_interleave(n // n_kv, 1)
        if has_bias:
            k_b = k_b.repeat_interleave(n // n_kv, 1)
    s = params.scale
    terms = {
        "TT": _dot(q_t, k_t) * s,
        "TN": _dot(q_t, k_n) * s,
        "NT": _dot(q_n, k_t) * s,
        "NN": _dot(q_n, k_n) * s,
    }
    if has_bias:
        terms["bias"] = (_dot(q_b, k_t + k_n + k_b) + _dot(q_t + q_n, k_b)) * s
    else:
        terms["bias"] = torch.zeros_like(terms["TT"])
    return terms


def decompose_scores(
    x: Tensor,
    basis: TangentBasis,
    params: AttentionParams,
    *,
    norm: NormParams | None = None,
    positions: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> dict[str, Tensor]:
    """Split ``x`` (batch, pos, d_model) with ``basis``, then :func:`decompose_parts`.

    Without ``norm``, ``x`` is the attention input (the exact input to W_Q/W_K). With
    ``norm`` (the pre-attention norm), ``x`` is the residual stream before it and
    ``basis`` was fitted there: the norm is made linear by freezing its scale at the
    value on the full ``x`` (:func:`linearize_norm`), and its bias joins ``bias``.
    """
    if not isinstance(basis, TangentBasis):
        raise TypeError(f"basis must be a TangentBasis; got {type(basis).__name__}.")
    x_t, x_n = basis.split(torch.as_tensor(x).detach())
    if norm is not None:
        x_t, x_n, offset = linearize_norm(x_t, x_n, norm, dtype=dtype)
        if offset is not None:
            params = _with_input_offset(params, offset)
    return decompose_parts(x_t, x_n, params, positions=positions, dtype=dtype)


# --------------------------------------------------------------------------- norms
@dataclass(frozen=True)
class NormParams:
    """A LayerNorm or RMSNorm: y = w ⊙ (x − mean·[layernorm]) / σ + b."""

    kind: str  # "layernorm" or "rmsnorm"
    weight: Tensor | None
    bias: Tensor | None
    eps: float

    def __post_init__(self) -> None:
        if self.kind not in ("layernorm", "rmsnorm"):
            raise ValueError(f"kind must be 'layernorm' or 'rmsnorm'; got {self.kind!r}.")


def linearize_norm(
    x_tangent: Tensor, x_normal: Tensor, norm: NormParams, *, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The norm as a linear map with its scale frozen at the value on the full input.

    Returns ``(u_tangent, u_normal, offset)`` with u_T + u_N + offset == norm(x_T + x_N)
    (offset is the norm's bias, or None): σ is computed on x = x_T + x_N and then held
    fixed, so the centring, 1/σ and the weight act linearly on each part.
    """
    xt, xn = x_tangent.to(dtype), x_normal.to(dtype)
    x = xt + xn
    if norm.kind == "layernorm":
        sigma = (x.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
        xt, xn = xt - xt.mean(-1, keepdim=True), xn - xn.mean(-1, keepdim=True)
    else:
        sigma = (x.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    w = 1.0 if norm.weight is None else norm.weight.to(x.device, dtype)
    offset = None if norm.bias is None else norm.bias.to(x.device, dtype)
    return xt / sigma * w, xn / sigma * w, offset


def _with_input_offset(params: AttentionParams, offset: Tensor) -> AttentionParams:
    """Fold a constant input offset u_b into the biases: b' = b + u_b W."""
    offset = offset.detach()
    b_q = torch.einsum("d,hde->he", offset, params.W_Q.to(offset))
    b_k = torch.einsum("d,hde->he", offset, params.W_K.to(offset))
    if params.b_Q is not None:
        b_q = b_q + params.b_Q.to(offset)
    if params.b_K is not None:
        b_k = b_k + params.b_K.to(offset)
    return replace(params, b_Q=b_q, b_K=b_k)


def _norm_from_module(module: nn.Module) -> NormParams:
    name = type(module).__name__
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    weight = None if weight is None else weight.detach()
    bias = None if bias is None else bias.detach()
    if isinstance(module, nn.LayerNorm) or name.endswith("LayerNormPre"):
        return NormParams("layernorm", weight, bias, float(module.eps))
    if "RMSNorm" in name:
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None:
            raise ValueError(f"cannot find the epsilon of {name}.")
        if "Gemma" in name:
            raise ValueError(f"{name} scales by (1 + weight); it is not supported.")
        return NormParams("rmsnorm", weight, None, float(eps))
    raise ValueError(
        f"cannot linearize a {name}: only LayerNorm and RMSNorm are supported; "
        "fit the basis at the attention input instead."
    )


# --------------------------------------------------------------------------- HF modules
def _module_apply_rotary(module: nn.Module) -> Callable[..., tuple[Tensor, Tensor]]:
    fn = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as fn
    return fn


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
    out, d = weight_out_in.shape
    return weight_out_in.reshape(n, out // n, d).transpose(1, 2)


def _bias_heads(bias: Tensor | None, n: int) -> Tensor | None:
    return None if bias is None else bias.reshape(n, -1)


def _reject_nonlinear(module: nn.Module) -> None:
    for attr in ("q_norm", "k_norm", "q_layernorm", "k_layernorm"):
        if getattr(module, attr, None) is not None:
            raise ValueError(
                f"{type(module).__name__} normalises q/k ({attr}); the score is not bilinear in "
                "the input and cannot be split into TT/TN/NT/NN."
            )
    if getattr(module, "attn_logit_softcapping", None) or getattr(
        getattr(module, "config", None), "attn_logit_softcapping", None
    ):
        raise ValueError(f"{type(module).__name__} soft-caps scores; the split is not additive.")


def params_from_hf(module: nn.Module, *, rotary_emb: nn.Module | None = None) -> AttentionParams:
    """:class:`AttentionParams` from a plain Hugging Face attention module.

    Supports GPT2Attention (fused ``c_attn`` Conv1D), GPTNeoXAttention (fused
    ``query_key_value`` with heads interleaved as [q_h, k_h, v_h]), Llama-style
    ``q_proj``/``k_proj`` modules (GQA) and BertAttention/BertSelfAttention. Rotary
    models need the model's ``rotary_emb`` (e.g. ``model.model.rotary_emb``,
    ``model.gpt_neox.rotary_emb``; :func:`hf_attention_module` finds it).
    """
    rotary = None if rotary_emb is None else _unwrap(rotary_emb)
    return _params_from_hf(_unwrap(module), rotary).detached()


def _params_from_hf(module: nn.Module, rotary_emb: nn.Module | None) -> AttentionParams:
    if hasattr(module, "self") and hasattr(module.self, "query"):  # BertAttention
        module = module.self
    _reject_nonlinear(module)
    name = type(module).__name__
    if hasattr(module, "c_attn"):  # GPT-2: Conv1D, x @ W + b, W (d, 3d)
        if getattr(module, "is_cross_attention", False):
            raise ValueError("GPT-2 cross-attention is not supported; pass a self-attention.")
        n, e = int(module.num_heads), int(module.head_dim)
        w, b = module.c_attn.weight, module.c_attn.bias
        d = w.shape[0]
        w_q = w[:, : n * e].reshape(d, n, e).permute(1, 0, 2)
        w_k = w[:, n * e : 2 * n * e].reshape(d, n, e).permute(1, 0, 2)
        b_q, b_k = b[: n * e].reshape(n, e), b[n * e : 2 * n * e].reshape(n, e)
        return AttentionParams(w_q, w_k, b_q, b_k, float(module.scaling), None, True)
    if hasattr(module, "query_key_value") and hasattr(module, "rotary_ndims"):  # GPT-NeoX
        # fused rows are laid out (head, [q|k|v], d_head)
        n, e = int(module.config.num_attention_heads), int(module.head_size)
        lin = module.query_key_value
        w = lin.weight.reshape(n, 3, e, -1)
        w_q, w_k = w[:, 0].transpose(1, 2), w[:, 1].transpose(1, 2)
        b_q = b_k = None
        if lin.bias is not None:
            bb = lin.bias.reshape(n, 3, e)
            b_q, b_k = bb[:, 0], bb[:, 1]
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
            raise ValueError(f"{name} uses {pe!r} position scores; only 'absolute' is supported.")
        n = int(module.num_attention_heads)
        w_q, w_k = _heads(module.query.weight, n), _heads(module.key.weight, n)
        b_q, b_k = _bias_heads(module.query.bias, n), _bias_heads(module.key.bias, n)
        scale = float(getattr(module, "scaling", module.attention_head_size**-0.5))
        causal = bool(getattr(module, "is_causal", False))
        return AttentionParams(w_q, w_k, b_q, b_k, scale, None, causal)
    raise ValueError(
        f"unsupported attention module {name}: expected GPT2Attention, GPTNeoXAttention, a "
        "q_proj/k_proj (Llama-style) module or BertAttention. Build AttentionParams by hand."
    )


def _require_rotary(module: nn.Module, rotary_emb: nn.Module | None) -> RotaryFn:
    if rotary_emb is None:
        raise ValueError(
            f"{type(module).__name__} uses rotary positions: pass rotary_emb=<the model's "
            "rotary_emb module> (hf_attention_module(model, layer) returns it)."
        )
    return _hf_rotary(rotary_emb, _module_apply_rotary(module))


def _unwrap(model: Any) -> nn.Module:
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
    hf = _unwrap(model)
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
        raise ValueError(f"cannot find the layer list of {type(hf).__name__}.")
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer must be in [0, {len(layers)}); got {layer}.")
    block = layers[layer]
    for attr in ("attn", "self_attn", "attention"):
        attn = getattr(block, attr, None)
        if isinstance(attn, nn.Module):
            return attn, getattr(base, "rotary_emb", None)
    raise ValueError(f"cannot find the attention module of {type(block).__name__}.")


def norm_from_hf(model: Any, layer: int) -> NormParams:
    """The pre-attention norm of ``layer`` in a pre-norm Hugging Face model."""
    attn, _ = hf_attention_module(model, layer)
    for block in _unwrap(model).modules():
        if any(m is attn for m in block.children()):
            for attr in ("ln_1", "input_layernorm"):
                if isinstance(getattr(block, attr, None), nn.Module):
                    return _norm_from_module(getattr(block, attr))
    raise ValueError(
        "no pre-attention norm (ln_1 / input_layernorm) found: a post-norm model's attention "
        "input is the residual stream itself; fit the basis there."
    )


# --------------------------------------------------------------------------- TL bridges
def _tl_attention(model: Any, layer: int) -> Any:
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(
            f"{type(model).__name__} has no .blocks: pass a TransformerLens TransformerBridge "
            "(or use params_from_hf for a plain Hugging Face model)."
        )
    if not 0 <= layer < len(blocks):
        raise ValueError(f"layer must be in [0, {len(blocks)}); got {layer}.")
    return blocks[layer].attn


def params_from_bridge(model: Any, layer: int) -> AttentionParams:
    """:class:`AttentionParams` of ``layer`` from a TransformerLens 4.x bridge.

    Weights come from the bridge's ``W_Q``/``W_K``/``b_Q``/``b_K``; the scale and the
    rotary from the wrapped module (HF ``scaling`` and the model's ``rotary_emb`` with
    its ``apply_rotary_pos_emb``; the native model's ``rotary.apply_rope`` and
    ``1/scale``).
    """
    from transformer_lens.model_bridge.sources.native.model import NativeAttention

    attn = _tl_attention(model, layer)
    orig = getattr(attn, "original_component", None)
    if orig is None:
        raise ValueError(
            f"blocks.{layer}.attn wraps no module: params_from_bridge needs a TransformerLens "
            "4.x TransformerBridge (boot_transformers / boot_native)."
        )
    w_q, w_k, b_q, b_k = (
        None if t is None else t.detach() for t in (attn.W_Q, attn.W_K, attn.b_Q, attn.b_K)
    )
    if w_q.ndim != 3:
        raise ValueError(f"blocks.{layer}.attn.W_Q has shape {tuple(w_q.shape)}; expected 3-D.")
    if isinstance(orig, NativeAttention):
        if orig.attn_scores_soft_cap > 0:
            raise ValueError("attn_scores_soft_cap is set: soft-capped scores are not additive.")
        rotary = None
        if orig.rotary is not None:
            native_rotary = orig.rotary

            def rotary(q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
                return native_rotary.apply_rope(q, k, position_ids=positions)

        return AttentionParams(w_q, w_k, b_q, b_k, 1.0 / float(orig.scale), rotary, orig.causal)
    hf_params = params_from_hf(orig, rotary_emb=_bridge_rotary_emb(model))
    return replace(hf_params, W_Q=w_q, W_K=w_k, b_Q=b_q, b_K=b_k)


def _bridge_rotary_emb(model: Any) -> nn.Module | None:
    rot = getattr(model, "rotary_emb", None)
    if rot is None:
        return None
    return getattr(rot, "original_component", None) or rot


def _is_post_norm(model: Any, layer: int) -> bool:
    block = model.blocks[layer]
    ln1 = getattr(block, "ln1", None)
    if ln1 is None:
        return True
    ln_mod = getattr(ln1, "original_component", None) or ln1
    attn_mod = getattr(block.attn, "original_component", None) or block.attn
    return any(m is ln_mod for m in attn_mod.modules())


def attention_input_hook(model: Any, layer: int) -> str:
    """Hook name of ``layer``'s attention input, where its basis should be fitted.

    ``blocks.{l}.ln1.hook_out`` on pre-norm models; ``blocks.{l}.attn.hook_in`` (the
    residual stream) on post-norm encoders such as BERT, whose ``ln1`` comes after
    attention.
    """
    _tl_attention(model, layer)
    if _is_post_norm(model, layer):
        return f"blocks.{layer}.attn.hook_in"
    return f"blocks.{layer}.ln1.hook_out"


def norm_from_bridge(model: Any, layer: int) -> NormParams:
    """The ``ln1`` of a pre-norm bridge layer as :class:`NormParams`."""
    if _is_post_norm(model, layer):
        raise ValueError(
            f"layer {layer} is post-norm (ln1 follows attention): its attention input is "
            "the residual stream; use site='attn_in'."
        )
    ln1 = model.blocks[layer].ln1
    return _norm_from_module(getattr(ln1, "original_component", None) or ln1)


def score_terms(
    model: Any,
    tokens: Tensor,
    layer: int,
    basis: TangentBasis,
    *,
    attention_mask: Tensor | None = None,
    site: str = "attn_in",
) -> dict[str, Tensor]:
    """``TT, TN, NT, NN, bias``, each ``(batch, head, q_pos, k_pos)`` float64, for a
    TransformerLens model on ``tokens``; they sum to the pre-mask scaled scores.

    ``site="attn_in"`` (default): ``basis`` is fitted at the attention input
    (:func:`attention_input_hook`: ``ln1.hook_out`` on pre-norm models). ``site=
    "resid_pre"``: ``basis`` is fitted at ``hook_resid_pre`` and ln1 is treated as
    linear with its scale frozen at the value on the full input, so the norm's bias
    joins the ``bias`` term (pre-norm models only).
    """
    if site not in ("attn_in", "resid_pre"):
        raise ValueError(f"site must be 'attn_in' or 'resid_pre'; got {site!r}.")
    params = params_from_bridge(model, layer)
    norm = norm_from_bridge(model, layer) if site == "resid_pre" else None
    hook_name = f"blocks.{layer}.{'hook_resid_pre' if norm is not None else 'attn.hook_in'}"
    captured: dict[str, Tensor] = {}

    def capture(x: Tensor, hook: Any) -> None:
        captured["x"] = x.detach()

    kwargs: dict[str, Any] = {"return_type": None}
    if layer + 1 < len(model.blocks):  # later blocks are not needed
        kwargs["stop_at_layer"] = layer + 1
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    with torch.no_grad(), model.hooks(fwd_hooks=[(hook_name, capture)]):
        model(tokens, **kwargs)
    if "x" not in captured:
        raise RuntimeError(f"{hook_name} did not fire; is layer {layer} run by this model?")
    return decompose_scores(captured["x"], basis, params, norm=norm)


# --------------------------------------------------------------------------- statistics
def _keep_mask(
    shape: torch.Size, attention_mask: Tensor | None, causal: bool, device: torch.device
) -> tuple[Tensor, Tensor]:
    """(entry mask (batch, 1, q, k), row mask (batch, 1, q)): True where kept."""
    batch, _, n_q, n_k = shape
    keep = torch.ones(batch, 1, n_q, n_k, dtype=torch.bool, device=device)
    if causal:
        if n_q != n_k:
            raise ValueError(f"a causal mask needs q_pos == k_pos; got {n_q} and {n_k}.")
        keep &= torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril()
    if attention_mask is not None:
        am = torch.as_tensor(attention_mask, device=device)
        if tuple(am.shape) != (batch, n_k) or n_q != n_k:
            raise ValueError(
                f"attention_mask must be (batch, pos) = ({batch}, {n_k}) with 1 for real tokens "
                f"and 0 for padding; got {tuple(am.shape)}."
            )
        valid = am.bool()
        keep &= valid[:, None, :, None] & valid[:, None, None, :]
    return keep, keep.any(-1)


class AttentionAccumulator:
    """Streaming per-head statistics of the score decomposition (mergeable, float64).

    Over the entries the model does not mask (causal mask and padding; padded query
    rows are dropped too), with E_t = Σ t² the energy of term t:

    - ``score_share_t`` = E_t / Σ_u E_u for t in TT, TN, NT, NN, bias (sums to 1; the
      cross terms' energy is the normaliser, not ‖s‖², which also has cross products);
    - ``pattern_kl_TT`` = mean over kept query rows of KL(P ‖ P_TT), with P the real
      pattern softmax(s + mask) and P_TT = softmax(TT + bias + mask), in nats.

    State is sums and counts, so ``update`` order, batch splits and ``merge`` give the
    same answer as one pass.
    """

    def __init__(
        self, n_heads: int | None = None, device: torch.device | str | None = None
    ) -> None:
        self._energy: Tensor | None = None  # (5, n_heads)
        self._kl: Tensor | None = None  # (n_heads,)
        self._rows = 0
        self._entries = 0
        if n_heads is not None:
            if n_heads < 1:
                raise ValueError(f"n_heads must be a positive int; got {n_heads}.")
            self._init(n_heads, torch.device(device or "cpu"))

    @property
    def n_heads(self) -> int | None:
        return None if self._energy is None else int(self._energy.shape[1])

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def entries(self) -> int:
        return self._entries

    def _init(self, n_heads: int, device: torch.device) -> None:
        self._energy = torch.zeros(len(TERMS), n_heads, dtype=torch.float64, device=device)
        self._kl = torch.zeros(n_heads, dtype=torch.float64, device=device)

    @torch.no_grad()
    def update(
        self,
        terms: Mapping[str, Tensor],
        attention_mask: Tensor | None = None,
        causal: bool = True,
    ) -> AttentionAccumulator:
        """Add one batch of terms (from :func:`score_terms`); ``attention_mask`` is the
        HF-style ``(batch, pos)`` padding mask (1 = token, 0 = padding)."""
        missing = [t for t in TERMS if t not in terms]
        if missing:
            raise ValueError(f"terms lacks {missing}; pass the dict score_terms returns.")
        ts = [torch.as_tensor(terms[t]).to(torch.float64) for t in TERMS]
        shape = ts[0].shape
        if len(shape) != 4 or any(t.shape != shape for t in ts):
            raise ValueError(
                "every term must be (batch, head, q_pos, k_pos) with one shared shape; got "
                f"{[tuple(t.shape) for t in ts]}."
            )
        if self._energy is None:
            self._init(shape[1], ts[0].device)
        elif shape[1] != self.n_heads:
            raise ValueError(f"terms have {shape[1]} heads; this accumulator has {self.n_heads}.")
        dev = self._energy.device
        ts = [t.to(dev) for t in ts]
        keep, rows = _keep_mask(shape, attention_mask, causal, dev)
        for i, t in enumerate(ts):
            self._energy[i] += torch.where(keep, t * t, 0.0).sum((0, 2, 3))
        scores = sum(ts[1:], ts[0])
        neg = torch.tensor(float("-inf"), dtype=torch.float64, device=dev)
        log_p = torch.log_softmax(torch.where(keep, scores, neg), -1)
        log_q = torch.log_softmax(torch.where(keep, ts[0] + ts[4], neg), -1)
        kl = torch.where(keep, log_p.exp() * (log_p - log_q), 0.0).sum(-1)  # (b, h, q)
        self._kl += torch.where(rows, kl, 0.0).sum((0, 2))
        self._rows += int(rows.sum())
        self._entries += int(keep.sum())
        return self

    def merge(self, other: AttentionAccumulator) -> AttentionAccumulator:
        """Add ``other``'s statistics into this one (exact)."""
        if not isinstance(other, AttentionAccumulator):
            raise TypeError(f"can only merge an AttentionAccumulator; got {type(other).__name__}.")
        if other._energy is None:
            return self
        if self._energy is None:
            self._init(other.n_heads, other._energy.device)
        elif other.n_heads != self.n_heads:
            raise ValueError(f"cannot merge {other.n_heads} heads into {self.n_heads}.")
        self._energy += other._energy.to(self._energy.device)
        self._kl += other._kl.to(self._kl.device)
        self._rows += other._rows
        self._entries += other._entries
        return self

    def all_reduce_(self, group: object | None = None) -> AttentionAccumulator:
        """Sum these statistics over all ranks of ``torch.distributed`` in place.

        A no-op when torch.distributed is not initialised. Every rank needs n_heads:
        update first, or construct with ``AttentionAccumulator(n_heads=...)``.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        if self._energy is None:
            raise ValueError(
                "all_reduce_ needs n_heads on every rank: update before reducing or "
                "construct AttentionAccumulator(n_heads=...)."
            )
        counts = torch.tensor([self._rows, self._entries], dtype=torch.float64)
        flat = torch.cat([self._energy.flatten(), self._kl, counts.to(self._kl.device)])
        dist.all_reduce(flat, group=group)
        n = self._energy.numel()
        self._energy = flat[:n].reshape(self._energy.shape).clone()
        self._kl = flat[n : n + self._kl.numel()].clone()
        self._rows, self._entries = (int(v) for v in flat[-2:].tolist())
        return self

    def results(self) -> dict[str, Tensor]:
        """statistic -> ``(n_heads,)`` float64 tensor, for the names in ``STATISTICS``."""
        if self._energy is None or self._entries == 0:
            raise ValueError("no unmasked entries accumulated yet; call update() first.")
        total = self._energy.sum(0)
        out = {f"score_share_{t}": self._energy[i] / total for i, t in enumerate(TERMS)}
        out["pattern_kl_TT"] = self._kl / self._rows
        return out

    def state_dict(self) -> dict[str, Tensor]:
        state = {
            "rows": torch.tensor(self._rows, dtype=torch.int64),
            "entries": torch.tensor(self._entries, dtype=torch.int64),
        }
        if self._energy is not None:
            state |= {"energy": self._energy.clone(), "kl": self._kl.clone()}
        return state

    def load_state_dict(self, state: Mapping[str, Tensor]) -> AttentionAccumulator:
        if "rows" not in state or "entries" not in state:
            raise ValueError("state lacks rows/entries; it was not written by state_dict().")
        self._rows, self._entries = int(state["rows"]), int(state["entries"])
        if "energy" not in state:
            self._energy = self._kl = None
            return self
        energy = torch.as_tensor(state["energy"], dtype=torch.float64)
        kl = torch.as_tensor(state["kl"], dtype=torch.float64)
        if energy.ndim != 2 or energy.shape[0] != len(TERMS) or kl.shape != energy.shape[1:]:
            raise ValueError(f"corrupt state: energy {tuple(energy.shape)}, kl {tuple(kl.shape)}.")
        self._energy, self._kl = energy.clone(), kl.clone()
        return self

    def __repr__(self) -> str:
        return f"AttentionAccumulator(n_heads={self.n_heads}, rows={self._rows})"
