"""Σ G Gᵀ of weight gradients G = XᵀΔ (d_in × out), in float64: one map's
(`weight_gram`), the maps that read one input pooled (`pooled_weight_gram`, in the form
`fold_flops` counts cheaper), or a G a backward already formed (`gradient_gram`).

Products are formed in `stats.gram_dtype` (float32 for float32 activations on an IEEE
device) about X's mean, each factor scaled by an exact power of two (`stats.unit_scale`)
so float32 neither overflows nor underflows (G Gᵀ only where it would leave float32's
range, `stats.in_float32_range`), and read back into float64; symmetric products are
symmetric bit for bit (`compute.syrk`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .compute import syrk
from .errors import UsageError
from .stats import gram_dtype, in_float32_range, unit_scale

__all__ = [
    "fold_flops",
    "fold_form",
    "gradient_gram",
    "input_gradient",
    "pooled_weight_gram",
    "weight_gram",
]


def gradient_gram(g: Tensor, work: torch.dtype, *, overwrite: bool = False) -> Tensor:
    """G Gᵀ (float64) of a weight gradient G (d_in × out), the product formed in ``work``
    (`compute.syrk`, symmetric bit for bit) from G rounded to ``work`` once: on the CPU as
    it is where the product stays in float32's range (`stats.in_float32_range`), else G
    scaled by an exact power of two (`stats.unit_scale`, in place with ``overwrite``)."""
    if work == torch.float32 and g.device.type == "cpu":  # a GPU would wait on the check
        gram = syrk([g.to(work)])
        if in_float32_range(gram):
            return gram.to(torch.float64)
    scale = unit_scale(g)
    scaled = g.mul_(scale) if overwrite else g * scale
    gram = syrk([scaled.to(work)]).to(torch.float64)
    return gram.mul_(scale.to(torch.float64) ** -2)  # exact: a power of two


def input_gradient(x: Tensor, delta: Tensor) -> Tensor:
    """G = XᵀΔ (d_in × out) in float64, the product formed in `stats.gram_dtype`: X about
    its mean rounded to float32, G = (X − 1cᵀ)ᵀΔ + c·(1ᵀΔ) with the rank-one part in
    float64, Δ scaled by an exact power of two (`stats.unit_scale`)."""
    work = gram_dtype(x)
    if work == torch.float64:
        return x.to(torch.float64).T @ delta.to(torch.float64)
    centre = (x.sum(0, dtype=torch.float64) / max(x.shape[0], 1)).to(work)
    scale = unit_scale(delta)
    g = ((x.to(work) - centre).T @ (delta.to(work) * scale)).to(torch.float64)
    g /= scale.to(torch.float64)
    return g + torch.outer(centre.to(torch.float64), delta.sum(0, dtype=torch.float64))


def weight_gram(x: Tensor, delta: Tensor) -> Tensor:
    """G Gᵀ (d_in × d_in, float64) of one map's weight gradient G = XᵀΔ (`input_gradient`),
    the product formed in `stats.gram_dtype` of ``x``: in float32, G is scaled by an exact
    power of two (`stats.unit_scale`) and rounded once, the product read back in float64."""
    return gradient_gram(input_gradient(x, delta), gram_dtype(x), overwrite=True)


def fold_flops(n: int, d: int, outs: int, form: str) -> int:
    """Flops of Σ_m G_mG_mᵀ for ``n`` tokens, ``d`` inputs and ``outs`` = Σ_m out_m
    outputs, each symmetric product counted at one triangle's flops (as BLAS ``?syrk``
    spends them; torch's product spends twice as many, in less time on two threads):
    "direct" forms each G_m = XᵀΔ_m and their Gram, "token" the token Gram
    K = Σ_m Δ_mΔ_mᵀ and XᵀKX, "weights" only the Grams of the G_m a backward formed for
    the weights' own gradients. Which is cheaper turns on n against d."""
    if form == "weights":
        return d * d * outs
    if form == "direct":
        return 2 * n * d * outs + d * d * outs
    return n * n * outs + 2 * n * n * d + 2 * n * d * d


def fold_form(n: int, d: int, outs: int) -> str:
    """The fold of X and Δ that `fold_flops` counts cheaper: "token" or "direct" (on a
    tie, "direct")."""
    cheaper = fold_flops(n, d, outs, "token") < fold_flops(n, d, outs, "direct")
    return "token" if cheaper else "direct"


def pooled_weight_gram(x: Tensor, deltas: Sequence[Tensor], form: str = "auto") -> Tensor:
    """Σ_m G_mG_mᵀ (d_in × d_in, float64), G_m = XᵀΔ_m, over maps that read the same
    ``x`` (n × d_in), in the cheaper ``form`` of `fold_flops` ("auto"), or the one named.
    In `stats.gram_dtype` float32 both forms work about X's mean c rounded to float32,
    X = X̃ + 1cᵀ, with every Δ_m scaled by one exact power of two (`stats.unit_scale`):

    - "direct": each G_m = X̃ᵀΔ_m + c s_mᵀ (s_m its column sums, in float64), scaled and
      rounded once as `weight_gram` rounds it, G_mG_mᵀ (`compute.syrk`) read back map by
      map (one float32 sum over every map's columns rounds several times more);
    - "token": S = X̃ᵀKX̃ + w cᵀ + c wᵀ + ‖s‖² ccᵀ with K = Σ_m Δ_mΔ_mᵀ (`compute.syrk`),
      u = K·1 = Σ_m Δ_m s_m and w = X̃ᵀu; X̃ scaled too, so X̃ᵀKX̃ stays in range.

    Each is read back into float64; in float64 (no IEEE float32 matmul) the same forms
    run unscaled."""
    if form == "auto":
        form = fold_form(*x.shape, sum(delta.shape[-1] for delta in deltas))
    if form not in ("direct", "token"):
        raise UsageError(f"form must be 'auto', 'direct' or 'token'; got {form!r}.")
    work = gram_dtype(x)
    if x.shape[0] == 0:
        return torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64, device=x.device)
    if work == torch.float64:
        x64, d64 = x.to(torch.float64), [delta.to(torch.float64) for delta in deltas]
        if form == "direct":
            return syrk([torch.cat([x64.T @ delta for delta in d64], 1)])
        s = x64.T @ (syrk(d64) @ x64)
        return (s + s.T) / 2
    centre = (x.sum(0, dtype=torch.float64) / x.shape[0]).to(work)
    c = centre.to(torch.float64)
    scale = unit_scale(*deltas)
    scaled = [delta.to(work) * scale for delta in deltas]
    sums = torch.cat([delta.sum(0, dtype=torch.float64) for delta in scaled])
    widths = [delta.shape[1] for delta in scaled]
    x_c = x.to(work) - centre
    if form == "direct":
        s = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64, device=x.device)
        for delta, s_m in zip(scaled, sums.split(widths), strict=True):
            g = (x_c.T @ delta).to(torch.float64).addr_(c, s_m)
            s += gradient_gram(g, work, overwrite=True)
        return s.mul_(scale.to(torch.float64) ** -2)
    x_scale = unit_scale(x_c)
    x_c *= x_scale
    k = syrk(scaled)
    u = torch.zeros(x.shape[0], dtype=work, device=x.device)
    for delta, s_m in zip(scaled, sums.split(widths), strict=True):
        u.addmv_(delta, s_m.to(work))
    # in X̃'s scaled frame (c and w times x_scale, exact): m = A + 2 c wᵀ + ‖s‖² ccᵀ in
    # place, then (m + mᵀ)/2, symmetric bit for bit, unscaled by powers of two
    c_x = c * x_scale.to(torch.float64)
    m = (x_c.T @ (k @ x_c)).to(torch.float64)
    m.addr_(c_x, (x_c.T @ u).to(torch.float64), alpha=2).addr_(c_x * (sums @ sums), c_x)
    return (m + m.T).mul_((x_scale.to(torch.float64) * scale.to(torch.float64)) ** -2 / 2)
