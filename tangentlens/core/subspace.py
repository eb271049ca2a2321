"""Tangent subspaces: orthonormal bases Q_T fitted by PCA on streaming statistics.

`TangentBasis` follows scikit-learn's conventions: hyper-parameters in the
constructor or `fit`, fitted attributes end in ``_``, points are rows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .compute import top_eigh
from .controls import draw_frames
from .errors import CorruptFileError, UsageError
from .files import load_tensors, save_tensors
from .stats import Moments
from .validation import check_int, check_rank

__all__ = [
    "TangentBasis",
    "chance_overlap",
    "complement",
    "near_chance",
    "normal_controls",
    "shares",
    "split_half_overlap",
    "subspace_overlap",
    "tangent_share",
    "uniform_controls",
]

_ORTHO_TOL = 1e-6


def _as_tensor(x: Any) -> Tensor:
    """``x`` as a tensor; a tensor stays on its own device (``torch.as_tensor`` would move it
    to a default device set with ``torch.set_default_device``)."""
    return x if isinstance(x, Tensor) else torch.as_tensor(x)


def _check_orthonormal(q: Tensor, name: str = "q") -> Tensor:
    if q.ndim != 2:
        raise UsageError(f"{name} must be a (d, k) matrix; got shape {tuple(q.shape)}.")
    d, k = q.shape
    if not 1 <= k < d:
        raise UsageError(
            f"{name} has rank k={k} for d={d}; a tangent basis needs 1 <= k < d "
            "(pass fewer columns)."
        )
    if not bool(torch.isfinite(q).all()):
        raise UsageError(f"{name} contains NaN or Inf.")
    q64 = q.to(torch.float64)
    err = (q64.T @ q64 - torch.eye(k, dtype=torch.float64, device=q.device)).abs().max().item()
    if err > _ORTHO_TOL:
        raise UsageError(
            f"{name} is not orthonormal (max |QᵀQ − I| = {err:.2e}); "
            "orthonormalise it first, e.g. torch.linalg.qr(q).Q."
        )
    return q64


def _cloned(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.clone()


class TangentBasis:
    """An orthonormal basis Q_T of shape ``(d, k)`` with provenance.

    ``TangentBasis(q)`` wraps a given orthonormal matrix (checked);
    ``TangentBasis.fit(moments, rank=k)`` or ``fit(moments, variance=0.9)`` runs
    centred PCA on the statistics. ``split(x)`` returns ``(tangent, normal)``.
    ``eigengap_`` = λ_k/λ_{k+1} of the fitted spectrum (None when not fitted here): near 1,
    the k-th direction is barely identified and Q_T is unstable across samples.
    """

    def __init__(
        self,
        q: Tensor,
        *,
        explained_variance: Tensor | None = None,
        mean: Tensor | None = None,
        total_variance: float | None = None,
        eigengap: float | None = None,
        provenance: dict[str, Any] | None = None,
    ) -> None:
        self.basis_ = _check_orthonormal(_as_tensor(q), "q").contiguous()
        self.explained_variance_ = (
            None if explained_variance is None else _as_tensor(explained_variance).double()
        )
        self.mean_ = None if mean is None else _as_tensor(mean).double()
        self.total_variance_ = total_variance
        self.eigengap_ = eigengap
        self.provenance = dict(provenance or {})

    # ------------------------------------------------------------------ fit
    @classmethod
    def fit(
        cls,
        moments: Moments,
        rank: int | None = None,
        *,
        variance: float | None = None,
        provenance: dict[str, Any] | None = None,
    ) -> TangentBasis:
        """Centred PCA of ``moments``: the top ``rank`` eigenvectors of the covariance,
        or the fewest that explain a ``variance`` fraction of it (which needs the whole
        spectrum; ``rank=`` computes only the top rank + 1 eigenpairs on the CPU)."""
        if not isinstance(moments, Moments):
            raise TypeError(f"moments must be a Moments; got {type(moments).__name__}.")
        if (rank is None) == (variance is None):
            raise UsageError(
                "pass exactly one of rank= (an int) or variance= (a fraction in (0, 1])."
            )
        if moments.count < 2:
            raise UsageError(
                f"fitting a basis needs at least 2 vectors; the moments hold {moments.count}."
            )
        cov = moments.covariance()
        d = cov.shape[0]
        if rank is None:
            if not 0 < variance <= 1:
                raise UsageError(f"variance must be in (0, 1]; got {variance}.")
            evals, evecs = torch.linalg.eigh(cov)
            evals, evecs = evals.flip(0).clamp_min(0), evecs.flip(1)
            total = _some_variance(float(evals.sum()))
            cum = torch.cumsum(evals, 0) / total
            rank = int(torch.searchsorted(cum, cum.new_tensor(variance)).item()) + 1
            rank = check_rank(min(rank, d - 1), d)
        else:
            rank = check_rank(rank, d)
            if rank > moments.count - 1:  # n centred vectors span at most n - 1 directions
                raise UsageError(
                    f"rank {rank} needs at least {rank + 1} vectors; these moments hold "
                    f"{moments.count}, which span at most {moments.count - 1} directions (the "
                    "rest of Q_T would be arbitrary): fit on more tokens, or a lower rank."
                )
            # Σλ is the trace, up to the rounding-level negative eigenvalues a full
            # decomposition would clamp; read before `top_eigh` overwrites ``cov``
            total = _some_variance(float(torch.trace(cov)))
            evals, evecs = top_eigh(cov, rank + 1)
            evals = evals.clamp_min(0)
        q = evecs[:, :rank]
        # Deterministic signs: the largest-magnitude entry of each column is positive.
        pivots = q[q.abs().argmax(0), torch.arange(rank, device=q.device)]
        q = q * torch.where(pivots < 0, -1.0, 1.0).to(q.dtype)
        prov = {"rank": rank, "count": moments.count, "d": d, **(provenance or {})}
        return cls(
            q,
            explained_variance=evals[:rank],
            mean=moments.mean,
            total_variance=total,
            eigengap=_eigengap(float(evals[rank - 1]), float(evals[rank])),
            provenance=prov,
        )

    def relabelled(self, **provenance: Any) -> TangentBasis:
        """A copy with ``provenance`` updated: a basis fitted on one tensor, recorded for
        another name of that tensor (copies: a file holds each basis on its own)."""
        return TangentBasis(
            self.basis_.clone(),
            explained_variance=_cloned(self.explained_variance_),
            mean=_cloned(self.mean_),
            total_variance=self.total_variance_,
            eigengap=self.eigengap_,
            provenance={**self.provenance, **provenance},
        )

    # ------------------------------------------------------------- geometry
    @property
    def d(self) -> int:
        return int(self.basis_.shape[0])

    @property
    def k(self) -> int:
        return int(self.basis_.shape[1])

    @property
    def explained_variance_ratio_(self) -> Tensor | None:
        if self.explained_variance_ is None or not self.total_variance_:
            return None
        return self.explained_variance_ / self.total_variance_

    def _check_x(self, x: Tensor, name: str = "x") -> Tensor:
        x = _as_tensor(x)
        if x.ndim < 1 or x.shape[-1] != self.d:
            raise UsageError(
                f"{name} must have shape (..., {self.d}) to match this basis; "
                f"got {tuple(x.shape)}. "
                "Was the basis fitted at another site or on another model?"
            )
        return x

    def coordinates(self, x: Tensor) -> Tensor:
        """x Q_T: coordinates in the tangent basis, shape ``(..., k)``, float64."""
        x = self._check_x(x)
        return x.to(torch.float64) @ self.basis_.to(x.device)

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(tangent, normal)`` with ``tangent + normal == x`` exactly.

        Both are returned in float64 (or x's dtype if wider). The tangent part is
        x Q Qᵀ rounded to x's own precision, so the float64 difference is exact and the
        sum reproduces x bit for bit: always for float16/bfloat16 inputs, and for float32
        unless a coordinate's tangent part exceeds the input's by more than 2²⁹. Float64
        inputs are reproduced to the last ulp.
        """
        x = self._check_x(x)
        out_dtype = torch.promote_types(x.dtype, torch.float64)
        q = self.basis_.to(x.device, out_dtype)
        xw = x.to(out_dtype)
        tangent = (xw @ q) @ q.T
        if x.dtype != out_dtype:
            tangent = tangent.to(x.dtype).to(out_dtype)
        normal = xw - tangent
        return tangent, normal

    def projector(self) -> Tensor:
        """Q_T Q_Tᵀ, float64 (d, d)."""
        return self.basis_ @ self.basis_.T

    # ----------------------------------------------------------- save / load
    def to_dict(self) -> dict[str, Any]:
        return {
            "d": self.d,
            "k": self.k,
            "total_variance": self.total_variance_,
            "eigengap": self.eigengap_,
            "provenance": self.provenance,
        }

    def tensors(self) -> dict[str, Tensor]:
        out = {"basis": self.basis_.cpu().contiguous()}
        if self.explained_variance_ is not None:
            out["explained_variance"] = self.explained_variance_.cpu().contiguous()
        if self.mean_ is not None:
            out["mean"] = self.mean_.cpu().contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], meta: dict[str, Any]) -> TangentBasis:
        """Rebuild a saved basis; a file without ``eigengap`` loads with ``eigengap_ = None``."""
        if "basis" not in tensors:
            raise CorruptFileError(
                "no 'basis' tensor in the file; it was not written by TangentBasis.save."
            )
        try:
            return cls(
                tensors["basis"],
                explained_variance=tensors.get("explained_variance"),
                mean=tensors.get("mean"),
                total_variance=meta.get("total_variance"),
                eigengap=meta.get("eigengap"),
                provenance=meta.get("provenance", {}),
            )
        except UsageError as err:
            raise CorruptFileError(f"the saved basis is invalid: {err}") from err

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (safetensors, with the JSON metadata in its header) atomically."""
        return save_tensors(path, self.tensors(), {"tangentlens": json.dumps(self.to_dict())})

    @classmethod
    def load(cls, path: str | Path) -> TangentBasis:
        tensors, meta = load_tensors(path, verified=True)
        try:
            info = json.loads(meta["tangentlens"])
        except (KeyError, json.JSONDecodeError) as err:
            raise CorruptFileError(
                f"{path} has no readable tangentlens metadata; it is not a saved TangentBasis."
            ) from err
        return cls.from_tensors(tensors, info)

    def diagnostics(self) -> dict[str, float]:
        """How much to trust this basis: ``eigengap`` (λ_k/λ_{k+1}), ``chance_overlap``
        (k/d) and, when the fit recorded it in ``provenance``, ``split_half_overlap``."""
        out = {
            "eigengap": math.nan if self.eigengap_ is None else float(self.eigengap_),
            "chance_overlap": chance_overlap(self.k, self.d),
        }
        if "split_half_overlap" in self.provenance:
            out["split_half_overlap"] = float(self.provenance["split_half_overlap"])
        return out

    def __repr__(self) -> str:
        return f"TangentBasis(d={self.d}, k={self.k})"


# --------------------------------------------------------------- complements
def complement(basis: TangentBasis | Tensor) -> Tensor:
    """An orthonormal basis ``(d, d − k)`` of the orthogonal complement of Q_T."""
    q = basis.basis_ if isinstance(basis, TangentBasis) else _check_orthonormal(basis)
    k = q.shape[1]
    full, _ = torch.linalg.qr(q, mode="complete")
    return full[:, k:]


def _basis_q(basis: TangentBasis | Tensor) -> Tensor:
    return basis.basis_ if isinstance(basis, TangentBasis) else _check_orthonormal(basis, "basis")


def normal_controls(
    basis: TangentBasis | Tensor, n: int, seed: int = 0, rank: int | None = None
) -> Tensor:
    """``(n, d, k)`` uniformly random orthonormal k-frames in the complement of Q_T.

    Frames are drawn (`controls.draw_frames`, float64) in the coordinates of a fixed
    complement basis, so they are orthogonal to Q_T by construction; reproducible from
    ``seed``.
    """
    q = _basis_q(basis)
    d, k = q.shape
    k = k if rank is None else rank
    check_int(n, "n (number of controls)", minimum=1)
    if not 1 <= k <= d - q.shape[1]:
        raise UsageError(
            f"a control of rank {k} does not fit in the {d - q.shape[1]}-dim complement; "
            "use a smaller basis rank."
        )
    frames = draw_frames(d - q.shape[1], k, n, int(seed), exact=True)
    # complement(q) @ frames without forming the complement: Q_T's Householder Q applied
    # to the frames below k zero rows (the same numbers, at O(d·k·n·k) instead of O(d³))
    a, tau = torch.geqrf(q)
    padded = torch.cat([frames.new_zeros(n, q.shape[1], k), frames], 1)
    flat = torch.ormqr(a, tau, padded.permute(1, 0, 2).reshape(d, n * k))
    return flat.reshape(d, n, k).permute(1, 0, 2).contiguous()


def uniform_controls(d: int, k: int, n: int, seed: int = 0) -> Tensor:
    """``(n, d, k)`` orthonormal k-frames drawn uniformly (Haar, `controls.draw_frames`,
    float64) from the whole space."""
    check_int(n, "n (number of controls)", minimum=1)
    if not 1 <= check_int(k, "k") <= d:
        raise UsageError(f"rank k must be in [1, d={d}]; got {k}.")
    return draw_frames(d, k, n, int(seed), exact=True)


# ------------------------------------------------------------- energy shares
def tangent_share(matrix: Tensor | Moments, basis: TangentBasis | Tensor) -> float:
    """tr(QᵀMQ)/tr(M): the share of a symmetric PSD matrix's energy that lies in span(Q).

    A `Moments` stands for its uncentred second moment E[x xᵀ] = C + μμᵀ, so the share is
    E‖xᵀQ‖²/E‖x‖², the energy a gradient or a residual write carries, mean included; it
    is read as (tr(QᵀCQ) + ‖Qᵀμ‖²)/(tr C + ‖μ‖²), which never forms the d × d sum.
    Every share in tangentlens goes through here, so tables agree to the last digit.
    """
    q = _basis_q(basis)
    d = q.shape[0]
    moments = isinstance(matrix, Moments)
    m = matrix.covariance() if moments else _as_tensor(matrix)
    if tuple(m.shape) != (d, d):
        raise UsageError(
            f"matrix must be ({d}, {d}) to match the basis; got {tuple(m.shape)}. "
            "Was the basis fitted at another site?"
        )
    m = m.to(torch.float64)
    q = q.to(m.device)
    tangent, total = ((m @ q) * q).sum(), torch.trace(m)
    if moments:
        mean = matrix.mean.to(m)
        tangent, total = tangent + (mean @ q).pow(2).sum(), total + mean @ mean
    total = float(total)
    if not total > 0:
        raise UsageError(f"tr(M) = {total}: there is no energy to share (all-zero vectors?).")
    return float(tangent) / total


def shares(tangent_energy: float, total_energy: float, k: int, d: int) -> dict[str, float]:
    """Share statistics from summed energies Σ‖xᵀQ‖² and Σ‖x‖² (the streaming form).

    ``tangent_share`` (NaN when nothing was summed), ``chance_share`` = k/d, the expected
    share of an isotropic vector, and ``share_ratio`` = share/chance.
    """
    d = check_int(d, "d", minimum=2)
    k = check_rank(k, d, name="k")
    chance = k / d
    share = tangent_energy / total_energy if total_energy > 0 else math.nan
    return {"tangent_share": share, "chance_share": chance, "share_ratio": share / chance}


# ---------------------------------------------------------- basis stability
def _some_variance(total: float) -> float:
    """The covariance's total variance Σλ, refused when there is none to fit a basis to."""
    if total <= 0:
        raise UsageError("the activations have zero variance; no subspace to fit.")
    return total


def _eigengap(lam_k: float, lam_next: float) -> float:
    """λ_k/λ_{k+1}: inf when only k directions vary, NaN when not even k do."""
    if lam_next > 0:
        return lam_k / lam_next
    return math.inf if lam_k > 0 else math.nan


def subspace_overlap(a: TangentBasis | Tensor, b: TangentBasis | Tensor) -> float:
    """‖Q_AᵀQ_B‖²_F / k, the mean squared cosine of the principal angles: 1 for the same
    subspace, 0 for orthogonal ones, k/d in expectation for independent random ones."""
    qa, qb = _basis_q(a), _basis_q(b)
    if qa.shape != qb.shape:
        raise UsageError(
            f"overlap needs bases of the same (d, k); got {tuple(qa.shape)} and {tuple(qb.shape)}."
        )
    return float((qa.T @ qb.to(qa.device)).pow(2).sum()) / qa.shape[1]


def split_half_overlap(moments_a: Moments, moments_b: Moments, rank: int) -> float:
    """`subspace_overlap` of rank-``rank`` bases fitted on two disjoint halves of the
    sequences: near 1 when Q_T is a property of the model, near `chance_overlap` when it
    is sampling noise."""
    return subspace_overlap(
        TangentBasis.fit(moments_a, rank=rank), TangentBasis.fit(moments_b, rank=rank)
    )


def near_chance(overlap: float, k: int, d: int) -> bool:
    """Whether a split-half ``overlap`` lies within a quarter of the way from chance (k/d)
    to 1: Q_T is then mostly sampling noise (`UnstableBasisWarning`)."""
    chance = chance_overlap(k, d)
    return overlap < chance + 0.25 * (1 - chance)


def chance_overlap(k: int, d: int) -> float:
    """k/d: the expected `subspace_overlap` of two independent uniformly random k-frames."""
    d = check_int(d, "d", minimum=2)
    return check_rank(k, d, name="k") / d
