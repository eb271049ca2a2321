"""Activation probe: `Moments` per site (to fit Q_T) and a bounded, seeded reservoir
sample of activation vectors (for TwoNN and other point-cloud metrics).

The token samples for TwoNN live here, and there are two on purpose:

- `Reservoir` samples a stream of unknown length: Vitter's algorithm R driven by a numpy
  PCG64 stream of one draw per token, so the sample depends on the seed and the token
  order only, not on how the tokens are split into batches. It is one process's sample
  (not part of a probe's mergeable state). The probe and the linear probes use it.
- `FixedSample` samples a token set known in advance (a study's probe set): its
  positions are drawn up front, uniformly without replacement, and each row is written by
  the pass that holds its token, so the sample is the same however the set is split over
  batches, processes or resumed checkpoints: what a study's per-checkpoint parts need to
  be comparable and mergeable. A reservoir cannot promise that across processes.

Memory: ``size × d`` float32 per site for either, whatever the number of tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..core.errors import UsageError
from ..core.stats import Moments, state_dtype
from ..core.validation import check_int
from ..hooks.sites import Site
from .base import Observation, Probe, row
from .bases import site_order
from .registry import Plan, ProbeSpec, register

__all__ = ["ActivationProbe", "FixedSample", "Reservoir"]


class Reservoir:
    """A uniform sample of at most ``size`` rows from a stream (algorithm R), with
    optional integer ``tags`` per row (a label, the sequence it came from) kept aligned."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = check_int(size, "reservoir size", minimum=1)
        self.seen = 0
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._rows: Tensor | None = None
        self._tags: Tensor | None = None

    @torch.no_grad()
    def update(
        self, x: Tensor, mask: Tensor | None = None, tags: Tensor | None = None
    ) -> Reservoir:
        """Offer the rows of ``x`` ``(..., d)`` kept by ``mask``; ``tags`` ``(..., m)``
        int64 travel with their rows."""
        if tags is not None and tuple(tags.shape[:-1]) != tuple(x.shape[:-1]):
            raise UsageError(
                f"tags must be x.shape[:-1] + (m,) = {tuple(x.shape[:-1])} + (m,); "
                f"got {tuple(tags.shape)}."
            )
        if mask is not None:
            keep = mask.to(x.device).bool()
            x = x[keep]
            tags = None if tags is None else tags.to(keep.device)[keep]
        rows = x.detach().reshape(-1, x.shape[-1]).to("cpu", torch.float32)
        n = rows.shape[0]
        if n == 0:
            return self
        if self._rows is None:
            self._rows = torch.empty(self.size, rows.shape[1], dtype=torch.float32)
            if tags is not None:
                self._tags = torch.empty(self.size, tags.shape[-1], dtype=torch.int64)
        flat_tags = None if tags is None else tags.reshape(n, -1).to("cpu", torch.int64)
        t = self.seen + np.arange(n)  # global index of each row
        slot = np.floor(self._rng.random(n) * (t + 1)).astype(np.int64)
        slot[t < self.size] = t[t < self.size]
        for i in np.flatnonzero(slot < self.size):  # later rows overwrite earlier ones
            self._rows[slot[i]] = rows[i]
            if self._tags is not None and flat_tags is not None:
                self._tags[slot[i]] = flat_tags[i]
        self.seen += n
        return self

    def sample(self) -> Tensor:
        """The sample, ``(min(size, seen), d)`` float32."""
        if self._rows is None:
            raise UsageError("the reservoir is empty; run some tokens through the model first.")
        return self._rows[: min(self.size, self.seen)].clone()

    def tags(self) -> Tensor:
        """The sampled rows' tags, ``(min(size, seen), m)`` int64."""
        if self._tags is None:
            raise UsageError("this reservoir was fed without tags.")
        return self._tags[: min(self.size, self.seen)].clone()


class FixedSample:
    """Activations of ``min(size, n_seq · seq_len)`` probe tokens of an ``(n_seq, seq_len)``
    set, drawn from ``seed`` uniformly without replacement before any pass (see the module
    for why this and not a `Reservoir`). ``hook(site)`` fills ``buffers[site]``; set
    ``start`` to the first sequence of each batch before running it. ``seq`` / ``pos``: the
    sampled tokens' sequence and position, in order."""

    def __init__(
        self, size: int, seed: int, shape: tuple[int, int], sites: list[Site], d: int
    ) -> None:
        n_seq, seq_len = shape
        size = min(size, n_seq * seq_len)
        rng = np.random.default_rng(seed)
        flat = torch.as_tensor(np.sort(rng.choice(n_seq * seq_len, size=size, replace=False)))
        self.seq, self.pos = flat // seq_len, flat % seq_len
        self.buffers = {s: torch.zeros(size, d) for s in sites} if size else {}
        self.start = 0  # first probe sequence of the batch being run

    def hook(self, site: Site) -> Any:
        buffer = self.buffers[site]

        def fn(x: Tensor) -> None:
            sel = (self.seq >= self.start) & (self.seq < self.start + x.shape[0])
            if bool(sel.any()):
                rows = x.detach()[self.seq[sel] - self.start, self.pos[sel]]
                buffer[sel] = rows.to("cpu", torch.float32)

        return fn


class ActivationProbe(Probe):
    """`Moments` of the activations at each site, and optionally a `Reservoir` (a
    per-process sample: it is not part of the mergeable state). Memory per site:
    8d² + 8d bytes (``memory="full"``) or 4d² + 8d (``"compact"``), plus 4·reservoir·d."""

    name = "activation"
    float32_products = True  # what it feeds is a basis, which float32 products barely move

    def __init__(
        self, sites: list[Site], *, reservoir: int = 0, seed: int = 0, memory: str = "full"
    ) -> None:
        super().__init__()
        reservoir = check_int(reservoir, "reservoir (0: no sample)", minimum=0)
        dtype = state_dtype(memory)
        self._sites = list(sites)
        for site in self._sites:
            self.add_state(site.hook_name, lambda: Moments(dtype=dtype))
        self.reservoirs: dict[Site, Reservoir] = (
            {s: Reservoir(reservoir, seed=seed + i) for i, s in enumerate(sites)}
            if reservoir
            else {}
        )

    @property
    def forward_sites(self) -> list[Site]:
        return list(self._sites)

    @property
    def moments(self) -> dict[Site, Moments]:
        """Site → activation `Moments`."""
        return {s: self.state(s.hook_name) for s in self._sites}

    def update(self, obs: Observation) -> None:
        self.state(obs.site.hook_name).add_batch(*obs.statistics())
        if obs.site in self.reservoirs:
            self.reservoirs[obs.site].update(obs.tensor, obs.mask)

    def all_reduce_(self, group: Any = None, *, d: int | None = None) -> ActivationProbe:
        if self.reservoirs:
            raise UsageError(
                "activation samples (reservoir=) do not merge across processes; "
                "run with world_size=1 or reservoir=0."
            )
        super().all_reduce_(group, d=d)
        return self

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for site, m in self.moments.items():
            if m.count == 0:
                continue
            out.append(row(self.name, site, "mean_sq_norm", m.trace_second_moment()))
            out.append(row(self.name, site, "n_tokens", float(m.count)))
        return out


def _sites(plan: Plan) -> dict[Site, None]:
    """The sites with a basis in scope; without bases, every site in scope."""
    chosen = plan.scoped if plan.bases else plan.in_scope
    return dict.fromkeys(sorted(chosen, key=site_order))


register(
    ProbeSpec(
        "activation",
        ActivationProbe,
        _sites,
        needs="sites in scope",
        options=("reservoir",),
        build=lambda plan, sites, **options: ActivationProbe(
            list(sites), **plan.shared(ActivationProbe), **options
        ),
        order=4,
    )
)
