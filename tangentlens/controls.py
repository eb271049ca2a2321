"""Random matched-rank frames and their traces in one site's coordinates: the Monte-Carlo
controls of `tangentlens.significance`, kept apart from the tests that read them.

A control is a Haar-random k-frame F. Every quantity the tests need is ``tr(FᵀMF)``,
``tr(FᵀM²F)`` or ``‖FᵀMF‖²_F`` for a symmetric d × d M. `SiteFrames` takes one
eigendecomposition of M on the complement of Q_T, which puts M in coordinates
W = [Q_T, V] where it is an arrow (a k × k block, a k × (d − k) border, a diagonal). A
Haar frame drawn directly in W is Haar (uniform controls), and its complement rows,
orthonormalised, are Haar in the complement (the paper's normal controls), so both kinds
come from one draw at O(d·k²) each. The frames are drawn once per (d, k, n, seed) and
cached with what every site reads of them (`ControlSet`, `control_frames`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from torch import Tensor

__all__ = [
    "NULL_DTYPE",
    "ControlSet",
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


class ControlSet:
    """One draw of ``n`` uniform k-frames F = [A; B] of R^dim (`draw_frames`), with what
    every site reads of them: the squared row norms ‖F_i‖² (Σλᵢ‖F_i‖² over all frames is
    a mat-vec) and, for normal controls, L⁻¹ with LLᵀ = BᵀB and the squared row norms of
    G = B·L⁻ᵀ. L comes from a float64 QR of B (G = the QR's Q), once per draw: exact
    however ill-conditioned B is (2k near d), and no site pays for it again."""

    def __init__(self, frames: Tensor) -> None:
        self.frames = frames
        self.squares = frames.pow(2).sum(-1)
        self._normal: tuple[Tensor, Tensor] | None = None
        self._lock = threading.Lock()

    def normal(self) -> tuple[Tensor, Tensor]:
        """``(L⁻¹ (n, k, k), ‖G_i‖² (n, dim − k))`` in `NULL_DTYPE`, computed on first use."""
        with self._lock:
            if self._normal is None:
                k = self.frames.shape[-1]
                g, r = torch.linalg.qr(self.frames[:, k:].double())  # G R = B: L = Rᵀ
                eye = torch.eye(k, dtype=torch.float64).expand_as(r)
                inv = torch.linalg.solve_triangular(r.mT, eye, upper=False)
                self._normal = (inv.to(NULL_DTYPE), g.pow(2).sum(-1).to(NULL_DTYPE))
            return self._normal

    @property
    def nbytes(self) -> int:
        extra = sum(t.nbytes for t in self._normal) if self._normal is not None else 0
        return self.frames.nbytes + self.squares.nbytes + extra


class FrameCache:
    """`ControlSet` by (dim, k, n, seed), least recently used out first, within a byte
    budget: one draw serves every site and both tests of a study."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._sets: OrderedDict[tuple[int, int, int, int], ControlSet] = OrderedDict()

    def __call__(self, dim: int, k: int, n: int, seed: int) -> ControlSet:
        with self._lock:  # sites are tested side by side (`compute.site_map`)
            return self._get((dim, k, n, seed))

    def _get(self, key: tuple[int, int, int, int]) -> ControlSet:
        if key in self._sets:
            self._sets.move_to_end(key)
            return self._sets[key]
        entry = self._sets[key] = ControlSet(draw_frames(*key))
        # the oldest go first; the newest stays even when it alone is over budget
        while len(self._sets) > 1 and sum(c.nbytes for c in self._sets.values()) > self.max_bytes:
            self._sets.popitem(last=False)
        return entry


control_frames = FrameCache(CACHE_BYTES)


class SiteFrames:
    """Matched-rank controls of one site, in coordinates W = [Q_T, V] of a symmetric M:
    V the eigenvectors of M on the complement of Q_T, eigenvalues Λ.

    In W, M is an arrow: T = Q_TᵀMQ_T (k × k), X = Q_TᵀMV (k × (d − k)) and Λ. A uniform
    control is a Haar frame F = [A; B] of R^d (A its first k rows), exact in any fixed
    coordinates; a normal control is G = B·L⁻ᵀ with LLᵀ = BᵀB, whose span is Haar in the
    complement. Every trace then costs k × k algebra after two products of B with
    (d − k) × k matrices (`_null_traces`; what the normal controls need of L is
    computed once per draw, `ControlSet`), and one eigendecomposition serves the energy
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
        self.low = {key: value.to(NULL_DTYPE) for key, value in low.items()}

    def null(self, n: int, seed: int, *, normal: bool, squares: bool) -> dict[str, Tensor]:
        """Per control, over the cached frames of (d, k, n, seed): ``tr`` = tr(FᵀMF) and,
        with ``squares``, ``tr2`` = tr(FᵀM²F) and ``frob`` = ‖FᵀMF‖²_F; with a
        ``rank_one`` r, ``m`` = ‖Fᵀr‖²; the same with suffix ``_normal`` for normal
        controls. float64, computed in `NULL_DTYPE`."""
        draw = control_frames(self.v.shape[0], self.k, n, int(seed))
        inv, sq_g = draw.normal() if normal else (None, None)
        parts = [
            _null_traces(
                self,
                draw.frames[i : i + CHUNK],
                draw.squares[i : i + CHUNK],
                None if inv is None else (inv[i : i + CHUNK], sq_g[i : i + CHUNK]),
                squares,
            )
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
    site: SiteFrames,
    f: Tensor,
    sq: Tensor,
    normal: tuple[Tensor, Tensor] | None,
    squares: bool,
) -> dict[str, Tensor]:
    """One chunk of `SiteFrames.null` (see there for the names), in `NULL_DTYPE`:
    frames ``f`` with squared row norms ``sq`` and, for normal controls, their
    ``(L⁻¹, ‖G_i‖²)`` (`ControlSet.normal`)."""
    low = site.low
    lam, x, t = low["lam"], low["x"], low["t"]
    k = site.k
    a, b, sq_b = f[:, :k], f[:, k:], sq[:, k:]

    def tr(z: Tensor) -> Tensor:
        return z.diagonal(dim1=-2, dim2=-1).sum(-1)

    def dot(y: Tensor, z: Tensor) -> Tensor:
        return (y * z).sum((-2, -1))

    ata = a.mT @ t @ a
    # X B and, for the squares, X Λ B: one product with the rows stacked
    stacked = (torch.cat([x, x * lam]) if squares else x) @ b
    p = stacked[:, :k]
    out = {"tr": tr(ata) + 2 * dot(a, p) + sq_b @ lam}
    if "m_t" in low:
        bm = b.mT @ low["m_c"]  # (n, k)
        out["m"] = (a.mT @ low["m_t"] + bm).pow(2).sum(-1)
    if squares:
        kb = b.mT @ (lam[:, None] * b)  # BᵀΛB
        r = stacked[:, k:]  # XΛB
        out["tr2"] = (t @ a + p).pow(2).sum((-2, -1)) + dot(a, low["xxt"] @ a) + 2 * dot(a, r)
        out["tr2"] = out["tr2"] + sq_b @ lam**2
        out["frob"] = (ata + a.mT @ p + p.mT @ a + kb).pow(2).sum((-2, -1))
    if normal is not None:
        inv, sq_g = normal  # G = B L⁻ᵀ
        out["tr_normal"] = sq_g @ lam
        if "m_t" in low:
            out["m_normal"] = (inv @ bm[..., None]).pow(2).sum((-2, -1))
        if squares:
            gkg = inv @ kb @ inv.mT  # GᵀΛG
            out["tr2_normal"] = sq_g @ lam**2 + (p @ inv.mT).pow(2).sum((-2, -1))
            out["frob_normal"] = gkg.pow(2).sum((-2, -1))
    return out
