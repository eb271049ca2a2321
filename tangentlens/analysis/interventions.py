"""Interventions: remove the tangent (or normal) part of an activation and measure what
that does, against the same intervention on random frames of matched rank.

>>> hook = ablate(bases["blocks.3.hook_resid_pre"], "tangent")
>>> loss = model.run_with_hooks(tokens, return_type="loss",
...                             fwd_hooks=[("blocks.3.hook_resid_pre", hook)])
>>> effects = causal_effects(model, batches, bases)        # per layer, with a null

`ablate` and `keep_terms` give hook functions with TransformerLens' ``(tensor, hook)``
signature (``hook`` is optional, so on nnsight ``h[:] = ablate(basis)(h)`` works too).
`causal_effects` (per site) and `head_effects` (per head) measure the effect of a removal
against the same removal of random frames of matched rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..core import results
from ..core.decompose import AttentionParams
from ..core.errors import UsageError
from ..core.subspace import TangentBasis, uniform_controls
from ..core.validation import check_int
from ..hooks.base import Backend, get_backend
from ..hooks.sites import NamesFilter, Site, select_sites
from ..models.batches import as_batches, unpack_batch
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
    """A hook that removes ``part`` of the activation: the activation becomes the other
    part of `TangentBasis.split` (rounded to the activation's dtype), so ablating the
    tangent part leaves ``split(x)[1]`` and ablating both would leave zero."""
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
    ids, mask = unpack_batch(batch)
    n = (ids.shape[1] - 1) * ids.shape[0] if mask is None else int(mask[:, 1:].sum())
    return lm_loss(model, batch) / max(n, 1)


def _with_hook(
    backend: Backend, site: Site, fn: HookFn, model: Any, batches: Sequence[Any], metric: Metric
) -> float:
    handle = backend.add_forward_hook(site, lambda x: fn(x))
    try:
        return _mean_metric(model, batches, metric)
    finally:
        handle.remove()


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
    metric = _default_metric if metric is None else metric
    by_site = as_bases(bases)
    check_basis_sites(by_site)
    warn_basis_weights(by_site, model, stacklevel=4)
    return as_batches(model, batches), metric, get_backend(model), by_site


def causal_effects(
    model: Any,
    batches: Iterable[Any],
    bases: Mapping[str | Site, TangentBasis],
    *,
    part: str = "tangent",
    sites: NamesFilter = None,
    metric: Metric | None = None,
    n_null: int = 8,
    seed: int = 0,
    progress: bool = True,
) -> pd.DataFrame:
    """Per site with a basis: the change of ``metric`` (default: mean next-token loss)
    when ``part`` of the activation is removed there, against removing the same part of
    ``n_null`` uniformly random frames of the same rank (the null).

    Rows (``probe="intervention"``, ``component=part``): ``delta_metric`` (ablated − clean),
    ``delta_metric_null_mean``/``_std``, ``z`` and ``p_value`` = (1 + #{|null| ≥
    |effect|})/(n_null + 1). Each intervention's hook is removed before the next.
    """
    batches, metric, backend, by_site = _setup(model, batches, bases, part, n_null, metric)
    chosen = [s for s in select_sites(list(by_site), sites) if s in by_site]
    if not chosen:
        raise UsageError("no site with a basis is selected; fit bases there or widen sites=.")
    clean = _mean_metric(model, batches, metric)
    rows: list[dict[str, Any]] = []
    for site in tqdm(chosen, desc="interventions", disable=not progress):
        basis = by_site[site]
        effect = _with_hook(backend, site, ablate(basis, part), model, batches, metric) - clean
        null = [
            _with_hook(backend, site, ablate(b, part), model, batches, metric) - clean
            for b in _null_bases(basis, n_null, seed + site.layer)
        ]
        rows += _effect_rows(site, effect, null, part)
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
    n_null: int = 8,
    seed: int = 0,
    progress: bool = True,
) -> pd.DataFrame:
    """Per head of a TransformerLens bridge: the change of ``metric`` when ``part`` of the
    attention input is removed from that head's queries and keys only (its score keeps
    the other part's terms and the bias), against random frames of matched rank.

    Uses the bases at ``attn_in`` (``blocks.{l}.ln1.hook_out``). Under grouped-query
    attention the key edit is on the head's kv head, which its group shares.
    """
    batches, metric, backend, by_site = _setup(model, batches, bases, part, n_null, metric)
    wanted = range(backend.n_layers) if layers is None else layers
    sites = [Site(layer, "attn_in") for layer in wanted if Site(layer, "attn_in") in by_site]
    hook_dict = getattr(model, "hook_dict", {})
    if not sites or any(f"blocks.{s.layer}.attn.hook_q" not in hook_dict for s in sites):
        raise UsageError(
            "head_effects needs a TransformerLens bridge (attn.hook_q / attn.hook_k) and bases "
            "at attn_in (blocks.{l}.ln1.hook_out)."
        )
    clean = _mean_metric(model, batches, metric)
    rows: list[dict[str, Any]] = []
    for site in tqdm(sites, desc="head interventions", disable=not progress):
        params = backend.attention_params(site.layer)
        real = by_site[site]
        frames = _null_bases(real, n_null, seed + site.layer)
        for head in range(params.n_heads):
            deltas = [
                _head_metric(model, batches, metric, b, params, site.layer, head, part) - clean
                for b in (real, *frames)
            ]
            rows += _effect_rows(site, deltas[0], deltas[1:], part, head=head)
    return results.frame(rows)


def _head_metric(
    model: Any,
    batches: Sequence[Any],
    metric: Metric,
    basis: TangentBasis,
    params: AttentionParams,
    layer: int,
    head: int,
    part: str,
) -> float:
    """``metric`` with `keep_terms` hooks on one head of a TransformerLens bridge."""
    capture, q_hook, k_hook = keep_terms(basis, params, head, part)
    prefix = f"blocks.{layer}.attn"
    hooks = [
        (f"{prefix}.hook_in", capture),
        (f"{prefix}.hook_q", q_hook),
        (f"{prefix}.hook_k", k_hook),
    ]
    with model.hooks(fwd_hooks=hooks):
        return _mean_metric(model, batches, metric)
