"""Activation probe: `Moments` per site (to fit Q_T) and a bounded, seeded reservoir
sample of activation vectors (for TwoNN and other point-cloud metrics).

The reservoir is Vitter's algorithm R driven by a numpy PCG64 stream of one draw per
token, so the sample depends on the seed and the token order only, not on how the
tokens are split into batches. Memory: ``size × d`` per site, whatever the stream length.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..hooks.sites import Site
from ..stats import Moments, SharedBatch
from .residual import _row

__all__ = ["ActivationProbe", "Reservoir"]


class Reservoir:
    """A uniform sample of at most ``size`` rows from a stream (algorithm R)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1; got {size!r}.")
        self.size = size
        self.seen = 0
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._rows: Tensor | None = None

    @torch.no_grad()
    def update(self, x: Tensor, mask: Tensor | None = None) -> Reservoir:
        if mask is not None:
            x = x[mask.to(x.device).bool()]
        rows = x.detach().reshape(-1, x.shape[-1]).to("cpu", torch.float32)
        n = rows.shape[0]
        if n == 0:
            return self
        if self._rows is None:
            self._rows = torch.empty(self.size, rows.shape[1], dtype=torch.float32)
        t = self.seen + np.arange(n)  # global index of each row
        slot = np.floor(self._rng.random(n) * (t + 1)).astype(np.int64)
        slot[t < self.size] = t[t < self.size]
        for i in np.flatnonzero(slot < self.size):  # later rows overwrite earlier ones
            self._rows[slot[i]] = rows[i]
        self.seen += n
        return self

    def sample(self) -> Tensor:
        """The sample, ``(min(size, seen), d)`` float32."""
        if self._rows is None:
            raise ValueError("the reservoir is empty; run some tokens through the model first.")
        return self._rows[: min(self.size, self.seen)].clone()


class ActivationProbe:
    """`Moments` of the activations at each site, and optionally a `Reservoir`."""

    name = "activation"

    def __init__(self, sites: list[Site], reservoir: int = 0, seed: int = 0) -> None:
        if not isinstance(reservoir, int) or reservoir < 0:
            raise ValueError(f"reservoir must be an int >= 0 (0: no sample); got {reservoir!r}.")
        self.moments: dict[Site, Moments] = {s: Moments() for s in sites}
        self._shared = SharedBatch()
        self.reservoirs: dict[Site, Reservoir] = (
            {s: Reservoir(reservoir, seed=seed + i) for i, s in enumerate(sites)}
            if reservoir
            else {}
        )

    @property
    def sites(self) -> list[Site]:
        return list(self.moments)

    def update(self, site: Site, x: Tensor, mask: Tensor | None = None) -> None:
        self.moments[site].add_batch(*self._shared(x, mask))
        if site in self.reservoirs:
            self.reservoirs[site].update(x, mask)

    def rows(self) -> list[dict]:
        out = []
        for site, m in self.moments.items():
            if m.count == 0:
                continue
            out.append(_row(self.name, site, "mean_sq_norm", m.trace_second_moment()))
            out.append(_row(self.name, site, "n_tokens", float(m.count)))
        return out
