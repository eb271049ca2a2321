"""Random matched-rank frames and their traces in one site's coordinates: the Monte-Carlo
controls of `tangentlens.significance`, kept apart from the tests that read them.

A control is a Haar-random k-frame F. Every quantity the tests need is ``tr(FᵀMF)``,
``tr(FᵀM²F)`` or ``‖FᵀMF‖²_F`` for a symmetric d × d M. `SiteFrames` takes one
eigendecomposition of M on the complement of Q_T, which puts M in coordinates
W = [Q_T, V] where it is an arrow (a k × k block, a k × (d − k) border, a diagonal). A
Haar frame drawn directly in W is Haar (uniform controls), and its complement rows,
orthonormalised, are Haar in the complement (the paper's normal controls), so both kinds
come from one draw at O(d·k²) each. The frames are drawn once per (d, k, n, seed) and
cached (`control_frames`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from torch import Tensor

__all__ = [
    "NULL_DTYPE",
    "FrameCache",
    "SiteFrames",
    "canonical_vectors",
    "control_frames",
    "draw_frames",
]

CHUNK = 512  # frames per batch of algebra
CACHE_BYTES = 512 * 2**20
NULL_DTYPE = torch.float32
"""The controls' traces: relative error ~1e-6, far inside their Monte-Carlo error, at half
the cost of float64 (the eigendecomposition and the tangent statistics stay float64)."""


def draw_frames(dim: int, k: int, n: int, seed: int) -> Tensor:
    """``(n, dim, k)`` orthonormal frames with uniformly random span, orthonormalised in
    float64 and kept in float32 (`NULL_DTYPE`).

    Every statistic here depends on a frame's span only, so Cholesky-QR
    (Z·L⁻ᵀ with LLᵀ = ZᵀZ) replaces Householder QR: the same span, at GEMM speed.
    """
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(n, dim, k, dtype=NULL_DTYPE)
    for start in range(0, n, CHUNK):
        # float32 draws (4x faster than float64 here)
        z = torch.randn(min(CHUNK, n - start), dim, k, generator=gen).double()
        chol, info = torch.linalg.cholesky_ex(z.mT @ z)
        if bool(info.any()):  # numerically rank-deficient draw: fall back to Householder
            q = torch.linalg.qr(z).Q
        else:
            q = torch.linalg.solve_triangular(chol.mT, z, upper=True, left=False)
        out[start : start + q.shape[0]] = q
    return out


class FrameCache:
    """Control frames by (dim, k, n, seed), least recently used out first, within a byte
    budget: one draw serves every site and both tests of a study. With each set it keeps
    the squared row norms ‖F_i‖², so Σλᵢ‖F_i‖² over all frames is a mat-vec."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._frames: OrderedDict[tuple[int, int, int, int], tuple[Tensor, Tensor]] = OrderedDict()

    def __call__(self, dim: int, k: int, n: int, seed: int) -> tuple[Tensor, Tensor]:
        with self._lock:  # sites are tested side by side (`compute.site_map`)
            return self._get((dim, k, n, seed))

    def _get(self, key: tuple[int, int, int, int]) -> tuple[Tensor, Tensor]:
        if key in self._frames:
            self._frames.move_to_end(key)
            return self._frames[key]
        frames = draw_frames(*key)
        entry = self._frames[key] = (frames, frames.pow(2).sum(-1))
        # the oldest go first; the newest stays even when it alone is over budget
        while len(self._frames) > 1 and self._bytes() > self.max_bytes:
            self._frames.popitem(last=False)
        return entry

    def _bytes(self) -> int:
        return sum(f.nbytes + q.nbytes for f, q in self._frames.values())


control_frames = FrameCache(CACHE_BYTES)


class SiteFrames:
    """Matched-rank controls of one site, in coordinates W = [Q_T, V] of a symmetric M:
    V the eigenvectors of M on the complement of Q_T, eigenvalues Λ.

    In W, M is an arrow: T = Q_TᵀMQ_T (k × k), X = Q_TᵀMV (k × (d − k)) and Λ. A uniform
    control is a Haar frame F = [A; B] of R^d (A its first k rows), exact in any fixed
    coordinates; a normal control is G = B·L⁻ᵀ with LLᵀ = BᵀB, whose span is Haar in the
    complement. Every trace then costs k × k algebra after four products of B with
    (d − k) × k matrices (`_null_traces`), and one eigendecomposition serves the energy
    test (αM + mmᵀ: the second moment is the covariance plus the mean's outer product)
    and the isotropy test (βM) with both kinds of controls.

    V comes from one eigendecomposition of PMP + σQ_TQ_Tᵀ (P = I − Q_TQ_Tᵀ, σ = 2‖M‖_F
    above every eigenvalue of PMP): its bottom d − k eigenvectors are V, so no basis of
    the complement is formed. ``rank_one`` (the mean, whose outer product turns the
    covariance M into the second moment) is kept in W for the energy test."""

    def __init__(self, m: Tensor, q_t: Tensor, rank_one: Tensor | None = None) -> None:
        d, k = q_t.shape
        m = (m + m.T) / 2
        mq = m @ q_t
        self.k = k
        self.t = q_t.T @ mq
        pmp = m - q_t @ mq.T - mq @ q_t.T + q_t @ self.t @ q_t.T
        sigma = 2 * float(torch.linalg.matrix_norm(m)) or 1.0
        lam, v = torch.linalg.eigh(pmp + sigma * (q_t @ q_t.T))
        lam = lam[: d - k]
        self.v = canonical_vectors(v[:, : d - k], lam, rank_one, sigma)
        self.q_t = q_t
        # float32 copies scaled to ‖M‖_F = 1, eigenvalues under 1e-12 of it set to 0:
        # gradients' tiny second moments squared would otherwise be float32 denormals,
        # slow to multiply (measured: 62 ms against 30 ms a chunk of 512 controls)
        self.scale = sigma / 2
        lam = torch.where(lam.abs() < 1e-12 * self.scale, 0.0, lam) / self.scale
        x = mq.T @ self.v / self.scale
        low = {"lam": lam, "x": x, "t": self.t / self.scale, "xxt": x @ x.T}
        if rank_one is not None:
            root = self.scale**0.5
            low |= {"m_t": q_t.T @ rank_one / root, "m_c": self.v.T @ rank_one / root}
        self.exact = low  # float64, for chunks whose normal controls are ill-conditioned
        self.low = {key: value.to(NULL_DTYPE) for key, value in low.items()}

    def null(self, n: int, seed: int, *, normal: bool, squares: bool) -> dict[str, Tensor]:
        """Per control, over the cached frames of (d, k, n, seed): ``tr`` = tr(FᵀMF) and,
        with ``squares``, ``tr2`` = tr(FᵀM²F) and ``frob`` = ‖FᵀMF‖²_F; with a
        ``rank_one`` r, ``m`` = ‖Fᵀr‖²; the same with suffix ``_normal`` for normal
        controls. float64, computed in `NULL_DTYPE`."""
        frames, sq = control_frames(self.v.shape[0], self.k, n, int(seed))
        parts = [
            _null_traces(self, frames[i : i + CHUNK], sq[i : i + CHUNK], normal, squares)
            for i in range(0, n, CHUNK)
        ]
        power = {"tr": 1, "m": 1, "tr2": 2, "frob": 2}  # homogeneity in M (and r r^T)
        return {
            key: torch.cat([p[key] for p in parts]).double()
            * self.scale ** power[key.split("_")[0]]
            for key in parts[0]
        }


def canonical_vectors(v: Tensor, lam: Tensor, rank_one: Tensor | None, scale: float) -> Tensor:
    """Eigenvectors that do not depend on LAPACK's choices, so that the controls'
    realisation (hence each p-value) does not change with the BLAS or thread count: each
    column's largest-magnitude entry is positive, and in the null space of M (eigenvalues
    ≤ d·ε·scale: fewer samples than d) the first vector is ``rank_one``'s direction there,
    the only direction of that space any trace sees."""
    pivots = v[v.abs().argmax(0), torch.arange(v.shape[1])]
    v = v * torch.where(pivots < 0, -1.0, 1.0).to(v)
    null = (lam.abs() <= v.shape[0] * torch.finfo(v.dtype).eps * scale).nonzero().flatten()
    if rank_one is None or null.numel() < 2:
        return v
    block = v[:, null]
    z = block.T @ rank_one.to(v)
    if float(z.norm()) == 0:
        return v
    u = z / z.norm()
    u[0] -= 1  # Householder reflection that swaps z/|z| and e_1
    if float(u.norm()) > 0:
        block = block - 2 * torch.outer(block @ u, u) / (u @ u)
    v = v.clone()
    v[:, null] = block
    return v


def _null_traces(
    site: SiteFrames, f: Tensor, sq: Tensor, normal: bool, squares: bool, exact: bool = False
) -> dict[str, Tensor]:
    """One chunk of `SiteFrames.null` (see there for the names), in `NULL_DTYPE`, or in
    float64 (``exact``) where a frame's complement block is ill-conditioned."""
    low = site.exact if exact else site.low
    lam, x, t = low["lam"], low["x"], low["t"]
    k = site.k
    f, sq = f.to(lam), sq.to(lam)
    a, b, sq_b = f[:, :k], f[:, k:], sq[:, k:]

    def tr(z: Tensor) -> Tensor:
        return z.diagonal(dim1=-2, dim2=-1).sum(-1)

    def dot(y: Tensor, z: Tensor) -> Tensor:
        return (y * z).sum((-2, -1))

    ata = a.mT @ t @ a
    p = x @ b  # X B
    out = {"tr": tr(ata) + 2 * dot(a, p) + sq_b @ lam}
    if "m_t" in low:
        m_t, m_c = low["m_t"], low["m_c"]
        bm = b.mT @ m_c  # (n, k)
        out["m"] = (a.mT @ m_t + bm).pow(2).sum(-1)
    if squares or normal:
        lb = lam[:, None] * b
        kb = b.mT @ lb  # BᵀΛB
    if squares:
        r = (x * lam) @ b  # XΛB
        out["tr2"] = (t @ a + p).pow(2).sum((-2, -1)) + dot(a, low["xxt"] @ a) + 2 * dot(a, r)
        out["tr2"] = out["tr2"] + sq_b @ lam**2
        out["frob"] = (ata + a.mT @ p + p.mT @ a + kb).pow(2).sum((-2, -1))
    if normal:
        inv, weak = _complement_gram_inverse_root(a, b)
        if weak and not exact:  # L⁻¹ ill-conditioned: float32 would lose the normal traces
            return _null_traces(site, f, sq, normal, squares, exact=True)
        gkg = inv @ kb @ inv.mT  # GᵀΛG
        out["tr_normal"] = tr(gkg)
        if "m_t" in low:
            out["m_normal"] = (inv @ bm[..., None]).pow(2).sum((-2, -1))
        if squares:
            out["tr2_normal"] = tr(inv @ (lb.mT @ lb) @ inv.mT) + (p @ inv.mT).pow(2).sum((-2, -1))
            out["frob_normal"] = gkg.pow(2).sum((-2, -1))
    return out


def _complement_gram_inverse_root(a: Tensor, b: Tensor) -> tuple[Tensor, bool]:
    """L⁻¹ with LLᵀ = BᵀB, per frame, so that G = B·L⁻ᵀ is orthonormal, and whether any
    frame was ill-conditioned. F = [A; B] is orthonormal up to its float32 rounding, so
    BᵀB = I − AᵀA (float64, k × k) where a pivot is at least 0.1; a weaker frame (2k near
    d puts eigenvalues of AᵀA near 1, where the rounding would show) takes L = Rᵀ from a
    float64 QR of its own B. Every trace depends on the span of G only."""
    k = a.shape[-1]
    eye = torch.eye(k, dtype=torch.float64, device=a.device)
    a64 = a.double()
    chol, info = torch.linalg.cholesky_ex(eye - a64.mT @ a64)
    weak = ((info != 0) | (chol.diagonal(dim1=-2, dim2=-1).amin(-1) < 0.1)).nonzero().flatten()
    if weak.numel():
        chol[weak] = torch.linalg.qr(b[weak].double()).R.mT
    inv = torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False)
    return inv.to(a.dtype), bool(weak.numel())
