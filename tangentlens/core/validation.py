"""Argument checks shared by every layer: one rule, one message, one place.

Integers are Python or numpy integers, never booleans; every failure is a
`UsageError` whose message names the argument and the fix.
"""

from __future__ import annotations

import codecs
import numbers
from collections.abc import Iterable
from typing import Any

from .errors import UsageError

__all__ = [
    "BACKENDS",
    "CONTROLS",
    "MAXIMA",
    "MAX_SEED",
    "OBJECTIVES",
    "check_backend",
    "check_controls",
    "check_encoding",
    "check_int",
    "check_layers",
    "check_limits",
    "check_rank",
    "check_seed",
    "check_seeds",
    "check_seq_len",
    "check_window_fraction",
    "is_int",
    "is_seed",
    "max_rank",
]

BACKENDS = ("transformer_lens", "nnsight")
"""Model libraries tangentlens hooks into (`tangentlens.hooks`)."""

CONTROLS = ("uniform", "normal")
"""Kinds of random matched-rank frames: ``uniform`` over the whole space (exact test),
``normal`` in the complement of Q_T (the paper's design)."""

OBJECTIVES = ("causal", "masked")
"""What the trainer optimises: ``causal`` (a decoder, next-token loss) or ``masked`` (an
encoder, masked-token loss)."""


def is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# The largest value each count takes, however it is spelled (``n_controls``,
# ``--n-controls``, ``StudyConfig.n_controls``): far beyond any real run, and small enough
# that a typo (an extra few zeros) is refused at once instead of running for days or
# filling memory before anything says why.
MAXIMA = {
    "n_controls": 100_000,
    "n_null": 100_000,
    "head_null": 10_000,
    "n_permutations": 1_000_000,
    "n_sequences": 10_000_000,
    "max_steps": 100_000_000,
    "n_seeds": 1_000,  # runs trained one after another
}


# the largest seed: every generator takes it (numpy's legacy ones stop at 2**32 − 1), with
# room for the offsets a run adds to it (a layer, a rank, a checkpoint)
MAX_SEED = 2**31 - 1


def is_seed(value: Any) -> bool:
    """An int in [0, `MAX_SEED`]: the one seed rule every check below reads."""
    return is_int(value) and 0 <= value <= MAX_SEED


def check_seed(value: Any, name: str = "seed") -> int:
    """A seed (`is_seed`), as a plain int."""
    if not is_seed(value):
        raise UsageError(f"{name} must be an int in [0, {MAX_SEED}]; got {value!r}.")
    return int(value)


def check_int(
    value: Any, name: str, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """``int(value)`` if it is an integer in [``minimum``, ``maximum``]; a `UsageError`
    otherwise. Without ``maximum``, a count named in `MAXIMA` is bounded there."""
    if not is_int(value) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise UsageError(f"{name} must be an int{bound}; got {value!r}.")
    key = name.rsplit(".", 1)[-1].lstrip("-").replace("-", "_").split(" ")[0]
    top = MAXIMA.get(key) if maximum is None else maximum
    if top is not None and value > top:
        raise UsageError(
            f"{name} must be at most {top:,}; got {value:,}, which would not finish or not "
            "fit in memory: pass a smaller value."
        )
    return int(value)


def check_limits(config: Any, prefix: str) -> None:
    """Every count of ``config`` named in `MAXIMA` within its bound (`check_int`)."""
    for field, top in MAXIMA.items():
        value = getattr(config, field, None)
        if is_int(value):
            check_int(value, f"{prefix}.{field}", maximum=top)


def check_layers(layers: Any, n_layers: int, name: str = "layers") -> list[int]:
    """Sorted distinct layer indices of a model with ``n_layers`` layers, from None (all),
    one int or a non-empty iterable of ints; a bool is no layer index (``layers=True`` would
    otherwise mean layer 1), and an empty list would probe nothing."""
    if layers is None:
        return list(range(n_layers))
    if isinstance(layers, str) or not (is_int(layers) or isinstance(layers, Iterable)):
        raise UsageError(f"{name} must be None, an int or a list of ints; got {layers!r}.")
    chosen = [layers] if is_int(layers) else list(layers)
    bad = [layer for layer in chosen if not is_int(layer) or not 0 <= layer < n_layers]
    every = f"leave {name} out" if name.startswith("--") else f"pass {name}=None"
    if not chosen:
        raise UsageError(f"{name} names no layer: name at least one, or {every} for all.")
    if bad:
        raise UsageError(
            f"{name} {bad} do not exist: this model has layers 0..{n_layers - 1} (ints, not "
            f"bools); {every} for all."
        )
    return sorted({int(layer) for layer in chosen})


def check_seeds(seeds: Any, name: str = "seeds") -> tuple[int, ...]:
    """Training seeds, each a separate run (the unit of replication): a non-empty list of
    distinct ints >= 0, or the same as comma-separated text (``"0,1,2"``, what ``--seeds``
    takes). A repeated seed would train and count one run twice, so it is refused."""
    fix = f"pass distinct integers >= 0 separated by commas, e.g. {name} 0,1,2"
    items = seeds.split(",") if isinstance(seeds, str) else seeds
    if isinstance(items, bytes) or not hasattr(items, "__iter__"):
        raise UsageError(f"{name} takes a list of seeds; got {seeds!r}: {fix}.")
    out: dict[int, None] = {}  # ordered, and a repeat found at once
    for item in items:
        text = item.strip() if isinstance(item, str) else item
        if isinstance(text, str) and text.lstrip("+").isdigit():
            text = int(text)
        if not is_seed(text):
            raise UsageError(f"{name} {seeds!r}: {item!r} is no seed in [0, {MAX_SEED}]; {fix}.")
        if int(text) in out:
            raise UsageError(f"{name} {seeds!r} repeats seed {int(text)}; {fix}.")
        out[int(text)] = None
    if not out:
        raise UsageError(f"{name} is empty; {fix}.")
    return tuple(out)


def check_seq_len(seq_len: Any, name: str = "seq_len") -> int:
    """A sequence length of at least 2 tokens: a one-token sequence has no next token to
    predict (no gradient) and no pair of tokens to attend, so every command, config and
    data loader refuses it with this one message."""
    if not is_int(seq_len) or seq_len < 2:
        raise UsageError(
            f"{name} must be an int >= 2; got {seq_len!r}: a one-token sequence has no "
            "next token to predict (no gradient) and no pair of tokens to attend."
        )
    return int(seq_len)


def check_window_fraction(fraction: Any, name: str = "window fraction") -> float:
    """The share of training each of the early and late windows takes, in (0, 0.5]: above
    one half the two windows would overlap and late − early would compare a checkpoint
    with itself."""
    real = isinstance(fraction, numbers.Real) and not isinstance(fraction, bool)
    if not real or not 0.0 < fraction <= 0.5:
        raise UsageError(
            f"{name} must be a number in (0, 0.5] so the early and late windows do not "
            f"overlap; got {fraction!r}."
        )
    return float(fraction)


def check_controls(controls: Any) -> str:
    if controls not in CONTROLS:
        raise UsageError(f"controls must be one of {CONTROLS}; got {controls!r}.")
    return str(controls)


def check_encoding(encoding: Any, name: str = "encoding") -> str:
    """A text encoding Python knows (``utf-8``, ``latin-1``, ...), checked before any file
    is read, so a typo fails at once even when the default corpus needs no decoding."""
    try:
        if not getattr(codecs.lookup(encoding), "_is_text_encoding", True):  # base64, rot13
            raise LookupError(encoding)
        "a".encode(encoding)  # "undefined" is found, then fails on any text
    except (LookupError, TypeError, UnicodeError):
        raise UsageError(
            f"{name} {encoding!r} is not a text encoding Python knows; use e.g. utf-8 or latin-1."
        ) from None
    return str(encoding)


def check_backend(backend: Any) -> str:
    if backend not in BACKENDS:
        raise UsageError(f"backend must be one of {BACKENDS}; got {backend!r}.")
    return str(backend)


def max_rank(d: int, controls: str = "uniform") -> int:
    """The largest rank a test with these controls takes at dimension ``d``: normal
    controls of rank k must vary in the (d − k)-dimensional complement, so 2k < d (at
    2k = d every one spans the complement itself)."""
    return (d - 1) // 2 if check_controls(controls) == "normal" else d - 1


def check_rank(rank: Any, d: int, controls: str | None = None, *, name: str = "rank") -> int:
    """A rank k with 1 <= k < d (and 2k < d for normal controls). The CLI and the API
    both take k < d (``controls=None``): from d/2 on the ``_normal`` statistics are left
    out with a warning, the uniform-control ones stay."""
    limit = d - 1 if controls is None else max_rank(d, controls)
    if not is_int(rank) or rank < 1:
        raise UsageError(f"{name} must be a positive int; got {rank!r}.")
    if rank > limit:
        why = "normal controls (orthogonal to Q_T) need " if controls == "normal" else "need "
        raise UsageError(
            f"{name} {rank} is too large for d_model={d}: {why}{name} <= {limit}; lower the rank."
        )
    return int(rank)
