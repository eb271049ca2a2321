"""Drive a model over batches: `run` (probes with a progress bar), `fit_bases` (one
pass, PCA per site), `lm_loss` (the default next-token loss) and `mlm_loss` (the
built-in masked-token loss for encoders).

Batches are ``(batch, pos)`` token-id tensors or dicts with ``input_ids`` and
``attention_mask``. Gradients are taken with respect to the embedding output only, so
the parameters' ``.grad`` stay as the caller's code leaves them.
"""

from __future__ import annotations

import contextlib
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..core.compute import site_map
from ..core.errors import UnstableBasisWarning, UsageError
from ..core.stats import Moments, state_dtype
from ..core.subspace import TangentBasis, near_chance, split_half_overlap
from ..hooks.base import get_backend
from ..hooks.families import unwrap
from ..hooks.sites import INPUT_KINDS, RESIDUAL_KINDS, NamesFilter, Site
from ..models.batches import as_batches, draw_masked, iter_batches, unpack_batch, vocabulary_size
from ..version import __version__
from .base import first_equal
from .bases import BasisSet, weights_hash
from .session import ProbeSession, open_sessions

__all__ = ["LOSSES", "fit_bases", "lm_loss", "masked_positions", "mlm_loss", "run"]


def _device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError, TypeError):
        return torch.device("cpu")


def _forward(model: Any, ids: Tensor, mask: Tensor | None) -> Tensor:
    return model(ids) if mask is None else model(ids, attention_mask=mask)


def _model_id(model: Any) -> str:
    """What a basis's provenance names as its model, alike on both backends: the bridge's
    ``cfg.model_name``, else the Hugging Face ``name_or_path`` (the folder or hub id an
    nnsight model was loaded from), else the class."""
    name = getattr(getattr(model, "cfg", None), "model_name", None)
    if name:
        return str(name)
    inner = unwrap(model, strict=False)
    path = getattr(getattr(inner, "config", None), "name_or_path", "")
    return str(path) if path else type(inner).__name__


def lm_loss(model: Any, batch: Any, *, per_sequence: bool = False) -> Tensor:
    """Summed next-token cross-entropy over real (unpadded) token pairs.

    Summed, not averaged, so each token's gradient does not depend on the batch size.
    ``per_sequence``: the sum of each sequence apart, ``(batch,)``, so one pass over
    copies of a batch (each edited differently) gives every copy's loss.
    """
    ids, mask = unpack_batch(batch)
    ids = ids.to(_device(model))
    out = _forward(model, ids, None if mask is None else mask.to(ids.device))
    logits = _logits(out, "the next-token loss")
    logp = logits[:, :-1].float().log_softmax(-1)
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
    if mask is not None:
        m = mask.to(ids.device).bool()
        nll = nll * (m[:, 1:] & m[:, :-1])
    return nll.sum(-1) if per_sequence else nll.sum()


def _logits(out: Any, what: str) -> Tensor:
    logits = getattr(out, "logits", out)  # Hugging Face models return a ModelOutput
    if not isinstance(logits, Tensor) or logits.ndim != 3:
        raise UsageError(
            f"the model did not return (batch, pos, vocab) logits, which {what} needs; pass "
            "loss=callable(model, batch) -> scalar."
        )
    return logits


def _hf(model: Any) -> Any:
    """The Hugging Face model inside ``model``, or ``model`` itself where it wraps none."""
    return unwrap(model, strict=False)


def _has_lm_head(hf: Any) -> bool:
    """Whether the checkpoint has an LM head: its class has output embeddings and the
    saved ``architectures`` are not bare encoders (``BertModel``: a bridge would boot it
    with a freshly initialised head)."""
    head = getattr(hf, "get_output_embeddings", None)
    if callable(head) and head() is None:
        return False
    saved = getattr(getattr(hf, "config", None), "architectures", None) or []
    return not saved or any("For" in a or "LMHead" in a for a in saved)


def _vocab_and_mask_id(model: Any) -> tuple[int | None, int | None, set[int]]:
    """(vocabulary size, mask token id, special token ids) from the model's tokenizer (a
    TransformerLens bridge's or nnsight ``TransformersModel``'s) or its config."""
    config, tok = getattr(_hf(model), "config", None), getattr(model, "tokenizer", None)
    vocab = vocabulary_size(model) or vocabulary_size(_hf(model))
    mask_id = getattr(tok, "mask_token_id", None)
    if mask_id is None:
        mask_id = getattr(config, "mask_token_id", None)
    special = set(getattr(tok, "all_special_ids", None) or [])
    for name in ("pad", "bos", "eos", "cls", "sep", "unk"):
        value = getattr(config, f"{name}_token_id", None)
        if isinstance(value, int):
            special.add(value)
    return vocab, mask_id, special | ({mask_id} if mask_id is not None else set())


def masked_positions(model: Any, batch: Any, *, rate: float = 0.15, seed: int = 0) -> Tensor:
    """The positions `mlm_loss` masks and predicts, ``(batch, pos)`` bool: a fraction
    ``rate`` of each sequence's non-special, unpadded positions (at least one), drawn from
    ``seed`` and the batch's token ids, so every backend and every rerun masks the same."""
    if not 0 < rate < 1:
        raise UsageError(f"rate must be in (0, 1); got {rate}.")
    ids, mask = unpack_batch(batch)
    ids = ids.cpu()
    _, _, special = _vocab_and_mask_id(model)
    eligible = ~torch.isin(ids, torch.tensor(sorted(special), dtype=ids.dtype))
    if mask is not None:
        eligible &= mask.cpu().bool()
    return draw_masked(eligible, rate, seed * 1_000_003 + zlib.crc32(ids.numpy().tobytes()))


def mlm_loss(
    model: Any,
    batch: Any,
    *,
    rate: float = 0.15,
    seed: int = 0,
    mask_token_id: int | None = None,
) -> Tensor:
    """Summed masked-token cross-entropy, the encoders' built-in loss (``loss="mlm"``).

    The positions of `masked_positions` are replaced by the mask token and predicted from
    the rest; the loss sums the cross-entropy at those positions (summed, like `lm_loss`).
    The mask token comes from the model's tokenizer or config (``mask_token_id``
    overrides). Needs a masked-LM head (``...ForMaskedLM``): a model without one (a bare
    encoder such as MiniLM's ``BertModel``) is a `UsageError`.
    """
    ids, mask = unpack_batch(batch)
    ids = ids.cpu()
    hf = _hf(model)
    if not _has_lm_head(hf):
        saved = getattr(getattr(hf, "config", None), "architectures", None)
        name = ", ".join(saved or [type(hf).__name__])
        raise UsageError(
            f"loss='mlm' needs a masked-LM head, and the checkpoint ({name}) has none: "
            "load the model with its head (AutoModelForMaskedLM) or pass "
            "loss=callable(model, batch) -> scalar."
        )
    vocab, found, _ = _vocab_and_mask_id(model)
    mask_id = found if mask_token_id is None else int(mask_token_id)
    if mask_id is None:
        raise UsageError(
            "loss='mlm' needs the mask token id, which neither the model's tokenizer nor its "
            "config has: pass loss=functools.partial(mlm_loss, mask_token_id=...)."
        )
    chosen = masked_positions(model, batch, rate=rate, seed=seed)
    device = _device(model)
    masked = ids.masked_fill(chosen, mask_id).to(device)
    out = _forward(model, masked, None if mask is None else mask.to(device))
    logits = _logits(out, "loss='mlm'")
    if vocab is not None and logits.shape[-1] != vocab:
        raise UsageError(
            f"loss='mlm' needs a masked-LM head, but {type(model).__name__} returns "
            f"{logits.shape[-1]} features per token, not {vocab} vocabulary logits; load the "
            "model with its head (AutoModelForMaskedLM) or pass loss=callable(model, batch)."
        )
    chosen = chosen.to(device)
    logp = logits[chosen].float().log_softmax(-1)
    return -logp.gather(-1, ids.to(device)[chosen][:, None]).sum()


LOSSES: dict[str, Callable[[Any, Any], Tensor]] = {"lm": lm_loss, "mlm": mlm_loss}


def run(
    model: Any,
    batches: Iterable[Any],
    bases: Mapping[str | Site, TangentBasis] | None,
    probes: Sequence[str] = ("residual", "attention", "gradient"),
    *,
    loss: Callable[[Any, Any], Tensor] | str | None = None,
    layers: int | Iterable[int] | None = None,
    progress: bool = True,
    **options: Any,
) -> ProbeSession:
    """Probe ``model`` over ``batches``: the forward (and backward) passes done for you.

    The one entry point for a probing run: `probe` is the context manager under it (for
    passes you run yourself), `tangentlens.probes.distributed.run_probe` the same over
    several processes. Without a gradient probe each batch is one forward under
    ``no_grad``, stopped after the deepest layer a probe reads (`Probe.last_layer`): no
    later block, final norm or unembedding runs for nothing (inside another open session,
    which reads every layer of these passes too, the whole forward). With one, the loss is
    differentiated with respect to the embedding output only, so the model's parameters
    keep their ``.grad``. Called under ``torch.inference_mode()``, it runs outside it (its
    state is updated in place and its gradient passes need autograd): the same table.

    Args:
        model: A TransformerLens bridge or an nnsight model (`load`).
        batches: ``(batch, pos)`` token ids, dicts with ``input_ids`` and
            ``attention_mask``, text (read with the model's tokenizer) or an iterable of
            those; padding is masked out of every statistic.
        bases: A `BasisSet` or a dict hook name → `TangentBasis`; the probes run at the
            sites that have one (None: probes that need no basis only).
        probes: Registered probe names (`tangentlens.probes.PROBES`).
        loss: ``"lm"`` (summed next-token loss; the default for causal models),
            ``"mlm"`` (seeded masked-token loss, for encoders) or
            ``callable(model, batch) -> scalar``.
        layers: Layers to probe (default: every layer with a basis).
        progress: Show a progress bar.
        **options: The probes' own options (``n_controls``, ``head_null``, ``reservoir``,
            ``seed``, ``sites``, ``memory``; see `ProbeSession`); an option no probe takes
            is an error.

    Returns:
        The closed `ProbeSession`; ``session.results()`` is the long results table. A
        probe that cannot run on this model is skipped with one warning and listed in
        ``session.skipped``.

    Raises:
        UsageError: An unknown ``loss`` name or option, batches the model cannot read,
            the gradient probe on an encoder without a ``loss``, or a ``loss`` that gives
            no scalar tensor with a graph through the model.

    Example:
        With ``model`` from `load`, ``texts`` a list of strings and ``bases`` from
        `fit_bases`:

        >>> session = tangentlens.run(model, texts, bases, progress=False)
        >>> table = session.results()
        >>> sorted(table["probe"].unique())
        ['attention', 'basis', 'gradient', 'residual']
    """
    if isinstance(loss, str) and loss not in LOSSES:
        raise UsageError(f"loss must be one of {sorted(LOSSES)} or a callable; got {loss!r}.")
    with torch.inference_mode(False):  # the probes' state and passes: never inference tensors
        session = ProbeSession(model, bases, probes, layers, **options)
        return _drive(session, model, batches, loss, progress)


def _drive(
    session: ProbeSession,
    model: Any,
    batches: Iterable[Any],
    loss: Callable[[Any, Any], Tensor] | str | None,
    progress: bool,
) -> ProbeSession:
    """`run`'s passes, inside ``torch.inference_mode(False)``."""
    session.progress = progress
    wants_grad = any(p.reads_backward for p in session.probes.values())
    if wants_grad and loss is None:
        if not session.backend.causal:
            raise UsageError(
                "the gradient probe on an encoder needs a loss: pass loss='mlm' (the built-in "
                "masked-token loss) or loss=callable(model, batch) -> scalar, or drop "
                "'gradient' from probes."
            )
        loss = "lm"
    loss = LOSSES[loss] if isinstance(loss, str) else loss
    session.leaves = [] if wants_grad else None
    if hasattr(batches, "__len__"):
        batches = as_batches(model, batches)
        total: int | None = len(batches)
    else:  # a stream: read one batch at a time
        batches, total = iter_batches(model, batches), None
    device = _device(model)
    with session, contextlib.nullcontext() if wants_grad else _stopped_forward(session):
        for given in tqdm(batches, total=total, disable=not progress, desc="probing"):
            batch = _outside_inference(given)
            ids, mask = unpack_batch(batch)
            if not wants_grad:
                with torch.no_grad(), contextlib.suppress(_ForwardDone):
                    _forward(model, ids.to(device), None if mask is None else mask.to(device))
                continue
            session.leaves.clear()
            with torch.enable_grad():
                value = _checked_loss(loss(model, batch), bool(session.leaves))
                torch.autograd.grad(value, session.leaves, allow_unused=True)
    session.leaves = None
    return session


def _outside_inference(batch: Any) -> Any:
    """``batch`` with its inference tensors (made under ``torch.inference_mode``) copied to
    normal ones, which the gradient passes can save for the backward; any other batch as
    it is (a tokenizer's `BatchEncoding` stays one for a loss of the caller's own)."""
    if isinstance(batch, Tensor):
        return batch.clone() if batch.is_inference() else batch
    inference = isinstance(batch, Mapping) and any(
        isinstance(v, Tensor) and v.is_inference() for v in batch.values()
    )
    return {k: _outside_inference(v) for k, v in batch.items()} if inference else batch


def _checked_loss(value: Any, ran: bool) -> Tensor:
    """``loss(model, batch)``'s value if the gradient probes can differentiate it: one
    number, with a graph through the model's embedding (``ran``: the embedding's output was
    captured)."""
    fix = "loss must be callable(model, batch) returning the batch's scalar loss tensor"
    if not isinstance(value, Tensor):
        raise UsageError(f"{fix}; got a {type(value).__name__}.")
    if value.numel() != 1:
        raise UsageError(f"{fix}; got shape {tuple(value.shape)} (per sequence? take its .mean()).")
    if not ran or not value.requires_grad:
        raise UsageError(
            f"{fix}, computed from the model's forward with its graph (no .detach(), .item() "
            "or torch.no_grad() inside it): no gradient reaches the probes."
        )
    return value


class _ForwardDone(Exception):
    """Raised by `_stopped_forward`'s hook: the rest of the forward is not read."""


@contextlib.contextmanager
def _stopped_forward(session: ProbeSession) -> Iterator[None]:
    """Forward passes inside stop at the ``resid_post`` of `ProbeSession.last_layer`,
    after the session's own hooks there, by raising `_ForwardDone`: the later blocks, the
    final norm and the unembedding (a large share of a small model with a large
    vocabulary) compute nothing a forward-only probe reads. Without that layer's
    ``resid_post`` among the backend's sites, or inside another open session on the model
    (whose passes would otherwise stop short of its deeper sites): the whole forward."""
    last = session.last_layer
    site = None if last is None else Site(last, "resid_post")
    if site is None or site not in session.backend.sites() or open_sessions(session.model) > 1:
        yield
        return

    def stop(x: Tensor) -> None:
        raise _ForwardDone

    handle = session.backend.add_forward_hook(site, stop)
    try:
        yield
    finally:
        handle.remove()


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
    memory: str = "full",
) -> BasisSet:
    """Fit Q_T, the top principal subspace of the activations, at every site.

    One pass over ``batches`` keeps streaming `Moments` per site (no activation is
    stored), then each site gets its own PCA. The even and the odd batches are also
    fitted apart: their overlap (``split_half_overlap`` in each basis's provenance) says
    whether Q_T is a property of the model or of this sample, and an
    `UnstableBasisWarning` names the sites where it is near chance.

    Args:
        model: A TransformerLens bridge or an nnsight model (`load`).
        batches: ``(batch, pos)`` token ids, dicts with ``input_ids`` and
            ``attention_mask``, text or an iterable of those; padding is masked.
        rank: Dimension k of every basis; pass this or ``variance``.
        variance: Fraction of each site's variance to keep, instead of ``rank``.
        sites: A TransformerLens names filter (None, a hook name, a list or a callable);
            default: ``resid_pre``, ``resid_mid``, ``resid_post``, ``attn_in`` and
            ``mlp_in`` of every layer.
        layers: Layers to fit (default: all).
        progress: Show a progress bar.
        provenance: Extra entries recorded in every basis's provenance.
        memory: ``"full"`` (float64 d×d state) or ``"compact"`` (float32, for d ≥ 2048).

    Returns:
        A `BasisSet` (hook name → `TangentBasis`) that also keeps the `Moments` in
        ``.moments``; each basis records the weights it was fitted on, so using it on
        other weights warns.

    Raises:
        UsageError: Both or neither of ``rank`` and ``variance``, batches the model
            cannot read, or a site too few tokens reached.

    Example:
        With ``model`` from `load` and ``texts`` a list of strings:

        >>> bases = tangentlens.fit_bases(model, texts, rank=8, progress=False)
        >>> bases["blocks.0.hook_resid_pre"].k
        8
    """
    if (rank is None) == (variance is None):
        raise UsageError("pass exactly one of rank= (an int) or variance= (a fraction in (0, 1]).")
    backend = get_backend(model)

    def default_sites(name: str) -> bool:
        return Site.from_hook_name(name).kind in (*RESIDUAL_KINDS, *INPUT_KINDS)

    sites = default_sites if sites is None else sites
    batches = as_batches(model, batches)
    # even and odd batches apart: two bases fitted on disjoint halves of the sequences
    # tell how stable Q_T is (split_half_overlap); the fit uses both
    halves = [
        run(
            model,
            part,
            None,
            ("activation",),
            layers=layers,
            sites=sites,
            progress=progress,
            memory=memory,
        ).activation.moments
        for part in (batches[0::2], batches[1::2])
        if part
    ]
    dtype = state_dtype(memory)
    moments = {s: Moments.merged([h[s] for h in halves if s in h], dtype=dtype) for s in halves[0]}
    empty = [s.hook_name for s, m in moments.items() if m.count < 2]
    if empty:
        raise UsageError(
            f"too few tokens reached {empty} to fit a basis; pass more batches (and check "
            "the attention masks)."
        )
    info = {
        "model": _model_id(model),
        "d_model": backend.d_model,
        "n_layers": backend.n_layers,
        "rank": rank,
        "variance": variance,
        "n_tokens": max(m.count for m in moments.values()),
        "weight_hash": weights_hash(model),
        "library": f"tangentlens {__version__}",
        **(provenance or {}),
    }
    # two names of one tensor have bit-identical statistics: fit once, relabel (the
    # eigendecompositions dominate)
    names = list(moments)
    first = first_equal(names, lambda a, b: _same_tensor(a, b, moments, halves))
    twins = {s: names[j] for s, j in zip(names, first, strict=True)}

    def fit(s: Site) -> TangentBasis:
        basis = TangentBasis.fit(
            moments[s], rank, variance=variance, provenance={"site": s.hook_name, **info}
        )
        if len(halves) > 1 and min(h[s].count for h in halves) >= 2:
            split = split_half_overlap(halves[0][s], halves[1][s], basis.k)
            basis.provenance["split_half_overlap"] = split
        return basis

    distinct = [s for s, t in twins.items() if s == t]
    fitted = dict(zip(distinct, site_map(fit, distinct), strict=True))  # side by side
    bases: dict[Site, TangentBasis] = {}
    unstable = []
    for s, t in twins.items():
        basis = fitted[s] if s == t else fitted[t].relabelled(site=s.hook_name)
        split = basis.provenance.get("split_half_overlap")
        if split is not None and near_chance(split, basis.k, basis.d):
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


def _same_tensor(
    a: Site, b: Site, moments: Mapping[Site, Moments], halves: list[Mapping[Site, Moments]]
) -> bool:
    """Whether sites ``a`` and ``b`` saw the same vectors, in both halves too."""
    return moments[a].identical(moments[b]) and all(
        a in h and b in h and h[a].identical(h[b]) for h in halves
    )
