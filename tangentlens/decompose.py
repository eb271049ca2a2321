"""Attention maths: the pre-mask scaled score split into tangent and normal parts.

With a tangent basis Q_T fitted at a layer's attention input x (the exact input to
W_Q/W_K), x = x_T + x_N exactly, and since projections and rotary are linear,

    s = (R q)·(R k) · scale = TT + TN + NT + NN + bias,

where TT = (R q_T)·(R k_T)·scale with q_T = x_T W_Q, and so on, and ``bias`` gathers
every term that involves b_Q or b_K. ``s`` is the pre-mask scaled score the model
softmaxes (grouped-query heads repeated as the model repeats them).

A pre-attention norm can be made linear by freezing its scale at the value on the
full input (`linearize_norm`), so a basis fitted on the residual stream splits the
scores too. This module holds no model code: the backends (`tangentlens.hooks`) read
`AttentionParams` and `NormParams` out of TransformerLens and Hugging Face modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .errors import UsageError
from .subspace import TangentBasis

__all__ = [
    "TERMS",
    "AttentionParams",
    "NormParams",
    "RotaryFn",
    "decompose_parts",
    "decompose_scores",
    "linearize_norm",
]


TERMS = ("TT", "TN", "NT", "NN", "bias")


RotaryFn = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
"""``rotary(q, k, positions) -> (q, k)``: q, k ``(batch, head, pos, d_head)``,
positions ``(batch, pos)`` int64. Must be linear in q and in k (as RoPE is)."""


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
            raise UsageError(
                "W_Q and W_K must be (heads, d_model, d_head); got "
                f"{tuple(self.W_Q.shape)} and {tuple(self.W_K.shape)}."
            )
        n, d, e = self.W_Q.shape
        n_kv = self.W_K.shape[0]
        if self.W_K.shape[1:] != (d, e) or n % n_kv:
            raise UsageError(
                f"W_K {tuple(self.W_K.shape)} does not match W_Q {tuple(self.W_Q.shape)}: "
                "it needs the same d_model and d_head and a head count dividing n_heads."
            )
        for name, b, heads in (("b_Q", self.b_Q, n), ("b_K", self.b_K, n_kv)):
            if b is not None and tuple(b.shape) != (heads, e):
                raise UsageError(f"{name} must be ({heads}, {e}) or None; got {tuple(b.shape)}.")
        if not self.scale > 0:
            raise UsageError(f"scale must be positive; got {self.scale}.")

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
        raise UsageError(
            "x_tangent and x_normal must both be (batch, pos, d_model); got "
            f"{tuple(x_tangent.shape)} and {tuple(x_normal.shape)}."
        )
    if x_tangent.shape[-1] != params.d_model:
        raise UsageError(
            f"the input has d_model={x_tangent.shape[-1]} but W_Q expects {params.d_model}; "
            "was the basis fitted at another layer's attention input or another model?"
        )
    if dtype not in (torch.float32, torch.float64):
        raise UsageError(f"dtype must be torch.float32 or torch.float64; got {dtype}.")
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
            raise UsageError(
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


@dataclass(frozen=True)
class NormParams:
    """A LayerNorm or RMSNorm: y = w ⊙ (x − mean·[layernorm]) / σ + b."""

    kind: str  # "layernorm" or "rmsnorm"
    weight: Tensor | None
    bias: Tensor | None
    eps: float

    def __post_init__(self) -> None:
        if self.kind not in ("layernorm", "rmsnorm"):
            raise UsageError(f"kind must be 'layernorm' or 'rmsnorm'; got {self.kind!r}.")


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
