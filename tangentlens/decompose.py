"""Attention maths: the pre-mask scaled score split into tangent and normal parts.

With a tangent basis Q_T fitted at a layer's attention input x (the exact input to
W_Q/W_K), x = x_T + x_N exactly, and since projections and rotary are linear,

    s = (R q)·(R k) · scale = TT + TN + NT + NN + bias,

where TT = (R q_T)·(R k_T)·scale with q_T = x_T W_Q, and so on, and ``bias`` gathers
every term that involves b_Q or b_K. ``s`` is the pre-mask scaled score the model
softmaxes (grouped-query heads repeated as the model repeats them).

A pre-attention norm can be made linear by freezing its scale at the value on the
full input (`linearize_norm`), so a basis fitted on the residual stream splits the
scores too. The same move makes q/k normalisation (Qwen3, Gemma 3, OLMo 2: an RMSNorm
of each head's query and key, or of the whole projection) exact: its 1/σ is computed
per token (and head) on the full query (key) and then held fixed, so the score stays
bilinear in the input and the five terms still sum to the model's score. Such a split
is a *linearisation* (`AttentionParams.linearised`): the terms are what the model's
frozen-scale queries and keys give, and the attention probe marks its rows so.

Local attention (a sliding window, `AttentionParams.window`) only changes which entries
the model masks (`keep_mask`), never the scores. This module holds no model code: the
backends (`tangentlens.hooks`) read `AttentionParams` and `NormParams` out of
TransformerLens and Hugging Face modules.

The output side: head h writes z_h W_O^h into the residual stream (z_h its output
before the output projection, W_O^h ``(d_head, d_model)``). With S_h = Σ_t z_hᵀz_h over
tokens, its write energy is tr(S_h W_O^h W_O^hᵀ) and the part in span(Q) is
tr(S_h (W_O^h Q)(W_O^h Q)ᵀ): d_head × d_head algebra per head (`z_gram`,
`head_write_energies`), no write is ever materialised. A uniformly random k-frame has
mean share k/d exactly and a closed-form spread (`random_share_std`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from einops import rearrange
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
    "head_write_energies",
    "keep_mask",
    "linearize_norm",
    "random_share_std",
    "z_gram",
]


TERMS = ("TT", "TN", "NT", "NN", "bias")


RotaryFn = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
"""``rotary(q, k, positions) -> (q, k)``: q, k ``(batch, head, pos, d_head)``,
positions ``(batch, pos)`` int64. Must be linear in q and in k (as RoPE is)."""


@dataclass(frozen=True)
class NormParams:
    """A LayerNorm or RMSNorm: y = w ⊙ (x − mean·[layernorm]) / σ + b.

    ``weight`` is the effective scale: Gemma's ``(1 + weight)`` is stored as such.
    """

    kind: str  # "layernorm" or "rmsnorm"
    weight: Tensor | None
    bias: Tensor | None
    eps: float

    def __post_init__(self) -> None:
        if self.kind not in ("layernorm", "rmsnorm"):
            raise UsageError(f"kind must be 'layernorm' or 'rmsnorm'; got {self.kind!r}.")

    def detached(self) -> NormParams:
        w, b = (None if t is None else t.detach() for t in (self.weight, self.bias))
        return replace(self, weight=w, bias=b)


@dataclass(frozen=True)
class AttentionParams:
    """What the score decomposition needs from one attention layer.

    ``W_Q`` is ``(n_heads, d_model, d_head)``, ``W_K`` ``(n_kv_heads, d_model, d_head)``
    (TransformerLens layout: q = x @ W_Q[h] + b_Q[h]); ``b_Q`` ``(n_heads, d_head)`` and
    ``b_K`` ``(n_kv_heads, d_head)`` or None; ``scale`` multiplies q·k (usually
    d_head**-0.5); ``rotary`` is applied to q and k after projection (and q/k norm), or
    None; ``causal`` says whether the model applies a causal mask.

    ``q_norm`` / ``k_norm``: a norm of the projected queries / keys before rotary (Qwen3,
    Gemma 3: one per head, weight ``(d_head,)``; with ``qk_norm_over_heads`` one over the
    whole projection, weight ``(heads * d_head,)``, as OLMo 2). The split then freezes its
    scale per token (and head) at the value on the full input: exact, but a linearisation
    (`linearised`). ``window``: local attention, query q sees key k only when
    |q − k| < window (None: global); see `keep_mask`.
    """

    W_Q: Tensor
    W_K: Tensor
    b_Q: Tensor | None
    b_K: Tensor | None
    scale: float
    rotary: RotaryFn | None = None
    causal: bool = True
    q_norm: NormParams | None = None
    k_norm: NormParams | None = None
    qk_norm_over_heads: bool = False
    window: int | None = None

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
        for name, norm, heads in (("q_norm", self.q_norm, n), ("k_norm", self.k_norm, n_kv)):
            width = heads * e if self.qk_norm_over_heads else e
            for part in ("weight", "bias"):
                t = None if norm is None else getattr(norm, part)
                if t is not None and tuple(t.shape) != (width,):
                    raise UsageError(
                        f"{name}.{part} must be ({width},) (over_heads="
                        f"{self.qk_norm_over_heads}); got {tuple(t.shape)}."
                    )
        if not self.scale > 0:
            raise UsageError(f"scale must be positive; got {self.scale}.")
        if self.window is not None and not (isinstance(self.window, int) and self.window > 0):
            raise UsageError(f"window must be a positive int or None; got {self.window!r}.")

    def detached(self) -> AttentionParams:
        """A copy whose tensors are detached from autograd (a snapshot for analysis)."""
        b_q = None if self.b_Q is None else self.b_Q.detach()
        b_k = None if self.b_K is None else self.b_K.detach()
        q_norm, k_norm = (None if m is None else m.detached() for m in (self.q_norm, self.k_norm))
        return replace(
            self,
            W_Q=self.W_Q.detach(),
            W_K=self.W_K.detach(),
            b_Q=b_q,
            b_K=b_k,
            q_norm=q_norm,
            k_norm=k_norm,
        )

    @property
    def linearised(self) -> str | None:
        """``"qk_norm"`` when the split freezes a q/k norm's scale, else None (exact as is)."""
        return "qk_norm" if self.q_norm is not None or self.k_norm is not None else None

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


def _frozen_scale(
    parts: list[Tensor | None], norm: NormParams, dims: tuple[int, ...]
) -> list[Tensor | None]:
    """``parts`` (summing to x) centred (layernorm) and divided by σ(x), σ computed on the
    full x over ``dims`` and then held fixed, so the map is linear in each part."""
    present = [p for p in parts if p is not None]
    x = sum(present[1:], present[0])
    if norm.kind == "layernorm":
        sigma = (x.var(dims, unbiased=False, keepdim=True) + norm.eps).sqrt()
        parts = [None if p is None else p - p.mean(dims, keepdim=True) for p in parts]
    else:
        sigma = (x.pow(2).mean(dims, keepdim=True) + norm.eps).sqrt()
    return [None if p is None else p / sigma for p in parts]


def _qk_normalise(
    t: Tensor, n: Tensor, b: Tensor | None, norm: NormParams, over_heads: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """A q/k norm on (batch, head, pos, e) parts with its scale frozen on their sum; its
    weight scales every part and its bias joins the bias part."""
    heads = t.shape[1]
    dims = (1, 3) if over_heads else (3,)
    t, n, b = _frozen_scale([t, n, b], norm, dims)

    def per_head(v: Tensor) -> Tensor:  # (e,) or (heads * e,) -> broadcast over (b, h, p, e)
        return rearrange(v.to(t), "(h e) -> h 1 e", h=heads) if over_heads else v.to(t)

    if norm.weight is not None:
        w = per_head(norm.weight)
        t, n, b = t * w, n * w, None if b is None else b * w
    if norm.bias is not None:
        b = (0 if b is None else b) + per_head(norm.bias).expand_as(t)
    return t, n, b


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
    pre-mask scaled scores. With a q/k norm its scale is frozen per token (and head) on
    the full input (``params.linearised``). Runs without autograd: the terms are
    statistics' inputs.
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
    n, n_kv = params.n_heads, params.n_kv_heads

    def bias(b: Tensor | None, heads: int) -> Tensor | None:  # broadcast over positions
        if b is None:
            return None
        return b.to(dev, dtype)[None, :, None, :].expand(batch, heads, pos, -1).contiguous()

    q_t, q_n, q_b = _project(xt, w_q), _project(xn, w_q), bias(params.b_Q, n)
    k_t, k_n, k_b = _project(xt, w_k), _project(xn, w_k), bias(params.b_K, n_kv)
    if params.q_norm is not None:
        q_t, q_n, q_b = _qk_normalise(q_t, q_n, q_b, params.q_norm, params.qk_norm_over_heads)
    if params.k_norm is not None:
        k_t, k_n, k_b = _qk_normalise(k_t, k_n, k_b, params.k_norm, params.qk_norm_over_heads)
    has_bias = q_b is not None or k_b is not None
    if has_bias:  # rotary then makes the biases position-dependent
        q_b = torch.zeros_like(q_t) if q_b is None else q_b
        k_b = torch.zeros_like(k_t) if k_b is None else k_b
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


def keep_mask(
    shape: tuple[int, ...],
    *,
    causal: bool = True,
    window: int | None = None,
    attention_mask: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """``(batch, 1, q_pos, k_pos)`` bool, True where the model lets query q see key k.

    ``shape`` is the terms' ``(batch, head, q_pos, k_pos)``. Causal: k ≤ q; ``window``
    (local attention): |q − k| < window, which is Mistral's, Qwen's and Gemma 3's sliding
    window and ModernBERT's local window (its ``sliding_window`` attribute, half the
    local span + 1); ``attention_mask`` (``(batch, k_pos)``, 1 = token, 0 = padding)
    drops padded queries' and keys' entries.
    """
    batch, _, n_q, n_k = shape
    keep = torch.ones(batch, 1, n_q, n_k, dtype=torch.bool, device=device)
    if (causal or window is not None) and n_q != n_k:
        raise UsageError(f"a causal or local mask needs q_pos == k_pos; got {n_q} and {n_k}.")
    if causal or window is not None:
        offset = torch.arange(n_q, device=device)[:, None] - torch.arange(n_k, device=device)
        if causal:
            keep &= offset >= 0
        if window is not None:
            keep &= offset.abs() < window
    if attention_mask is not None:
        am = torch.as_tensor(attention_mask, device=device)
        if tuple(am.shape) != (batch, n_k) or n_q != n_k:
            raise UsageError(
                f"attention_mask must be (batch, pos) = ({batch}, {n_k}) with 1 for real tokens "
                f"and 0 for padding; got {tuple(am.shape)}."
            )
        valid = am.bool()
        keep &= valid[:, None, :, None] & valid[:, None, None, :]
    return keep


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


def linearize_norm(
    x_tangent: Tensor, x_normal: Tensor, norm: NormParams, *, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The norm as a linear map with its scale frozen at the value on the full input.

    Returns ``(u_tangent, u_normal, offset)`` with u_T + u_N + offset == norm(x_T + x_N)
    (offset is the norm's bias, or None): σ is computed on x = x_T + x_N and then held
    fixed, so the centring, 1/σ and the weight act linearly on each part.
    """
    xt, xn = _frozen_scale([x_tangent.to(dtype), x_normal.to(dtype)], norm, (-1,))
    w = 1.0 if norm.weight is None else norm.weight.to(xt.device, dtype)
    offset = None if norm.bias is None else norm.bias.to(xt.device, dtype)
    return xt * w, xn * w, offset


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


# ------------------------------------------------------------------------- head writes
@torch.no_grad()
def z_gram(z: Tensor, mask: Tensor | None = None) -> Tensor:
    """Σ_t z_{t,h}ᵀ z_{t,h} over the tokens ``mask`` keeps: ``(n_heads, d_head, d_head)``
    float64 from z ``(batch, pos, n_heads, d_head)`` (the heads' outputs, ``hook_z``)."""
    if z.ndim != 4:
        raise UsageError(f"z must be (batch, pos, n_heads, d_head); got {tuple(z.shape)}.")
    if mask is not None:
        z = z[mask.to(z.device).bool()]
    rows = z.detach().reshape(-1, *z.shape[-2:]).to(torch.float64)
    return torch.einsum("the,thf->hef", rows, rows)


@torch.no_grad()
def head_write_energies(gram: Tensor, w_o: Tensor, q: Tensor) -> dict[str, Tensor]:
    """Per head, from ``gram`` = `z_gram` and W_O ``(n_heads, d_head, d_model)``:
    ``total`` = Σ_t‖z_h W_O^h‖², ``tangent`` = Σ_t‖z_h W_O^h Q‖² for the orthonormal
    ``q`` ``(d_model, k)``, and ``square`` = tr(C_h²) with C_h = W_O^hᵀ S_h W_O^h the
    head's write second moment (for `random_share_std`). Each ``(n_heads,)`` float64."""
    if w_o.ndim != 3 or tuple(gram.shape) != (w_o.shape[0], w_o.shape[1], w_o.shape[1]):
        raise UsageError(
            f"gram {tuple(gram.shape)} and W_O {tuple(w_o.shape)} do not match: need "
            "(n_heads, d_head, d_head) and (n_heads, d_head, d_model)."
        )
    if q.shape[0] != w_o.shape[2]:
        raise UsageError(
            f"the basis has d={q.shape[0]} but W_O writes d_model={w_o.shape[2]}; use a basis "
            "of the residual stream this attention writes into."
        )
    s = gram.to(torch.float64)
    w = w_o.to(s.device, torch.float64)
    wq = w @ q.to(s.device, torch.float64)  # (h, e, k)
    sg = s @ (w @ w.transpose(1, 2))  # S_h G_h, G_h = W_O^h W_O^hᵀ
    return {
        "total": sg.diagonal(dim1=1, dim2=2).sum(-1),
        "tangent": (s * (wq @ wq.transpose(1, 2))).sum((1, 2)),
        "square": (sg * sg.transpose(1, 2)).sum((1, 2)),  # tr((S G)²) = tr(C²)
    }


def random_share_std(total: Tensor, square: Tensor, k: int, d: int) -> Tensor:
    """Standard deviation of the energy share tr(QᵀCQ)/tr(C) over uniformly random
    (Haar) k-frames Q in R^d, for a PSD C with tr(C) = ``total`` and tr(C²) = ``square``
    (the mean is k/d exactly): Var = 2k(d−k)/(d(d−1)(d+2)) · (tr C² − (tr C)²/d)/(tr C)²."""
    if not (1 <= k < d):
        raise UsageError(f"need 1 <= k < d; got k={k}, d={d}.")
    spread = (square - total**2 / d).clamp_min(0) / total**2
    return (2 * k * (d - k) / (d * (d - 1) * (d + 2)) * spread).sqrt()
