"""Attention's output side: what each head writes into the residual stream, in a basis.

Head h writes z_h W_O^h into the residual stream (z_h its output before the output
projection, W_O^h ``(d_head, d_model)``). With S_h = Σ_t z_hᵀz_h over tokens, its write
energy is tr(S_h W_O^h W_O^hᵀ) and the part in span(Q) is tr(S_h (W_O^h Q)(W_O^h Q)ᵀ):
d_head × d_head algebra per head (`z_gram`, `head_write_energies`), no write is ever
materialised. A uniformly random k-frame has mean share k/d exactly and a closed-form
spread (`random_share_std`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import UsageError

__all__ = ["head_write_energies", "random_share_std", "z_gram"]


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
