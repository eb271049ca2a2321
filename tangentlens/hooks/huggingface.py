"""Hugging Face modules: attention and norm parameters.

Shared by both backends and by anything else that reads plain HF models: what the score
decomposition needs from an attention module (`params_from_hf`, `norm_from_hf`,
`output_weight_from_hf`). What a family is (its layout, causality, the HF model inside a
wrapper, where a block keeps its attention): `tangentlens.hooks.families`.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as _llama_rotary

from ..core.decompose import AttentionParams, NormParams, RotaryFn
from ..core.errors import UsageError
from .families import hf_attention_module, unwrap

__all__ = [
    "first_tensor",
    "hf_attention_module",
    "norm_from_hf",
    "norm_from_module",
    "output_weight_from_hf",
    "params_from_hf",
]


def first_tensor(value: Any, where: str) -> Tensor:
    """The activation in a module output or input: the tensor itself or the first element."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return value[0]
    raise TypeError(f"expected a tensor (or a tuple starting with one) at {where}; got {value!r}.")


def _inner(module: nn.Module) -> nn.Module:
    """The HF module inside a TransformerLens bridge component (or the module itself)."""
    inner = getattr(module, "original_component", None)
    return inner if isinstance(inner, nn.Module) else module


@torch.no_grad()
def _rms_scale(module: nn.Module, weight: Tensor, eps: float) -> Tensor:
    """The RMSNorm's effective scale, ``weight`` or ``1 + weight`` (Gemma, Qwen3-Next):
    told apart by running its forward (no hooks) on a vector of ones, whose RMS is 1
    (in at least float32, so half-precision weights stay distinguishable)."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    ones = torch.ones(1, weight.shape[-1], dtype=dtype, device=weight.device)
    seen = module.forward(ones)[0].double() * math.sqrt(1 + eps)
    candidates = (weight, 1 + weight.to(dtype))  # as Gemma adds it: in float32
    gaps = [float((seen - w.double()).abs().max()) for w in candidates]
    if min(gaps) > 0.25:
        raise UsageError(f"{type(module).__name__} scales by neither weight nor 1 + weight.")
    return candidates[gaps.index(min(gaps))]


def norm_from_module(module: nn.Module) -> NormParams:
    """`NormParams` of a LayerNorm or an RMSNorm (Gemma's ``1 + weight`` is read as such)."""
    module = _inner(module)
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
        if weight is not None:
            weight = _rms_scale(module, weight, float(eps))
        return NormParams("rmsnorm", weight, None, float(eps))
    raise UsageError(
        f"cannot linearize a {name}: only LayerNorm and RMSNorm are supported; "
        "fit the basis at the attention input instead."
    )


def _module_apply_rotary(module: nn.Module) -> Callable[..., Any]:
    fn = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
    return _llama_rotary if fn is None else fn


def _layer_type(module: nn.Module) -> str | None:
    """The layer's attention type (``sliding_attention`` ...) where RoPE depends on it."""
    kind = getattr(module, "layer_type", None)
    types = getattr(getattr(module, "config", None), "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if kind is None and types is not None and index is not None:
        kind = types[index]
    return kind


def _hf_rotary(
    rotary_emb: nn.Module, apply: Callable[..., tuple[Tensor, Tensor]], layer_type: str | None
) -> RotaryFn:
    """Rotary from the model's own ``rotary_emb`` (cos, sin; per layer type where it takes
    one, as Gemma 3's and ModernBERT's) and ``apply_rotary_pos_emb``; partial rotary (cos
    narrower than d_head) rotates only the leading dims."""
    typed = "layer_type" in inspect.signature(rotary_emb.forward).parameters

    def rotary(q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = rotary_emb(q, positions, layer_type) if typed else rotary_emb(q, positions)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        rd = cos.shape[-1]
        if rd == q.shape[-1]:
            return apply(q, k, cos, sin)
        q_r, k_r = apply(q[..., :rd], k[..., :rd], cos, sin)
        return torch.cat([q_r, q[..., rd:]], -1), torch.cat([k_r, k[..., rd:]], -1)

    return rotary


def _gptj_rotary(rotary_emb: nn.Module, apply: Callable[..., Tensor], dims: int | None) -> RotaryFn:
    """GPT-J's rotary: ``(sin, cos)`` from its ``rotary_emb``, applied one tensor at a time
    in (batch, pos, head, e) layout to the leading ``rotary_dim`` dims, pairs interleaved."""

    def rotary(q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        sin, cos = (t.to(q.dtype) for t in rotary_emb(q, positions))
        rd = dims or q.shape[-1]

        def one(t: Tensor) -> Tensor:
            t = rearrange(t, "b h p e -> b p h e")
            t = torch.cat([apply(t[..., :rd], sin, cos), t[..., rd:]], -1)
            return rearrange(t, "b p h e -> b h p e")

        return one(q), one(k)

    return rotary


def _heads(weight_out_in: Tensor, n: int) -> Tensor:
    """nn.Linear weight (n*e, d) -> (n, d, e)."""
    return rearrange(weight_out_in, "(h e) d -> h d e", h=n)


def _bias_heads(bias: Tensor | None, n: int) -> Tensor | None:
    return None if bias is None else rearrange(bias, "(h e) -> h e", h=n)


def _reject_nonlinear(module: nn.Module) -> None:
    for attr in ("q_layernorm", "k_layernorm"):
        if getattr(module, attr, None) is not None:
            raise UsageError(
                f"{type(module).__name__} normalises q/k with per-head LayerNorm modules "
                f"({attr}); only q_norm/k_norm (RMSNorm or LayerNorm) are read."
            )
    if getattr(module, "attn_logit_softcapping", None) or getattr(
        getattr(module, "config", None), "attn_logit_softcapping", None
    ):
        raise UsageError(f"{type(module).__name__} soft-caps scores; the split is not additive.")


def _qk_norms(module: nn.Module, d_head: int) -> dict[str, Any]:
    """``q_norm``, ``k_norm`` and ``qk_norm_over_heads`` for `AttentionParams`: Qwen3's
    and Gemma 3's norms act on each head's d_head; OLMo 2's on the whole projection."""
    found = {}
    for attr in ("q_norm", "k_norm"):
        norm = getattr(module, attr, None)
        found[attr] = (
            None
            if norm is None or isinstance(_inner(norm), nn.Identity)
            else norm_from_module(norm)
        )
    widths = {n.weight.numel() for n in found.values() if n is not None and n.weight is not None}
    found["qk_norm_over_heads"] = bool(widths - {d_head})
    return found


def _window(module: nn.Module) -> int | None:
    """Local attention: the module's ``sliding_window`` (None on its global layers), else
    the config's (Mistral slides on every layer)."""
    if hasattr(module, "sliding_window"):
        window = module.sliding_window
    else:
        window = getattr(getattr(module, "config", None), "sliding_window", None)
    return None if window is None else int(window)


def params_from_hf(module: nn.Module, *, rotary_emb: nn.Module | None = None) -> AttentionParams:
    """:class:`AttentionParams` from a plain Hugging Face attention module.

    Supports GPT2Attention (fused ``c_attn`` Conv1D), GPTNeoXAttention (fused
    ``query_key_value`` with heads interleaved as [q_h, k_h, v_h]), ModernBertAttention
    (fused ``Wqkv``, local windows), ``q_proj``/``k_proj`` modules (Llama, Qwen, Mistral,
    OLMo, EuroBERT, GPT-J; GQA, sliding windows, and the q/k norms of Qwen3, Gemma 3 and
    OLMo 2, whose split is a linearisation: `AttentionParams.linearised`) and
    BertAttention/BertSelfAttention. Rotary models need the model's ``rotary_emb``
    (e.g. ``model.model.rotary_emb``; :func:`hf_attention_module` finds it).
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
        w_q, w_k, b_q, b_k = _fused_qk(module.query_key_value, module, "h three e")
        rot = _require_rotary(module, rotary_emb)
        return AttentionParams(w_q, w_k, b_q, b_k, float(module.scaling), rot, True)
    if hasattr(module, "Wqkv"):  # ModernBERT: fused rows laid out ([q|k|v], head, d_head)
        w_q, w_k, b_q, b_k = _fused_qk(module.Wqkv, module, "three h e")
        rot = _require_rotary(module, rotary_emb)
        causal = bool(getattr(module, "is_causal", False))
        scale = float(module.head_dim) ** -0.5
        return AttentionParams(w_q, w_k, b_q, b_k, scale, rot, causal, window=_window(module))
    if hasattr(module, "q_proj") and hasattr(module, "k_proj"):  # Llama family, GPT-J
        cfg = module.config
        n = int(cfg.num_attention_heads)
        n_kv = int(getattr(cfg, "num_key_value_heads", None) or n)
        w_q, w_k = _heads(module.q_proj.weight, n), _heads(module.k_proj.weight, n_kv)
        b_q, b_k = _bias_heads(module.q_proj.bias, n), _bias_heads(module.k_proj.bias, n_kv)
        rot = _require_rotary(module, rotary_emb)
        causal = bool(getattr(module, "is_causal", True))
        extra = {"window": _window(module), **_qk_norms(module, int(w_q.shape[-1]))}
        return AttentionParams(w_q, w_k, b_q, b_k, float(module.scaling), rot, causal, **extra)
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
        f"unsupported attention module {name}: expected GPT2Attention, GPTNeoXAttention, "
        "ModernBertAttention, a q_proj/k_proj (Llama-style) module or BertAttention. Build "
        "AttentionParams by hand."
    )


def output_weight_from_hf(linear: nn.Module, n_heads: int) -> Tensor:
    """W_O ``(n_heads, d_head, d_model)`` of an attention output projection (an
    ``nn.Linear``, or GPT-2's ``Conv1D``, which stores its weight transposed): head h
    writes z_h @ W_O[h]; the projection's bias is no head's (TransformerLens' b_O)."""
    linear = unwrap(linear)
    weight = linear.weight.detach()
    if type(linear).__name__ == "Conv1D":  # x @ W, W (n*e, d)
        return rearrange(weight, "(h e) d -> h e d", h=n_heads)
    if isinstance(linear, nn.Linear):  # x @ Wᵀ, W (d, n*e)
        return rearrange(weight, "d (h e) -> h e d", h=n_heads)
    raise UsageError(
        f"the attention output projection is a {type(linear).__name__}; expected nn.Linear "
        "or Conv1D."
    )


def _fused_qk(
    lin: nn.Module, module: nn.Module, rows: str
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """W_Q, W_K (head, d, d_head) and b_Q, b_K of a fused q/k/v ``nn.Linear`` whose output
    rows are laid out as ``rows`` (GPT-NeoX "h three e", ModernBERT "three h e")."""
    n = int(module.config.num_attention_heads)
    w_q, w_k, _ = rearrange(lin.weight, f"({rows}) d -> three h d e", h=n, three=3)
    if lin.bias is None:
        return w_q, w_k, None, None
    b_q, b_k, _ = rearrange(lin.bias, f"({rows}) -> three h e", h=n, three=3)
    return w_q, w_k, b_q, b_k


def _require_rotary(module: nn.Module, rotary_emb: nn.Module | None) -> RotaryFn:
    if rotary_emb is None:
        raise UsageError(
            f"{type(module).__name__} uses rotary positions: pass rotary_emb=<the model's "
            "rotary_emb module> (hf_attention_module(model, layer) returns it)."
        )
    apply = _module_apply_rotary(module)
    if list(inspect.signature(apply).parameters)[:3] == ["tensor", "sin", "cos"]:  # GPT-J
        return _gptj_rotary(rotary_emb, apply, getattr(module, "rotary_dim", None))
    return _hf_rotary(rotary_emb, apply, _layer_type(module))


def norm_from_hf(model: Any, layer: int) -> NormParams:
    """The pre-attention norm of ``layer`` in a pre-norm Hugging Face model."""
    attn, _ = hf_attention_module(model, layer)
    for block in unwrap(model).modules():
        if any(m is attn for m in block.children()):
            for attr in ("ln_1", "input_layernorm", "attn_norm"):
                norm = getattr(block, attr, None)
                if isinstance(norm, nn.Module) and not isinstance(norm, nn.Identity):
                    return norm_from_module(norm)
    raise UsageError(
        "no pre-attention norm (ln_1 / input_layernorm / attn_norm) found: the attention of "
        "a post-norm model (BERT, OLMo 2, ModernBERT's layer 0) reads the residual stream "
        "itself; fit the basis there."
    )
