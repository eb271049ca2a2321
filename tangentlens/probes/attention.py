"""Attention probe: per-head statistics of the score split TT + TN + NT + NN + bias.

The maths lives in `tangentlens.core.decompose`; the backends read each layer's
`AttentionParams`. Here:

- :class:`AttentionAccumulator`: streaming, mergeable per-head statistics of the terms
  (score shares and ``pattern_kl_TT``) over the entries the model does not mask;
- :class:`AttentionProbe`: one accumulator per attention-input site, fed by the session;
- :func:`score_terms`: the five terms of one layer in one call on a TransformerLens model.

The output side (``writes``): each head's write z_h·W_O^h into the residual stream, as
its energy share in the basis of the stream the attention writes into (the rule of
`write_basis_site`: ``resid_mid`` of the layer, else ``resid_post``, else the next
``resid_pre``). From Σ z_hᵀz_h per head (`z_gram`), so no write is materialised.

Never read ``hook_attn_scores`` to decompose: on HF bridges it is post-mask, on native
and BERT bridges it is the post-softmax pattern.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.decompose import (
    TERMS,
    AttentionParams,
    ScoreSplit,
    decompose_scores,
    head_write_energies,
    keep_blocks,
    keep_mask,
    random_share_std,
    z_gram,
)
from ..core.errors import CorruptFileError, UsageError
from ..core.settings import HEAD_NULL
from ..core.subspace import TangentBasis, normal_controls, shares
from ..core.validation import check_int
from ..hooks.base import Backend, Handle
from ..hooks.sites import Site
from ..hooks.transformer_lens import norm_from_bridge, params_from_bridge
from .base import Observation, Probe, Sum, row
from .bases import warn_basis_sites
from .registry import Plan, ProbeSpec, register
from .residual import write_basis_site

__all__ = [
    "STATISTICS",
    "WRITE_STATISTICS",
    "AttentionAccumulator",
    "AttentionProbe",
    "score_terms",
]

STATISTICS = (*(f"score_share_{t}" for t in TERMS), "pattern_kl_TT")
WRITE_STATISTICS = (
    "write_share",
    "write_chance_share",
    "write_share_ratio",
    "write_share_null_std",
    "write_share_z",
)


def score_terms(
    model: Any,
    tokens: Tensor,
    layer: int,
    basis: TangentBasis,
    *,
    attention_mask: Tensor | None = None,
    site: str = "attn_in",
) -> dict[str, Tensor]:
    """``TT, TN, NT, NN, bias``, each ``(batch, head, q_pos, k_pos)`` float64, for a
    TransformerLens model on ``tokens``; they sum to the pre-mask scaled scores.

    ``site="attn_in"`` (default): ``basis`` is fitted at the attention input
    (:func:`attention_input_hook`: ``ln1.hook_out`` on pre-norm models). ``site=
    "resid_pre"``: ``basis`` is fitted at ``hook_resid_pre`` and ln1 is treated as
    linear with its scale frozen at the value on the full input, so the norm's bias
    joins the ``bias`` term (pre-norm models only). A basis whose provenance names
    another site gets a `BasisSiteWarning`.
    """
    if site not in ("attn_in", "resid_pre"):
        raise UsageError(f"site must be 'attn_in' or 'resid_pre'; got {site!r}.")
    warn_basis_sites({Site(layer, site): basis})
    params = params_from_bridge(model, layer)
    norm = norm_from_bridge(model, layer) if site == "resid_pre" else None
    hook_name = f"blocks.{layer}.{'hook_resid_pre' if norm is not None else 'attn.hook_in'}"
    captured: dict[str, Tensor] = {}

    def capture(x: Tensor, hook: Any) -> None:
        captured["x"] = x.detach()

    kwargs: dict[str, Any] = {"return_type": None}
    if layer + 1 < len(model.blocks):  # later blocks are not needed
        kwargs["stop_at_layer"] = layer + 1
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    with torch.no_grad(), model.hooks(fwd_hooks=[(hook_name, capture)]):
        model(tokens, **kwargs)
    if "x" not in captured:
        raise RuntimeError(f"{hook_name} did not fire; is layer {layer} run by this model?")
    return decompose_scores(captured["x"], basis, params, norm=norm)


# --------------------------------------------------------------------------- statistics
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
    """

    def __init__(
        self, n_heads: int | None = None, device: torch.device | str | None = None
    ) -> None:
        self._energy: Tensor | None = None  # (5, n_heads)
        self._kl: Tensor | None = None  # (n_heads,)
        self._rows = 0
        self._entries = 0
        if n_heads is not None:
            if n_heads < 1:
                raise UsageError(f"n_heads must be a positive int; got {n_heads}.")
            self._init(n_heads, torch.device(device or "cpu"))

    @property
    def n_heads(self) -> int | None:
        return None if self._energy is None else int(self._energy.shape[1])

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def entries(self) -> int:
        return self._entries

    def _init(self, n_heads: int, device: torch.device) -> None:
        self._energy = torch.zeros(len(TERMS), n_heads, dtype=torch.float64, device=device)
        self._kl = torch.zeros(n_heads, dtype=torch.float64, device=device)

    @torch.no_grad()
    def update(
        self,
        terms: Mapping[str, Tensor],
        attention_mask: Tensor | None = None,
        causal: bool = True,
        window: int | None = None,
    ) -> AttentionAccumulator:
        """Add one batch of terms (from :func:`score_terms`); ``attention_mask`` is the
        HF-style ``(batch, pos)`` padding mask (1 = token, 0 = padding); ``causal`` and
        ``window`` are the layer's (`AttentionParams`), so ``pattern_kl_TT`` compares the
        patterns the model computes."""
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

    def _add(self, cross: Tensor, block: _Block) -> None:
        """Add the statistics of TT, TN, NT, NN (``cross``, ``(4, batch, head, rows,
        keys)``, float32 or float64; overwritten) on one block of rows and the keys they
        see. Entries in ``cross``'s precision (P and the bias offset rounded to it, so a
        float32 null frame never converts its terms); each row's log-sum-exp and the sums
        over rows in float64."""
        if self._energy is None:  # restored from an empty state
            self._init(cross.shape[2], cross.device)
        kept, p, offset = block.in_dtype(cross.dtype)
        energy = cross.new_empty(cross.shape[:-1])  # per row
        for j, term in enumerate(cross):  # one term at a time, so it stays in cache
            term.mul_(kept)
            torch.linalg.vecdot(term, term, out=energy[j])
        self._energy[:4] += energy.to(torch.float64).sum((1, 3)).to(self._energy)
        self._energy[4] += block.bias_energy.to(self._energy)
        # KL(P‖P_TT) = Σ P log P − Σ P (TT + bias) + logsumexp(TT + bias); P is 0 where
        # masked, so zeroing those entries of TT changes neither sum
        tt = cross[0]
        kl = block.p_log_p - torch.linalg.vecdot(p, tt).to(torch.float64) - block.p_bias
        kl = kl + _logsumexp_(tt.add_(offset))
        self._kl += torch.where(block.rows, kl, 0.0).sum((0, 2)).to(self._kl)

    def _count(self, keep: Tensor) -> None:
        self._rows += int(keep.any(-1).sum())
        self._entries += int(keep.sum())

    def merge(self, other: AttentionAccumulator) -> AttentionAccumulator:
        """Add ``other``'s statistics into this one (exact)."""
        if not isinstance(other, AttentionAccumulator):
            raise TypeError(f"can only merge an AttentionAccumulator; got {type(other).__name__}.")
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
        flat = torch.cat([self._energy.flatten(), self._kl, counts.to(self._kl.device)])
        dist.all_reduce(flat, group=group)
        n = self._energy.numel()
        self._energy = flat[:n].reshape(self._energy.shape).clone()
        self._kl = flat[n : n + self._kl.numel()].clone()
        self._rows, self._entries = (int(v) for v in flat[-2:].tolist())
        return self

    def results(self) -> dict[str, Tensor]:
        """statistic -> ``(n_heads,)`` float64 tensor, for the names in ``STATISTICS``."""
        if self._energy is None or self._entries == 0:
            raise UsageError("no unmasked entries accumulated yet; call update() first.")
        total = self._energy.sum(0)
        out = {f"score_share_{t}": self._energy[i] / total for i, t in enumerate(TERMS)}
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
        if "rows" not in state or "entries" not in state:
            raise UsageError("state lacks rows/entries; it was not written by state_dict().")
        self._rows, self._entries = int(state["rows"]), int(state["entries"])
        if "energy" not in state:
            self._energy = self._kl = None
            return self
        energy = torch.as_tensor(state["energy"], dtype=torch.float64)
        kl = torch.as_tensor(state["kl"], dtype=torch.float64)
        if energy.ndim != 2 or energy.shape[0] != len(TERMS) or kl.shape != energy.shape[1:]:
            raise CorruptFileError(
                f"corrupt state: energy {tuple(energy.shape)}, kl {tuple(kl.shape)}."
            )
        self._energy, self._kl = energy.clone(), kl.clone()
        return self

    def __repr__(self) -> str:
        return f"AttentionAccumulator(n_heads={self.n_heads}, rows={self._rows})"


class _Block:
    """What the statistics of every basis share on one block of query rows (with all the
    keys they see): the keep mask, the model's pattern P = softmax(scores + mask) and
    Σ P log P per row, and the bias term (its energy, Σ P·bias, and bias + mask, the
    offset of TT in the pattern P_TT).

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

    def in_dtype(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """The keep mask as 0/1, P and the offset (masked entries at ``dtype``'s most
        negative finite float) in ``dtype``, made once per dtype."""
        if dtype not in self._in_dtype:
            offset = self.offset.to(dtype)
            if dtype != self.offset.dtype:  # float64's min would round to -inf
                offset.masked_fill_(~self.keep, torch.finfo(dtype).min)
            self._in_dtype[dtype] = (self.keep.to(dtype), self.p.to(dtype), offset)
        return self._in_dtype[dtype]


class AttentionProbe(Probe):
    """Per-head score statistics at attention-input sites (``attn_in``), and optionally
    the share of each head's write in Q_T.

    ``layers`` maps each site to ``(basis, params)``: the tangent basis fitted at that
    attention input and the layer's `AttentionParams` (from the backend). Where the split
    is a linearisation (q/k norms, their scale frozen per token and head: Qwen3, Gemma 3,
    OLMo 2), the site also gets a row ``statistic="linearised_qk_norm"``, ``value=1``
    (head <NA>), so a table says which numbers rest on it. Each head also gets a row
    ``kv_group`` = head // (n_heads // n_kv_heads): the key/value head it shares (GQA).

    The null: the same statistics with ``head_null`` random frames of matched rank in the
    complement of Q_T in place of Q_T (`normal_controls`), as rows ``{statistic}_null``
    (mean over frames), ``{statistic}_null_std`` and ``{statistic}_z`` per head
    (``head_null=0`` turns the null off). Each layer is projected once for the basis and
    all frames (`ScoreSplit`); the basis's terms are float64, the frames' float32 (their
    tangent projections formed in float64; their terms, energies and KL entries float32,
    each row's log-sum-exp and the sums over rows float64): a random frame's tangent part
    is of typical size, with no cancellation, so this moves the null means and spreads far
    less than the spread over frames.

    ``writes`` maps a layer (one with an ``attn_in`` site here) to ``(basis_site, basis,
    W_O)``: the residual site whose basis measures that attention's writes and W_O
    ``(n_heads, d_head, d_model)``. Rows at ``attn_out`` per head: ``write_share`` =
    Σ‖z_h W_O^h Q_T‖²/Σ‖z_h W_O^h‖² over tokens, ``write_chance_share`` = k/d (the exact
    mean over uniformly random k-frames), ``write_share_ratio``, ``write_share_null_std``
    (the closed-form spread over those frames, `random_share_std`) and ``write_share_z``;
    and, head <NA>, ``write_basis_{kind}`` with value = the basis site's layer (e.g.
    ``write_basis_resid_mid`` = 3: measured in ``blocks.3.hook_resid_mid``). The write is
    z·W_O before any norm of the attention output (Gemma 3 and OLMo 2 normalise it).
    ``head_null=0`` drops the write's null rows too.
    """

    name = "attention"

    def __init__(
        self,
        layers: Mapping[Site, tuple[TangentBasis, AttentionParams]],
        *,
        head_null: int = HEAD_NULL.default,
        seed: int = 0,
        writes: Mapping[int, tuple[Site, TangentBasis, Tensor]] | None = None,
    ) -> None:
        super().__init__()
        self.layers = dict(layers)
        self.head_null = check_int(head_null, "head_null (head null frames)", minimum=0)
        self.null_bases: dict[Site, list[TangentBasis]] = {}
        for site, (basis, params) in self.layers.items():
            if site.kind != "attn_in":
                raise UsageError(f"the attention probe reads attn_in sites; got {site}.")
            if basis.d != params.d_model:
                raise UsageError(
                    f"the basis for {site} has d={basis.d} but W_Q reads d_model="
                    f"{params.d_model}; fit the basis at this layer's attention input."
                )
            self.add_state(site.hook_name, lambda n=params.n_heads: AttentionAccumulator(n))
            if self.head_null and 2 * basis.k <= basis.d:
                frames = normal_controls(basis, self.head_null, seed=seed + site.layer)
                self.null_bases[site] = [TangentBasis(f) for f in frames]
                for j in range(self.head_null):
                    key = f"{site.hook_name}/null{j}"
                    self.add_state(key, lambda n=params.n_heads: AttentionAccumulator(n))
        warn_basis_sites({s: b for s, (b, _) in self.layers.items()}, stacklevel=4)
        self.writes = {layer: (s, b, w.detach()) for layer, (s, b, w) in (writes or {}).items()}
        by_layer = {s.layer: p for s, (_, p) in self.layers.items()}
        for layer, (_, basis, w_o) in self.writes.items():
            params = by_layer.get(layer)
            if params is None:
                raise UsageError(
                    f"writes has layer {layer}, which has no attn_in site here: head writes "
                    "are read with their layer's attention input (for its padding mask)."
                )
            if (
                tuple(w_o.shape[:1]) != (params.n_heads,)
                or w_o.ndim != 3
                or basis.d != w_o.shape[2]
            ):
                raise UsageError(
                    f"W_O of layer {layer} is {tuple(w_o.shape)}: it must be (n_heads="
                    f"{params.n_heads}, d_head, d_model={basis.d}) to match its basis."
                )
            shape = (params.n_heads, w_o.shape[1], w_o.shape[1])
            self.add_state(self._write_key(layer), lambda shape=shape: Sum(shape))
        self._masks: dict[int, Tensor | None] = {}

    @staticmethod
    def _write_key(layer: int) -> str:
        return f"{Site(layer, 'attn_out').hook_name}/z"

    @property
    def forward_sites(self) -> list[Site]:
        return list(self.layers)

    def attach(self, backend: Backend) -> list[Handle]:
        """A hook on each write layer's z (`Backend.add_z_hook`)."""
        handles: list[Handle] = []
        try:
            for layer in self.writes:
                handles.append(backend.add_z_hook(layer, self._z_hook(layer)))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles

    def _z_hook(self, layer: int) -> Any:
        def hook(z: Tensor) -> None:
            with torch.no_grad():
                self.state(self._write_key(layer)).add(z_gram(z, self._masks.get(layer)))

        return hook

    def update(self, obs: Observation) -> None:
        basis, params = self.layers[obs.site]
        self._masks[obs.site.layer] = obs.mask  # this layer's z comes next in the pass
        bases = [basis, *self.null_bases.get(obs.site, [])]
        accs = [self.state(obs.site.hook_name)]
        accs += [self.state(f"{obs.site.hook_name}/null{j}") for j in range(len(bases) - 1)]
        batch, pos = obs.tensor.shape[:2]
        keep = keep_mask(
            (batch, 1, pos, pos),
            causal=params.causal,
            window=params.window,
            attention_mask=obs.mask,
            device=obs.tensor.device,
        )
        split = ScoreSplit(obs.tensor, params)  # projections shared by every basis
        # the basis in float64; its null frames, a Monte-Carlo reference, in float32
        parts = [(split.parts(bases[:1]), accs[:1])]
        if len(bases) > 1:
            parts.append((split.parts(bases[1:], dtype=torch.float32), accs[1:]))
        for rows, keys in keep_blocks(pos, causal=params.causal, window=params.window):
            block = _Block(split.scores(rows, keys), split.bias(rows, keys), keep[..., rows, keys])
            for part, part_accs in parts:
                for i, acc in enumerate(part_accs):
                    acc._add(part.terms(i, rows, keys), block)
        for acc in accs:
            acc._count(keep)

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for site in self.layers:
            acc = self.state(site.hook_name)
            if acc.entries == 0:
                continue
            values = acc.results()
            nulls = [
                self.state(f"{site.hook_name}/null{j}").results()
                for j in range(len(self.null_bases.get(site, [])))
            ]
            for stat, per_head in values.items():
                per_stat = {stat: per_head}
                if len(nulls) >= 2:
                    null = torch.stack([n[stat] for n in nulls])  # (head_null, heads)
                    mean, std = null.mean(0), null.std(0)
                    per_stat |= {
                        f"{stat}_null": mean,
                        f"{stat}_null_std": std,
                        f"{stat}_z": _z(per_head, mean, std),
                    }
                out += _head_rows(self.name, site, per_stat)
            params = self.layers[site][1]
            group = params.n_heads // params.n_kv_heads
            out += _head_rows(self.name, site, {"kv_group": torch.arange(params.n_heads) // group})
            if params.linearised is not None:
                out.append(row(self.name, site, f"linearised_{params.linearised}", 1.0))
            if site.layer in self.writes:
                out += self._write_rows(site.layer)
        return out

    def _write_rows(self, layer: int) -> list[dict[str, Any]]:
        basis_site, basis, w_o = self.writes[layer]
        gram = self.state(self._write_key(layer)).value
        if not bool(gram.any()):
            return []
        e = head_write_energies(gram, w_o, basis.basis_)
        k, d = basis.k, basis.d
        per_head = [
            shares(t, n, k, d)
            for t, n in zip(e["tangent"].tolist(), e["total"].tolist(), strict=True)
        ]
        share = torch.tensor([s["tangent_share"] for s in per_head], dtype=torch.float64)
        chance = torch.full_like(share, k / d)
        stats = {
            "write_share": share,
            "write_chance_share": chance,
            "write_share_ratio": torch.tensor([s["share_ratio"] for s in per_head]),
        }
        if self.head_null and k < d:  # head_null=0 turns every null off, the closed form too
            std = random_share_std(e["total"], e["square"], k, d)
            stats |= {"write_share_null_std": std, "write_share_z": _z(share, chance, std)}
        site = Site(layer, "attn_out")
        flag = row(self.name, site, f"write_basis_{basis_site.kind}", float(basis_site.layer))
        return [*_head_rows(self.name, site, stats), flag]


def _exp(t: Tensor, out: Tensor | None = None) -> Tensor:
    """exp(t) with t clamped below at 0.9·log(smallest normal float): exp's underflow
    path is much slower on CPU, and masked entries (the most negative float) would take
    it. Where the largest term is 1, a sum of these is unchanged at its precision."""
    floor = 0.9 * math.log(torch.finfo(t.dtype).tiny)
    return torch.clamp(t, min=floor, out=out).exp_()


def _logsumexp_(z: Tensor) -> Tensor:
    """logsumexp over the last dim as torch.logsumexp computes it (max, then the sum of
    exp(z − max)), with `_exp`, the sum and log in float64; ``z`` is overwritten."""
    top = z.amax(-1, keepdim=True)
    total = _exp(z.sub_(top), out=z).sum(-1, dtype=torch.float64)
    return total.log_().add_(top.squeeze(-1))


def _head_rows(probe: str, site: Site, per_stat: Mapping[str, Tensor]) -> list[dict[str, Any]]:
    """One row per head and statistic, from ``(n_heads,)`` tensors."""
    return [
        row(probe, Site(site.layer, site.kind, h), name, float(v))
        for name, heads in per_stat.items()
        for h, v in enumerate(heads.tolist())
    ]


def _z(value: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """(value − mean)/std; 0 where the null does not vary and the value equals it (a term
    that is zero in every frame, such as the bias term of a bias-free model), ±inf where
    it does not vary but the value differs."""
    diff = value - mean
    safe = torch.where(std > 0, std, torch.ones_like(std))
    return torch.where(std > 0, diff / safe, torch.where(diff == 0, 0.0, diff * math.inf))


def _inputs(plan: Plan) -> dict[Site, TangentBasis]:
    return {s: b for s, b in plan.scoped.items() if s.kind == "attn_in"}


def _build(plan: Plan, sites: Mapping[Site, TangentBasis], **options: Any) -> AttentionProbe:
    """Each layer's attention parameters from the backend; each layer's head writes in
    the residual basis its attention writes into (`write_basis_site`), with its W_O."""
    backend, writes = plan.backend, {}
    for site in sites:
        target = write_basis_site(Site(site.layer, "attn_out"), plan.bases, backend.n_layers)
        if target is not None:
            writes[site.layer] = (target, plan.bases[target], backend.output_weight(site.layer))
    layers = {s: (b, backend.attention_params(s.layer)) for s, b in sites.items()}
    return AttentionProbe(layers, seed=plan.seed, writes=writes, **options)


register(
    ProbeSpec(
        "attention",
        AttentionProbe,
        _inputs,
        needs="attn_in (blocks.{l}.ln1.hook_out)",
        options=("head_null",),
        build=_build,
        order=2,
    )
)
