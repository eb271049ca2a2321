"""Streaming per-head statistics of the score split, and the summary of their null.

- :class:`AttentionAccumulator`: mergeable sums (energies, KL, counts) of one basis's
  terms TT, TN, NT, NN and bias over the entries the model does not mask; with
  ``frames``, one such set per null frame on a leading axis, so the attention probe adds
  a whole chunk of frames with one batched product instead of one frame at a time;
- :class:`_Block`: what every basis shares on one block of query rows (the model's
  pattern and the bias term), made once per block for the basis and all its frames;
- :func:`null_summary`: a statistic against its frames: their mean and spread, a
  two-sided empirical p-value (`tangentlens.core.uncertainty.two_sided_p_value`) and,
  only with enough frames for its spread to be known (`MIN_Z_FRAMES`), a z;
- :func:`frame_plan`: how many frames go into one batched product (bounded memory).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.decompose import TERMS, keep_mask
from ..core.errors import CorruptFileError, UsageError
from ..core.uncertainty import two_sided_p_value
from ..core.validation import check_int

__all__ = [
    "MIN_Z_FRAMES",
    "STATISTICS",
    "AttentionAccumulator",
    "frame_plan",
    "null_summary",
    "z_score",
]

STATISTICS = (*(f"score_share_{t}" for t in TERMS), "pattern_kl_TT")

MIN_Z_FRAMES = 99
"""Frames below which `null_summary` gives no z. A z divides by the frames' standard
deviation, itself estimated from them (relative standard error about 1/√(2(n − 1))): from
a handful of frames a head can look extreme because its frames happened to agree. 99
frames is also the fewest at which the p-value can reach 0.01."""

FRAMES_PER_CHUNK = 4
"""Frames one batched product takes at most (`frame_plan`): enough that a chunk's own
work (its projections and rotary, the dispatch of each product and statistic) is small
beside its frames' arithmetic, few enough that a block's terms and their temporaries stay
in a core's cache (`benchmarks/bench_head_null.py --chunks`)."""

FRAME_CHUNK_BYTES = 64 * 2**20
"""Bytes of float32 frame terms and projections one batched product may hold
(`frame_plan`), whatever `FRAMES_PER_CHUNK` allows: a large model's null then never holds
every frame's queries and keys at once, and its largest temporary (a block's terms, at
most a third of a chunk for d_head ≥ 32) stays below the size at which the C allocator
maps fresh pages from the system for each (32 MiB at most for glibc), whose first touch,
chunk after chunk, costs more than the arithmetic on them."""

PATTERN_BYTES = 256 * 2**20
"""Bytes the blocks' patterns (`_Block`) of one input may hold to be kept for every chunk
of frames (`frame_plan`) rather than made again per chunk: each is a float64 softmax."""


class AttentionAccumulator:
    """Streaming per-head statistics of the score decomposition (mergeable, float64).

    Over the entries the model does not mask (causal mask, local window and padding;
    padded query rows are dropped too), with E_t = Σ t² the energy of term t:

    - ``score_share_t`` = E_t / Σ_u E_u for t in TT, TN, NT, NN, bias (sums to 1; the
      cross terms' energy is the normaliser, not ‖s‖², which also has cross products);
    - ``pattern_kl_TT`` = mean over kept query rows of KL(P ‖ P_TT), with P the real
      pattern softmax(s + mask) and P_TT = softmax(TT + bias + mask), in nats.

    State is sums and counts, so ``update`` order, batch splits and ``merge`` give the
    same answer as one pass.

    ``frames``: one set of these sums per null frame, on a leading axis (`results` gives
    ``(frames, n_heads)``). The frames see the same entries, so they share the counts; the
    attention probe fills them (`update` takes one basis's terms).
    """

    def __init__(
        self,
        n_heads: int | None = None,
        device: torch.device | str | None = None,
        *,
        frames: int | None = None,
    ) -> None:
        self.frames = None if frames is None else check_int(frames, "frames", minimum=1)
        self._energy: Tensor | None = None  # (*frames, 5, n_heads)
        self._kl: Tensor | None = None  # (*frames, n_heads)
        self._rows = 0
        self._entries = 0
        if n_heads is not None:
            if n_heads < 1:
                raise UsageError(f"n_heads must be a positive int; got {n_heads}.")
            self._init(n_heads, torch.device(device or "cpu"))

    @property
    def n_heads(self) -> int | None:
        return None if self._energy is None else int(self._energy.shape[-1])

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def entries(self) -> int:
        return self._entries

    @property
    def _lead(self) -> tuple[int, ...]:
        return () if self.frames is None else (self.frames,)

    def _init(self, n_heads: int, device: torch.device) -> None:
        f64 = {"dtype": torch.float64, "device": device}
        self._energy = torch.zeros(*self._lead, len(TERMS), n_heads, **f64)
        self._kl = torch.zeros(*self._lead, n_heads, **f64)

    @torch.no_grad()
    def update(
        self,
        terms: Mapping[str, Tensor],
        attention_mask: Tensor | None = None,
        causal: bool = True,
        window: int | None = None,
    ) -> AttentionAccumulator:
        """Add one batch of terms (from `tangentlens.probes.attention.score_terms`);
        ``attention_mask`` is the HF-style ``(batch, pos)`` padding mask (1 = token, 0 =
        padding); ``causal`` and ``window`` are the layer's (`AttentionParams`), so
        ``pattern_kl_TT`` compares the patterns the model computes."""
        if self.frames is not None:
            raise UsageError("update takes one basis's terms; this accumulator has frames.")
        missing = [t for t in TERMS if t not in terms]
        if missing:
            raise UsageError(f"terms lacks {missing}; pass the dict score_terms returns.")
        ts = [torch.as_tensor(terms[t]).to(torch.float64) for t in TERMS]
        shape = ts[0].shape
        if len(shape) != 4 or any(t.shape != shape for t in ts):
            raise UsageError(
                "every term must be (batch, head, q_pos, k_pos) with one shared shape; got "
                f"{[tuple(t.shape) for t in ts]}."
            )
        if self._energy is None:
            self._init(shape[1], ts[0].device)
        elif shape[1] != self.n_heads:
            raise UsageError(f"terms have {shape[1]} heads; this accumulator has {self.n_heads}.")
        dev = self._energy.device
        ts = [t.to(dev) for t in ts]
        keep = keep_mask(
            tuple(shape), causal=causal, window=window, attention_mask=attention_mask, device=dev
        )
        self._add(torch.stack(ts[:4]), _Block(sum(ts[1:], ts[0]), ts[4], keep))
        self._count(keep)
        return self

    def _add(self, cross: Tensor, block: _Block, frames: slice | None = None) -> None:
        """Add the statistics of TT, TN, NT, NN (``cross``, ``(4, batch, head, rows,
        keys)``, float32 or float64; overwritten) on one block of rows and the keys they
        see; with frames, ``cross`` is ``(4, n, batch, ...)``, the ``frames`` slice of
        them. Entries, and their sums over a sequence's block, in ``cross``'s precision (P
        and the bias offset rounded to it, so a float32 null frame never converts its
        terms); each row's log and the sums over sequences and rows in float64."""
        if self._energy is None:  # restored from an empty state
            self._init(cross.shape[-3], cross.device)
        energy_sums = self._energy if frames is None else self._energy[frames]
        kl_sums = self._kl if frames is None else self._kl[frames]
        kept, p, offset = block.in_dtype(cross.dtype)
        flat = cross.flatten(-2)  # (4, *frames, batch, head, rows·keys)
        energy = flat.new_empty(flat.shape[:-1])  # per sequence and head
        for j, term in enumerate(flat):  # one term at a time, so it stays in cache
            term.mul_(kept.flatten(-2))
            torch.linalg.vector_norm(term, dim=-1, out=energy[j])  # a reduction, no temporary
        per_head = energy.to(torch.float64).square_().sum(-2).movedim(0, -2)  # (*frames, 4, h)
        energy_sums[..., :4, :] += per_head.to(energy_sums)
        energy_sums[..., 4, :] += block.bias_energy.to(energy_sums)
        # KL(P‖P_TT) = Σ P log P − Σ P (TT + bias) + logsumexp(TT + bias) per row; P is 0
        # where masked and on rows with no kept key, so zeroing those entries of TT changes
        # neither sum, and Σ P·TT can be taken over the whole block at once
        p_tt = (flat[0] * p.flatten(-2)).sum(-1).to(torch.float64).sum(-2)
        lse = _logsumexp_(flat[0].view_as(cross[0]).add_(offset))
        lse = torch.where(block.rows, lse, 0.0).sum((-3, -1))
        kl_sums += (block.kl_rows - p_tt + lse).to(kl_sums)

    def _count(self, keep: Tensor) -> None:
        self._rows += int(keep.any(-1).sum())
        self._entries += int(keep.sum())

    def merge(self, other: AttentionAccumulator) -> AttentionAccumulator:
        """Add ``other``'s statistics into this one (exact)."""
        if not isinstance(other, AttentionAccumulator):
            raise TypeError(f"can only merge an AttentionAccumulator; got {type(other).__name__}.")
        if other.frames != self.frames:
            raise UsageError(f"cannot merge {other.frames} frames into {self.frames}.")
        if other._energy is None:
            return self
        if self._energy is None:
            self._init(other.n_heads, other._energy.device)
        elif other.n_heads != self.n_heads:
            raise UsageError(f"cannot merge {other.n_heads} heads into {self.n_heads}.")
        self._energy += other._energy.to(self._energy.device)
        self._kl += other._kl.to(self._kl.device)
        self._rows += other._rows
        self._entries += other._entries
        return self

    def all_reduce_(self, group: object | None = None) -> AttentionAccumulator:
        """Sum these statistics over all ranks of ``torch.distributed`` in place.

        A no-op when torch.distributed is not initialised. Every rank needs n_heads:
        update first, or construct with ``AttentionAccumulator(n_heads=...)``.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return self
        if self._energy is None:
            raise UsageError(
                "all_reduce_ needs n_heads on every rank: update before reducing or "
                "construct AttentionAccumulator(n_heads=...)."
            )
        counts = torch.tensor([self._rows, self._entries], dtype=torch.float64)
        flat = torch.cat([self._energy.flatten(), self._kl.flatten(), counts.to(self._kl)])
        dist.all_reduce(flat, group=group)
        n = self._energy.numel()
        self._energy = flat[:n].reshape(self._energy.shape).clone()
        self._kl = flat[n : n + self._kl.numel()].reshape(self._kl.shape).clone()
        self._rows, self._entries = (int(v) for v in flat[-2:].tolist())
        return self

    def results(self) -> dict[str, Tensor]:
        """statistic -> ``(n_heads,)`` float64 tensor (``(frames, n_heads)`` with frames),
        for the names in ``STATISTICS``."""
        if self._energy is None or self._entries == 0:
            raise UsageError("no unmasked entries accumulated yet; call update() first.")
        total = self._energy.sum(-2)
        out = {f"score_share_{t}": self._energy[..., i, :] / total for i, t in enumerate(TERMS)}
        out["pattern_kl_TT"] = self._kl / self._rows
        return out

    def state_dict(self) -> dict[str, Tensor]:
        state = {
            "rows": torch.tensor(self._rows, dtype=torch.int64),
            "entries": torch.tensor(self._entries, dtype=torch.int64),
        }
        if self._energy is not None:
            state |= {"energy": self._energy.clone(), "kl": self._kl.clone()}
        return state

    def load_state_dict(self, state: Mapping[str, Tensor]) -> AttentionAccumulator:
        counts = [torch.as_tensor(state.get(k, -1)) for k in ("rows", "entries")]
        if any(c.numel() != 1 or c.is_floating_point() or int(c) < 0 for c in counts):
            raise CorruptFileError(
                "the saved state's rows/entries are missing or not counts; it was not "
                "written by state_dict()."
            )
        rows, entries = (int(c) for c in counts)
        if "energy" not in state:
            self._energy = self._kl = None
            self._rows, self._entries = rows, entries
            return self
        if "kl" not in state:
            raise CorruptFileError("the saved state has energies but no KL sums; damaged.")
        energy = torch.as_tensor(state["energy"], dtype=torch.float64)
        kl = torch.as_tensor(state["kl"], dtype=torch.float64)
        heads = self.n_heads if self.n_heads is not None else energy.shape[-1]
        lead = self._lead
        if energy.shape != (*lead, len(TERMS), heads) or kl.shape != (*lead, heads):
            raise UsageError(
                f"the saved state is energy {tuple(energy.shape)}, kl {tuple(kl.shape)}; this "
                f"accumulator holds {len(lead) and lead[0]} null frames of {len(TERMS)} terms "
                f"and {heads} heads: build it as the one that saved it (head_null, the model)."
            )
        if not bool(torch.isfinite(energy).all() and torch.isfinite(kl).all()):
            raise CorruptFileError("the saved state holds NaN or Inf: damaged, not a state.")
        self._energy, self._kl = energy.clone(), kl.clone()
        self._rows, self._entries = rows, entries
        return self

    def __repr__(self) -> str:
        frames = "" if self.frames is None else f", frames={self.frames}"
        return f"AttentionAccumulator(n_heads={self.n_heads}{frames}, rows={self._rows})"


class _Block:
    """What the statistics of every basis share on one block of query rows (with all the
    keys they see): the keep mask, the model's pattern P = softmax(scores + mask) and
    Σ P log P per row, and the bias term (its energy, Σ P·bias, and bias + mask, the
    offset of TT in the pattern P_TT). ``kl_rows``: Σ P log P − Σ P·bias over the kept
    rows per head, the part of Σ KL(P‖P_TT) that no basis changes.

    Masked entries get the most negative finite float instead of −inf, and P is exactly
    0 there, so products with P need no second mask (rows with no kept key are dropped
    through ``rows``); exp never sees them unclamped (`_exp`)."""

    def __init__(self, scores: Tensor, bias: Tensor | None, keep: Tensor) -> None:
        self.keep, self.rows = keep, keep.any(-1)
        self._in_dtype: dict[torch.dtype, tuple[Tensor, Tensor, Tensor]] = {}
        mask = torch.zeros(keep.shape, dtype=scores.dtype, device=scores.device)
        mask.masked_fill_(~keep, torch.finfo(scores.dtype).min)
        z = scores + mask
        z -= z.amax(-1, keepdim=True)
        p = _exp(z).mul_(keep)  # exactly 0 where masked
        total = p.sum(-1, keepdim=True).clamp_min_(torch.finfo(p.dtype).tiny)  # 0: no key
        self.p = p.div_(total)
        self.p_log_p = torch.linalg.vecdot(self.p, z.sub_(total.log_()))
        self.bias_energy = torch.zeros(scores.shape[1], dtype=torch.float64, device=keep.device)
        self.p_bias, self.offset = torch.zeros_like(self.p_log_p), mask
        if bias is not None:
            self.bias_energy += torch.where(keep, bias, 0.0).square().sum((0, 2, 3))
            self.p_bias, self.offset = torch.linalg.vecdot(self.p, bias), bias + mask
        per_row = torch.where(self.rows, self.p_log_p - self.p_bias, 0.0)
        self.kl_rows = per_row.to(torch.float64).sum((0, 2))

    def in_dtype(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """The keep mask as 0/1, P and the offset (masked entries at ``dtype``'s most
        negative finite float) in ``dtype``, made once per dtype."""
        if dtype not in self._in_dtype:
            offset = self.offset.to(dtype)
            if dtype != self.offset.dtype:  # float64's min would round to -inf
                offset.masked_fill_(~self.keep, torch.finfo(dtype).min)
            self._in_dtype[dtype] = (self.keep.to(dtype), self.p.to(dtype), offset)
        return self._in_dtype[dtype]


def _exp(t: Tensor, out: Tensor | None = None) -> Tensor:
    """exp(t) with t clamped below at 0.9·log(smallest normal float): exp's underflow
    path is much slower on CPU, and masked entries (the most negative float) would take
    it. Where the largest term is 1, a sum of these is unchanged at its precision."""
    floor = 0.9 * math.log(torch.finfo(t.dtype).tiny)
    return torch.clamp(t, min=floor, out=out).exp_()


def _logsumexp_(z: Tensor) -> Tensor:
    """logsumexp over the last dim as torch.logsumexp computes it (max, then the sum of
    exp(z − max)), with `_exp`; the log in float64. ``z`` is overwritten. The sum stays in
    ``z``'s precision: its terms are positive and at most 1 (no cancellation), and a
    float64 sum of float32 terms costs several times the exp."""
    top = z.amax(-1, keepdim=True)
    total = _exp(z.sub_(top), out=z).sum(-1).to(torch.float64)
    return total.log_().add_(top.squeeze(-1).to(torch.float64))


def z_score(value: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """(value − mean)/std; 0 where the null does not vary and the value equals it (a term
    that is zero in every frame, such as the bias term of a bias-free model), ±inf where
    it does not vary but the value differs."""
    diff = value - mean
    safe = torch.where(std > 0, std, torch.ones_like(std))
    return torch.where(std > 0, diff / safe, torch.where(diff == 0, 0.0, diff * math.inf))


def null_summary(name: str, value: Tensor, null: Tensor) -> dict[str, Tensor]:
    """Statistic ``name`` per head (``value``, ``(n_heads,)``) against its values in ``n``
    null frames (``null``, ``(n, n_heads)``, n ≥ 2): ``{name}_null`` (their mean),
    ``{name}_null_std``, ``{name}_p_value`` and, from `MIN_Z_FRAMES` frames on,
    ``{name}_z``.

    The p-value is two-sided for every statistic (`two_sided_p_value`), since either
    direction says Q_T is not an ordinary k-frame for the head: the score shares sum to 1,
    so a head reading Q_T more than the frames in one term reads it less in another, and
    a head that avoids Q_T is as structured as one that reads it; ``pattern_kl_TT`` below
    its null says TT carries the pattern, above it that the pattern lives outside Q_T.
    The sign is in value − ``{name}_null``."""
    mean, std = null.mean(0), null.std(0)
    out = {f"{name}_null": mean, f"{name}_null_std": std}
    out[f"{name}_p_value"] = two_sided_p_value(value, null)
    if len(null) >= MIN_Z_FRAMES:
        out[f"{name}_z"] = z_score(value, mean, std)
    return out


def frame_plan(n: int, batch: int, pos: int, n_heads: int, d_head: int) -> tuple[list[slice], bool]:
    """How `AttentionProbe` takes ``n`` float32 frames of a ``(batch, pos)`` input: in
    chunks of equal size, each of at most `FRAMES_PER_CHUNK` frames holding at most
    `FRAME_CHUNK_BYTES` (at least one frame a chunk), and whether each block's pattern
    (`_Block`) is kept for every chunk rather than made again (when they fit in
    `PATTERN_BYTES`).

    One batched product per chunk saves the dispatch of a product per frame. A frame
    holds its tangent and normal queries and keys (and the float64 products they are made
    from) and its four terms on a block of query rows with their temporaries."""
    rows = min(32, pos)  # keep_blocks' rows
    frame = 4 * batch * n_heads * pos * (6 * d_head + 6 * rows)
    size = max(1, min(n, FRAMES_PER_CHUNK, FRAME_CHUNK_BYTES // frame))
    count = -(-n // size)  # as few chunks as the bounds allow, sizes within one frame
    chunks = [slice(i * n // count, (i + 1) * n // count) for i in range(count)]
    return chunks, len(chunks) > 1 and 40 * batch * n_heads * pos * pos <= PATTERN_BYTES
