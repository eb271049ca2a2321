"""Random matched-rank frames and their traces in one site's coordinates: the Monte-Carlo
controls of `tangentlens.core.significance`, kept apart from the tests that read them.

A control is a Haar-random k-frame F. Every quantity the tests need is ``tr(FᵀMF)``,
``tr(FᵀM²F)`` or ``‖FᵀMF‖²_F`` for a symmetric d × d M. `SiteFrames` takes one
tridiagonal reduction of M on the complement of Q_T, which puts M in coordinates
W = [Q_T, U] where it is an arrow (a k × k block, a k × (d − k) border, a tridiagonal
block). A Haar frame drawn directly in W is Haar (uniform controls), and its complement
rows, orthonormalised, are Haar in the complement (the paper's normal controls), so both
kinds come from one draw at O(d·k²) each. The frames are drawn once per (d, k, n, seed) and
cached with what every site reads of them (`ControlSet`, `control_frames`).
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .compute import tridiagonal_apply, tridiagonalize

__all__ = [
    "NULL_DTYPE",
    "ControlSet",
    "FrameCache",
    "Rows",
    "SiteFrames",
    "control_frames",
    "draw_frames",
]

CHUNK = 512  # frames per batch of algebra
GROUP_FLOATS = 2**18  # a group of frames' complement rows in `_banded_gram`: 1 MiB
CACHE_BYTES = 512 * 2**20
NULL_DTYPE = torch.float32
"""The controls' traces: rounding error far inside their Monte-Carlo error, at less cost
than float64 (the reduction and the tangent statistics stay float64)."""


_TIE = 16 * torch.finfo(NULL_DTYPE).eps  # relative: a tie at the controls' precision


def exceedance_p_value(null: Tensor, observed: float, scale: float | None = None) -> float:
    """(1 + #{null ≥ observed}) / (n + 1), compared at the controls' precision: their
    traces are sums in `NULL_DTYPE`, good to a few of its rounding steps, so a control
    within `_TIE` of the observed value, relative to ``scale`` (default: its size), counts
    as extreme (an exact tie: an isotropic matrix gives every frame the same share, and
    ΔIso* = 0, an IsoScore* difference whose scale is 1)."""
    at = observed - _TIE * (abs(observed) if scale is None else scale)
    return (1 + int((null >= at).sum())) / (null.numel() + 1)


def normal_controls_vary(k: int, d: int, *, stacklevel: int = 3) -> bool:
    """Whether normal controls of rank k can vary in the complement (2k < d). At 2k = d
    every one spans the complement itself, so a test would only ask whether the share is
    above 1/2; above it none fits. Then the ``_normal`` statistics are left out, and a
    warning says so: a table should not lose a column without a word."""
    if 2 * k < d:
        return True
    warnings.warn(
        f"rank k={k} at d={d} leaves no room for varied normal controls (2k >= d): "
        "p_value_normal, delta_iso_normal and isotropy_p_value_normal are left out; "
        "p_value and isotropy_p_value (uniform controls, exact at any rank) are reported.",
        stacklevel=stacklevel,
    )
    return False


def draw_frames(dim: int, k: int, n: int, seed: int, *, exact: bool = False) -> Tensor:
    """``(n, dim, k)`` Haar-random orthonormal k-frames of R^dim, from ``seed``: the one
    sampler of random matched-rank frames (the tests' controls here, and through
    `tangentlens.core.subspace.normal_controls` / `uniform_controls` the attention probe's head
    null and the interventions' null), so one seed means one set of frames everywhere.

    Each frame is Q = Z·R⁻¹ for a Gaussian Z = QR with R's diagonal positive (Haar).
    By default Cholesky-QR (Z·L⁻ᵀ with LLᵀ = ZᵀZ) forms it in float64 at GEMM speed and
    keeps it in float32 (`NULL_DTYPE`): every statistic of the tests depends on a frame's
    span only. ``exact=True`` forms the same Q with Householder QR and keeps it in
    float64, orthonormal to rounding however ill-conditioned Z is: frames a caller uses
    as a basis (`TangentBasis` checks orthonormality).
    """
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(n, dim, k, dtype=torch.float64 if exact else NULL_DTYPE, device="cpu")
    for start in range(0, n, CHUNK):
        # float32 draws (cheaper than float64; the frame itself is formed in float64)
        z = torch.randn(min(CHUNK, n - start), dim, k, generator=gen, device="cpu").double()
        if exact:
            q = _householder_q(z)
        else:
            chol, info = torch.linalg.cholesky_ex(z.mT @ z)
            if bool(info.any()):  # numerically rank-deficient draw: fall back to Householder
                q = torch.linalg.qr(z).Q
            else:
                q = torch.linalg.solve_triangular(chol.mT, z, upper=True, left=False)
        out[start : start + q.shape[0]] = q
    return out


def _householder_q(z: Tensor) -> Tensor:
    """Z's Q factor with R's diagonal made positive: the QR sign ambiguity fixed, so the
    frame is Haar and equals Cholesky-QR's."""
    q, r = torch.linalg.qr(z)
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    signs[signs == 0] = 1
    return q * signs.unsqueeze(-2)


@dataclass(frozen=True)
class Rows:
    """Per frame: ``main`` (the frames, or L⁻¹ for normal controls) and the frames' rows'
    squared norms ``sq`` and products with the next row (``lag1``) and the one after
    (``lag2``): tr(FᵀKF) and tr(FᵀK²F) for a tridiagonal K are then mat-vecs."""

    main: Tensor
    sq: Tensor
    lag1: Tensor
    lag2: Tensor

    @classmethod
    def of(cls, main: Tensor, rows: Tensor) -> Rows:
        """``main`` with the row products of ``rows`` ``(n, dim, k)``."""
        sq, lag1 = rows.pow(2).sum(-1), (rows[:, :-1] * rows[:, 1:]).sum(-1)
        return cls(main, sq, lag1, (rows[:, :-2] * rows[:, 2:]).sum(-1))

    @classmethod
    def cat(cls, parts: list[Rows]) -> Rows:
        """The frames of ``parts``, in order."""
        return cls(*(torch.cat(ts) for ts in zip(*(p.tensors for p in parts), strict=True)))

    @property
    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.main, self.sq, self.lag1, self.lag2

    def sliced(self, start: int, stop: int) -> Rows:
        return Rows(*(t[start:stop] for t in self.tensors))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


class ControlSet:
    """One draw of ``n`` uniform k-frames F = [A; B] of R^dim (`draw_frames`) with what
    every site reads of them (`Rows`) and, for normal controls, L⁻¹ with LLᵀ = BᵀB and
    the rows of G = B·L⁻ᵀ. L comes from a float64 QR of B (G is the QR's Q), once per
    draw: exact however ill-conditioned B is (2k near d), and no site pays for it."""

    def __init__(self, frames: Tensor, on_grow: Callable[[ControlSet], None] | None = None) -> None:
        """``on_grow(self)`` is called once the normal controls' rows are built (what a
        cache that holds this set needs to count them against its budget)."""
        self.frames = frames
        self._uniform = Rows.of(frames, frames)
        self._normal: Rows | None = None
        self._lock = threading.Lock()
        self._on_grow = on_grow

    def rows(self, start: int, stop: int) -> Rows:
        """The uniform frames ``start:stop`` with their row products."""
        return self._uniform.sliced(start, stop)

    def normal(self) -> Rows:
        """L⁻¹ ``(n, k, k)`` with G's row products, in `NULL_DTYPE`, made on first use."""
        with self._lock:  # chunked: float64 frames of d = 4096 would take 0.5 GB at once
            grew = self._normal is None
            if grew:
                chunks = range(0, len(self.frames), CHUNK)
                self._normal = Rows.cat([_normal_rows(self.frames[i : i + CHUNK]) for i in chunks])
            normal = self._normal
        if grew and self._on_grow is not None:
            self._on_grow(self)
        return normal

    @property
    def nbytes(self) -> int:
        return self._uniform.nbytes + (0 if self._normal is None else self._normal.nbytes)


def _normal_rows(frames: Tensor) -> Rows:
    """L⁻¹ and G's row products for ``frames`` F = [A; B]: G R = B (float64 QR), L = Rᵀ."""
    k = frames.shape[-1]
    g, r = torch.linalg.qr(frames[:, k:].double())
    eye = torch.eye(k, dtype=torch.float64, device=r.device).expand_as(r)
    inv = torch.linalg.solve_triangular(r.mT, eye, upper=False)
    return Rows.of(inv.to(NULL_DTYPE), g.to(NULL_DTYPE))


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
        entry = self._sets[key] = ControlSet(draw_frames(*key), on_grow=self._grew)
        self._trim()
        return entry

    def _grew(self, entry: ControlSet) -> None:
        """A set built its normal controls' rows: count them now, the set being in use."""
        with self._lock:
            key = next((k for k, c in self._sets.items() if c is entry), None)
            if key is not None:  # not evicted meanwhile
                self._sets.move_to_end(key)
                self._trim()

    def _trim(self) -> None:
        """The least recently used go first; the newest stays even when it alone is over
        budget."""
        while len(self._sets) > 1 and sum(c.nbytes for c in self._sets.values()) > self.max_bytes:
            self._sets.popitem(last=False)


control_frames = FrameCache(CACHE_BYTES)


class SiteFrames:
    """Matched-rank controls of one site, in coordinates W = [Q_T, U] of a symmetric M:
    U an orthonormal basis of the complement of Q_T in which M is tridiagonal.

    In W, M is an arrow: T = Q_TᵀMQ_T (k × k), X = Q_TᵀMU (k × (d − k)) and a tridiagonal
    K (diagonal α, off-diagonal β). A uniform control is a Haar frame F = [A; B] of R^d
    (A its first k rows), exact in any fixed coordinates; a normal control is G = B·L⁻ᵀ
    with LLᵀ = BᵀB, whose span is Haar in the complement. Every trace then costs k × k
    algebra after two products of B with (d − k) × k matrices and band sums over the
    frames' rows (`_null_traces`; what normal controls need of L, and the rows' products
    with their neighbours, are computed once per draw, `ControlSet`). One reduction serves
    the energy test (αM + rrᵀ: the second moment is the covariance plus the mean's outer
    product) and the isotropy test (βM) with both kinds of controls.

    U = C·H·Q_K is never formed: C the complement columns of the Householder QR of Q_T
    (applied to M in compact WY form, together with H: one rank-(2k + 2) update of M,
    O(d²k), `_complement_arrow`), H a reflection that makes ``rank_one``'s part in the
    complement the first coordinate, Q_K LAPACK's tridiagonal
    reduction (`compute.tridiagonalize`: half an eigendecomposition), which keeps that
    coordinate. So where M has a null space (fewer samples than d), ``rank_one`` lies in
    the first coordinate and what is left of the null space is invisible to every trace:
    noise confined there moves nothing. Rounding-level changes elsewhere in M can move
    the traces (the reduction's last coordinates inside M's range are ill-conditioned when
    M is rank-deficient): each control is then another Haar draw, so a p-value stays exact
    but its Monte-Carlo realisation may differ with the BLAS or the thread count. Computed
    in float64 on M's device (where it is not the CPU, K is diagonal, `_Eigen`), the
    traces in `NULL_DTYPE` on the CPU."""

    def __init__(self, m: Tensor, q_t: Tensor, rank_one: Tensor | None = None) -> None:
        self.device = m.device  # where `null` returns its traces
        m, q_t = m.detach().double(), q_t.detach().to(m.device, torch.float64)
        d, k = q_t.shape
        self.d, self.k, self.q_t = d, k, q_t
        if not torch.equal(m, m.mT):  # moments' covariances are symmetric bit for bit
            m = (m + m.mT) / 2
        t = q_t.T @ (m @ q_t)
        self.t = (t + t.T) / 2
        # H, the Q of Q_T's Householder QR, is [Q_T·diag(signs), C]
        self._qr = a, tau = torch.geqrf(q_t)
        signs = torch.where(a.diagonal() < 0, -1.0, 1.0).to(q_t.dtype)
        r = None if rank_one is None else rank_one.detach().to(m)
        block, x0, r_c, self._reflection = _complement_arrow(m, a, tau, r)
        x0 = signs[:, None] * x0
        self._reduction = _reduce(block)
        alpha, beta = self._reduction.alpha, self._reduction.beta
        # float32 copies scaled to ‖M‖_F = 1, entries under 1e-12 of it set to 0:
        # gradients' tiny second moments squared would otherwise be float32 denormals,
        # which are slow to multiply
        self.scale = float(torch.linalg.matrix_norm(m)) or 1.0
        alpha, beta = (
            torch.where(b.abs() < 1e-12 * self.scale, 0.0, b) / self.scale for b in (alpha, beta)
        )
        x = self._reduction.apply(x0) / self.scale
        xk = x * alpha
        xk[:, 1:] += x[:, :-1] * beta
        xk[:, :-1] += x[:, 1:] * beta
        low = {"alpha": alpha, "beta": beta, "x": x, "xk": xk, "t": self.t.cpu() / self.scale}
        low |= {"xxt": x @ x.T, "k2": _squared_bands(alpha, beta)}
        if r is not None:
            root = self.scale**0.5
            m_c = self._reduction.apply(r_c[None])[0]
            low |= {"m_t": (q_t.T @ r).cpu() / root, "m_c": m_c / root}
        self.low = {key: _low(value) for key, value in low.items()}

    def complement_basis(self) -> Tensor:
        """U ``(d, d − k)`` explicitly (CPU), at O(d³): for checks; the traces never form it."""
        a, tau = self._qr
        c = torch.ormqr(a, tau, torch.eye(self.d, dtype=a.dtype, device=a.device))[:, self.k :]
        if self._reflection is not None:
            u, p = self._reflection
            c = c - p * torch.outer(c @ u, u)
        return self._reduction.apply(c)

    def null(self, n: int, seed: int, *, normal: bool, squares: bool) -> dict[str, Tensor]:
        """Per control, over the cached frames of (d, k, n, seed): ``tr`` = tr(FᵀMF) and,
        with ``squares``, ``tr2`` = tr(FᵀM²F) and ``frob`` = ‖FᵀMF‖²_F; with a
        ``rank_one`` r, ``m`` = ‖Fᵀr‖²; the same with suffix ``_normal`` for normal
        controls. float64 on M's device, computed in `NULL_DTYPE` on the CPU."""
        draw = control_frames(self.d, self.k, n, int(seed))
        rows = draw.normal() if normal else None
        # one buffer for every group's K·B, a group of frames small enough that its
        # complement rows and their K·B stay in a core's cache (`_banded_gram`)
        group = min(n, max(4, GROUP_FLOATS // max((self.d - self.k) * self.k, 1)))
        work = draw.frames.new_empty(group, self.d - self.k, self.k) if squares else None
        parts = [
            _null_traces(
                self,
                draw.rows(i, i + CHUNK),
                None if rows is None else rows.sliced(i, i + CHUNK),
                work,
            )
            for i in range(0, n, CHUNK)
        ]
        power = {"tr": 1, "m": 1, "tr2": 2, "frob": 2}  # homogeneity in M (and r r^T)
        return {
            key: (
                torch.cat([p[key] for p in parts]).double() * self.scale ** power[key.split("_")[0]]
            ).to(self.device)
            for key in parts[0]
        }


class _Tridiagonal:
    """The CPU reduction: QᵀAQ tridiagonal (`compute.tridiagonalize`), Q e₁ = e₁."""

    def __init__(self, block: Tensor) -> None:
        self.alpha, self.beta, self._reflectors = tridiagonalize(block)

    def apply(self, c: Tensor) -> Tensor:
        """``c @ Q`` on the CPU."""
        return tridiagonal_apply(self._reflectors, c)


class _Eigen:
    """Other devices (no tridiagonal reduction there): QᵀAQ diagonal by an eigendecomposition
    on the device, β = 0. Q mixes e₁ into the null space, so where M has one, a p-value's
    Monte-Carlo realisation follows the library's choice of basis there."""

    def __init__(self, block: Tensor) -> None:
        lam, self._q = torch.linalg.eigh(block)
        self.alpha, self.beta = lam.cpu(), lam.new_zeros(max(len(lam) - 1, 0)).cpu()

    def apply(self, c: Tensor) -> Tensor:
        """``c @ Q`` on the CPU."""
        return (c.to(self._q) @ self._q).cpu()


def _reduce(block: Tensor) -> _Tridiagonal | _Eigen:
    """QᵀAQ banded for the complement block A: tridiagonal on the CPU, diagonal elsewhere."""
    return _Tridiagonal(block) if block.device.type == "cpu" else _Eigen(block)


def _low(value: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
    if isinstance(value, tuple):
        return tuple(v.to(NULL_DTYPE) for v in value)
    return value.to(NULL_DTYPE)


def _reflector(r: Tensor) -> tuple[Tensor, float] | None:
    """``(u, 2/uᵀu)``: the reflection I − (2/uᵀu)·uuᵀ that maps ``r`` onto a multiple of
    e₁; None when ``r`` is 0."""
    norm = float(r.norm())
    if norm == 0:
        return None
    u = r.clone()
    u[0] += norm if float(r[0]) >= 0 else -norm
    return u, 2 / float(u @ u)


def _compact_wy(a: Tensor, tau: Tensor) -> tuple[Tensor, Tensor]:
    """``(V, T)`` with H = I − V·T·Vᵀ for the reflectors of a `torch.geqrf` ``(a, tau)``:
    V unit lower trapezoidal, T upper triangular (LAPACK ``dlarft``'s recurrence, exact
    where a τ is 0), so H's products are GEMMs."""
    d, k = a.shape
    v = a.tril(-1) + torch.eye(d, k, dtype=a.dtype, device=a.device)
    vtv = v.T @ v
    t = torch.diag(tau)
    for i in range(1, k):
        t[:i, i] = -tau[i] * (t[:i, :i] @ vtv[:i, i])
    return v, t


def _complement_arrow(
    m: Tensor, a: Tensor, tau: Tensor, r: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None, tuple[Tensor, float] | None]:
    """``(block, x0, r_c, reflection)`` for H = I − V·T·Vᵀ = [Q_T·diag(signs), C], the
    Householder Q of ``(a, tau)``: block = R·CᵀMC·R and x0 = diag(signs)·Q_TᵀMC·R, with r_c =
    R·Cᵀr and R the `_reflector` that maps Cᵀr onto e₁ (R = I without ``r``).

    HᵀMH = M − X·Vᵀ − V·Xᵀ with X = MVT − ½V·(TᵀVᵀMV·T), so the block, its reflection
    included, is one symmetric rank-(2k + 2) update of M's trailing block: one GEMM that
    writes the only (d − k)² array, where applying the reflectors to M from both sides
    passes over d × d arrays several times."""
    k = a.shape[1]
    v, t = _compact_wy(a, tau)
    w = m @ v
    g = t.T @ (v.T @ w) @ t
    x = w @ t - 0.5 * (v @ ((g + g.T) / 2))
    v1, v2, x1, x2 = v[:k], v[k:], x[:k], x[k:]
    x0 = m[:k, k:] - x1 @ v2.T - v1 @ x2.T
    left, right = [x2, v2], [v2, x2]
    r_c = reflection = None
    if r is not None:
        r_c = (r - v @ (t.T @ (v.T @ r)))[k:]
        reflection = _reflector(r_c)
    if reflection is not None:
        u, p = reflection
        bu = m[k:, k:] @ u - x2 @ (v2.T @ u) - v2 @ (x2.T @ u)  # the block times u
        z = p * bu
        z = z - (p / 2) * (u @ z) * u
        left, right = [*left, u[:, None], z[:, None]], [*right, z[:, None], u[:, None]]
        x0 = x0 - p * torch.outer(x0 @ u, u)
        r_c = r_c - p * (u @ r_c) * u
    block = torch.addmm(m[k:, k:], torch.cat(left, 1), torch.cat(right, 1).T, alpha=-1)
    return block, x0, r_c, reflection


def _squared_bands(alpha: Tensor, beta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The diagonal and the first two off-diagonals of K² for the tridiagonal K."""
    zero = beta.new_zeros(1)
    left, right = torch.cat([zero, beta]), torch.cat([beta, zero])
    return alpha**2 + left**2 + right**2, beta * (alpha[:-1] + alpha[1:]), beta[:-1] * beta[1:]


def _banded_gram(b: Tensor, alpha: Tensor, beta: Tensor, work: Tensor) -> Tensor:
    """BᵀKB for each frame's complement rows B in ``b`` ``(n, d − k, k)`` and the
    tridiagonal K (diagonal α, off-diagonal β): BᵀY + YᵀB with Y = (diag(α)/2 + the upper
    band of K)·B. Y is formed for ``len(work)`` frames at a time, in ``work``, so each
    group's B and Y are read from a core's cache by the product that follows rather than
    from memory (forming Y for a whole chunk passes over it four times in memory)."""
    k = b.shape[-1]
    out = b.new_empty(len(b), k, k)
    half, off = alpha[:, None] / 2, beta[:, None]
    step = len(work)
    for i in range(0, len(b), step):
        part = b[i : i + step]
        y = torch.mul(part, half, out=work[: len(part)])
        y[:, :-1].addcmul_(part[:, 1:], off)
        torch.bmm(part.mT, y, out=out[i : i + step])
    return out + out.mT


def _null_traces(
    site: SiteFrames, f: Rows, normal: Rows | None, work: Tensor | None
) -> dict[str, Tensor]:
    """One chunk of `SiteFrames.null` (see there for the names), in `NULL_DTYPE`, from the
    uniform frames' `Rows` and, for normal controls, L⁻¹ with G's `Rows`; the squares
    with ``work``, the buffer of `_banded_gram`."""
    low, k = site.low, site.k
    alpha, beta, x, t = low["alpha"], low["beta"], low["x"], low["t"]
    a, b = f.main[:, :k], f.main[:, k:]
    # the complement rows' products, for band sums against K and K²
    b_rows = Rows(b, f.sq[:, k:], f.lag1[:, k:], f.lag2[:, k:])

    def tr(z: Tensor) -> Tensor:
        return z.diagonal(dim1=-2, dim2=-1).sum(-1)

    def dot(y: Tensor, z: Tensor) -> Tensor:
        return (y * z).sum((-2, -1))

    def band(rows: Rows, diagonal: Tensor, off1: Tensor, off2: Tensor | None = None) -> Tensor:
        """tr(RᵀSR) for the rows R of ``rows`` and a symmetric band S."""
        out = rows.sq @ diagonal + 2 * (rows.lag1 @ off1)
        return out if off2 is None else out + 2 * (rows.lag2 @ off2)

    ata = a.mT @ t @ a
    # X B, for the squares X K B, for a rank-one r m_cᵀB: one product, the rows stacked,
    # so the frames are read once
    rank_one = "m_t" in low
    lhs = [x] + ([low["xk"]] if work is not None else []) + ([low["m_c"][None]] if rank_one else [])
    stacked = torch.cat(lhs) @ b
    p = stacked[:, :k]
    out = {"tr": tr(ata) + 2 * dot(a, p) + band(b_rows, alpha, beta)}
    if rank_one:
        bm = stacked[:, -1]  # (n, k)
        out["m"] = (a.mT @ low["m_t"] + bm).pow(2).sum(-1)
    if work is not None:
        kb = _banded_gram(b, alpha, beta, work)
        r = stacked[:, k : 2 * k]  # XKB
        out["tr2"] = (t @ a + p).pow(2).sum((-2, -1)) + dot(a, low["xxt"] @ a) + 2 * dot(a, r)
        out["tr2"] = out["tr2"] + band(b_rows, *low["k2"])
        out["frob"] = (ata + a.mT @ p + p.mT @ a + kb).pow(2).sum((-2, -1))
    if normal is not None:
        inv = normal.main  # G = B L⁻ᵀ
        out["tr_normal"] = band(normal, alpha, beta)
        if rank_one:
            out["m_normal"] = (inv @ bm[..., None]).pow(2).sum((-2, -1))
        if work is not None:
            gkg = inv @ kb @ inv.mT  # GᵀKG
            out["tr2_normal"] = band(normal, *low["k2"]) + (p @ inv.mT).pow(2).sum((-2, -1))
            out["frob_normal"] = gkg.pow(2).sum((-2, -1))
    return out
