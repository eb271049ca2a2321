"""Anisotropy and dimension statistics: plain functions, one layout.

Every point cloud is ``(n_samples, d)``, numpy or torch. Functions that only
need second-order statistics also take a `Moments` or a covariance matrix
(``*_from_cov``), so nothing needs the point cloud when the statistics suffice.
Results are Python floats, except `isoscore_star`, which returns a 0-dim
tensor and is differentiable when its input requires grad.

Identities used (exact, checked against the reference packages in the tests):
IsoScore (Rudman et al. 2022, as implemented in ``IsoScore`` 2.0.1) of a
covariance C in d dimensions equals ``(PR(C) − 1)/(d − 1)`` with the
participation ratio ``PR(C) = tr(C)²/tr(C²)``; so it needs two traces, no
eigendecomposition, and the same holds after removing a subspace.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .errors import UsageError
from .stats import Moments

__all__ = [
    "covariance",
    "effective_rank",
    "effective_rank_from_cov",
    "isoscore",
    "isoscore_from_cov",
    "isoscore_from_traces",
    "isoscore_star",
    "isoscore_star_from_cov",
    "mean_cosine",
    "participation_ratio",
    "participation_ratio_from_cov",
    "spectral_anisotropy",
    "spectral_anisotropy_from_cov",
    "twonn_dimension",
]


def _points(x: Any, name: str = "x", min_samples: int = 2) -> Tensor:
    """(n, d) float64 tensor, validated. Keeps autograd when x is a torch tensor."""
    t = x if isinstance(x, Tensor) else torch.as_tensor(np.asarray(x))
    if t.ndim != 2:
        raise UsageError(
            f"{name} must be a point cloud of shape (n_samples, d); got {tuple(t.shape)}. "
            "Flatten activations with x.reshape(-1, d)."
        )
    if t.shape[0] < min_samples or t.shape[1] < 1:
        raise UsageError(
            f"{name} needs at least {min_samples} samples and 1 feature; got {tuple(t.shape)}."
        )
    t = t.to(torch.float64)
    if not bool(torch.isfinite(t).all()):
        raise UsageError(f"{name} contains NaN or Inf; drop or mask those rows first.")
    return t


def covariance(x: Any, ddof: int = 1) -> Tensor:
    """Covariance of a point cloud (``ddof=1``, as ``torch.cov``), a `Moments` or a matrix."""
    if isinstance(x, Moments):
        return x.covariance(ddof=ddof)
    t = _points(x)
    centred = t - t.mean(0)
    return centred.T @ centred / (t.shape[0] - ddof)


def _cov_arg(c: Any, name: str = "cov") -> Tensor:
    if isinstance(c, Moments):
        return c.covariance(ddof=1)
    t = c if isinstance(c, Tensor) else torch.as_tensor(np.asarray(c))
    if t.ndim != 2 or t.shape[0] != t.shape[1]:
        raise UsageError(f"{name} must be a square (d, d) matrix; got {tuple(t.shape)}.")
    t = t.to(torch.float64)
    # a finite sum has no NaN or Inf behind it, and takes one pass with no d × d mask;
    # only a sum that is not finite (an entry that is not, or an overflow) needs the mask
    if not (bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())):
        raise UsageError(f"{name} contains NaN or Inf.")
    return t


def _eigvals(cov: Tensor) -> Tensor:
    """Eigenvalues of a symmetric PSD matrix, descending, clamped at 0."""
    return torch.linalg.eigvalsh((cov + cov.T) / 2).flip(0).clamp_min(0)


# ------------------------------------------------------------------- IsoScore
def isoscore_from_traces(trace: Tensor | float, trace_sq: Tensor | float, d: int) -> Tensor:
    """IsoScore from tr(C), tr(C²) and the dimension: ``(PR − 1)/(d − 1)``.

    Works elementwise on batches of traces (one per control, say)."""
    if d < 2:
        raise UsageError(f"IsoScore needs d >= 2 dimensions; got {d}.")
    trace, trace_sq = (
        t.to(torch.float64) if isinstance(t, Tensor) else torch.as_tensor(t, dtype=torch.float64)
        for t in (trace, trace_sq)
    )
    if bool((trace_sq <= 0).any()):
        raise UsageError("the covariance is zero: IsoScore is undefined for constant data.")
    return (trace**2 / trace_sq - 1) / (d - 1)


def isoscore_from_cov(cov: Any) -> float:
    """IsoScore of a covariance matrix (or `Moments`)."""
    c = _cov_arg(cov)
    return float(isoscore_from_traces(torch.trace(c), (c * c).sum(), c.shape[0]))


def isoscore(x: Any) -> float:
    """IsoScore of a point cloud ``(n_samples, d)``: 0 for one direction, 1 isotropic.

    Equals ``IsoScore.IsoScore(x)`` of the reference package (version 2.0.1).
    """
    if isinstance(x, Moments):
        return isoscore_from_cov(x)
    return isoscore_from_cov(covariance(x))


def _shrunk(c: Tensor, zeta: float, reference: Any | None) -> Tensor:
    if not 0 <= zeta <= 1:
        raise UsageError(f"zeta must be in [0, 1]; got {zeta}.")
    d = c.shape[0]
    if reference is None:
        ref = torch.eye(d, dtype=c.dtype, device=c.device) * (torch.trace(c) / d)
    else:
        ref = _cov_arg(reference, "reference").to(c.device)
        if ref.shape != c.shape:
            raise UsageError(
                f"reference must be ({d}, {d}) to match the data; got {tuple(ref.shape)}."
            )
    return (1 - zeta) * c + zeta * ref


def isoscore_star_from_cov(cov: Any, zeta: float = 0.0, reference: Any | None = None) -> Tensor:
    """IsoScore* of a covariance: IsoScore of ``(1 − zeta)·C + zeta·reference``."""
    c = cov.to(torch.float64) if isinstance(cov, Tensor) and cov.ndim == 2 else _cov_arg(cov)
    m = _shrunk(c, zeta, reference)
    return isoscore_from_traces(torch.trace(m), (m * m).sum(), m.shape[0])


def isoscore_star(x: Any, zeta: float = 0.0, reference: Any | None = None) -> Tensor:
    """IsoScore* (Rudman & Eickhoff 2024): IsoScore of the covariance shrunk toward a reference.

    ``reference=None`` uses the scale-matched identity ``tr(C)/d · I``: the plain identity
    makes the score depend on the data's units. ``zeta=0`` gives `isoscore`. The covariance
    is normalised by ``n − 1`` as in the reference package, so with the same ``reference``
    this equals ``IsoScore.IsoScore_star(x, reference, zeta)``. Differentiable in torch.
    """
    c = x.covariance(ddof=1) if isinstance(x, Moments) else covariance(x)
    return isoscore_star_from_cov(c, zeta=zeta, reference=reference)


# ----------------------------------------------------------- spectrum summaries
def participation_ratio_from_cov(cov: Any) -> float:
    """``tr(C)²/tr(C²)``: between 1 (one direction) and d (isotropic)."""
    c = _cov_arg(cov)
    tsq = float((c * c).sum())
    if tsq <= 0:
        raise UsageError("the covariance is zero: the participation ratio is undefined.")
    return float(torch.trace(c)) ** 2 / tsq


def participation_ratio(x: Any) -> float:
    """Participation ratio of a point cloud's covariance."""
    return participation_ratio_from_cov(x if isinstance(x, Moments) else covariance(x))


def effective_rank_from_cov(cov: Any) -> float:
    """Roy & Vetterli's effective rank, exp(entropy of the normalised singular values).

    Convention: the singular values of the centred data matrix, i.e. the square
    roots of the covariance eigenvalues (not the eigenvalues themselves).
    """
    sv = _eigvals(_cov_arg(cov)).sqrt()
    total = float(sv.sum())
    if total <= 0:
        raise UsageError("the covariance is zero: the effective rank is undefined.")
    p = sv[sv > 0] / total
    return math.exp(float(-(p * p.log()).sum()))


def effective_rank(x: Any) -> float:
    """Effective rank (Roy & Vetterli 2007) of a centred point cloud: 1 for rank-1 data,
    ≈ d for an isotropic cloud. See `effective_rank_from_cov` for the convention."""
    if isinstance(x, Moments):
        return effective_rank_from_cov(x)
    t = _points(x)
    sv = torch.linalg.svdvals(t - t.mean(0))
    total = float(sv.sum())
    if total <= 0:
        raise UsageError("the points are all equal: the effective rank is undefined.")
    p = sv[sv > 0] / total
    return math.exp(float(-(p * p.log()).sum()))


def spectral_anisotropy_from_cov(second_moment: Any) -> float:
    """Share of energy in the top direction, ``λ_max/tr``: 1/d isotropic, 1 for one direction."""
    ev = _eigvals(_cov_arg(second_moment, "second_moment"))
    total = float(ev.sum())
    if total <= 0:
        raise UsageError("the matrix is zero: spectral anisotropy is undefined.")
    return float(ev[0]) / total


def spectral_anisotropy(x: Any, centered: bool = False) -> float:
    """Share of E‖x‖² along the top principal direction.

    Uncentred by default (the common-direction anisotropy of raw embeddings,
    where the mean dominates); ``centered=True`` uses the covariance instead.
    A `Moments` argument is read the same way.
    """
    if isinstance(x, Moments):
        return spectral_anisotropy_from_cov(x.covariance() if centered else x.second_moment())
    t = _points(x, min_samples=1)
    if centered:
        t = t - t.mean(0)
    return spectral_anisotropy_from_cov(t.T @ t / t.shape[0])


# -------------------------------------------------------------------- cosines
def mean_cosine(x: Any) -> float:
    """Mean cosine similarity over all distinct pairs, in O(n·d).

    Uses ``Σ_{i≠j} uᵢ·uⱼ = ‖Σ uᵢ‖² − n`` for unit rows uᵢ. Given a `Moments` of
    unit-normalised vectors, the same identity runs on its count and mean.
    """
    if isinstance(x, Moments):
        n = x.count
        if n < 2:
            raise UsageError("mean_cosine needs at least 2 vectors.")
        s2 = float((x.mean * n).pow(2).sum())
        return (s2 - n) / (n * (n - 1))
    t = _points(x)
    norms = t.norm(dim=1)
    if bool((norms == 0).any()):
        raise UsageError("x has zero rows; cosine similarity is undefined for them: drop them.")
    u = t / norms[:, None]
    n = u.shape[0]
    s2 = float(u.sum(0).pow(2).sum())
    return (s2 - float(u.pow(2).sum())) / (n * (n - 1))


# ---------------------------------------------------------------------- TwoNN
def _two_nearest(
    t: Tensor, groups: Tensor | None = None, chunk: int = 2048
) -> tuple[Tensor, Tensor]:
    """Distances to the first and second nearest neighbours (exact, chunked).

    With ``groups``, a point's own group is skipped and the second neighbour is taken
    from a third group. Candidates come from the expanded ‖a‖² + ‖b‖² − 2a·b form; the
    two distances are then recomputed as ‖a − b‖ to avoid its cancellation for close points.
    """
    sq = (t * t).sum(1)
    nbrs = torch.empty(t.shape[0], 2, dtype=torch.long)
    for start in range(0, t.shape[0], chunk):
        block = t[start : start + chunk]
        rows = torch.arange(block.shape[0])
        d2 = sq[start : start + chunk, None] + sq[None, :] - 2 * block @ t.T
        if groups is None:
            d2[rows, rows + start] = float("inf")
            nbrs[start : start + block.shape[0]] = d2.topk(2, dim=1, largest=False).indices
            continue
        own = groups[start : start + chunk]
        d2[own[:, None] == groups[None, :]] = float("inf")
        first = d2.argmin(1)
        d2[groups[first][:, None] == groups[None, :]] = float("inf")
        nbrs[start : start + block.shape[0], 0] = first
        nbrs[start : start + block.shape[0], 1] = d2.argmin(1)
    dist = (t[:, None, :] - t[nbrs]).norm(dim=-1).sort(dim=1).values
    return dist[:, 0], dist[:, 1]


def _group_labels(groups: Any, n: int) -> Tensor:
    g = groups if isinstance(groups, Tensor) else torch.as_tensor(np.asarray(groups))
    if g.shape != (n,) or g.dtype.is_floating_point or g.dtype.is_complex or g.dtype == torch.bool:
        raise UsageError(
            f"groups must hold one integer label per row of x ({n}); "
            f"got {g.dtype} of shape {tuple(g.shape)}."
        )
    return g.long()


def twonn_dimension(x: Any, groups: Any | None = None, *, discard_fraction: float = 0.1) -> float:
    """TwoNN intrinsic dimension (Facco et al. 2017).

    μ = r₂/r₁ per point; the top ``discard_fraction`` of μ is dropped; the slope of
    −log(1 − F(μ)) against log μ, fitted through the origin, is the dimension.
    Duplicate points are removed first (they make r₁ = 0).

    ``groups`` (one integer label per row, e.g. the sequence index) measures the
    dimension *across* groups: a point's neighbours are sought outside its own group, and
    the two neighbours come from two different groups. Tokens of one sequence lie on a
    short, nearly 1-dimensional path, so without it the estimate collapses toward 1; and
    two tokens of one neighbouring sequence would give μ ≈ 1. Each row its own group
    gives the ungrouped estimate.
    """
    t = _points(x, min_samples=3).detach()
    if not 0 <= discard_fraction < 1:
        raise UsageError(f"discard_fraction must be in [0, 1); got {discard_fraction}.")
    if groups is None:
        t = torch.unique(t, dim=0)
        labels = None
    else:
        labels = _group_labels(groups, t.shape[0])
        t, inverse = torch.unique(t, dim=0, return_inverse=True)
        # a duplicated point keeps one of its labels
        labels = torch.empty(t.shape[0], dtype=torch.long).scatter_(0, inverse, labels)
        if labels.unique().numel() < 3:
            raise UsageError("grouped TwoNN needs points in at least 3 distinct groups.")
    if t.shape[0] < 3:
        raise UsageError("TwoNN needs at least 3 distinct points.")
    r1, r2 = _two_nearest(t, labels)
    keep = r1 > 0
    mu = (r2[keep] / r1[keep]).sort().values
    n = mu.shape[0]
    n_keep = int(n * (1 - discard_fraction))
    if n_keep < 2:
        raise UsageError("fewer than 2 points left after discarding; pass more points.")
    mu = mu[:n_keep]
    f_emp = torch.arange(1, n_keep + 1, dtype=torch.float64) / n
    xs, ys = mu.log(), -torch.log1p(-f_emp)
    spread = (xs * xs).sum()
    if spread == 0:  # the fit's slope is 0/0: μ = 1 has probability 0 at any finite d
        raise UsageError(
            "every point's two nearest neighbours are equally far (μ = r₂/r₁ = 1: one-hot "
            "rows, a lattice, tied distances); TwoNN estimates no dimension from ties."
        )
    return float((xs * ys).sum() / spread)
