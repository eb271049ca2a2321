"""Attention probe: per-head statistics of the score split TT + TN + NT + NN + bias.

The maths lives in `tangentlens.core.decompose`; the backends read each layer's
`AttentionParams`. Here:

- :class:`AttentionProbe`: one accumulator per attention-input site
  (`tangentlens.probes.attention_stats.AttentionAccumulator`: streaming, mergeable score
  shares and ``pattern_kl_TT`` per head), and one for all its null frames, fed by the
  session;
- :func:`score_terms`: the five terms of one layer in one call on a TransformerLens model.

The output side (``writes``): each head's write z_h·W_O^h into the residual stream, as
its energy share in the basis of the stream the attention writes into (the rule of
`write_basis_site`: ``resid_mid`` of the layer, else ``resid_post``, else the next
``resid_pre``). From Σ z_hᵀz_h per head (`z_gram`), so no write is materialised.

Never read ``hook_attn_scores`` to decompose: on HF bridges it is post-mask, on native
and BERT bridges it is the post-softmax pattern.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..core.decompose import AttentionParams, ScoreSplit, decompose_scores, keep_blocks, keep_mask
from ..core.errors import UsageError
from ..core.head_writes import head_write_energies, random_share_std, z_gram
from ..core.settings import HEAD_NULL, HEAD_NULL_SEQUENCES
from ..core.subspace import TangentBasis, normal_controls, shares
from ..core.validation import check_int
from ..hooks.base import Backend, Handle
from ..hooks.sites import Site
from ..hooks.transformer_lens import norm_from_bridge, params_from_bridge
from ..models.batches import unpack_batch
from .attention_stats import (
    MIN_Z_FRAMES,
    STATISTICS,
    AttentionAccumulator,
    _Block,
    frame_plan,
    null_summary,
    z_score,
)
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
    batch = {"input_ids": tokens, "attention_mask": attention_mask}
    tokens, attention_mask = unpack_batch(batch)  # checked: a mask of another shape is refused
    warn_basis_sites([(Site(layer, site), basis)])
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
    complement of Q_T in place of Q_T (`normal_controls`), as rows per head
    ``{statistic}_null`` (mean over frames), ``{statistic}_null_std``,
    ``{statistic}_p_value`` (two-sided, floor 1/(head_null + 1): enough frames for 0.01
    by default) and, from `MIN_Z_FRAMES` frames on, ``{statistic}_z``: a z whose spread
    comes from a few frames is not a measure of anything (`null_summary`). ``head_null=0``
    turns the null off; it needs at least 2 frames otherwise, and 2k < d (at 2k = d every
    frame spans the complement itself: no null). The frames lie outside Q_T,
    so they are not exchangeable with it: the p-value is exact only as k/d → 0, and
    anti-conservative by a margin of order k/d (as the gradient probe's normal controls).

    The frames see the first ``head_null_sequences`` sequences only (None: all). Each
    frame is a full set of score terms, so a null on every sequence multiplies the
    probe's cost per batch by about ``head_null``; on a fixed sample its cost is paid once
    and a long run streams at the cost of the basis alone. The p-value and z compare like
    with like: the frames against Q_T's own statistic on the same sequences
    (``{statistic}_null_sample``, kept beside the statistic over every sequence), so the
    test stays a frame-randomisation test on that sample. The site row
    ``head_null_sequences`` says how many sequences it holds (per process: each rank of a
    distributed run takes its own first sequences).

    Each layer is projected once for the basis and all frames (`ScoreSplit`), and the
    frames' terms come from one batched product per chunk of frames (`frame_plan`), not
    one per frame. The basis's terms are float64, the frames' float32 (their tangent
    projections formed in float64; their terms, energies and KL entries float32, each
    row's log-sum-exp and the sums over rows float64): a random frame's tangent part is
    of typical size, with no cancellation, so this moves the null means and spreads far
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
        head_null_sequences: int | None = HEAD_NULL_SEQUENCES.default,
        seed: int = 0,
        writes: Mapping[int, tuple[Site, TangentBasis, Tensor]] | None = None,
    ) -> None:
        super().__init__()
        self.layers = dict(layers)
        self.head_null = check_int(head_null, "head_null (head null frames)", minimum=0)
        if self.head_null == 1:
            raise UsageError(
                "head_null=1 gives no spread and a p-value of at least 1/2: use 0 (no null) "
                f"or at least 2 frames ({MIN_Z_FRAMES} for z and p-values down to 0.01)."
            )
        self.head_null_sequences = (
            None
            if head_null_sequences is None
            else check_int(head_null_sequences, "head_null_sequences", minimum=1)
        )
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
            if self.head_null and 2 * basis.k >= basis.d:  # a table loses no column unsaid
                warnings.warn(
                    f"{site.hook_name}: rank {basis.k} at d={basis.d} leaves no room for varied "
                    "null frames (2k >= d), so the heads' null rows are left out there; fit a "
                    "rank below d/2 for them.",
                    stacklevel=4,
                )
            elif self.head_null:
                frames = normal_controls(basis, self.head_null, seed=seed + site.layer)
                self.null_bases[site] = [TangentBasis(f) for f in frames]
                self.add_state(
                    self._null_key(site),
                    lambda n=params.n_heads: AttentionAccumulator(n, frames=self.head_null),
                )
                self.add_state(
                    self._sample_key(site), lambda n=params.n_heads: AttentionAccumulator(n)
                )
                self.add_state(self._seen_key(site), Sum)
        warn_basis_sites([(s, b) for s, (b, _) in self.layers.items()], stacklevel=4)
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
    def _null_key(site: Site) -> str:
        return f"{site.hook_name}/null"

    @staticmethod
    def _sample_key(site: Site) -> str:
        return f"{site.hook_name}/null_sample"

    @staticmethod
    def _seen_key(site: Site) -> str:
        return f"{site.hook_name}/null_sequences"

    def _null_room(self, site: Site, batch: int) -> int:
        """How many of the next ``batch`` sequences the null still takes."""
        if site not in self.null_bases:
            return 0
        if self.head_null_sequences is None:
            return batch
        seen = int(self.state(self._seen_key(site)).value)
        return max(0, min(batch, self.head_null_sequences - seen))

    @staticmethod
    def _write_key(layer: int) -> str:
        return f"{Site(layer, 'attn_out').hook_name}/z"

    @property
    def forward_sites(self) -> list[Site]:
        return list(self.layers)

    @property
    def last_layer(self) -> int | None:
        """The deepest attention input: the head writes' z hooks sit in those layers."""
        return max((site.layer for site in self.layers), default=None)

    def state_bases(self) -> dict[Any, TangentBasis]:
        """Each site's Q_T and its null frames (drawn from ``seed``): the score split's
        state is measured against them. The head writes' state is basis-free."""
        found: dict[Any, TangentBasis] = {site: basis for site, (basis, _) in self.layers.items()}
        for site, frames in self.null_bases.items():
            found.update({(site, i): frame for i, frame in enumerate(frames)})
        return found

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
        """The basis's split on every sequence; the null's frames, and the basis again
        into the null's sample, on the sequences the null still takes (`_null_room`)."""
        basis, params = self.layers[obs.site]
        self._masks[obs.site.layer] = obs.mask  # this layer's z comes next in the pass
        main = self.state(obs.site.hook_name)
        x, mask = obs.tensor, obs.mask
        n = self._null_room(obs.site, x.shape[0])
        if n:  # one split for both: the basis's terms go to the sample, then to the total
            sample = AttentionAccumulator(params.n_heads, x.device)
            nulls = (self.null_bases[obs.site], self.state(self._null_key(obs.site)))
            self._split(x[:n], None if mask is None else mask[:n], basis, params, sample, nulls)
            main.merge(sample)
            self.state(self._sample_key(obs.site)).merge(sample)
            self.state(self._seen_key(obs.site)).add(torch.tensor(float(n)))
        if n < x.shape[0]:
            self._split(x[n:], None if mask is None else mask[n:], basis, params, main, None)

    @staticmethod
    def _split(
        x: Tensor,
        mask: Tensor | None,
        basis: TangentBasis,
        params: AttentionParams,
        target: AttentionAccumulator,
        nulls: tuple[list[TangentBasis], AttentionAccumulator] | None,
    ) -> None:
        """The statistics of ``basis``'s split of ``x`` into ``target`` and, with
        ``nulls``, those of each null frame into the frames' accumulator."""
        batch, pos = x.shape[:2]
        rule = {"causal": params.causal, "window": params.window}
        keep = keep_mask((batch, 1, pos, pos), **rule, attention_mask=mask, device=x.device)
        split = ScoreSplit(x, params)  # projections shared by every basis
        frames_of, frame_acc = nulls if nulls else ([], None)
        chunks, reuse = frame_plan(len(frames_of), batch, pos, params.n_heads, params.d_head)
        made: dict[int, _Block] = {}  # each block's pattern, kept across chunks if `reuse`
        # the basis in float64 with the first chunk; the frames, a Monte-Carlo reference,
        # in float32, each chunk's terms from one batched product
        for c, frames in enumerate(chunks or [None]):
            jobs = [(split.parts([basis]), target, 0, None)] if c == 0 else []
            if frames is not None and frame_acc is not None:
                frame_parts = split.parts(frames_of[frames], dtype=torch.float32)
                jobs.append((frame_parts, frame_acc, slice(None), frames))
            for b, (rows, keys) in enumerate(keep_blocks(pos, **rule)):
                block = made.get(b) or _Block(
                    split.scores(rows, keys), split.bias(rows, keys), keep[..., rows, keys]
                )
                if reuse:
                    made[b] = block
                for part, acc, which, at in jobs:
                    acc._add(part.terms(which, rows, keys), block, at)
        target._count(keep)
        if frame_acc is not None:
            frame_acc._count(keep)

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for site in self.layers:
            acc = self.state(site.hook_name)
            if acc.entries == 0:
                continue
            seen = site in self.null_bases and self.state(self._null_key(site)).entries > 0
            null = self.state(self._null_key(site)).results() if seen else {}
            sample = self.state(self._sample_key(site)).results() if seen else {}
            for stat, per_head in acc.results().items():
                per_stat = {stat: per_head}
                if null:  # (head_null, n_heads) per statistic, against Q_T on their sample
                    per_stat |= null_summary(stat, sample[stat], null[stat])
                    per_stat[f"{stat}_null_sample"] = sample[stat]
                out += _head_rows(self.name, site, per_stat)
            if null:
                n_seen = float(self.state(self._seen_key(site)).value)
                out.append(row(self.name, site, "head_null_sequences", n_seen))
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
            stats |= {"write_share_null_std": std, "write_share_z": z_score(share, chance, std)}
        site = Site(layer, "attn_out")
        flag = row(self.name, site, f"write_basis_{basis_site.kind}", float(basis_site.layer))
        return [*_head_rows(self.name, site, stats), flag]


def _head_rows(probe: str, site: Site, per_stat: Mapping[str, Tensor]) -> list[dict[str, Any]]:
    """One row per head and statistic, from ``(n_heads,)`` tensors."""
    return [
        row(probe, Site(site.layer, site.kind, h), name, float(v))
        for name, heads in per_stat.items()
        for h, v in enumerate(heads.tolist())
    ]


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
        options=("head_null", "head_null_sequences"),
        build=_build,
        order=2,
    )
)
