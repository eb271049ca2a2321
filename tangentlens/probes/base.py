"""The Probe protocol: what is measured at a site, as a mergeable metric.

A probe is a stateful metric in the torchmetrics sense. It declares the sites it
reads (`forward_sites`, `backward_sites`); the session calls `update` with each
forward activation and `update_gradient` with each gradient, as an `Observation`;
`rows` turns the state into results rows. A probe that reads more than sites (the
modules that read a site, say) adds its own hooks in `attach`; the session removes
them with its own. Its state is a set of named `Mergeable` statistics (`Moments`,
`Sum`, `AttentionAccumulator`) registered with `add_state`, so one implementation of
`merge`, `state_dict` / `load_state_dict`, `all_reduce_` and `reset` serves every
probe: shards, processes and checkpoints combine exactly.

Collect, then compute: a `MomentProbe` (residual, gradient, weight gradient) built on
sites alone keeps basis-free state, and its `compute` tests that state against bases
given afterwards; a study collects every checkpoint that way and computes with the same
code a probe session uses. A probe whose state cannot be basis-free (the attention
probe's score split is not linear in Q_T) is built on the bases and runs once they exist.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from tqdm.auto import tqdm

from ..core.digests import tensor_hash
from ..core.errors import CorruptFileError, UsageError
from ..core.results import row  # the probes' row builder, here beside the protocol they follow
from ..core.stats import Moments, SharedBatch
from ..core.subspace import TangentBasis
from ..hooks.base import Backend, Handle
from ..hooks.sites import Site

__all__ = [
    "BASES_KEY",
    "Mergeable",
    "MomentProbe",
    "Observation",
    "Probe",
    "SharedEnergies",
    "Sum",
    "ci_columns",
    "energy_sums",
    "first_equal",
    "row",
    "sites_bar",
]

M = TypeVar("M")
T = TypeVar("T")


@torch.no_grad()
def energy_sums(x: Tensor, basis: TangentBasis, mask: Tensor | None = None) -> Tensor:
    """``[Σ‖x‖², Σ‖x Q_T‖², n]`` over the rows of ``x (..., d)`` kept by ``mask``, float64,
    on x's device (no host sync per batch)."""
    if mask is not None:
        x = x[mask.to(x.device).bool()]
    rows = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
    flat, coords = rows.reshape(-1), basis.coordinates(rows).reshape(-1)
    return torch.stack(
        [
            torch.dot(flat, flat),  # no squared copy
            torch.dot(coords, coords),
            torch.tensor(float(rows.shape[0]), dtype=torch.float64, device=rows.device),
        ]
    )


class SharedEnergies:
    """`energy_sums` of the last (tensor, mask, basis) asked for, reused when the next ask
    reads the same memory against an equal basis: the residual, gradient and
    weight-gradient probes read one activation at a site, and a bridge's ``resid_post`` of
    layer l and ``resid_pre`` of layer l + 1 are one tensor whose bases are equal copies.
    The tensor is held, as `SharedBatch` holds it, and the basis compared by value."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._held: tuple[Tensor, Tensor | None, Tensor] | None = None
        self._sums: Tensor | None = None

    def __call__(self, x: Tensor, mask: Tensor | None, basis: TangentBasis) -> Tensor:
        key = (SharedBatch.key_of(x), SharedBatch.key_of(mask))
        q, held = basis.basis_, self._held
        same = (
            held is not None
            and key == self._key
            and q.shape == held[2].shape
            and q.device == held[2].device
            and torch.equal(q, held[2])
        )
        if not same:
            self._sums = energy_sums(x, basis, mask)
            # detached: the same storage keeps the key valid, without keeping a graph alive
            self._key, self._held = key, (x.detach(), mask, q.detach().clone())
        return self._sums


@dataclass
class Observation:
    """One tensor seen at a site: an activation (forward) or its gradient (backward).

    ``mask`` ``(batch, pos)`` is True at positions that count (padding and positions
    whose gradient is zero by construction are False). `statistics` is computed once
    per tensor and shared by every probe that asks (and by views of the same tensor).
    ``group`` is the index of the forward pass the tensor belongs to (a gradient carries
    its forward pass's index): disjoint sets of whole sequences, for intervals over tokens.
    ``fast``: the batch product may be formed in float32 (`statistics`); the session
    allows it only where every probe reading the site says float32 products are enough
    (`Probe.float32_products`) or under ``memory="compact"``.
    """

    site: Site
    tensor: Tensor
    mask: Tensor | None = None
    cache: SharedBatch = field(default_factory=SharedBatch)
    group: int = 0
    fast: bool = False
    energy_cache: SharedEnergies = field(default_factory=SharedEnergies)

    def statistics(self) -> tuple[int, Tensor, Tensor]:
        """(count, mean, centred scatter) of the kept rows, float64; with ``fast`` the
        scatter's product is formed in `stats.gram_dtype` (float32 for float32 inputs)."""
        return self.cache(self.tensor, self.mask, fast=self.fast)

    def energies(self, basis: TangentBasis) -> Tensor:
        """`energy_sums` of the kept rows against ``basis``, computed once per tensor and
        basis and shared like `statistics`."""
        return self.energy_cache(self.tensor, self.mask, basis)


def ci_columns(interval: tuple[float, float] | None) -> dict[str, float]:
    """``ci_low`` / ``ci_high`` entries of a row, or none without an interval."""
    return {} if interval is None else {"ci_low": interval[0], "ci_high": interval[1]}


class Mergeable(Protocol):
    """A sufficient statistic that combines exactly: `Moments`, `Sum`,
    `tangentlens.probes.attention.AttentionAccumulator`."""

    def merge(self, other: Any) -> Any: ...

    def state_dict(self) -> dict[str, Tensor]: ...

    def load_state_dict(self, state: Mapping[str, Tensor]) -> Any: ...

    def all_reduce_(self, group: Any = None) -> Any: ...


BASES_KEY = "state_bases_sha256"
"""The key of a saved probe state that holds the digest of the bases it was measured
against (`Probe.bases_digest`)."""


class Sum:
    """A tensor of sums (energies, counts): merged by addition; float64, or ``dtype``
    (float32 for d×d sums under ``memory="compact"``)."""

    def __init__(self, shape: tuple[int, ...] = (), dtype: torch.dtype = torch.float64) -> None:
        self.value = torch.zeros(shape, dtype=dtype)

    def add(self, value: Tensor) -> None:
        """``value`` is added where it lives (no host sync per batch)."""
        self.value = value.to(self.value.dtype) + self.value.to(value.device)

    def merge(self, other: Sum) -> Sum:
        if other.value.shape != self.value.shape:
            raise UsageError(f"cannot merge sums of shape {tuple(other.value.shape)}.")
        self.add(other.value)
        return self

    def state_dict(self) -> dict[str, Tensor]:
        return {"sum": self.value.detach().cpu().clone()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> Sum:
        if "sum" not in state:
            raise CorruptFileError("the saved state lacks its 'sum'; it was not written here.")
        value = torch.as_tensor(state["sum"], dtype=self.value.dtype)
        if value.shape != self.value.shape:
            raise UsageError(
                f"the saved sums have shape {tuple(value.shape)}, this probe's "
                f"{tuple(self.value.shape)}: build it as the probe that saved them was "
                "(n_groups, head_null, the model's heads)."
            )
        if not bool(torch.isfinite(value).all()):
            raise CorruptFileError("the saved sums hold NaN or Inf: damaged, not a state.")
        self.value = value.clone()
        return self

    def all_reduce_(self, group: Any = None) -> Sum:
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.value, group=group)
        return self


class Probe:
    """Base class of every probe; subclasses set ``name`` and register their state."""

    name: ClassVar[str] = "probe"
    progress: bool = False  # a bar over the sites in rows() when they take a while
    # whether float32 batch products (about the batch mean) are precise enough for what
    # this probe computes from `Observation.statistics` of activations: a basis (top
    # eigenvectors) is; a ratio with 1 − share in its denominator is not
    float32_products: ClassVar[bool] = False

    def __init__(self) -> None:
        self._states: dict[str, Mergeable] = {}
        self._factories: dict[str, Callable[[], Mergeable]] = {}
        self._bases_digest: Tensor | None = None
        # whether the state came (in part) from `load_state_dict` or `merge` rather than
        # this probe's own passes: a session that ran none still has results to give
        self.loaded = False

    # ------------------------------------------------------------------ sites
    @property
    def forward_sites(self) -> list[Site]:
        """Sites whose activations this probe reads."""
        return []

    @property
    def backward_sites(self) -> list[Site]:
        """Sites whose gradients this probe reads."""
        return []

    @property
    def reads_backward(self) -> bool:
        """Whether this probe needs backward passes: the session then makes the embedding
        output require grad (frozen models) and `run` takes gradients."""
        return bool(self.backward_sites)

    @property
    def last_layer(self) -> int | None:
        """The deepest layer whose forward this probe reads: a forward-only pass may stop
        after that layer's ``resid_post`` (`run`). None: it needs the whole forward. By
        default the deepest of `forward_sites` for a probe without hooks of its own; a
        probe whose `attach` adds hooks says where they are (they could read the logits)."""
        if type(self).attach is not Probe.attach or not self.forward_sites:
            return None
        return max(site.layer for site in self.forward_sites)

    def saw_backward(self) -> bool:
        """Whether a backward pass reached this probe through its own hooks (`attach`);
        the session counts those through its sites itself."""
        return False

    def attach(self, backend: Backend) -> list[Handle]:
        """Hooks of the probe's own, beyond its sites; the session removes every one in
        ``finally``, with its own hooks. Default: none."""
        return []

    def update(self, obs: Observation) -> None:
        """Fold in one forward activation at ``obs.site``."""
        raise NotImplementedError(f"{type(self).__name__} reads no activations.")

    def update_gradient(self, obs: Observation) -> None:
        """Fold in one gradient at ``obs.site``."""
        raise NotImplementedError(f"{type(self).__name__} reads no gradients.")

    def rows(self) -> list[dict[str, Any]]:
        """Results rows from the current state."""
        raise NotImplementedError

    # ------------------------------------------------------------------ state
    def add_state(self, key: str, factory: Callable[[], M]) -> M:
        """Register a mergeable state under ``key``; ``factory()`` makes it afresh."""
        self._factories[key] = factory
        self._states[key] = factory()
        return self._states[key]  # type: ignore[return-value]

    def state(self, key: str) -> Any:
        return self._states[key]

    def reset(self) -> None:
        """Forget everything seen; the sites and options stay."""
        self._states = {key: make() for key, make in self._factories.items()}
        self.loaded = False

    def merge(self, other: Probe) -> Probe:
        """Fold ``other``'s state (same probe, same sites, same bases) into this one; exact."""
        if type(other) is not type(self) or set(other._states) != set(self._states):
            raise UsageError(
                f"cannot merge {type(other).__name__} into {type(self).__name__}: "
                "merge probes of one kind built on the same sites."
            )
        mine, theirs = self.state_bases(), other.state_bases()
        if mine.keys() != theirs.keys() or any(
            not _same_basis(b, mine[s]) for s, b in theirs.items()
        ):
            raise UsageError(
                f"cannot merge this {type(self).__name__}: its state was measured against "
                "other bases; merge shards probed with the same bases (one fit_bases result)."
            )
        for key, state in other._states.items():
            self._states[key].merge(state)
        self.loaded = True
        return self

    def state_bases(self) -> dict[Any, Any]:
        """The bases the state was measured against, by site (none: a basis-free state):
        `merge` folds only states measured against the same ones."""
        return {}

    def bases_digest(self) -> Tensor | None:
        """SHA-256 (32 bytes) of `state_bases`, which a saved state carries under
        `BASES_KEY` so that it loads only into a probe measuring against the same bases
        (None: a basis-free state). The bases are fixed at construction: computed once."""
        bases = self.state_bases()
        if bases and self._bases_digest is None:
            named = {repr(site): basis.basis_ for site, basis in bases.items()}
            digest = bytes.fromhex(tensor_hash(named))
            self._bases_digest = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
        return self._bases_digest if bases else None

    def state_dict(self) -> dict[str, Tensor]:
        out = {
            f"{key}/{name}": t.detach().cpu().clone()
            for key, state in self._states.items()
            for name, t in state.state_dict().items()
        }
        digest = self.bases_digest()
        return out if digest is None else out | {BASES_KEY: digest.clone()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> Probe:
        """Replace the state by ``state`` (from `state_dict` of a probe built the same way:
        sites, options, and the same bases when it was measured against bases)."""
        name = type(self).__name__
        known = tuple(f"{key}/" for key in self._factories)
        extra = sorted(k for k in state if not k.startswith(known) and k != BASES_KEY)
        if extra:
            raise CorruptFileError(
                f"the saved state holds {extra[:3]}, which this {name} does not "
                "hold: load a state saved by a probe built the same way (sites, n_groups)."
            )
        saved, mine = state.get(BASES_KEY), self.bases_digest()
        if saved is None and mine is not None:
            raise UsageError(
                f"the saved {name} state does not say which bases it was measured against "
                f"(no {BASES_KEY}), and this probe reads bases: load a state saved by "
                "`state_dict` of a probe on these bases."
            )
        if saved is not None and (mine is None or not torch.equal(torch.as_tensor(saved), mine)):
            raise UsageError(
                f"the saved {name} state was measured against other bases than this probe's "
                "(another Q_T, rank or null frames): load it into a probe built on the bases "
                "it was saved with."
            )
        states = {}
        for key, make in self._factories.items():
            prefix = f"{key}/"
            own = {k.removeprefix(prefix): t for k, t in state.items() if k.startswith(prefix)}
            if not own:
                raise CorruptFileError(
                    f"the saved state has nothing for {key}; load a state saved by the same "
                    f"{name} (same sites)."
                )
            try:
                states[key] = make().load_state_dict(own)
            except (UsageError, CorruptFileError) as err:
                raise type(err)(f"{name} state {key}: {err}") from err
        self._states = states  # all or nothing: a refused state leaves this one as it was
        self.loaded = True
        return self

    def all_reduce_(self, group: Any = None, *, d: int | None = None) -> Probe:
        """Sum the state over the ranks of ``torch.distributed`` in place (no-op when it
        is not initialised): every rank ends with the statistics of all ranks. ``d``
        sizes the `Moments` this rank saw no data for, so every rank joins each reduce."""
        if not (dist.is_available() and dist.is_initialized()):
            return self
        for key in sorted(self._states):
            state = self._states[key]
            if isinstance(state, Moments) and state.count == 0 and d is not None:
                state = self._states[key] = Moments(d=d, dtype=state.dtype)
            state.all_reduce_(group)
        return self

    def state_bytes(self, d: int) -> int:
        """Bytes this probe's state takes once it has seen vectors of dimension ``d``:
        `Moments` not yet sized are sized on the meta device (nothing is allocated)."""
        total = 0
        for state in self._states.values():
            if isinstance(state, Moments):
                sized = state if state.count else Moments(d, device="meta", dtype=state.dtype)
                total += sized.nbytes
            elif isinstance(state, Sum):
                total += state.value.nbytes
            else:
                total += sum(t.nbytes for t in state.state_dict().values())
        return total

    def __repr__(self) -> str:
        sites = sorted({s.hook_name for s in self.forward_sites + self.backward_sites})
        return f"{type(self).__name__}({len(sites)} sites)"


class MomentProbe(Probe):
    """A probe that collects first and tests against bases after: `compute` is the one
    implementation of its statistics, whichever way its state was collected.

    Built on sites alone (a list), the state is basis-free (second moments per group of
    sequences), so `compute` takes bases fitted after the pass: a study collects each
    checkpoint this way, saves the `state_dict`, and computes once Q_T exists. Built on
    bases (site → Q_T), the state may keep only what `compute` reads for those bases
    (their projections: a few floats per group instead of a d × d matrix each), and
    `compute` then takes those bases alone. `rows` is `compute` against the
    construction's bases (no rows without any: nothing to test against)."""

    def _set_sites(self, bases: Mapping[Site, Any] | Sequence[Site]) -> None:
        self.sites: list[Site] = list(bases)
        self.bases: dict[Site, Any] = dict(bases) if isinstance(bases, Mapping) else {}

    @property
    def basis_free(self) -> bool:
        """Whether the state depends on no basis (built on sites alone)."""
        return not self.bases

    def state_bases(self) -> dict[Any, Any]:
        return dict(self.bases)

    def compute(self, bases: Mapping[Site, Any] | None = None, **context: Any) -> list[dict]:
        """Results rows of the state against ``bases`` (default: the construction's)."""
        raise NotImplementedError

    def rows(self) -> list[dict[str, Any]]:
        return self.compute() if self.bases else []

    def against(self, bases: Mapping[Site, Any] | None) -> dict[Site, Any]:
        """The bases `compute` tests this probe's sites against: ``bases`` restricted to
        them (sites without one are skipped), or the construction's. A state kept for its
        own bases holds their projections only, so other bases are a `UsageError`."""
        if bases is None:
            if not self.bases:
                raise UsageError(
                    f"this {type(self).__name__} was built on sites alone: pass the bases to "
                    "compute against (site -> TangentBasis)."
                )
            return dict(self.bases)
        chosen = {s: bases[s] for s in self.sites if s in bases}
        if self.bases and any(
            s not in self.bases or not _same_basis(b, self.bases[s]) for s, b in chosen.items()
        ):
            raise UsageError(
                f"this {type(self).__name__} kept only the projections on the bases it was "
                "built with; build it on the sites alone (a list) to compute against others."
            )
        return chosen


def _same_basis(a: Any, b: Any) -> bool:
    return a is b or torch.equal(a.basis_, b.basis_)


def first_equal(items: Sequence[T], same: Callable[[T, T], bool]) -> list[int]:
    """For each item, the index of the first item ``same`` as it (its own index if none
    before it is): two names of one tensor (``resid_post`` of layer l is ``resid_pre`` of
    l + 1 on a bridge) are then decomposed or tested once. Compares with the first of
    each kind only."""
    out: list[int] = []
    firsts: list[int] = []
    for i, item in enumerate(items):
        j = next((f for f in firsts if same(items[f], item)), i)
        if j == i:
            firsts.append(i)
        out.append(j)
    return out


def sites_bar(items: Iterable[T], probe: Probe, total: int | None = None) -> Iterable[T]:
    """``items`` behind a progress bar named after ``probe``, shown only when the loop
    takes more than two seconds (and ``probe.progress`` is on); ``total`` for an
    iterator (else the items are listed first)."""
    return tqdm(
        list(items) if total is None else items,
        total=total,
        desc=f"{probe.name} tests",
        delay=2.0,
        disable=not probe.progress,
        leave=False,
    )
