"""Streaming, mergeable sufficient statistics of vectors.

`Moments` keeps the count, the mean and the centred scatter matrix of a stream
of d-dimensional vectors, whatever the input dtype or device. Batches are combined
with Chan et al.'s pairwise formulas, which are exact in exact arithmetic and
numerically stable: a stream whose mean is large against its spread keeps its
covariance in float64, where a naive E[xxᵀ] − μμᵀ loses it to cancellation.

Precision rule (`gram_dtype`). A batch's d×d product is formed in float32 when the
activations are float32, float16 or bfloat16 and float32 matmuls on their device are
IEEE (not TF32 / bf16 passes), and the caller asks for it (``fast=True``); in float64
otherwise. The probes ask only where float32 is enough for what they compute
(`Probe.float32_products`: `fit_bases`, whose bases they barely move) or under
``memory="compact"``: gradients (ΔIso* is a small difference of IsoScore* values, which
float32 products move far more than a share) and the activations behind
``normalized_ratio`` (1 − share sits in a denominator) keep float64 products.
`Moments.update` keeps float64 products. The float32 product is formed about the batch's
own mean rounded to float32 (the offset of that centre corrected in float64), scaled by a
power of two where its squares would leave float32's range, so neither a large mean nor
that range costs precision, then added into float64 state.
`benchmarks/bench_accumulation.py` measures how far each statistic moves
(docs/PERFORMANCE.md).

Memory (`MEMORY`). ``memory="full"`` keeps the scatter in float64 (8·d² bytes);
``"compact"`` in float32 (4·d² bytes), for d ≥ 2048: half the memory, every statistic
still read in float64. The mean (d floats) is float64 in both. Of the statistics, the
controls' mean ΔIso* (``delta_iso_normal``, a small difference) moves the most against
full; docs/PERFORMANCE.md has the comparison and its command.

The sum and the uncentred Gram matrix are derived on demand, so every use
(`covariance`, `second_moment`, merge, all-reduce) reads one consistent state.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from .errors import CorruptFileError, UsageError
from .validation import check_int

__all__ = [
    "MEMORY",
    "Moments",
    "SharedBatch",
    "batch_statistics",
    "gram_dtype",
    "in_float32_range",
    "scatter_of",
    "state_dtype",
    "unit_scale",
]

MEMORY = {"full": torch.float64, "compact": torch.float32}


def state_dtype(memory: str) -> torch.dtype:
    """The dtype of d×d state for a ``memory`` mode (see the module docstring)."""
    if memory not in MEMORY:
        raise UsageError(f"memory must be one of {sorted(MEMORY)}; got {memory!r}.")
    return MEMORY[memory]


def _ieee_float32_matmul(device: torch.device) -> bool:
    """Whether float32 matmuls on ``device`` run in IEEE float32, not in TF32 or bf16
    passes (`torch.set_float32_matmul_precision`, ``fp32_precision``). Unknown: no."""
    backends = {"cuda": torch.backends.cuda, "cpu": torch.backends.mkldnn}
    try:
        own = backends[device.type].matmul.fp32_precision
        return (own if own != "none" else torch.backends.fp32_precision) in ("none", "ieee")
    except (KeyError, AttributeError, RuntimeError):
        return False


def gram_dtype(x: Tensor) -> torch.dtype:
    """The dtype of the per-batch products of ``x`` (the module docstring's rule):
    float32 for float32/float16/bfloat16 activations where float32 matmuls are IEEE,
    float64 otherwise."""
    low = x.dtype in (torch.float32, torch.float16, torch.bfloat16)
    return torch.float32 if low and _ieee_float32_matmul(x.device) else torch.float64


def unit_scale(*tensors: Tensor) -> Tensor:
    """2^-e with 2^(e-1) ≤ max|t| < 2^e over every entry of ``tensors`` (1 for zeros), on
    their device: multiplying by it is exact and brings them into [-1, 1), so float32
    products neither overflow nor underflow."""
    # one pass, no |t| copy; a transposed view (a weight's gradient) read as its
    # contiguous buffer: the same entries, in the order aminmax reads fast
    dense = (t.mT if t.ndim == 2 and t.mT.is_contiguous() else t for t in tensors)
    peaks = [torch.maximum(high, -low) for low, high in map(torch.aminmax, dense)]
    peak = peaks[0] if len(peaks) == 1 else torch.stack(peaks).amax()
    return torch.ldexp(torch.ones((), device=peak.device), -torch.frexp(peak)[1])


def in_float32_range(gram: Tensor) -> bool:
    """Whether a float32 Gram matrix A·Aᵀ formed from unscaled factors is the one their
    `unit_scale` twin gives. Its diagonal bounds every entry and every product that formed
    one: between 2^-30 and 2^100 nothing overflowed, only products 2^-96 below the peak
    could underflow, and a power-of-two scale would round every sum alike. Outside that
    (or NaN / Inf), form it again scaled."""
    return 2.0**-30 <= float(gram.diagonal().max()) <= 2.0**100


def scatter_of(rows: Tensor, mean: Tensor, *, fast: bool = False) -> Tensor:
    """Σ (x − x̄)(x − x̄)ᵀ over the rows of ``rows`` (n, d) with ``mean`` x̄ (float64),
    returned in float64; the product in float64, or with ``fast`` in `gram_dtype`: about
    x̄ rounded to float32 (the offset of that centre corrected in float64), scaled by a
    power of two only where its squares leave float32's range (`in_float32_range`)."""
    work = gram_dtype(rows) if fast else torch.float64
    if work == torch.float64:
        centred = rows.to(torch.float64) - mean
        return centred.T @ centred
    centre = mean.to(work)
    centred = rows.to(work) - centre
    offset = mean - centre.to(torch.float64)  # x̄ − centre, exactly
    gram = centred.T @ centred
    if in_float32_range(gram):
        gram = gram.to(torch.float64)
    else:
        scale = unit_scale(centred)
        centred.mul_(scale)
        gram = (centred.T @ centred).to(torch.float64).mul_(scale.to(torch.float64) ** -2)
    return gram.addr_(offset, offset, alpha=-rows.shape[0])  # in place: d × d passes cost


@torch.no_grad()
def batch_statistics(
    x: Tensor, mask: Tensor | None = None, *, fast: bool = False
) -> tuple[int, Tensor, Tensor]:
    """(count, mean, centred scatter) of the rows of ``x`` ``(..., d)``, in float64
    (the scatter's product in float64, or with ``fast`` in `gram_dtype`).

    ``mask`` (shape ``x.shape[:-1]``) keeps positions where it is true.
    """
    if not isinstance(x, Tensor):
        x = torch.as_tensor(x)
    if x.ndim < 1:
        raise UsageError("x must have shape (..., d); got a scalar. Pass vectors as rows.")
    if x.shape[-1] == 0:
        raise UsageError(f"x must have shape (..., d) with d ≥ 1; got {tuple(x.shape)}.")
    if mask is not None:
        mask = torch.as_tensor(mask, device=x.device).bool()
        if tuple(mask.shape) != tuple(x.shape[:-1]):
            raise UsageError(
                f"mask must have shape x.shape[:-1] = {tuple(x.shape[:-1])}; "
                f"got {tuple(mask.shape)}."
            )
        x = x[mask]
    rows = x.detach().reshape(-1, x.shape[-1])
    n, d = rows.shape
    if n == 0:
        zeros = torch.zeros(d, d, dtype=torch.float64, device=rows.device)
        return 0, torch.zeros(d, dtype=torch.float64, device=rows.device), zeros
    mean = rows.sum(0, dtype=torch.float64) / n
    scatter = scatter_of(rows, mean, fast=fast)
    # NaN or Inf anywhere in the batch reaches its mean or the scatter's diagonal, and so
    # their largest entries: an O(d) check instead of a pass over every element.
    if not math.isfinite(float(mean.abs().max() + scatter.diagonal().max())):
        raise UsageError(
            "x contains NaN or Inf; check the model's dtype (overflow in float16?) "
            "or mask the offending positions with mask=."
        )
    return n, mean, scatter


def _memory_of(device: torch.device) -> int | None:
    """Bytes of memory on ``device`` (the machine's RAM for the CPU), None if unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError, RuntimeError):
        pass
    return None


def _check_fits(d: int, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a d×d scatter larger than the device's whole memory up front: an absurd
    ``d`` (a count or a sequence length passed by mistake) otherwise ends in the kernel's
    out-of-memory killer or a torch allocation error that names neither ``d`` nor why."""
    need = d * d * dtype.itemsize + d * 8
    have = _memory_of(device)
    if have is not None and need > have:
        raise UsageError(
            f"Moments with d={d:,} need {need / 2**30:,.1f} GiB for the d×d scatter, more "
            f"than the {have / 2**30:,.1f} GiB of {device}; check d (the width of the "
            "vectors, e.g. d_model)."
        )


class SharedBatch:
    """`batch_statistics` of the last tensor seen, reused when the next call sees the same
    memory: a TransformerLens bridge's ``resid_post`` of layer l and ``resid_pre`` of layer
    l + 1 are views of one tensor. A reference to that tensor is held, so its address
    cannot be reused while the entry lives; in-place edits bump ``_version`` and miss. An
    inference tensor (`torch.inference_mode`) has no version, so it never hits."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._held: tuple[Tensor, Tensor | None] | None = None
        self._stats: tuple[int, Tensor, Tensor] | None = None

    @staticmethod
    def key_of(t: Tensor | None) -> tuple | None:
        """Identity of a tensor's contents while a reference to it is held: address,
        layout, dtype, device and in-place version (for an inference tensor, which has
        none, a key equal to no other)."""
        if t is None:
            return None
        version = object() if t.is_inference() else t._version
        return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, version)

    def __call__(
        self, x: Tensor, mask: Tensor | None = None, *, fast: bool = False
    ) -> tuple[int, Tensor, Tensor]:
        key = (self.key_of(x), self.key_of(mask), fast)
        if self._stats is None or key != self._key:
            self._stats = batch_statistics(x, mask, fast=fast)
            # detached: the same storage keeps the key valid, without keeping a graph alive
            self._key, self._held = key, (x.detach(), mask)
        return self._stats


class Moments:
    """Count, sum and Gram matrix of a stream of vectors, read in float64.

    >>> m = Moments()
    >>> m.update(torch.randn(8, 128, 64))     # (..., d); d inferred on first use
    >>> m.covariance().shape
    torch.Size([64, 64])

    State: ``count`` (number of vectors), ``mean_`` (d,), ``scatter`` (d, d) =
    Σ (x − mean)(x − mean)ᵀ. ``sum`` and ``gram`` (Σ x xᵀ) are derived. ``dtype``: the
    scatter's storage, float64 or float32 (``memory="compact"``); reads are float64.
    """

    def __init__(
        self,
        d: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        if dtype not in MEMORY.values():
            raise UsageError(f"Moments store float64 or float32; got dtype={dtype}.")
        self.dtype = dtype
        self._n = 0
        self._mean: Tensor | None = None
        self._scatter: Tensor | None = None
        self._device = torch.device(device) if device is not None else None
        if d is not None:
            self._init(d, self._device or torch.device("cpu"))

    def _init(self, d: int, device: torch.device) -> None:
        check_int(d, "d", minimum=1)
        _check_fits(d, self.dtype, device)
        self._device = device
        self._mean = torch.zeros(d, dtype=torch.float64, device=device)
        self._scatter = torch.zeros(d, d, dtype=self.dtype, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes of the state's tensors (0 before the first update)."""
        return sum(t.nbytes for t in (self._mean, self._scatter) if t is not None)

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def update(self, x: Tensor, mask: Tensor | None = None) -> Moments:
        """Add the vectors of ``x`` (shape ``(..., d)``); ``mask`` (shape ``x.shape[:-1]``)
        keeps positions where it is true (e.g. an attention mask dropping padding)."""
        return self.add_batch(*batch_statistics(x, mask))

    def add_batch(self, n_b: int, mean_b: Tensor, scatter_b: Tensor) -> Moments:
        """Fold in a batch given as `batch_statistics` returns it (count, mean, scatter)."""
        if self._mean is None:
            self._init(mean_b.shape[0], self._device or mean_b.device)
        if mean_b.shape[0] != self.d:
            raise UsageError(
                f"x has d={mean_b.shape[0]} but these Moments hold d={self.d}; "
                "use one Moments per site."
            )
        if n_b:
            self._combine(n_b, mean_b.to(self._device), scatter_b.to(self._device))
        return self

    def _combine(self, n_b: int, mean_b: Tensor, scatter_b: Tensor) -> None:
        n_a = self._n
        n = n_a + n_b
        if n == 0:
            return
        if n_a == 0:  # the formula below with n_a = 0, bit for bit, without its d² work
            self._mean.copy_(mean_b)
            self._scatter.copy_(scatter_b)
            self._n = n
            return
        delta, weight = mean_b - self._mean, n_a * n_b / n
        self._mean += delta * (n_b / n)
        if self.dtype == torch.float64:  # in place, no d × d temporaries
            self._scatter += scatter_b
            self._scatter.addr_(delta, delta, alpha=weight)
        else:  # rounded to the state's float32 once
            self._scatter += (scatter_b + torch.outer(delta, delta) * weight).to(self.dtype)
        self._n = n

    # ------------------------------------------------------------------- merge
    def merge(self, other: Moments) -> Moments:
        """Fold ``other`` into ``self`` (Chan's formula; exact) and return ``self``."""
        if not isinstance(other, Moments):
            raise TypeError(f"merge takes a Moments; got {type(other).__name__}.")
        if other._mean is None:
            return self
        if self._mean is None:
            self._init(other.d, self._device or other._device)
        if other.d != self.d:
            raise UsageError(f"cannot merge Moments with d={other.d} into d={self.d}.")
        self._combine(other._n, other._mean.to(self._device), other._scatter64().to(self._device))
        return self

    @classmethod
    def merged(cls, parts: Iterable[Moments], *, dtype: torch.dtype = torch.float64) -> Moments:
        """New Moments holding the merge of ``parts`` in order (none: empty). A fresh
        object, so callers that pool groups, halves or checkpoints never fold into, and
        so alter, one of the parts they were handed."""
        out = cls(dtype=dtype)
        for part in parts:
            out.merge(part)
        return out

    def remove(self, other: Moments) -> Moments:
        """Take the sub-stream ``other`` back out of ``self`` (Chan's formula inverted) and
        return ``self``: the moments of the rest, with no second pass over the data (what a
        leave-one-group-out jackknife needs). Exact in exact arithmetic; removing a stream
        that was never merged in is caught when it leaves a negative variance."""
        if not isinstance(other, Moments):
            raise TypeError(f"remove takes a Moments; got {type(other).__name__}.")
        if other._n == 0:
            return self
        if self._mean is None or other.d != self.d or other._n > self._n:
            raise UsageError(
                f"cannot remove {other!r} from {self!r}: it must be a sub-stream "
                "(same d, at most as many vectors)."
            )
        n_a, n_b = self._n, other._n
        n = n_a - n_b
        mean_b, scatter_b = other._mean.to(self._device), other._scatter64().to(self._device)
        if n == 0:
            self._n = 0
            self._mean.zero_()
            self._scatter.zero_()
            return self
        mean = (self._mean * n_a - mean_b * n_b) / n
        delta = mean_b - mean
        between = torch.outer(delta, delta) * (n * n_b / n_a)
        own = self._scatter64()
        scatter = own - scatter_b - between
        slack = 1e-8 * (own.diagonal() + scatter_b.diagonal() + between.diagonal())
        if bool((scatter.diagonal() < -slack).any()):
            raise UsageError(
                "removing these Moments leaves a negative variance: they are not a sub-stream "
                "of the Moments they were removed from."
            )
        self._n, self._mean, self._scatter = n, mean, scatter.to(self.dtype)
        return self

    def __add__(self, other: Moments) -> Moments:
        return self.copy().merge(other)

    def __sub__(self, other: Moments) -> Moments:
        return self.copy().remove(other)

    def copy(self) -> Moments:
        out = Moments(dtype=self.dtype)
        out.load_state_dict(self.state_dict())
        return out

    # -------------------------------------------------------------- properties
    @property
    def d(self) -> int:
        if self._mean is None:
            raise UsageError("these Moments are empty: call update() with data first.")
        return int(self._mean.shape[0])

    @property
    def count(self) -> int:
        return self._n

    @property
    def device(self) -> torch.device | None:
        return self._device

    def _require_data(self, what: str, minimum: int = 1) -> None:
        if self._n < minimum:
            raise UsageError(
                f"{what} needs at least {minimum} vector(s); these Moments hold {self._n}. "
                "Feed more tokens with update()."
            )

    def _scatter64(self) -> Tensor:
        return self._scatter.to(torch.float64)

    @property
    def mean(self) -> Tensor:
        self._require_data("mean")
        return self._mean.clone()

    @property
    def sum(self) -> Tensor:
        self._require_data("sum", 0)
        return self._mean * self._n if self._mean is not None else torch.zeros(0)

    @property
    def gram(self) -> Tensor:
        """Σ x xᵀ (uncentred)."""
        self._require_data("gram")
        return self._scatter64() + torch.outer(self._mean, self._mean) * self._n

    def covariance(self, ddof: int = 0) -> Tensor:
        """Centred covariance Σ (x − μ)(x − μ)ᵀ / (count − ddof).

        ``ddof=0`` (default) is the maximum-likelihood normalisation used by every
        metric here; ``ddof=1`` gives the unbiased sample covariance (numpy's default).
        """
        self._require_data("covariance", ddof + 1)
        return self._scatter64() / (self._n - ddof)

    def second_moment(self) -> Tensor:
        """Uncentred second moment E[x xᵀ] = Σ x xᵀ / count."""
        self._require_data("second_moment")
        return self._scatter64() / self._n + torch.outer(self._mean, self._mean)

    def trace_second_moment(self) -> float:
        """E‖x‖² without forming the d×d matrix."""
        self._require_data("trace_second_moment")
        trace = torch.diagonal(self._scatter).sum(dtype=torch.float64)
        return float(trace / self._n + self._mean @ self._mean)

    def identical(self, other: Moments) -> bool:
        """Bit for bit the same state: the same stream, e.g. two names of one tensor
        (a bridge's ``resid_post`` of layer l is ``resid_pre`` of layer l + 1)."""
        if self._n != other._n or (self._mean is None) != (other._mean is None):
            return False
        return self._mean is None or (
            torch.equal(self._mean, other._mean) and torch.equal(self._scatter, other._scatter)
        )

    # -------------------------------------------------------------- state_dict
    def state_dict(self) -> dict[str, Tensor]:
        if self._mean is None:
            return {"count": torch.tensor(0, dtype=torch.int64)}
        return {
            "count": torch.tensor(self._n, dtype=torch.int64),
            "mean": self._mean.clone(),
            "scatter": self._scatter.clone(),
        }

    def load_state_dict(self, state: Mapping[str, Tensor]) -> Moments:
        if "count" not in state:
            raise CorruptFileError(
                "state has no 'count'; it was not written by Moments.state_dict()."
            )
        try:
            count = torch.as_tensor(state["count"])
            n = int(count)
            if count.is_floating_point() or count.dtype == torch.bool:
                raise TypeError(f"count of dtype {count.dtype}")
            if n == 0 and "mean" not in state:
                self._n, self._mean, self._scatter = 0, None, None
                return self
            mean = torch.as_tensor(state["mean"], dtype=torch.float64)
            scatter = torch.as_tensor(state["scatter"], dtype=self.dtype)
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise CorruptFileError(
                f"corrupt Moments state ({type(err).__name__}: {err}); recompute the statistics."
            ) from err
        d = mean.shape[0] if mean.ndim else 0
        if mean.ndim != 1 or tuple(scatter.shape) != (d, d) or n < 0:
            raise CorruptFileError(
                f"corrupt Moments state: mean {tuple(mean.shape)}, scatter {tuple(scatter.shape)}, "
                f"count {n}."
            )
        if not (bool(torch.isfinite(mean).all()) and bool(torch.isfinite(scatter).all())):
            raise CorruptFileError(
                "corrupt Moments state: NaN or infinite values in its mean or scatter; "
                "recompute the statistics."
            )
        self._device = mean.device if self._device is None else self._device
        self._n = n
        self._mean = mean.to(self._device).clone()
        self._scatter = scatter.to(self._device).clone()
        return self

    # -------------------------------------------------------------- distributed
    def all_reduce_(self, group: object | None = None) -> Moments:
        """Merge these Moments across all ranks of ``torch.distributed`` in place.

        Sends count, sum and Gram (plain sums) then re-centres; every rank ends
        with the pooled statistics. A no-op when torch.distributed is not initialised.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self
        if self._mean is None:
            raise UsageError(
                "all_reduce_ needs d on every rank: construct Moments(d=...) "
                "or update before reducing."
            )
        n = torch.tensor([float(self._n)], dtype=torch.float64, device=self._device)
        s = self._mean * self._n
        # A shifted Gram keeps precision: reduce Σ(x − c)(x − c)ᵀ about a shared centre c.
        centre = s.clone()
        dist.all_reduce(centre, group=group)
        dist.all_reduce(n, group=group)
        total = int(n.item())
        if total == 0:
            return self
        centre /= total
        dm = self._mean - centre
        shifted = self._scatter64() + torch.outer(dm, dm) * self._n
        dist.all_reduce(shifted, group=group)
        self._n = total
        self._mean = centre
        self._scatter = shifted.to(self.dtype)
        return self

    def __repr__(self) -> str:
        d = self.d if self._mean is not None else None
        return f"Moments(d={d}, count={self._n})"
