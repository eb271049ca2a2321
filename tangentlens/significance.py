"""Tests of a tangent basis against matched-rank random controls: closed-form effect
sizes, Monte-Carlo p-values.

Effect size. ``energy_ratio`` = s_T / ((1 − s_T)·k/(d − k)) with s_T the share of
gradient energy in Q_T: the tangent share over the exact mean share of a uniformly
random k-frame in the complement of Q_T (the paper's control). It is a closed form, so
it does not depend on the controls, the seed or their number.

Gram trick. Both tests read only d×d statistics: a control costs O(dim·k²), never
another pass over tokens, so 10,000 controls take seconds at d = 768. A control is
``Q_N = C·F`` with C an orthonormal basis of the control space (the complement of Q_T,
or the whole space) and F a Haar-random dim×k frame. Every quantity we need is
``tr(Q_NᵀSQ_N)``, ``tr(Q_NᵀS²Q_N)`` or ``‖Q_NᵀSQ_N‖²_F`` for a symmetric S. Writing
``CᵀSC = UΛUᵀ`` and drawing the frame directly in U's coordinates (``G = UᵀF`` is Haar
whenever F is) gives ``tr(Q_NᵀSQ_N) = Σᵢ λᵢ‖Gᵢ‖²``,
``tr(Q_NᵀS²Q_N) = Σᵢ λᵢ²‖Gᵢ‖² + ‖(UᵀCᵀSQ_T)ᵀG‖²_F`` and ``‖Q_NᵀSQ_N‖²_F = ‖GᵀΛG‖²_F``.

Controls. ``controls="uniform"`` (the default) draws frames from the whole space, which
makes Q_T exchangeable with the controls under any rotation-invariant null, so its
p-values are exact. ``controls="normal"`` is the paper's design: frames orthogonal to
Q_T. They are not exchangeable with Q_T (the complement loses whatever Q_T happens to
hold), so the test is anti-conservative when k/d is not small, and calling a test with
them warns (`ExchangeabilityWarning`) above k/d = 0.05. With isotropic Gaussian gradients
(2,048 vectors, 99 controls, 400 trials) the energy test's P(p ≤ 0.05) was 0.035 and
0.058 with uniform controls at (d, k) = (128, 16) and (64, 8), 0.068 and 0.098 with
normal ones. `tangent_tests` reports both, labelled (``p_value`` and ``p_value_normal``),
without warning. The paper used 20 controls (smallest possible p = 1/21); the default
here is 1,000.

Frame reuse. G depends only on (dim, k, n_controls, seed), since it is drawn in the
coordinates of whatever matrix is tested; the frames are drawn once and reused across
sites and tests from a small LRU cache of at most 512 MiB, in float64 with each frame's
squared row norms (d = 768, k = 32 and 1,000 controls take 197 MB), so an energy null is
one matrix-vector product over the eigenvalues (`numpy.linalg.eigvalsh`-class cost, no
eigenvectors) and only the IsoScore* null over normal frames needs eigenvectors.
Each site's p-value stays exact; p-values of different sites share their controls, so
they are dependent.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from .errors import ExchangeabilityWarning, UsageError
from .metrics import _cov_arg, isoscore_from_traces
from .stats import Moments
from .subspace import TangentBasis, complement, tangent_share
from .validation import check_controls, check_int, check_rank

__all__ = [
    "EnergyTestResult",
    "IsotropyTestResult",
    "delta_iso_tangent",
    "energy_ratio",
    "energy_test",
    "isotropy_test",
    "matrix_tests",
    "tangent_tests",
]

Controls = Literal["uniform", "normal"]
_CHUNK = 512
_KD_WARN = 0.05
_CACHE_BYTES = 512 * 2**20


@dataclass(frozen=True)
class EnergyTestResult:
    """Energy share of Q_T against matched-rank controls.

    ``tangent_share`` = E(Q_T) = tr(Q_TᵀHQ_T)/tr(H); ``chance_share`` = k/d;
    ``ratio`` = `energy_ratio` (closed form); ``p_value`` = (1 + #{E(Q_N) ≥ E(Q_T)})/(n + 1);
    ``null_shares`` the control energies; ``normalized_ratio`` the ratio divided by
    ``activation_ratio``, the same ratio of the activations' uncentred second moment
    (None without activation moments).
    """

    tangent_share: float
    chance_share: float
    ratio: float
    p_value: float
    null_shares: Tensor
    n_controls: int
    controls: str
    normalized_ratio: float | None = None
    activation_ratio: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("null_shares")
        return out


@dataclass(frozen=True)
class IsotropyTestResult:
    """ΔIso* of removing Q_T against removing matched-rank controls.

    ``delta_tangent`` = IsoScore*(after removing Q_T) − IsoScore*(before);
    ``delta_normal`` the mean of the same over the controls (of either kind);
    ``statistic`` their difference; ``p_value`` = (1 + #{Δ_N ≥ Δ_T})/(n + 1).
    """

    iso_before: float
    delta_tangent: float
    delta_normal: float
    statistic: float
    p_value: float
    null_deltas: Tensor
    n_controls: int
    controls: str

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("null_deltas")
        return out


# ---------------------------------------------------------------- validation
def _check_inputs(moments: Any, basis: Any, n_controls: Any, controls: Any) -> None:
    if not isinstance(moments, Moments):
        raise TypeError(
            f"gradient_moments must be a tangentlens.Moments; got {type(moments).__name__}. "
            "Build one with Moments().update(grads)."
        )
    if moments.count < 1:
        raise UsageError("gradient_moments is empty: run a backward pass through the probes first.")
    _check_basis(basis, moments.d, "the moments")
    check_int(n_controls, "n_controls", minimum=1)
    check_rank(basis.k, basis.d, check_controls(controls), name="k")


def _check_basis(basis: Any, d: int, what: str) -> None:
    if not isinstance(basis, TangentBasis):
        raise TypeError(f"basis must be a TangentBasis; got {type(basis).__name__}.")
    if basis.d != d:
        raise UsageError(
            f"basis has d={basis.d} but {what} have d={d}: the basis was fitted at another "
            "site or on another model; fit it at the same hook point."
        )


def _warn_exchangeability(basis: TangentBasis, controls: str) -> None:
    if controls == "normal" and basis.k / basis.d > _KD_WARN:
        warnings.warn(
            f"k/d = {basis.k}/{basis.d} = {basis.k / basis.d:.2f}: normal controls are not "
            "exchangeable with Q_T, so p-values are anti-conservative at this ratio. "
            "Use controls='uniform' for an exact test.",
            ExchangeabilityWarning,
            stacklevel=3,
        )


# ------------------------------------------------------------ control frames
def _draw_frames(dim: int, k: int, n: int, seed: int) -> Tensor:
    """``(n, dim, k)`` float64 orthonormal frames with uniformly random span (kept in
    float64: converting per use cost more than the tests).

    Every statistic here depends on a frame's span only, so Cholesky-QR
    (Z·L⁻ᵀ with LLᵀ = ZᵀZ) replaces Householder QR: the same span, at GEMM speed.
    """
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(n, dim, k, dtype=torch.float64)
    for start in range(0, n, _CHUNK):
        # float32 draws (4x faster than float64 here)
        z = torch.randn(min(_CHUNK, n - start), dim, k, generator=gen).double()
        chol, info = torch.linalg.cholesky_ex(z.mT @ z)
        if bool(info.any()):  # numerically rank-deficient draw: fall back to Householder
            q = torch.linalg.qr(z).Q
        else:
            q = torch.linalg.solve_triangular(chol.mT, z, upper=True, left=False)
        out[start : start + q.shape[0]] = q
    return out


class _FrameCache:
    """Control frames by (dim, k, n, seed), least recently used out first, within a byte
    budget: one draw serves every site and both tests of a study. With each set it keeps
    the squared row norms ‖G_i‖² (float64), so a trace over all frames is a mat-vec."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._frames: OrderedDict[tuple[int, int, int, int], tuple[Tensor, Tensor]] = OrderedDict()

    def __call__(self, dim: int, k: int, n: int, seed: int) -> tuple[Tensor, Tensor]:
        key = (dim, k, n, seed)
        if key in self._frames:
            self._frames.move_to_end(key)
            return self._frames[key]
        frames = _draw_frames(*key)
        squares = frames.pow(2).sum(-1)
        self._frames[key] = (frames, squares)
        while sum(f.nbytes + q.nbytes for f, q in self._frames.values()) > self.max_bytes:
            self._frames.popitem(last=False)
        return self._frames[key]


_control_frames = _FrameCache(_CACHE_BYTES)


class _ControlAlgebra:
    """Traces of a symmetric S over random k-frames, in the eigenbasis of S on the
    control space (the complement of Q_T, or the whole space).

    Only the eigenvalues are needed, except for tr(QᵀS²Q) over normal frames, which
    couples the complement to Q_T (``vectors=True``): eigenvalues alone cost a fraction
    of a full eigendecomposition. ``comp`` reuses a complement basis of Q_T."""

    def __init__(
        self,
        s: Tensor,
        q_t: Tensor,
        controls: Controls,
        *,
        vectors: bool = False,
        comp: Tensor | None = None,
    ) -> None:
        self.k = q_t.shape[1]
        self.w: Tensor | None = None
        if controls == "normal":
            c = complement(q_t) if comp is None else comp
            a = c.T @ s @ c
        else:
            a = s
        a = (a + a.T) / 2
        if vectors and controls == "normal":
            self.lam, u = torch.linalg.eigh(a)
            self.w = u.T @ (c.T @ s @ q_t)  # couples the control space to Q_T in S²
        else:
            self.lam = torch.linalg.eigvalsh(a)
        self.dim = a.shape[0]

    def null(self, n: int, seed: int, fn: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """``fn(squares, frames)`` over the cached frames, in chunks: ``squares``
        ``(n, dim)`` are the frames' squared row norms, ``frames`` ``(n, dim, k)``."""
        frames, squares = _control_frames(self.dim, self.k, n, int(seed))
        device = self.lam.device
        return torch.cat(
            [
                fn(squares[i : i + _CHUNK].to(device), frames[i : i + _CHUNK].to(device))
                for i in range(0, n, _CHUNK)
            ]
        )

    def trace(self, squares: Tensor) -> Tensor:
        """tr(QᵀSQ) per frame."""
        return squares @ self.lam

    def trace_sq(self, squares: Tensor, g: Tensor) -> Tensor:
        """tr(QᵀS²Q) per frame."""
        out = squares @ self.lam**2
        if self.w is not None:
            out = out + (self.w.T @ g).pow(2).sum((-2, -1))
        return out

    def frob_sq(self, g: Tensor) -> Tensor:
        """‖QᵀSQ‖²_F per frame."""
        m = g.transpose(-2, -1) @ (self.lam[:, None] * g)
        return m.pow(2).sum((-2, -1))


def _add_one_p(null: Tensor, observed: float) -> float:
    return (1 + int((null >= observed).sum())) / (null.numel() + 1)


# --------------------------------------------------------------- energy test
def energy_ratio(share: float, k: int, d: int) -> float:
    """s / ((1 − s)·k/(d − k)): a tangent share over the mean share of a uniformly random
    k-frame in the complement of Q_T, which is exactly (1 − s)·k/(d − k) (a Haar frame
    holds k/(d − k) of the complement's energy in expectation). inf when s = 1."""
    d = check_int(d, "d", minimum=2)
    k = check_rank(k, d, name="k")
    if math.isnan(share):
        return math.nan
    rest = (1 - share) * k / (d - k)
    return share / rest if rest > 0 else math.inf


def _energy(
    h: Tensor,
    basis: TangentBasis,
    *,
    n_controls: int,
    seed: int,
    controls: Controls,
    activation_moments: Moments | None,
    comp: Tensor | None = None,
) -> EnergyTestResult:
    total = float(torch.trace(h))
    if total <= 0:
        raise UsageError("the gradients are all zero: no energy to test. Check the loss.")
    d, k = basis.d, basis.k
    share = tangent_share(h, basis)
    algebra = _ControlAlgebra(h, basis.basis_.to(h.device), controls, comp=comp)
    null = algebra.null(n_controls, seed, lambda sq, g: algebra.trace(sq)) / total
    ratio = energy_ratio(share, k, d)
    normalized = act_ratio = None
    if activation_moments is not None:
        if activation_moments.d != d:
            raise UsageError(
                f"activation_moments have d={activation_moments.d}, the basis d={d}; "
                "pass the moments of the activations the basis was fitted on."
            )
        act_ratio = energy_ratio(tangent_share(activation_moments, basis), k, d)
        normalized = ratio / act_ratio if act_ratio > 0 else math.nan
    return EnergyTestResult(
        tangent_share=share,
        chance_share=k / d,
        ratio=ratio,
        p_value=_add_one_p(null, share),
        null_shares=null,
        n_controls=n_controls,
        controls=controls,
        normalized_ratio=normalized,
        activation_ratio=act_ratio,
    )


def energy_test(
    gradient_moments: Moments,
    basis: TangentBasis,
    *,
    n_controls: int = 1000,
    seed: int = 0,
    controls: Controls = "uniform",
    activation_moments: Moments | None = None,
) -> EnergyTestResult:
    """Does Q_T capture more gradient energy than matched-rank random subspaces?

    Energy share ``E(Q) = tr(QᵀHQ)/tr(H)`` with H the uncentred gradient second
    moment E[g gᵀ]. See the module docstring for the two kinds of ``controls``.
    With ``activation_moments`` (the activations the basis was fitted on), the
    ``normalized_ratio`` divides out the share that Q_T holds of the activations'
    own energy: a subspace fitted on activations inflates weight-gradient energy by
    construction.
    """
    _check_inputs(gradient_moments, basis, n_controls, controls)
    _warn_exchangeability(basis, controls)
    return _energy(
        gradient_moments.second_moment(),
        basis,
        n_controls=n_controls,
        seed=seed,
        controls=controls,
        activation_moments=activation_moments,
    )


# ------------------------------------------------------------- isotropy test
class _IsoAfterRemoval:
    """IsoScore* of the gradient covariance before, and after removing a k-frame, from the
    traces of S over the frame (S the covariance, ``n − 1`` normalisation, shrunk by
    ``zeta`` toward ``reference``)."""

    def __init__(self, moments: Moments, basis: TangentBasis, zeta: float, reference: Any):
        if moments.count < 2:
            raise UsageError("ΔIso* needs at least 2 gradient vectors for a covariance.")
        if not 0 <= zeta <= 1:
            raise UsageError(f"zeta must be in [0, 1]; got {zeta}.")
        c = moments.covariance(ddof=1)
        self.d, self.k = basis.d, basis.k
        if reference is None:
            self.s = c
        else:
            ref = _cov_arg(reference, "reference").to(c.device)
            if ref.shape != c.shape:
                raise UsageError(f"reference must be ({self.d}, {self.d}); got {tuple(ref.shape)}.")
            self.s = (1 - zeta) * c + zeta * ref
        self.zeta, self.scaled = zeta, reference is None
        self.tr_s, self.tr_s2 = torch.trace(self.s), (self.s * self.s).sum()
        self.before = float(
            isoscore_from_traces(self.tr_s, self._t2(self.tr_s2, self.tr_s, self.d), self.d)
        )

    def _t2(self, t2: Tensor, t1: Tensor, dim: int) -> Tensor:
        """tr(S²) after shrinking toward tr/dim · I of the measured space (reference=None)."""
        if not self.scaled:
            return t2
        z = self.zeta
        return (1 - z) ** 2 * t2 + (2 * z * (1 - z) + z**2) * t1**2 / dim

    def after(self, tr_q: Tensor, tr2_q: Tensor, frob_q: Tensor) -> Tensor:
        """IsoScore* in the complement of Q from tr(QᵀSQ), tr(QᵀS²Q) and ‖QᵀSQ‖²_F."""
        t1 = self.tr_s - tr_q
        dim = self.d - self.k
        return isoscore_from_traces(t1, self._t2(self.tr_s2 - 2 * tr2_q + frob_q, t1, dim), dim)

    def delta(self, q: Tensor) -> float:
        """ΔIso* of removing the frame ``q``."""
        q = q.to(self.s.device)
        sq = self.s @ q
        qsq = q.T @ sq
        return float(self.after(torch.trace(qsq), (sq * sq).sum(), qsq.pow(2).sum())) - self.before


def delta_iso_tangent(
    gradient_moments: Moments,
    basis: TangentBasis,
    *,
    zeta: float = 0.0,
    reference: Any | None = None,
) -> float:
    """IsoScore* of the gradients after removing Q_T minus before: positive when the
    tangent directions are what makes the gradients anisotropic.

    IsoScore* after removal is measured in the coordinates of the complement
    (dimension d − k), on the gradient covariance (``n − 1`` normalisation) shrunk
    by ``zeta`` toward ``reference`` restricted to the same complement; with
    ``reference=None`` the reference is the scale-matched identity of whichever
    space is measured, as in `metrics.isoscore_star`.
    """
    if not isinstance(gradient_moments, Moments):
        raise TypeError(
            f"gradient_moments must be a Moments; got {type(gradient_moments).__name__}."
        )
    _check_basis(basis, gradient_moments.d, "the moments")
    return _IsoAfterRemoval(gradient_moments, basis, zeta, reference).delta(basis.basis_)


def _isotropy(
    iso: _IsoAfterRemoval,
    basis: TangentBasis,
    *,
    n_controls: int,
    seed: int,
    controls: Controls,
    comp: Tensor | None = None,
) -> IsotropyTestResult:
    delta_t = iso.delta(basis.basis_)
    q_t = basis.basis_.to(iso.s.device)
    algebra = _ControlAlgebra(iso.s, q_t, controls, vectors=True, comp=comp)

    def delta(squares: Tensor, g: Tensor) -> Tensor:
        traces = algebra.trace(squares), algebra.trace_sq(squares, g), algebra.frob_sq(g)
        return iso.after(*traces) - iso.before

    null = algebra.null(n_controls, seed, delta)
    delta_n = float(null.mean())
    return IsotropyTestResult(
        iso_before=iso.before,
        delta_tangent=delta_t,
        delta_normal=delta_n,
        statistic=delta_t - delta_n,
        p_value=_add_one_p(null, delta_t),
        null_deltas=null,
        n_controls=n_controls,
        controls=controls,
    )


def isotropy_test(
    gradient_moments: Moments,
    basis: TangentBasis,
    *,
    n_controls: int = 1000,
    zeta: float = 0.0,
    reference: Any | None = None,
    seed: int = 0,
    controls: Controls = "uniform",
) -> IsotropyTestResult:
    """ΔIso*: how much IsoScore* of the gradients rises when Q_T is removed (see
    `delta_iso_tangent`), against removing a matched-rank control."""
    _check_inputs(gradient_moments, basis, n_controls, controls)
    _warn_exchangeability(basis, controls)
    iso = _IsoAfterRemoval(gradient_moments, basis, zeta, reference)
    return _isotropy(iso, basis, n_controls=n_controls, seed=seed, controls=controls)


def _energy_statistics(
    h: Tensor,
    basis: TangentBasis,
    n_controls: int,
    seed: int,
    activation_moments: Moments | None,
    comp: Tensor | None = None,
) -> dict[str, float | None]:
    """The energy test's named statistics: uniform controls, plus normal ones (labelled,
    so no warning) where they fit (2k ≤ d)."""
    mc = {"n_controls": n_controls, "seed": seed}
    energy = _energy(h, basis, **mc, controls="uniform", activation_moments=activation_moments)
    out = {
        "tangent_share": energy.tangent_share,
        "chance_share": energy.chance_share,
        "energy_ratio": energy.ratio,
        "p_value": energy.p_value,
        "normalized_ratio": energy.normalized_ratio,
    }
    if 2 * basis.k <= basis.d:
        comp = comp if comp is not None else complement(basis.basis_.to(h.device))
        normal = _energy(h, basis, **mc, controls="normal", activation_moments=None, comp=comp)
        out["p_value_normal"] = normal.p_value
    return out


def tangent_tests(
    gradient_moments: Moments,
    basis: TangentBasis,
    *,
    n_controls: int = 1000,
    seed: int = 0,
    zeta: float = 0.0,
    reference: Any | None = None,
    activation_moments: Moments | None = None,
) -> dict[str, float]:
    """Both tests at one site, as the named statistics of a results table.

    ``p_value``, ``isotropy_p_value`` and ``iso_statistic`` (ΔIso*_T minus its mean over
    the controls) use uniform controls: exact. ``p_value_normal``, ``delta_iso_normal``
    and ``isotropy_p_value_normal`` use the paper's normal controls (labelled, so no
    warning; left out when 2k > d, where no normal control fits). ``normalized_ratio``
    needs ``activation_moments``.
    """
    _check_inputs(gradient_moments, basis, n_controls, "uniform")
    h = gradient_moments.second_moment()
    # one complement basis of Q_T serves both tests' normal controls
    comp = complement(basis.basis_.to(h.device)) if 2 * basis.k <= basis.d else None
    out = _energy_statistics(h, basis, n_controls, seed, activation_moments, comp)
    iso = _IsoAfterRemoval(gradient_moments, basis, zeta, reference)
    uniform = _isotropy(iso, basis, n_controls=n_controls, seed=seed, controls="uniform")
    out["delta_iso_tangent"] = uniform.delta_tangent
    out["iso_statistic"] = uniform.statistic
    out["isotropy_p_value"] = uniform.p_value
    if 2 * basis.k <= basis.d:
        normal = _isotropy(
            iso, basis, n_controls=n_controls, seed=seed, controls="normal", comp=comp
        )
        out["delta_iso_normal"] = normal.delta_normal
        out["isotropy_p_value_normal"] = normal.p_value
    return {k: v for k, v in out.items() if v is not None}


def matrix_tests(
    matrix: Tensor,
    basis: TangentBasis,
    *,
    n_controls: int = 1000,
    seed: int = 0,
    activation_moments: Moments | None = None,
) -> dict[str, float]:
    """The energy test of a symmetric PSD ``matrix`` S (d × d) in place of a gradient
    second moment, as named statistics: the share ``tr(Q_TᵀSQ_T)/tr(S)`` against the
    same matched-rank controls and cached frames as `tangent_tests`, which it matches on
    S = E[g gᵀ]. For statistics that are not moments of vectors, such as Σ G Gᵀ over
    weight gradients G.

    ``tangent_share``, ``chance_share``, ``energy_ratio`` (closed form), ``p_value``
    (uniform controls), ``p_value_normal`` (normal controls; left out when 2k > d) and,
    with ``activation_moments``, ``normalized_ratio``.
    """
    h = torch.as_tensor(matrix)
    if h.ndim != 2 or h.shape[0] != h.shape[1] or not bool(torch.isfinite(h).all()):
        raise UsageError(f"matrix must be a finite square (d, d) tensor; got {tuple(h.shape)}.")
    _check_basis(basis, h.shape[0], "the matrix")
    check_int(n_controls, "n_controls", minimum=1)
    out = _energy_statistics(h.to(torch.float64), basis, n_controls, seed, activation_moments)
    return {k: v for k, v in out.items() if v is not None}
