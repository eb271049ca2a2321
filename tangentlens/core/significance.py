"""Tests of a tangent basis against matched-rank random controls: closed-form effect
sizes, Monte-Carlo p-values.

Effect size. ``energy_ratio`` = s_T / ((1 − s_T)·k/(d − k)) with s_T the share of
gradient energy in Q_T: the tangent share over the exact mean share of a uniformly
random k-frame in the complement of Q_T (the paper's control). It is a closed form, so
it does not depend on the controls, the seed or their number.

Gram trick. Both tests read only d×d statistics: a control costs O(d·k²), never
another pass over tokens (`tangentlens.core.controls`: one tridiagonal reduction per site
serves both tests and both kinds of controls, since the energy test's second moment is the
covariance plus the mean's outer product and the isotropy test's covariance is the same
matrix scaled by n/(n − 1), or by f·n/(n − 1) when ΔIsoScore*'s reference makes it f
times the covariance, as a pool of one checkpoint does; another reference needs a
reduction of its own). `benchmarks/bench_fixed_costs.py` times one site against one
top-k eigendecomposition (docs/PERFORMANCE.md).

Controls. ``controls="uniform"`` (the default) draws frames from the whole space, which
makes Q_T exchangeable with the controls under any rotation-invariant null, so its
p-values are exact. ``controls="normal"`` is the paper's design: frames orthogonal to
Q_T. They are not exchangeable with Q_T (the complement loses whatever Q_T happens to
hold), so the test is anti-conservative when k/d is not small, and calling a test with
them warns (`ExchangeabilityWarning`) from k/d = 0.05 on. `tests/test_significance.py`
checks the calibration of both under isotropic Gaussian gradients. `tangent_tests` reports
both, labelled (``p_value`` and ``p_value_normal``), without warning. The paper used 20
controls (smallest possible p = 1/21); the default here is 1,000.

Frame reuse. The frames depend only on (d, k, n_controls, seed); they are drawn once and
reused across sites and tests (`controls.control_frames`). The controls' traces are
float32 (their rounding error lies far inside their Monte-Carlo error); the tangent
statistics, the tridiagonal reduction and the closed forms are float64. With at least as
many gradients as d, rounding-level changes of the statistics (another BLAS or thread
count) move the controls' traces at rounding level; with fewer, the null space is
invisible to them, but the reduction's last coordinates inside the range are
ill-conditioned, so a p-value may come out as another, equally exact Monte-Carlo
realisation (`controls.SiteFrames`). The coordinates are part of a realisation too: a
ΔIsoScore* reference that is a multiple of the covariance reads the controls in the
covariance's coordinates, any other reference in those of its own S. Each site's p-value
is exact; p-values of different sites share their controls, so they are dependent.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from .controls import SiteFrames, exceedance_p_value, normal_controls_vary
from .errors import ExchangeabilityWarning, UsageError
from .metrics import _cov_arg, isoscore_from_traces
from .stats import Moments
from .subspace import TangentBasis, tangent_share
from .validation import check_controls, check_int, check_rank

__all__ = [
    "EnergyTestResult",
    "IsotropyTestResult",
    "delta_iso_tangent",
    "energy_ratio",
    "energy_test",
    "isotropy_test",
    "matrix_tests",
    "pooled_shape",
    "reference_at",
    "tangent_tests",
]

Controls = Literal["uniform", "normal"]
_KD_WARN = 0.05


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
    if controls == "normal" and basis.k / basis.d >= _KD_WARN:
        warnings.warn(
            f"k/d = {basis.k}/{basis.d} = {basis.k / basis.d:.2f}: normal controls are not "
            "exchangeable with Q_T, so p-values are anti-conservative at this ratio. "
            "Use controls='uniform' for an exact test.",
            ExchangeabilityWarning,
            stacklevel=3,
        )


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


def _energy_inputs(matrix: Moments | Tensor, basis: TangentBasis) -> tuple[float, float]:
    """``(tr H, tangent share of H)`` for the second moment H a `Moments` stands for, or a
    matrix; an error when there is no energy."""
    if isinstance(matrix, Moments):
        total = matrix.trace_second_moment()
    else:
        total = float(torch.trace(matrix))
    if total <= 0:
        raise UsageError("the gradients are all zero: no energy to test. Check the loss.")
    return total, tangent_share(matrix, basis)


def _energy(
    total: float,
    share: float,
    basis: TangentBasis,
    draws: dict[str, Tensor],
    *,
    n_controls: int,
    controls: Controls,
    activation: Moments | float | None,
) -> EnergyTestResult:
    """The energy test of a second moment H with trace ``total`` and tangent ``share``
    against its controls' ``draws`` of `SiteFrames.null` (tr(FᵀHF) is ``tr`` plus ``m``
    where H = M + μμᵀ). ``activation``: the activations' `Moments`, or the tangent share
    of their uncentred second moment where only that was kept."""
    d, k = basis.d, basis.k
    suffix = "_normal" if controls == "normal" else ""
    null = draws["tr" + suffix] + draws.get("m" + suffix, 0.0)
    null = null / total
    ratio = energy_ratio(share, k, d)
    normalized = act_ratio = None
    if isinstance(activation, Moments):
        if activation.d != d:
            raise UsageError(
                f"activation_moments have d={activation.d}, the basis d={d}; "
                "pass the moments of the activations the basis was fitted on."
            )
        activation = tangent_share(activation, basis)
    if activation is not None:
        act_ratio = energy_ratio(activation, k, d)
        normalized = ratio / act_ratio if act_ratio > 0 else math.nan
    return EnergyTestResult(
        tangent_share=share,
        chance_share=k / d,
        ratio=ratio,
        p_value=exceedance_p_value(null, share),
        null_shares=null,
        n_controls=n_controls,
        controls=controls,
        normalized_ratio=normalized,
        activation_ratio=act_ratio,
    )


def _moment_draws(
    moments: Moments,
    basis: TangentBasis,
    n_controls: int,
    seed: int,
    *,
    normal: bool,
    squares: bool,
) -> dict[str, Tensor]:
    """Controls' traces in the coordinates of the covariance (ddof=0), with the mean as
    the rank-one term that makes the second moment."""
    cov = moments.covariance()
    frames = SiteFrames(cov, basis.basis_.to(cov), rank_one=moments.mean)
    return frames.null(n_controls, seed, normal=normal, squares=squares)


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
    normal = controls == "normal"
    total, share = _energy_inputs(gradient_moments, basis)
    draws = _moment_draws(gradient_moments, basis, n_controls, seed, normal=normal, squares=False)
    return _energy(
        total,
        share,
        basis,
        draws,
        n_controls=n_controls,
        controls=controls,
        activation=activation_moments,
    )


# ------------------------------------------------------------- isotropy test
class _IsoAfterRemoval:
    """IsoScore* of the gradient covariance before, and after removing a k-frame, from the
    traces of S over the frame (S the covariance, ``n − 1`` normalisation, shrunk by
    ``zeta`` toward ``reference``).

    ``multiple`` is f with S = f·C for the covariance C (``n − 1`` normalisation) where
    that holds to ``_MULTIPLE_TOL`` in Frobenius norm (no reference, or a reference that
    is a multiple of C, as a pool of one checkpoint gives): the controls' traces of S are
    then those of C scaled, to within k·‖S − f·C‖₂ each, far under the float32 rounding of
    the traces themselves. None otherwise: S needs a reduction of its own."""

    def __init__(self, moments: Moments, basis: TangentBasis, zeta: float, reference: Any):
        if moments.count < 2:
            raise UsageError("ΔIso* needs at least 2 gradient vectors for a covariance.")
        if basis.d - basis.k < 2:  # IsoScore* of what is left is of one dimension: undefined
            raise UsageError(
                f"ΔIso* needs at least 2 dimensions outside Q_T; rank {basis.k} at d={basis.d} "
                f"leaves {basis.d - basis.k}: use rank <= {basis.d - 2} (energy_test has no "
                "such limit)."
            )
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
        self.multiple = 1.0 if self.scaled else _multiple(self.s, c, float(self.tr_s2) ** 0.5)
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


_MULTIPLE_TOL = 1e-12


def _multiple(s: Tensor, c: Tensor, norm_s: float) -> float | None:
    """f with ‖S − f·C‖_F ≤ `_MULTIPLE_TOL`·‖S‖_F (f = tr S / tr C), else None."""
    tr_c = float(torch.trace(c))
    if not tr_c > 0:
        return None
    f = float(torch.trace(s)) / tr_c
    off = float(torch.linalg.matrix_norm(torch.sub(s, c, alpha=f)))
    return f if off <= _MULTIPLE_TOL * norm_s else None


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


def _iso_draws(
    iso: _IsoAfterRemoval,
    moments: Moments,
    basis: TangentBasis,
    n_controls: int,
    seed: int,
    normal: bool,
    draws: dict[str, Tensor] | None = None,
) -> tuple[dict[str, Tensor], float]:
    """Controls' traces for ΔIso* and their scale: the covariance's own ``draws`` (ddof=0,
    so scaled by f·n/(n − 1)) where S is a multiple f of it (`_IsoAfterRemoval`), else
    draws on S."""
    if iso.multiple is None:
        return SiteFrames(iso.s, basis.basis_.to(iso.s)).null(
            n_controls, seed, normal=normal, squares=True
        ), 1.0
    if draws is None:
        draws = _moment_draws(moments, basis, n_controls, seed, normal=normal, squares=True)
    return draws, iso.multiple * moments.count / (moments.count - 1)


def _isotropy(
    iso: _IsoAfterRemoval,
    delta_t: float,
    draws: dict[str, Tensor],
    scale: float,
    *,
    n_controls: int,
    controls: Controls,
) -> IsotropyTestResult:
    """The test of ΔIso*_T = ``delta_t`` against the controls' ``draws`` (traces of S
    over ``scale``)."""
    suffix = "_normal" if controls == "normal" else ""
    traces = (
        draws[key + suffix] * scale**power for key, power in (("tr", 1), ("tr2", 2), ("frob", 2))
    )
    null = iso.after(*traces) - iso.before
    delta_n = float(null.mean())
    return IsotropyTestResult(
        iso_before=iso.before,
        delta_tangent=delta_t,
        delta_normal=delta_n,
        statistic=delta_t - delta_n,
        p_value=exceedance_p_value(null, delta_t, scale=1.0),
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
    normal = controls == "normal"
    draws, scale = _iso_draws(iso, gradient_moments, basis, n_controls, seed, normal)
    delta_t = iso.delta(basis.basis_)
    return _isotropy(iso, delta_t, draws, scale, n_controls=n_controls, controls=controls)


def _normal_fits(basis: TangentBasis) -> bool:
    return normal_controls_vary(basis.k, basis.d, stacklevel=4)


def _energy_statistics(
    h: Moments | Tensor,
    basis: TangentBasis,
    draws: dict[str, Tensor],
    n_controls: int,
    activation: Moments | float | None,
) -> dict[str, float | None]:
    """The energy test's named statistics for the second moment ``h`` (a `Moments` stands
    for its own): uniform controls, plus normal ones (labelled, so no warning) where they
    vary (2k < d)."""
    total, share = _energy_inputs(h, basis)
    energy = _energy(
        total,
        share,
        basis,
        draws,
        n_controls=n_controls,
        controls="uniform",
        activation=activation,
    )
    out = {
        "tangent_share": energy.tangent_share,
        "chance_share": energy.chance_share,
        "energy_ratio": energy.ratio,
        "p_value": energy.p_value,
        "normalized_ratio": energy.normalized_ratio,
    }
    if "tr_normal" in draws:
        normal = _energy(
            total,
            share,
            basis,
            draws,
            n_controls=n_controls,
            controls="normal",
            activation=None,
        )
        out["p_value_normal"] = normal.p_value
    return out


def pooled_shape(moments: Sequence[Moments]) -> Tensor:
    """ΔIsoScore*'s reference shape at a site: the mean over the checkpoints analysed
    together of the trace-normalised gradient covariance C/tr(C), so each checkpoint
    weighs the same whatever its gradient scale. A probe session analyses each
    checkpoint (tag) alone: its pool is that one checkpoint."""
    shapes = []
    for m in moments:
        c = m.covariance(ddof=1)
        shapes.append(c / torch.trace(c))
    return torch.stack(shapes).mean(0)


def reference_at(shape: Tensor, moments: Moments) -> Tensor:
    """The IsoScore* reference of one checkpoint: ``shape`` (`pooled_shape`) scaled to
    that checkpoint's own covariance trace. The gradient scale falls by orders of
    magnitude over training; unscaled, the reference would swamp the late checkpoints'
    own covariance. With a pool of one checkpoint the reference is its covariance, and
    the shrinkage ζ has no effect on ΔIsoScore*."""
    return shape * torch.trace(moments.covariance(ddof=1))


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
    warning; left out when 2k ≥ d, where normal controls cannot vary). ``normalized_ratio``
    needs ``activation_moments``. One tridiagonal reduction serves all of them (two with a
    ``reference`` that is not a multiple of the covariance, such as a pool of several
    checkpoints), and the same controls as `energy_test` and `isotropy_test`.
    """
    _check_inputs(gradient_moments, basis, n_controls, "uniform")
    normal = _normal_fits(basis)
    iso = _IsoAfterRemoval(gradient_moments, basis, zeta, reference)
    mc = (n_controls, seed)
    squares = iso.multiple is not None
    draws = _moment_draws(gradient_moments, basis, *mc, normal=normal, squares=squares)
    out = _energy_statistics(gradient_moments, basis, draws, n_controls, activation_moments)
    iso_draws, scale = _iso_draws(iso, gradient_moments, basis, *mc, normal, draws)
    delta_t = iso.delta(basis.basis_)
    uniform = _isotropy(iso, delta_t, iso_draws, scale, n_controls=n_controls, controls="uniform")
    out["delta_iso_tangent"] = uniform.delta_tangent
    out["iso_statistic"] = uniform.statistic
    out["isotropy_p_value"] = uniform.p_value
    if normal:
        others = _isotropy(iso, delta_t, iso_draws, scale, n_controls=n_controls, controls="normal")
        out["delta_iso_normal"] = others.delta_normal
        out["isotropy_p_value_normal"] = others.p_value
    return {k: v for k, v in out.items() if v is not None}


def matrix_tests(
    matrix: Tensor,
    basis: TangentBasis,
    *,
    n_controls: int = 1000,
    seed: int = 0,
    activation_moments: Moments | None = None,
    activation_share: float | None = None,
) -> dict[str, float]:
    """The energy test of a symmetric PSD ``matrix`` S (d × d) in place of a gradient
    second moment, as named statistics: the share ``tr(Q_TᵀSQ_T)/tr(S)`` against the
    same matched-rank controls and cached frames as `tangent_tests`. For statistics that
    are not moments of vectors, such as Σ G Gᵀ over weight gradients G.

    ``tangent_share``, ``chance_share``, ``energy_ratio`` (closed form), ``p_value``
    (uniform controls), ``p_value_normal`` (normal controls; left out when 2k ≥ d) and,
    with ``activation_moments`` or ``activation_share`` (the tangent share of the
    activations' uncentred second moment, all ``normalized_ratio`` reads of them, so a
    probe with a fixed basis keeps two energies instead of d × d moments),
    ``normalized_ratio``.
    """
    if activation_moments is not None and activation_share is not None:
        raise UsageError("pass activation_moments or activation_share, not both.")
    h = matrix if isinstance(matrix, Tensor) else torch.as_tensor(matrix)
    if h.ndim != 2 or h.shape[0] != h.shape[1] or not bool(torch.isfinite(h).all()):
        raise UsageError(f"matrix must be a finite square (d, d) tensor; got {tuple(h.shape)}.")
    _check_basis(basis, h.shape[0], "the matrix")
    check_int(n_controls, "n_controls", minimum=1)
    h = h.to(torch.float64)
    frames = SiteFrames(h, basis.basis_.to(h))
    draws = frames.null(n_controls, seed, normal=_normal_fits(basis), squares=False)
    activation = activation_moments if activation_share is None else float(activation_share)
    out = _energy_statistics(h, basis, draws, n_controls, activation)
    return {k: v for k, v in out.items() if v is not None}
