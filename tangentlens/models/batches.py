"""What a model is fed: token-id batches, from tensors, dicts or plain text.

Every routine that drives a model (`run`, `fit_bases`, `layerwise_probe`, the causal
effects) takes ``batches`` through `as_batches`, so the same things work everywhere:

- a ``(batch, pos)`` tensor of token ids, or one ``(pos,)`` sequence: one batch;
- a dict with ``input_ids`` (and ``attention_mask``): one batch;
- a string, or a list of strings: tokenised with the model's own tokenizer
  (``model.tokenizer`` on a TransformerLens bridge or an nnsight ``LanguageModel``),
  each text after the tokenizer's BOS token (as ``to_tokens`` reads text, on both
  backends), ``batch_size`` texts to a batch, right-padded with an attention mask;
- any other iterable: its items, each one of the above.

`text_batches` does the tokenising for a tokenizer the caller holds.

Token ids without an attention mask get the mask TransformerLens itself derives
(`derive_mask`): ``model.to_tokens(texts)`` pads with the pad token, and without a mask
every statistic would count those positions as tokens. A pad token that is also the
BOS or EOS token cannot be told from a real one at the padded end, so a mask derived
there comes with a `PaddingWarning` naming the fix (pass the texts, or a mask).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from ..core.errors import PaddingWarning, UsageError
from ..core.validation import check_int
from ..hooks.families import unwrap

__all__ = [
    "as_batches",
    "check_mask",
    "check_tokens",
    "context_length",
    "derive_mask",
    "draw_masked",
    "iter_batches",
    "text_batches",
    "unpack_batch",
    "vocabulary_size",
]


def unpack_batch(batch: Any) -> tuple[Tensor, Tensor | None]:
    """``(ids, attention_mask or None)`` of one batch, checked: ids are ``(batch, pos)``
    integers and the mask has their shape."""
    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise UsageError(f"a dict batch needs 'input_ids'; got keys {sorted(batch)}.")
        ids, mask = batch["input_ids"], batch.get("attention_mask")
    else:
        ids, mask = batch, None
    if isinstance(ids, list | tuple) and len(ids) == 1 and isinstance(ids[0], Tensor):
        ids = ids[0]  # what a DataLoader over a TensorDataset(ids) yields
    if isinstance(ids, str) or (isinstance(ids, list | tuple) and ids and isinstance(ids[0], str)):
        raise UsageError(
            "this batch is text: pass it through as_batches(model, texts) or "
            "text_batches(tokenizer, texts) to tokenise it."
        )
    form = (
        "a batch must be (batch, pos) integer token ids or a dict with input_ids and attention_mask"
    )
    if (
        isinstance(ids, list | tuple)
        and len(ids) == 2
        and all(isinstance(t, Tensor) and t.ndim == 2 for t in ids)
    ):
        raise UsageError(  # what a DataLoader over a TensorDataset(ids, mask) yields
            f"{form}; got a pair of tensors: pass {{'input_ids': ids, 'attention_mask': mask}}."
        )
    try:
        ids = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError) as err:
        raise UsageError(f"{form}; got a {type(ids).__name__} torch cannot read ({err}).") from None
    if ids.ndim != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise UsageError(f"{form}; got {tuple(ids.shape)} {ids.dtype}.")
    if ids.dtype not in (torch.int32, torch.int64):  # int8/uint8/int16: no embedding reads them
        ids = ids.long()
    if ids.numel() == 0:
        raise UsageError(
            f"a batch of shape {tuple(ids.shape)} holds no tokens; drop it from batches."
        )
    if mask is not None:
        mask = torch.as_tensor(mask)
        if mask.shape != ids.shape:
            raise UsageError(
                f"attention_mask {tuple(mask.shape)} must match input_ids {tuple(ids.shape)}."
            )
        check_mask(mask)
    return ids, mask


def check_mask(mask: Tensor) -> None:
    """An attention mask holds only 0 and 1 (bool or numbers) and keeps at least one
    position per sequence: any other value (2, −1, NaN) would be read as "keep" by one
    backend and as a bias by another, and a sequence with nothing kept makes NaN
    attention. Checked before any pass, so the fault is named instead of skewing results."""
    if mask.dtype != torch.bool:
        binary = (mask == 0) | (mask == 1)
        if not bool(binary.all()):
            bad = mask[~binary].flatten()[0].item()
            raise UsageError(
                f"attention_mask holds {bad!r}; it must hold only 0 (padding) and 1 (a "
                "token): pass mask.bool() or (mask > 0).long() if that is what you mean."
            )
    kept = mask.bool().any(-1)
    if not bool(kept.all()):
        rows = torch.nonzero(~kept).flatten().tolist()[:8]
        raise UsageError(
            f"attention_mask keeps no position of sequences {rows}; drop those sequences "
            "(each needs at least one token with mask 1)."
        )


def text_batches(
    tokenizer: Any,
    texts: str | Iterable[str],
    *,
    batch_size: int = 8,
    max_length: int | None = None,
) -> list[Tensor | dict[str, Tensor]]:
    """Tokenise ``texts`` into batches whose padding every probe can tell apart.

    Texts of unequal length need padding, and a pad id can also be a real token; a batch
    that needs padding therefore carries its ``attention_mask`` explicitly, so no
    statistic ever counts a pad position. The tokenizer is not modified (the padding is
    ours, so a tokenizer without a pad token works). Each text starts with the
    tokenizer's BOS token where it has one, as TransformerLens' ``to_tokens`` reads text:
    a bridge's tokenizer adds it and the same Hugging Face tokenizer under nnsight may
    not, and a text must give both backends the same ids (pass token ids to choose).

    Args:
        tokenizer: A Hugging Face tokenizer (``model.tokenizer``, ``load(...).tokenizer``).
        texts: A string or a list of strings.
        batch_size: Texts per batch.
        max_length: Tokens kept per text (default: all).

    Returns:
        A list of batches: a ``(batch, pos)`` id tensor where the texts have one length,
        else a dict with right-padded ``input_ids`` and its ``attention_mask``.

    Raises:
        UsageError: No texts, a text that tokenises to nothing, or a ``batch_size`` or
            ``max_length`` below 1.

    Example:
        With ``model`` from `load` and ``texts`` a list of strings of unequal length:

        >>> batches = tangentlens.text_batches(model.tokenizer, texts, batch_size=4)
        >>> sorted(batches[0])
        ['attention_mask', 'input_ids']
        >>> bases = tangentlens.fit_bases(model, batches, rank=8, progress=False)
    """
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise UsageError("texts must be a string or a non-empty list of strings.")
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    if max_length is not None:
        max_length = check_int(max_length, "max_length", minimum=1)
    bos = getattr(tokenizer, "bos_token_id", None)
    encoded = [_with_bos(list(tokenizer(t)["input_ids"]), bos)[:max_length] for t in texts]
    empty = [i for i, e in enumerate(encoded) if not e]
    if empty:
        raise UsageError(f"texts {empty} tokenise to nothing; drop them or add text.")
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = 0 if pad is None else int(pad)
    out: list[Tensor | dict[str, Tensor]] = []
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, seq in enumerate(chunk):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        out.append(ids if bool(mask.all()) else {"input_ids": ids, "attention_mask": mask})
    return out


def _with_bos(ids: list[int], bos: int | None) -> list[int]:
    return ids if bos is None or (ids and ids[0] == bos) else [int(bos), *ids]


def _is_text(x: Any) -> bool:
    return isinstance(x, str) or (
        isinstance(x, list | tuple) and bool(x) and all(isinstance(t, str) for t in x)
    )


def derive_mask(model: Any, ids: Tensor) -> Tensor | None:
    """The attention mask TransformerLens derives for padded token ids
    (``transformer_lens.utilities.get_attention_mask``), or None where it masks nothing.

    The rule is TransformerLens' own, so a tensor from ``model.to_tokens(texts)`` is read
    as the model reads it: on the tokenizer's padding side, the run of pad tokens at the
    end (right) or start (left) of each row is padding; with left padding and a pad token
    equal to BOS, the BOS before the first real token is kept when the model prepends
    BOS. A model without a tokenizer, or one without a pad token, gets no mask (as in
    TransformerLens). When the pad token is also the BOS or EOS token, a real one at the
    padded end is masked too: a `PaddingWarning` says so and names the fix.
    """
    tokenizer = getattr(model, "tokenizer", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    if tokenizer is None or pad is None:
        return None
    side = getattr(tokenizer, "padding_side", "right")
    not_pad = ids.ne(int(pad))
    if side == "right":
        padding = not_pad.flip(-1).long().cumsum(-1).flip(-1) == 0
    else:
        padding = not_pad.long().cumsum(-1) == 0
    if not bool(padding.any()):
        return None
    mask = (~padding).long()
    prepend_bos = bool(getattr(getattr(model, "cfg", None), "default_prepend_bos", True))
    if side != "right" and prepend_bos and getattr(tokenizer, "bos_token_id", None) == pad:
        rows = torch.arange(ids.shape[0])
        last = padding.sum(-1) - 1
        keep = last >= 0
        mask[rows[keep], last[keep]] = 1
    if side == "right":
        shared = [n for n in ("bos", "eos") if getattr(tokenizer, f"{n}_token_id", None) == pad]
    else:  # a leading run: only a BOS the model does not prepend itself is ambiguous
        bos = getattr(tokenizer, "bos_token_id", None) == pad and not prepend_bos
        shared = ["bos"] if bos else []
    if shared:
        warnings.warn(
            f"these token ids carry no attention mask, and their pad token (id {pad}) is "
            f"also the {' and '.join(n.upper() for n in shared)} token: every {side}-end run "
            f"of it is taken as padding, real ones too. Pass the texts, or a dict with "
            "input_ids and attention_mask, to say which tokens are real.",
            PaddingWarning,
            stacklevel=3,
        )
    return mask


def with_mask(model: Any, batch: Any) -> Any:
    """``batch``, with the mask `derive_mask` finds when it has padding and no mask of its
    own: a dict with ``input_ids`` and ``attention_mask``; otherwise ``batch`` itself."""
    if isinstance(batch, Mapping):
        if batch.get("attention_mask") is not None or "input_ids" not in batch:
            return batch
        ids = batch["input_ids"]
    elif isinstance(batch, Tensor):
        ids = batch
    else:
        return batch
    if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.dtype.is_floating_point:
        return batch
    mask = derive_mask(model, ids)
    if mask is None:
        return batch
    extra = dict(batch) if isinstance(batch, Mapping) else {}
    return {**extra, "input_ids": ids, "attention_mask": mask.to(ids.device)}


def as_batches(model: Any, batches: Any, *, batch_size: int = 8) -> list[Any]:
    """``batches`` as a list of batches (see the module docstring for what is accepted)."""
    return list(iter_batches(model, batches, batch_size=batch_size))


def iter_batches(model: Any, batches: Any, *, batch_size: int = 8) -> Iterator[Any]:
    """`as_batches`, lazily: a generator of batches is read one batch at a time. Every
    batch of token ids without a mask passes through `with_mask`, the one place where
    padding is found; each batch is then checked (`unpack_batch`, `check_tokens` against
    ``model``) before it is yielded, and no batch at all is a `UsageError`: every entry
    point fails on what the caller passed, naming it, instead of deep inside a model or
    with an empty result."""
    n = 0
    for raw in _items(model, batches, batch_size):
        batch = with_mask(model, raw)
        ids, _ = unpack_batch(batch)
        check_tokens(model, ids, what="batches")
        n += 1
        yield batch
    if n == 0:
        raise UsageError("batches holds no batch; pass at least one batch of token ids or text.")


def _is_pair(batches: Any) -> bool:
    """Two tensors of one shape, the second all 0/1 and the first not: token ids and their
    mask passed side by side, not two batches."""
    if not (isinstance(batches, list | tuple) and len(batches) == 2):
        return False
    ids, mask = batches
    if not (isinstance(ids, Tensor) and isinstance(mask, Tensor) and ids.shape == mask.shape):
        return False
    binary = bool(((mask == 0) | (mask == 1)).all())
    return binary and not bool(((ids == 0) | (ids == 1)).all())


def _items(model: Any, batches: Any, batch_size: int) -> Iterator[Any]:
    if isinstance(batches, Tensor):
        if batches.ndim == 1:
            yield batches[None]
            return
        if batches.ndim == 2:
            yield batches
            return
        if batches.ndim == 3 and not batches.dtype.is_floating_point:
            yield from batches  # a stack of (batch, pos) batches
            return
    if isinstance(batches, Mapping):
        yield batches
        return
    if _is_pair(batches):
        raise UsageError(
            "batches is an (ids, attention_mask) pair, which would read the mask as a second "
            "batch of token ids: pass {'input_ids': ids, 'attention_mask': mask}."
        )
    if _is_text(batches):
        yield from text_batches(_tokenizer(model), batches, batch_size=batch_size)
        return
    try:
        items = iter(batches)
    except TypeError:
        raise UsageError(
            f"batches must be token ids, a dict batch, text or an iterable of those; "
            f"got {type(batches).__name__}."
        ) from None
    for item in items:
        if _is_text(item):
            yield from text_batches(_tokenizer(model), item, batch_size=batch_size)
        elif isinstance(item, Tensor) and item.ndim == 1:  # one (pos,) sequence
            yield item[None]
        else:
            yield item


def _tokenizer(model: Any) -> Any:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise UsageError(
            f"this {type(model).__name__} has no tokenizer to read text with; pass token ids, "
            "or text_batches(tokenizer, texts)."
        )
    return tokenizer


# ----------------------------------------------------------- what the model takes
def vocabulary_size(model: Any) -> int | None:
    """How many token ids the model embeds: TransformerLens ``cfg.d_vocab``, else a
    Hugging Face ``config.vocab_size`` (of the model or the HF model it wraps, as an
    nnsight model does); None when the model says neither."""
    size = getattr(getattr(model, "cfg", None), "d_vocab", None)
    for m in (model, _inner(model)):
        size = size or getattr(getattr(m, "config", None), "vocab_size", None)
    return int(size) if isinstance(size, int) and size > 0 else None


def context_length(model: Any) -> int | None:
    """The longest sequence the model takes: TransformerLens ``cfg.n_ctx``, else a Hugging
    Face ``config.max_position_embeddings`` (of the model or the HF model it wraps); None
    when the model says neither."""
    size = getattr(getattr(model, "cfg", None), "n_ctx", None)
    for m in (model, _inner(model)):
        size = size or getattr(getattr(m, "config", None), "max_position_embeddings", None)
    return int(size) if isinstance(size, int) and size > 0 else None


def _inner(model: Any) -> Any:
    return unwrap(model, strict=False)


def check_tokens(
    model: Any,
    ids: Tensor,
    *,
    source: str = "the model",
    fix: str = "tokenize the text with this model's tokenizer",
    what: str = "token ids",
) -> None:
    """Token ids ``(..., seq_len)`` must be integers in the model's vocabulary and each
    sequence within its context, checked before any pass: past either, the model fails
    deep inside (an IndexError in an embedding, a RuntimeError on bool ids) or, with rotary
    positions, runs on silently. ``source`` names the model in the message, ``fix`` says
    what to do about foreign ids, ``what`` names the argument that holds them."""
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise UsageError(
            f"{what} are {ids.dtype}; pass integer token ids (a bool tensor is a mask: pass "
            "it as attention_mask)."
        )
    if ids.numel() == 0:
        raise UsageError(f"{what} hold no tokens (shape {tuple(ids.shape)}); pass some.")
    vocab = vocabulary_size(model)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        raise UsageError(
            f"{what}: token ids run from {low} to {high}, outside the vocabulary [0, {vocab}) "
            f"of {source}: {fix}."
        )
    context = context_length(model)
    if context is not None and ids.shape[-1] > context:
        raise UsageError(
            f"{what}: seq_len={ids.shape[-1]} exceeds the {context} positions of {source}; "
            "lower seq_len (or cut the sequences)."
        )


def draw_masked(eligible: Tensor, rate: float, seed: int) -> Tensor:
    """Which positions a masked-LM objective masks and predicts, ``eligible``'s shape
    ``(batch, pos)`` bool: each eligible position with probability ``rate``, and in every
    row with an eligible position at least one (its lowest draw), so no sequence adds
    nothing to the loss. The draws come from a generator of their own seeded with
    ``seed``: the same seed masks the same positions on every backend, rerun and resume,
    whatever else has drawn random numbers."""
    gen = torch.Generator().manual_seed(seed)
    draw = torch.rand(eligible.shape, generator=gen)
    chosen = eligible & (draw < rate)
    first = torch.where(eligible, draw, 2.0).argmin(1)  # each row's lowest eligible draw
    rows = eligible.any(1) & ~chosen.any(1)
    chosen[rows, first[rows]] = True
    return chosen
