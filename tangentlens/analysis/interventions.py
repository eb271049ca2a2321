"""Interventions: remove the tangent (or normal) part of an activation and measure what
that does, against the same intervention on random frames of matched rank.

>>> hook = ablate(bases["blocks.3.hook_resid_pre"], "tangent")
>>> loss = model.run_with_hooks(tokens, return_type="loss",
...                             fwd_hooks=[("blocks.3.hook_resid_pre", hook)])
>>> effects = causal_effects(model, batches, bases)        # per layer, with a null

`ablate` and `keep_terms` give hook functions with TransformerLens' ``(tensor, hook)``
signature (``hook`` is optional, so on nnsight ``h[:] = ablate(basis)(h)`` works too).
`causal_effects` (per site) and `head_effects` (per head, either backend) measure the
effect of a removal against the same removal of random frames of matched rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..core import results
from ..core.decompose import AttentionParams
from ..core.errors import UsageError
from ..core.subspace import TangentBasis, uniform_controls
from ..core.validation import check_int, check_layers
from ..hooks.base import Backend, get_backend
from ..hooks.sites import NamesFilter, Site, select_sites
from ..models.batches import as_batches, unpack_batch, vocabulary_size
from ..probes.bases import as_bases, check_basis_sites, warn_basis_weights
from ..probes.driver import lm_loss

__all__ = ["PARTS", "ablate", "causal_effects", "head_effects", "keep_terms"]

PARTS = ("tangent", "normal")
Metric = Callable[[Any, Any], Tensor]
HookFn = Callable[..., Tensor]


def _check_part(part: str) -> str:
    if part not in PARTS:
        raise UsageError(f"part must be one of {PARTS}; got {part!r}.")
    return part


def ablate(basis: TangentBasis, part: str = "tangent") -> HookFn:
    """A hook that removes ``part`` of an activation, for an intervention you run yourself.

    The activation becomes the other part of `TangentBasis.split` (rounded to the
    activation's dtype), so ``tangent + normal == input`` holds exactly and ablating
    both parts would leave zero. The hook has TransformerLens' ``(tensor, hook)``
    signature with ``hook`` optional, so on nnsight ``h[:] = ablate(basis)(h)`` works too.
    On ``hook_resid_mid`` it edits the MLP branch's input only (the skip path carries the
    stream on unedited); `causal_effects` removes the part from the stream itself there.

    Args:
        basis: The `TangentBasis` of the site the hook goes on.
        part: ``"tangent"`` (keep the normal part) or ``"normal"`` (keep the tangent part).

    Returns:
        A hook function ``hook(tensor, hook=None) -> tensor``.

    Raises:
        TypeError: ``basis`` is not a `TangentBasis`.
        UsageError: ``part`` is neither ``"tangent"`` nor ``"normal"``.

    Example:
        With ``model`` a TransformerLens bridge from `load`, ``texts`` a list of
        strings and ``bases`` from `fit_bases`:

        >>> hook = tangentlens.ablate(bases["blocks.1.hook_resid_pre"], "tangent")
        >>> loss = model.run_with_hooks(model.to_tokens(texts[0]), return_type="loss",
        ...                             fwd_hooks=[("blocks.1.hook_resid_pre", hook)])
        >>> bool(loss.isfinite())
        True
    """
    if not isinstance(basis, TangentBasis):
        raise TypeError(f"basis must be a TangentBasis; got {type(basis).__name__}.")
    index = 1 if _check_part(part) == "tangent" else 0

    def hook(tensor: Tensor, hook: Any = None) -> Tensor:
        return basis.split(tensor)[index].to(tensor.dtype)

    return hook


def _mean_metric(model: Any, batches: Sequence[Any], metric: Metric) -> float:
    with torch.no_grad():
        values = [float(metric(model, b)) for b in batches]
    return float(np.mean(values))


def _default_metric(model: Any, batch: Any) -> Tensor:
    """Mean next-token loss per predicted token of the batch."""
    return _per_copy_loss(model, batch, 1)[0]


def _predicted(batch: Any) -> int:
    """The token pairs `lm_loss` sums over: both tokens real, so left and right padding
    alike drop the pairs that touch them."""
    ids, mask = unpack_batch(batch)
    if mask is None:
        n = (ids.shape[1] - 1) * ids.shape[0]
    else:
        real = mask.bool()
        n = int((real[:, 1:] & real[:, :-1]).sum())
    if n < 1:  # its loss would be a mean over nothing, read as 0
        raise UsageError(
            f"a batch of shape {tuple(ids.shape)} has no token to predict: the default "
            "metric, the next-token loss, needs sequences of at least 2 tokens."
        )
    return n


def _per_copy_loss(model: Any, batch: Any, copies: int) -> Tensor:
    """`_default_metric` of each of ``copies`` stacked copies of ``batch``, from one pass."""
    stacked = _stack(batch, copies)
    losses = lm_loss(model, stacked, per_sequence=True).double().cpu()
    return losses.view(copies, -1).sum(1) / _predicted(batch)


def _stack(batch: Any, copies: int) -> Any:
    """``copies`` copies of ``batch`` along the batch dimension (the first copy first)."""
    if copies == 1:
        return batch
    ids, mask = unpack_batch(batch)
    ids = ids.repeat(copies, 1)
    return ids if mask is None else {"input_ids": ids, "attention_mask": mask.repeat(copies, 1)}


def _copies_per_pass(model: Any, batches: Sequence[Any], metric: Metric, n: int) -> int:
    """How many edits one forward pass carries: one copy of the batch per edit, as many as
    keep the largest pass's logits under ~2²⁶ numbers (a custom metric: one, as it sees
    the whole batch and cannot tell copies apart)."""
    if metric is not _default_metric:
        return 1
    vocab = vocabulary_size(model) or 1
    largest = max(int(unpack_batch(b)[0].numel()) for b in batches)
    return int(max(1, min(n, 2**26 // max(largest * vocab, 1))))


Install = Callable[[Sequence[TangentBasis]], list[Any]]


def _deltas(
    model: Any,
    batches: Sequence[Any],
    metric: Metric,
    frames: Sequence[TangentBasis],
    install: Install,
    clean: float,
) -> list[float]:
    """``metric`` with each frame's edit, minus ``clean``. ``install(chunk)`` adds the
    hooks that edit copy j of each stacked batch with ``chunk[j]`` and returns their
    handles; nulls of 99 frames then cost a few passes, not 99."""
    per_pass = _copies_per_pass(model, batches, metric, len(frames))
    out: list[float] = []
    for start in range(0, len(frames), per_pass):
        chunk = frames[start : start + per_pass]
        handles = install(chunk)
        try:
            with torch.no_grad():
                if per_pass == 1:
                    values = [[float(metric(model, b))] for b in batches]
                else:
                    values = [_per_copy_loss(model, b, len(chunk)).tolist() for b in batches]
        finally:
            for handle in handles:
                handle.remove()
        out += [float(v) - clean for v in np.mean(np.asarray(values), axis=0)]
    return out


def _per_copy(x: Tensor, chunk: Sequence[TangentBasis], edit: Callable[..., Tensor]) -> Tensor:
    """``edit(basis, x_j)`` on copy j of a stacked activation, for every basis of ``chunk``."""
    if len(chunk) == 1:
        return edit(chunk[0], x)
    parts = x.unflatten(0, (len(chunk), -1))
    return torch.cat([edit(b, parts[j]) for j, b in enumerate(chunk)])


def _stream_edit(
    backend: Backend, site: Site, chunk: Sequence[TangentBasis], part: str
) -> list[Any]:
    """Hooks that remove ``part`` from the residual stream at ``site`` (copy j of a stacked
    batch by ``chunk[j]``), returning their handles. Where a ``resid_mid`` hook is the MLP
    branch's input (`Backend.mid_on_branch`: ``ln2.hook_in``, the post-attention norm's
    input on nnsight), the skip path carries the stream past it unedited, so the same
    change is added again at that layer's ``resid_post``, which makes the stream there
    that of the edited ``resid_mid`` plus the MLP's output on it. BERT's resid_mid is the
    stream itself (its output LayerNorm's input): the edit alone reaches resid_post."""

    def edit(b: TangentBasis, x: Tensor) -> Tensor:
        return ablate(b, part)(x)

    if site.kind != "resid_mid" or not backend.mid_on_branch(site.layer):
        return [backend.add_forward_hook(site, lambda x: _per_copy(x, chunk, edit))]
    change: list[Tensor] = []  # this forward's edit at resid_mid, for its resid_post

    def at_mid(x: Tensor) -> Tensor:
        out = _per_copy(x, chunk, edit)
        change.append(out - x)
        return out

    def at_post(x: Tensor) -> Tensor:
        return x + change.pop()

    handles = [backend.add_forward_hook(site, at_mid)]
    try:
        handles.append(backend.add_forward_hook(Site(site.layer, "resid_post"), at_post))
    except BaseException:
        handles[0].remove()
        raise
    return handles


def _null_bases(basis: TangentBasis, n: int, seed: int) -> list[TangentBasis]:
    frames = uniform_controls(basis.d, basis.k, n, seed=seed)
    return [TangentBasis(f) for f in frames]


def _effect_rows(
    site: Site, effect: float, null: list[float], part: str, head: int | None = None
) -> list[dict[str, Any]]:
    mean = float(np.mean(null))
    std = float(np.std(null, ddof=1)) if len(null) > 1 else math.nan
    p = (1 + sum(abs(v) >= abs(effect) for v in null)) / (len(null) + 1)
    values = {
        "delta_metric": effect,
        "delta_metric_null_mean": mean,
        "delta_metric_null_std": std,
        "z": (effect - mean) / std if std and math.isfinite(std) and std > 0 else math.nan,
        "p_value": p,
        "p_value_floor": 1 / (len(null) + 1),
    }
    return [
        results.row("intervention", site, k, v, component=part, head=head)
        for k, v in values.items()
    ]


def _setup(
    model: Any,
    batches: Iterable[Any],
    bases: Mapping[str | Site, TangentBasis],
    part: str,
    n_null: int,
    metric: Metric | None,
) -> tuple[list[Any], Metric, Backend, dict[Site, TangentBasis]]:
    """Checked arguments of an effects routine: the batches, the metric, the backend and
    the bases by site."""
    _check_part(part)
    check_int(n_null, "n_null", minimum=2)
    backend = get_backend(model)
    if metric is None and not backend.causal:
        raise UsageError(
            "the default metric is the next-token loss, which an encoder does not predict: "
            "pass metric=callable(model, batch) -> scalar (e.g. a masked-token loss)."
        )
    metric = _default_metric if metric is None else metric
    by_site = as_bases(bases)
    check_basis_sites(by_site)
    warn_basis_weights(by_site, model, stacklevel=4)
    return as_batches(model, batches), metric, backend, by_site


def causal_effects(
    model: Any,
    batches: Iterable[Any],
    bases: Mapping[str | Site, TangentBasis],
    *,
    part: str = "tangent",
    sites: NamesFilter = None,
    metric: Metric | None = None,
    n_null: int = 99,
    seed: int = 0,
    progress: bool = True,
) -> pd.DataFrame:
    """The causal effect of removing ``part`` of the activation at each site, with a null.

    A removal changes the loss whatever subspace it takes away, so each site's effect is
    read against the same removal of ``n_null`` uniformly random frames of the same rank.
    The default 99 frames let the p-value reach 0.01; a handful of frames could never
    reject, and ``p_value_floor`` says how low this null can go. With the default metric
    the frames share forward passes (one copy of the batch per frame); every hook is
    removed before the next pass.

    Args:
        model: A TransformerLens bridge or an nnsight model (`load`).
        batches: ``(batch, pos)`` token ids, dicts with an ``attention_mask``, text or an
            iterable of those; padding is masked.
        bases: A `BasisSet` or a dict hook name → `TangentBasis`.
        part: ``"tangent"`` or ``"normal"``: the part removed.
        sites: A TransformerLens names filter over the sites with a basis (default: all).
        metric: ``metric(model, batch) -> scalar`` (default: mean next-token loss); a
            custom metric runs one frame per pass.
        n_null: Random frames behind the null (at least 2).
        seed: Seeds the random frames.
        progress: Show a progress bar.

    Returns:
        A results table (``probe="intervention"``, ``component=part``), per site:
        ``delta_metric`` (ablated − clean), ``delta_metric_null_mean`` and ``_std``,
        ``z``, ``p_value`` = (1 + #{|null| ≥ |effect|}) / (n_null + 1) and
        ``p_value_floor`` = 1 / (n_null + 1).

    Raises:
        UsageError: An unknown ``part``, ``n_null`` below 2, bases of another site, no
            site with a basis selected, or an encoder without a ``metric``.

    Example:
        With ``model`` from `load`, ``texts`` a list of strings and ``bases`` from
        `fit_bases`:

        >>> effects = tangentlens.causal_effects(model, texts, bases,
        ...                                      sites="blocks.1.hook_resid_pre", progress=False)
        >>> float(effects.set_index("statistic")["value"]["p_value_floor"])
        0.01
    """
    batches, metric, backend, by_site = _setup(model, batches, bases, part, n_null, metric)
    chosen = [s for s in select_sites(list(by_site), sites) if s in by_site]
    if not chosen:
        raise UsageError("no site with a basis is selected; fit bases there or widen sites=.")
    clean = _mean_metric(model, batches, metric)
    rows: list[dict[str, Any]] = []
    for site in tqdm(chosen, desc="interventions", disable=not progress):
        basis = by_site[site]

        def install(chunk: Sequence[TangentBasis], site: Site = site) -> list[Any]:
            return _stream_edit(backend, site, chunk, part)

        frames = [basis, *_null_bases(basis, n_null, seed + site.layer)]
        deltas = _deltas(model, batches, metric, frames, install, clean)
        rows += _effect_rows(site, deltas[0], deltas[1:], part)
    return results.frame(rows)


def keep_terms(
    basis: TangentBasis, params: AttentionParams, head: int, part: str = "tangent"
) -> tuple[HookFn, HookFn, HookFn]:
    """Three hooks that remove the contribution of ``part`` of the attention input to
    head ``head``'s score, which then keeps the other part's terms and the bias terms
    with it (NN + bias for ``part="tangent"``, TT + bias for ``part="normal"``; exactly
    `decompose_parts` with the removed part set to zero):

    ``(capture, q_hook, k_hook)`` for TransformerLens ``blocks.{l}.attn.hook_in`` (the
    attention input), ``blocks.{l}.attn.hook_q`` and ``.hook_k`` (projections before
    rotary, ``(batch, pos, head, d_head)``). Rotary is linear, so editing before it is
    exact. Under grouped-query attention the key edit is on the head's kv head.
    """
    _check_part(part)
    if not 0 <= head < params.n_heads:
        raise UsageError(f"head must be in 0..{params.n_heads - 1}; got {head}.")
    if params.linearised is not None:
        raise UsageError(
            "keep_terms edits q and k before the model's q/k norm, which would rescale the "
            "edit by its new scale: head interventions on q/k-norm models (Qwen3, Gemma 3, "
            "OLMo 2) are not supported."
        )
    captured: dict[str, Tensor] = {}
    index = 0 if part == "tangent" else 1
    group = params.n_heads // params.n_kv_heads

    def capture(x: Tensor, hook: Any = None) -> None:
        captured["part"] = basis.split(x)[index]

    def edit(tensor: Tensor, w: Tensor, h: int) -> Tensor:
        removed = captured["part"] @ w[h].to(captured["part"])
        out = tensor.clone()
        out[..., h, :] -= removed.to(tensor.dtype)
        return out

    def q_hook(q: Tensor, hook: Any = None) -> Tensor:
        return edit(q, params.W_Q, head)

    def k_hook(k: Tensor, hook: Any = None) -> Tensor:
        return edit(k, params.W_K, head // group)

    return capture, q_hook, k_hook


def head_effects(
    model: Any,
    batches: Iterable[Any],
    bases: Mapping[str | Site, TangentBasis],
    *,
    part: str = "tangent",
    layers: Iterable[int] | None = None,
    metric: Metric | None = None,
    n_null: int = 99,
    seed: int = 0,
    progress: bool = True,
) -> pd.DataFrame:
    """The causal effect of removing ``part`` of one head's query and key input, per head.

    Removing a part from the whole attention input would move every head at once; this
    edits one head's queries and keys only (its score keeps the other part's terms and
    the bias), against the same edit with random frames of matched rank. The edit goes
    on the outputs of the maps that read the attention input, at the head's columns, so
    it runs on either backend and on fused q/k/v maps; under grouped-query attention the
    key edit is on the head's kv head, which its group shares.

    Args:
        model: A TransformerLens bridge or an nnsight model (`load`).
        batches: ``(batch, pos)`` token ids, dicts with an ``attention_mask``, text or an
            iterable of those; padding is masked.
        bases: A `BasisSet` or a dict hook name → `TangentBasis` with bases at
            ``attn_in`` (``blocks.{l}.ln1.hook_out``).
        part: ``"tangent"`` or ``"normal"``: the part removed.
        layers: Layers to edit (default: every layer with a basis at ``attn_in``).
        metric: ``metric(model, batch) -> scalar`` (default: mean next-token loss).
        n_null: Random frames behind each head's null (at least 2).
        seed: Seeds the random frames.
        progress: Show a progress bar.

    Returns:
        A results table with the rows of `causal_effects` per ``layer`` and ``head``
        (read it as ``table["head"]``: ``table.head`` is the DataFrame method).

    Raises:
        UsageError: An unknown ``part``, ``n_null`` below 2, no basis at ``attn_in``, a
            model with q/k norms (the norm would rescale the edit), or an encoder without a
            ``metric``.

    Example:
        With ``model`` a TransformerLens bridge from `load`, ``texts`` a list of
        strings and ``bases`` from `fit_bases`:

        >>> effects = tangentlens.head_effects(model, texts[:4], bases, layers=[1],
        ...                                    n_null=19, progress=False)  # p ≥ 1/20
        >>> p = effects[effects["statistic"] == "p_value"]
        >>> len(p) == model.cfg.n_heads
        True
    """
    batches, metric, backend, by_site = _setup(model, batches, bases, part, n_null, metric)
    wanted = check_layers(layers, backend.n_layers)
    sites = [Site(layer, "attn_in") for layer in wanted if Site(layer, "attn_in") in by_site]
    if not sites:
        raise UsageError(
            "head_effects needs bases at attn_in (blocks.{l}.ln1.hook_out); fit them there."
        )
    index = 0 if part == "tangent" else 1
    clean = _mean_metric(model, batches, metric)
    rows: list[dict[str, Any]] = []
    for site in tqdm(sites, desc="head interventions", disable=not progress):
        params = backend.attention_params(site.layer)
        if params.linearised is not None:
            raise UsageError(
                "head interventions edit q and k before the model's q/k norm, which would "
                "rescale the edit: models with q/k norms (Qwen3, Gemma 3, OLMo 2) are not "
                "supported."
            )
        linears = [m for _, m in backend.input_linears(site)]
        frames = [by_site[site], *_null_bases(by_site[site], n_null, seed + site.layer)]
        group = params.n_heads // params.n_kv_heads
        for head in range(params.n_heads):
            targets = [params.W_Q[head], params.W_K[head // group]]
            edits = _head_columns(linears, targets, site, head)

            def install(chunk: Sequence[TangentBasis], edits: Any = edits) -> list[Any]:
                return [
                    module.register_forward_hook(_column_edit(chunk, index, cols, w))
                    for module, (cols, w) in edits.items()
                ]

            deltas = _deltas(model, batches, metric, frames, install, clean)
            rows += _effect_rows(site, deltas[0], deltas[1:], part, head=head)
    return results.frame(rows)


def _weight_in_out(module: nn.Module, d: int) -> Tensor:
    """A linear map's weight as ``(d_in, d_out)``: ``nn.Linear`` stores its transpose,
    GPT-2's ``Conv1D`` this."""
    w = module.weight.detach()
    return w.T if isinstance(module, nn.Linear) or w.shape[0] != d else w


def _head_columns(
    linears: Sequence[nn.Module], targets: Sequence[Tensor], site: Site, head: int
) -> dict[nn.Module, tuple[Tensor, Tensor]]:
    """Per linear map, the output columns equal to the columns of ``targets`` (the head's
    W_Q and its kv head's W_K, ``(d, d_head)``) and those weight columns: where each
    backend's layout puts the head, read from the weights themselves."""
    found: dict[nn.Module, list[int]] = {}
    for target in targets:
        t = target.detach().double()
        scale = float(t.abs().max()) or 1.0
        for j in range(t.shape[1]):
            column = t[:, j]
            for module in linears:
                w = _weight_in_out(module, t.shape[0]).double()
                if w.shape[0] != t.shape[0]:
                    continue
                err = (w - column[:, None]).abs().amax(0)
                best = int(err.argmin())
                if float(err[best]) <= 1e-5 * scale:
                    found.setdefault(module, []).append(best)
                    break
            else:
                raise UsageError(
                    f"cannot find head {head}'s query/key columns among the linear maps "
                    f"reading {site}; head interventions do not support this attention."
                )
    return {
        m: (torch.tensor(c), _weight_in_out(m, targets[0].shape[0])[:, c].clone())
        for m, c in found.items()
    }


def _column_edit(
    chunk: Sequence[TangentBasis], index: int, cols: Tensor, w: Tensor
) -> Callable[..., Tensor]:
    """A forward hook that subtracts the removed part's contribution (``part @ w``) from
    the output columns ``cols`` of a linear map, copy j of the batch with ``chunk[j]``."""

    def hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        x = args[0]

        def removed(basis: TangentBasis, xj: Tensor) -> Tensor:
            return basis.split(xj)[index] @ w.to(xj.device, torch.float64)

        delta = _per_copy(x, chunk, removed)
        out = out.clone()
        out[..., cols.to(out.device)] -= delta.to(out.dtype)
        return out

    return hook
