"""Drive a model over batches: `run` (probes with a progress bar), `fit_bases` (one
pass, PCA per site) and `lm_loss` (the default next-token loss).

Batches are ``(batch, pos)`` token-id tensors or dicts with ``input_ids`` and
``attention_mask``. Gradients are taken with respect to the embedding output only, so
the parameters' ``.grad`` stay as the caller's code leaves them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..errors import UnstableBasisWarning, UsageError
from ..files import tensor_hash
from ..hooks.base import get_backend
from ..hooks.sites import INPUT_KINDS, RESIDUAL_KINDS, NamesFilter, Site
from ..stats import Moments
from ..subspace import TangentBasis, near_chance, split_half_overlap
from ..version import __version__
from .bases import BasisSet
from .session import ProbeSession

__all__ = ["fit_bases", "lm_loss", "run", "unpack_batch"]


def unpack_batch(batch: Any) -> tuple[Tensor, Tensor | None]:
    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise UsageError(f"a dict batch needs 'input_ids'; got keys {sorted(batch)}.")
        ids, mask = batch["input_ids"], batch.get("attention_mask")
    else:
        ids, mask = batch, None
    ids = torch.as_tensor(ids)
    if ids.ndim != 2 or ids.dtype.is_floating_point:
        raise UsageError(
            f"a batch must be (batch, pos) integer token ids or a dict with input_ids and "
            f"attention_mask; got {tuple(ids.shape)} {ids.dtype}. Use ids[None] for one row."
        )
    if mask is not None:
        mask = torch.as_tensor(mask)
        if mask.shape != ids.shape:
            raise UsageError(
                f"attention_mask {tuple(mask.shape)} must match input_ids {tuple(ids.shape)}."
            )
    return ids, mask


def _device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError, TypeError):
        return torch.device("cpu")


def _forward(model: Any, ids: Tensor, mask: Tensor | None) -> Tensor:
    return model(ids) if mask is None else model(ids, attention_mask=mask)


def lm_loss(model: Any, batch: Any) -> Tensor:
    """Summed next-token cross-entropy over real (unpadded) token pairs.

    Summed, not averaged, so each token's gradient does not depend on the batch size.
    """
    ids, mask = unpack_batch(batch)
    ids = ids.to(_device(model))
    out = _forward(model, ids, None if mask is None else mask.to(ids.device))
    logits = getattr(out, "logits", out)  # Hugging Face models return a ModelOutput
    if not isinstance(logits, Tensor) or logits.ndim != 3:
        raise UsageError(
            "the model did not return (batch, pos, vocab) logits; pass loss=callable(model, "
            "batch) -> scalar."
        )
    logp = logits[:, :-1].float().log_softmax(-1)
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
    if mask is not None:
        m = mask.to(ids.device).bool()
        nll = nll * (m[:, 1:] & m[:, :-1])
    return nll.sum()


def run(
    model: Any,
    batches: Iterable[Any],
    bases: Mapping[str | Site, TangentBasis] | None,
    probes: Sequence[str] = ("residual", "attention", "gradient"),
    *,
    loss: Callable[[Any, Any], Tensor] | None = None,
    layers: int | Iterable[int] | None = None,
    progress: bool = True,
    **options: Any,
) -> ProbeSession:
    """Probe ``model`` over ``batches`` and return the closed session (`results()`).

    Each batch is a ``(batch, pos)`` tensor of token ids or a dict with ``input_ids``
    and ``attention_mask``. Without the gradient probe: one forward under ``no_grad``.
    With it: the loss, then gradients with respect to the embedding output only (model
    parameters' ``.grad`` are left untouched). ``loss(model, batch) -> scalar`` defaults
    to the summed next-token loss (`lm_loss`) for causal models; encoders need one.
    """
    session = ProbeSession(model, bases, probes, layers, **options)
    wants_grad = any(p.reads_backward for p in session.probes.values())
    if wants_grad and loss is None:
        if not session.backend.causal:
            raise UsageError(
                "the gradient probe on an encoder needs a loss: pass loss=callable(model, "
                "batch) -> scalar (e.g. a masked-token loss), or drop 'gradient' from probes."
            )
        loss = lm_loss
    session.leaves = [] if wants_grad else None
    total = len(batches) if hasattr(batches, "__len__") else None
    device = _device(model)
    with session:
        for batch in tqdm(batches, total=total, disable=not progress, desc="probing"):
            ids, mask = unpack_batch(batch)
            if not wants_grad:
                with torch.no_grad():
                    _forward(model, ids.to(device), None if mask is None else mask.to(device))
                continue
            session.leaves.clear()
            with torch.enable_grad():
                value = loss(model, batch)
                if not session.leaves:
                    raise RuntimeError("the loss did not run the model's embedding; no gradient.")
                torch.autograd.grad(value, session.leaves, allow_unused=True)
    session.leaves = None
    return session


def fit_bases(
    model: Any,
    batches: Iterable[Any],
    rank: int | None = None,
    *,
    variance: float | None = None,
    sites: NamesFilter = None,
    layers: int | Iterable[int] | None = None,
    progress: bool = True,
    provenance: dict[str, Any] | None = None,
) -> BasisSet:
    """One pass over ``batches``: activation `Moments` per site, then PCA per site.

    ``rank=k`` or ``variance=0.9`` (see `TangentBasis.fit`). ``sites`` is a names filter
    (default: ``resid_pre``, ``resid_mid``, ``resid_post``, ``attn_in`` and ``mlp_in`` of
    every layer). The returned `BasisSet` keeps the Moments in ``.moments``; each basis
    records ``split_half_overlap`` (bases fitted on the even and on the odd batches) in its
    provenance, and an `UnstableBasisWarning` names the sites where that is near chance.
    """
    if (rank is None) == (variance is None):
        raise UsageError("pass exactly one of rank= (an int) or variance= (a fraction in (0, 1]).")
    backend = get_backend(model)

    def default_sites(name: str) -> bool:
        return Site.from_hook_name(name).kind in (*RESIDUAL_KINDS, *INPUT_KINDS)

    sites = default_sites if sites is None else sites
    batches = list(batches)
    # even and odd batches apart: two bases fitted on disjoint halves of the sequences
    # tell how stable Q_T is (split_half_overlap); the fit uses both
    halves = [
        run(
            model, part, None, ("activation",), layers=layers, sites=sites, progress=progress
        ).activation.moments
        for part in (batches[0::2], batches[1::2])
        if part
    ]
    moments = {s: Moments().merge(m) for s, m in halves[0].items()}
    for s, m in (halves[1] if len(halves) > 1 else {}).items():
        moments[s].merge(m)
    empty = [s.hook_name for s, m in moments.items() if m.count < 2]
    if empty:
        raise UsageError(
            f"too few tokens reached {empty} to fit a basis; pass more batches (and check "
            "the attention masks)."
        )
    info = {
        "model": str(getattr(getattr(model, "cfg", None), "model_name", type(model).__name__)),
        "d_model": backend.d_model,
        "n_layers": backend.n_layers,
        "rank": rank,
        "variance": variance,
        "n_tokens": max(m.count for m in moments.values()),
        "weight_hash": _weight_hash(model),
        "library": f"tangentlens {__version__}",
        **(provenance or {}),
    }
    bases = {}
    unstable = []
    for s, m in moments.items():
        basis = TangentBasis.fit(
            m, rank, variance=variance, provenance={"site": s.hook_name, **info}
        )
        if len(halves) > 1 and min(h[s].count for h in halves) >= 2:
            split = split_half_overlap(halves[0][s], halves[1][s], basis.k)
            basis.provenance["split_half_overlap"] = split
            if near_chance(split, basis.k, basis.d):
                unstable.append(f"{s.hook_name} ({split:.2f})")
        bases[s] = basis
    if unstable:
        warnings.warn(
            f"Q_T fitted on even and on odd batches barely overlaps at {unstable} (chance is "
            "k/d): these bases are mostly sampling noise; fit them on more tokens.",
            UnstableBasisWarning,
            stacklevel=2,
        )
    return BasisSet(bases, provenance=info, moments=moments)


def _weight_hash(model: Any) -> str | None:
    try:
        return tensor_hash(model.state_dict())
    except (AttributeError, TypeError, RuntimeError):
        return None
