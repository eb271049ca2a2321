"""Attention maths: the pre-mask scaled score split into tangent and normal parts.

With a tangent basis Q_T fitted at a layer's attention input x (the exact input to
W_Q/W_K), x = x_T + x_N exactly, and since projections and rotary are linear,

    s = (R q)·(R k) · scale = TT + TN + NT + NN + bias,

where TT = (R q_T)·(R k_T)·scale with q_T = x_T W_Q, and so on, and ``bias`` gathers
every term that involves b_Q or b_K. ``s`` is the pre-mask scaled score the model
softmaxes (grouped-query heads repeated as the model repeats them). `ScoreSplit` maps the
full queries and keys once and each basis's tangent ones as (x Q)(Qᵀ W_Q), a rank-k
product; the normal parts are the differences, so many bases cost little more than one.

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
The output side (what each head writes) is `tangentlens.core.head_writes`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    "Parts",
    "RotaryFn",
    "ScoreSplit",
    "decompose_parts",
    "decompose_scores",
    "keep_blocks",
    "keep_mask",
    "linearize_norm",
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
    """(batch, pos, d) @ (head, d, e) -> (batch, head, pos, e), contiguous (blocks: views)."""
    return torch.einsum("bpd,hde->bhpe", x, w).contiguous()


def _frozen_norm(
    full: Tensor, norm: NormParams | None, over_heads: bool = False
) -> tuple[Callable[[Tensor], Tensor], Tensor | None]:
    """A norm as ``(linear map, bias)`` on parts of ``full``, its σ computed on ``full``
    (the whole input, biases included) and then held fixed, so every part, for every
    basis, sees the same scale; the norm's bias (broadcast over ``full``) joins the bias
    part. ``over_heads``: σ over (head, e) of ``(..., head, pos, e)``, weight
    ``(heads * e,)``; else over the last dim. Without a norm: the identity, no bias."""
    if norm is None:
        return (lambda t: t), None
    heads, dims = (full.shape[-3], (-3, -1)) if over_heads else (1, (-1,))
    if norm.kind == "layernorm":
        sigma = (full.var(dims, unbiased=False, keepdim=True) + norm.eps).sqrt()
    else:
        sigma = (full.pow(2).mean(dims, keepdim=True) + norm.eps).sqrt()

    def per_head(v: Tensor) -> Tensor:  # (e,) or (heads * e,) -> broadcast over (h, p, e)
        return rearrange(v.to(full), "(h e) -> h 1 e", h=heads) if over_heads else v.to(full)

    weight = None if norm.weight is None else per_head(norm.weight)

    def frozen(t: Tensor) -> Tensor:
        if norm.kind == "layernorm":
            t = t - t.mean(dims, keepdim=True)
        t = t / sigma.to(t.dtype)
        return t if weight is None else t * weight.to(t.dtype)

    return frozen, None if norm.bias is None else per_head(norm.bias).expand_as(full)


class ScoreSplit:
    """One layer's pre-mask scaled scores, ready to be split by many bases (`parts`).

    The full queries and keys go through the projection, a frozen q/k norm, rotary and
    the scale once; `parts` pushes each basis's tangent queries and keys through the
    same linear maps (the norm's scale frozen on the full projection, one for all
    bases) and takes the normal ones as the difference. The bias term and the scores
    are the same for every basis. Methods take a block of query rows and key columns,
    so statistics over unmasked entries can skip the blocks a causal or local mask drops.
    """

    @torch.no_grad()
    def __init__(
        self,
        x: Tensor,
        params: AttentionParams,
        *,
        positions: Tensor | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        """``x``: the attention input ``(batch, pos, d_model)``; ``positions`` as in
        `decompose_parts`; ``dtype`` float64 or float32."""
        self.x = x = _check_input(torch.as_tensor(x).detach(), params)
        self.params, self.dtype = params, _check_dtype(dtype)
        # W_Q, W_K per dtype on x's device and x in float64, converted once for every
        # `parts` call (a null's frames come a few at a time)
        self._w: dict[torch.dtype, tuple[Tensor, Tensor]] = {}
        self._x64 = x.to(torch.float64)
        batch, pos, _ = x.shape
        x_in = self._x64 if dtype == torch.float64 else x.to(dtype)
        q, k = (_project(x_in, w) for w in self._weights(dtype))
        q_b, k_b = (
            None if b is None else b.to(q)[None, :, None, :].expand_as(t)
            for b, t in ((params.b_Q, q), (params.b_K, k))
        )
        over = params.qk_norm_over_heads
        self._f_q, n_q = _frozen_norm(q if q_b is None else q + q_b, params.q_norm, over)
        self._f_k, n_k = _frozen_norm(k if k_b is None else k + k_b, params.k_norm, over)
        q, k = self._f_q(q), self._f_k(k)
        q_b = n_q if q_b is None else self._f_q(q_b) if n_q is None else self._f_q(q_b) + n_q
        k_b = n_k if k_b is None else self._f_k(k_b) if n_k is None else self._f_k(k_b) + n_k
        self._positions = None if params.rotary is None else _positions(positions, batch, pos, x)
        if self._positions is not None:
            q, k = self._rotate(q, k)
            if q_b is not None or k_b is not None:  # rotary makes them position-dependent
                zq, zk = torch.zeros_like(q), torch.zeros_like(k)
                rq, rk = self._rotate(zq if q_b is None else q_b, zk if k_b is None else k_b)
                q_b, k_b = (None if b is None else r for b, r in ((q_b, rq), (k_b, rk)))
        self._q, self._k = self._grouped(q * params.scale), k
        self._q_b = None if q_b is None else self._grouped(q_b * params.scale)
        self._k_b, self._k_all = k_b, k if k_b is None else k + k_b

    def _weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(W_Q, W_K) in ``dtype`` on x's device."""
        if dtype not in self._w:
            device = self.x.device
            self._w[dtype] = (
                self.params.W_Q.to(device, dtype),
                self.params.W_K.to(device, dtype),
            )
        return self._w[dtype]

    def _rotate(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Rotary on (..., batch, head, pos, e) q and k, leading dims folded into the batch."""
        if self.params.rotary is None:
            return q, k
        pos = self._positions
        qf, kf = q.flatten(0, -4), k.flatten(0, -4)
        qf, kf = self.params.rotary(qf, kf, pos.repeat(qf.shape[0] // pos.shape[0], 1))
        return qf.reshape(q.shape), kf.reshape(k.shape)

    def _grouped(self, q: Tensor) -> Tensor:
        """(..., head, pos, e) -> (..., kv_head, group, pos, e): query head j*r + i reads
        kv head j (grouped-query attention), so no key is repeated."""
        return q.unflatten(-3, (self.params.n_kv_heads, -1))

    def _heads(self, s: Tensor) -> Tensor:
        """(..., kv_head, group * rows, keys) -> (..., head, rows, keys), a view."""
        group = self.params.n_heads // self.params.n_kv_heads
        return s.unflatten(-2, (group, -1)).flatten(-4, -3)

    def _dot(self, q: Tensor, k: Tensor, rows: slice, keys: slice) -> Tensor:
        """Grouped queries · keys on a block: (..., head, rows, keys)."""
        return self._heads(_bmm(q[..., rows, :].flatten(-3, -2), k[..., keys, :]))

    def bias(self, rows: slice = slice(None), keys: slice = slice(None)) -> Tensor | None:
        """The bias term on a block (the same for every basis), or None without biases."""
        parts = []
        if self._q_b is not None:
            parts.append(self._dot(self._q_b, self._k_all, rows, keys))
        if self._k_b is not None:
            parts.append(self._dot(self._q, self._k_b, rows, keys))
        return sum(parts[1:], parts[0]) if parts else None

    def scores(self, rows: slice = slice(None), keys: slice = slice(None)) -> Tensor:
        """The pre-mask scaled scores on a block: ``(batch, head, rows, keys)``."""
        s = self._dot(self._q, self._k, rows, keys)
        b = self.bias(rows, keys)
        return s if b is None else s + b

    @torch.no_grad()
    def parts(self, bases: Sequence[TangentBasis], *, dtype: torch.dtype | None = None) -> Parts:
        """The split by each of ``bases`` (`Parts`), in ``dtype`` (default: this one's).
        x_T = x Q Qᵀ projects through W_Q as (x Q)(Qᵀ W_Q), a rank-k product."""
        if not bases:
            raise UsageError("parts needs at least one basis.")
        for basis in bases:
            if not isinstance(basis, TangentBasis):
                raise TypeError(f"bases must be TangentBasis; got {type(basis).__name__}.")
            if basis.d != self.params.d_model:
                raise UsageError(
                    f"a basis has d={basis.d} but W_Q reads d_model={self.params.d_model}; "
                    "fit the basis at this layer's attention input."
                )
        shape = (len(bases), basis.d, max(b.k for b in bases))
        frames = torch.zeros(shape, dtype=torch.float64, device=self.x.device)
        for i, basis in enumerate(bases):  # zero columns add nothing to x Q Qᵀ
            frames[i, :, : basis.k] = basis.basis_
        coords = torch.einsum("bpd,ndk->nbpk", self._x64, frames)  # x Q, once
        dtype = _check_dtype(dtype or self.dtype)
        low = coords.to(dtype)

        def tangent(index: int) -> Tensor:  # x Q and Qᵀ W in float64, their product in dtype
            w_t = torch.einsum("ndk,hde->nhke", frames, self._weights(torch.float64)[index])
            return torch.einsum("nbpk,nhke->nbhpe", low, w_t.to(dtype)).contiguous()

        return self._parts(tangent, dtype)

    def _parts(self, tangent: Callable[[int], Tensor], dtype: torch.dtype) -> Parts:
        """`Parts` from ``tangent(i)``, the tangent projections ``(n, batch, head, pos, e)``
        by W_Q (``i`` = 0) or W_K (1) in ``dtype``, before any norm, rotary or scale."""
        q_t, k_t = self._rotate(self._f_q(tangent(0)), self._f_k(tangent(1)))
        q_t, q, k = self._grouped(q_t * self.params.scale), self._q.to(dtype), self._k.to(dtype)
        return Parts(self, q_t, q - q_t, k_t, k - k_t)


class Parts:
    """Each basis's tangent and normal queries and keys on one `ScoreSplit`, ``(n, ...)``."""

    def __init__(self, split: ScoreSplit, q_t: Tensor, q_n: Tensor, k_t: Tensor, k_n: Tensor):
        self.split, self._q, self._k = split, (q_t, q_n), (k_t, k_n)

    def __len__(self) -> int:
        return int(self._q[0].shape[0])

    def terms(self, i: int | slice, rows: slice = slice(None), keys: slice = slice(None)) -> Tensor:
        """TT, TN, NT, NN of basis ``i`` on a block: ``(4, batch, head, rows, keys)``; of
        the bases in slice ``i``, from one batched product each: ``(4, n, batch, ...)``."""
        qs = [q[i][..., rows, :].flatten(-3, -2) for q in self._q]
        ks = [k[i][..., keys, :] for k in self._k]
        out = qs[0].new_empty(4, *qs[0].shape[:-1], ks[0].shape[-2])
        for j, (a, b) in enumerate((a, b) for a in qs for b in ks):  # TT, TN, NT, NN
            _bmm(a, b, out=out[j])
        return self.split._heads(out)

    def term_dict(self, i: int) -> dict[str, Tensor]:
        """Basis ``i``'s ``TT, TN, NT, NN, bias`` on all entries (`decompose_parts`)."""
        out = dict(zip(TERMS[:4], self.terms(i), strict=True))
        b = self.split.bias()
        out["bias"] = torch.zeros_like(out["TT"]) if b is None else b.to(out["TT"])
        return out


def _bmm(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """a (..., m, e) · b (..., n, e) -> (..., m, n) as one `torch.bmm` over the leading dims
    (torch.matmul copies 4-d operands first, which costs twice the product)."""
    flat = None if out is None else out.flatten(0, -3)
    return torch.bmm(a.flatten(0, -3), b.flatten(0, -3).transpose(-1, -2), out=flat).unflatten(
        0, a.shape[:-2]
    )


def _check_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in (torch.float32, torch.float64):
        raise UsageError(f"dtype must be torch.float32 or torch.float64; got {dtype}.")
    return dtype


def _positions(positions: Tensor | None, batch: int, pos: int, x: Tensor) -> Tensor:
    positions = torch.arange(pos, device=x.device) if positions is None else positions
    positions = torch.as_tensor(positions, device=x.device).long()
    if positions.ndim == 1:
        positions = positions[None].expand(batch, pos)
    if tuple(positions.shape) != (batch, pos):
        raise UsageError(
            f"positions must be ({pos},) or ({batch}, {pos}); got {tuple(positions.shape)}."
        )
    return positions


def _check_input(x: Tensor, params: AttentionParams) -> Tensor:
    if x.ndim != 3:
        raise UsageError(f"the input must be (batch, pos, d_model); got {tuple(x.shape)}.")
    if x.shape[-1] != params.d_model:
        raise UsageError(
            f"the input has d_model={x.shape[-1]} but W_Q expects {params.d_model}; "
            "was the basis fitted at another layer's attention input or another model?"
        )
    return x


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
    xt = _check_input(x_tangent, params).to(torch.float64)
    split = ScoreSplit(xt + x_normal.to(xt), params, positions=positions, dtype=dtype)
    x_low = xt.to(dtype)
    parts = split._parts(lambda i: _project(x_low, split._weights(dtype)[i])[None], dtype)
    return parts.term_dict(0)


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


def keep_blocks(
    n_pos: int, *, causal: bool = True, window: int | None = None, rows: int = 32
) -> list[tuple[slice, slice]]:
    """Blocks of query rows (``rows`` at a time) with the key columns `keep_mask`'s causal
    and window rules leave them (padding aside): statistics over the kept entries need
    nothing outside them, about half of a causal matrix. One block without either rule."""
    if not causal and window is None:
        return [(slice(None), slice(None))]
    out = []
    for start in range(0, n_pos, rows):
        stop = min(start + rows, n_pos)
        lo = 0 if window is None else max(0, start - window + 1)
        hi = stop if causal else min(n_pos, stop - 1 + window)
        out.append((slice(start, stop), slice(lo, hi)))
    return out


@torch.no_grad()
def decompose_scores(
    x: Tensor,
    basis: TangentBasis,
    params: AttentionParams,
    *,
    norm: NormParams | None = None,
    positions: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> dict[str, Tensor]:
    """Split ``x`` (batch, pos, d_model) with ``basis`` into ``TT, TN, NT, NN, bias``
    (as :func:`decompose_parts`; several bases at once: `ScoreSplit.parts`).

    Without ``norm``, ``x`` is the attention input (the exact input to W_Q/W_K). With
    ``norm`` (the pre-attention norm), ``x`` is the residual stream before it and
    ``basis`` was fitted there: the norm is made linear by freezing its scale at the
    value on the full ``x`` (:func:`linearize_norm`), and its bias joins ``bias``.
    """
    if not isinstance(basis, TangentBasis):
        raise TypeError(f"basis must be a TangentBasis; got {type(basis).__name__}.")
    if norm is None:
        split = ScoreSplit(x, params, positions=positions, dtype=dtype)
        return split.parts([basis]).term_dict(0)
    x_t, x_n = basis.split(torch.as_tensor(x).detach())
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
    xt, xn = x_tangent.to(dtype), x_normal.to(x_tangent.device, dtype)
    frozen, _ = _frozen_norm(xt + xn, norm)
    offset = None if norm.bias is None else norm.bias.to(xt.device, dtype)
    return frozen(xt), frozen(xn), offset


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
