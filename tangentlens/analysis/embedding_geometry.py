"""Embedding geometry: token frequency vs distance to a centre; the embedding-update split.

Conventions. Only tokens *seen* in the corpus (count > 0) enter a correlation;
frequency is ``log(count)``. Three centres are reported separately, because the
sign depends on the choice: ``mean_all`` (plain mean of all rows), ``mean_seen``
(plain mean of the seen rows) and ``weighted`` (count-weighted mean of the seen
rows); ``norm`` is the distance to the origin. The weighted centre sits near the
frequent tokens partly by construction, so it gets a permutation null:
counts shuffled across the seen tokens, the centre recomputed each draw.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch

from ..core.errors import UsageError
from ..core.subspace import TangentBasis

__all__ = ["frequency_buckets", "frequency_distance", "update_split"]

CENTRES = ("mean_all", "mean_seen", "weighted", "norm")


def _as_f64(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    arr = np.asarray(x, dtype=np.float64)
    if not np.isfinite(arr).all():
        raise UsageError(f"{name} contains NaN or Inf; check the model weights or counts.")
    return arr


def _check_inputs(embeddings: Any, counts: Any) -> tuple[np.ndarray, np.ndarray]:
    e = _as_f64(embeddings, "embeddings")
    if e.ndim != 2:
        raise UsageError(f"embeddings must be (vocab, d); got shape {e.shape}.")
    c = _as_f64(counts, "counts").reshape(-1)
    if (c < 0).any():
        raise UsageError("counts must be non-negative token counts.")
    if c.size > e.shape[0]:
        if c[e.shape[0] :].any():
            raise UsageError(
                f"counts has {c.size} entries with tokens beyond the {e.shape[0]} embedding "
                "rows; count with the model's own tokenizer."
            )
        c = c[: e.shape[0]]
    # Rows past the tokenizer (padding of the embedding matrix) are never seen.
    return e, np.pad(c, (0, e.shape[0] - c.size))


def _rank_rows(x: np.ndarray) -> np.ndarray:
    """Average ranks along the last axis (ties share their mean rank)."""
    return pd.DataFrame(np.atleast_2d(x)).rank(axis=1, method="average").to_numpy()


def _pearson_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r of matching rows of ``x`` and ``y`` (each ``(b, n)``)."""
    x = x - x.mean(axis=1, keepdims=True)
    y = y - y.mean(axis=1, keepdims=True)
    den = np.sqrt((x * x).sum(axis=1) * (y * y).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (x * y).sum(axis=1) / den


def _corrs(logf: np.ndarray, dist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    logf, dist = np.atleast_2d(logf), np.atleast_2d(dist)
    return _pearson_rows(logf, dist), _pearson_rows(_rank_rows(logf), _rank_rows(dist))


def _weighted_null(
    e_seen: np.ndarray, c_seen: np.ndarray, n_permutations: int, seed: int, chunk: int = 32
) -> tuple[np.ndarray, np.ndarray]:
    """Pearson and Spearman r for the weighted centre under shuffled counts."""
    rng = np.random.default_rng(seed)
    sq = (e_seen * e_seen).sum(axis=1)
    pearson, spearman = [], []
    for start in range(0, n_permutations, chunk):
        b = min(chunk, n_permutations - start)
        w = np.stack([rng.permutation(c_seen) for _ in range(b)])  # (b, n)
        centres = (w @ e_seen) / w.sum(axis=1, keepdims=True)  # (b, d)
        d2 = sq[None, :] - 2.0 * centres @ e_seen.T + (centres * centres).sum(axis=1)[:, None]
        p, s = _corrs(np.log(w), np.sqrt(np.clip(d2, 0.0, None)))
        pearson.append(p)
        spearman.append(s)
    return np.concatenate(pearson), np.concatenate(spearman)


def frequency_distance(
    embeddings: Any, counts: Any, *, n_permutations: int = 200, seed: int = 0
) -> pd.DataFrame:
    """Correlation of log frequency with the distance of each seen row to each centre.

    ``embeddings`` is ``(vocab, d)``; ``counts`` ``(vocab,)`` token counts (shorter
    is padded with zeros). Returns a long table ``statistic, value`` with
    ``pearson_{centre}`` / ``spearman_{centre}`` for the centres in ``CENTRES``,
    and for the weighted centre the permutation null ``*_null_mean``,
    ``*_null_std`` and the two-sided ``*_p_value`` (distance from the null mean).
    """
    if n_permutations < 1:
        raise UsageError(f"n_permutations must be at least 1 (use ≥ 200); got {n_permutations}.")
    e, c = _check_inputs(embeddings, counts)
    seen = c > 0
    if seen.sum() < 3:
        raise UsageError(
            f"only {int(seen.sum())} tokens are seen in the corpus; correlations need at "
            "least 3: count tokens over more text."
        )
    e_seen, c_seen = e[seen], c[seen]
    logf = np.log(c_seen)
    centres = {
        "mean_all": e.mean(axis=0),
        "mean_seen": e_seen.mean(axis=0),
        "weighted": (c_seen @ e_seen) / c_seen.sum(),
        "norm": np.zeros(e.shape[1]),
    }
    rows: list[tuple[str, float]] = [
        ("n_tokens", float(e.shape[0])),
        ("n_seen", float(seen.sum())),
    ]
    observed: dict[str, float] = {}
    for name, centre in centres.items():
        p, s = _corrs(logf, np.linalg.norm(e_seen - centre, axis=1))
        observed[f"pearson_{name}"], observed[f"spearman_{name}"] = float(p[0]), float(s[0])
        rows += [(f"pearson_{name}", float(p[0])), (f"spearman_{name}", float(s[0]))]
    null_p, null_s = _weighted_null(e_seen, c_seen, n_permutations, seed)
    for kind, null in (("pearson", null_p), ("spearman", null_s)):
        obs = observed[f"{kind}_weighted"]
        mean, std = float(null.mean()), float(null.std(ddof=1)) if null.size > 1 else 0.0
        extreme = np.abs(null - mean) >= abs(obs - mean) - 1e-12
        rows += [
            (f"{kind}_weighted_null_mean", mean),
            (f"{kind}_weighted_null_std", std),
            (f"{kind}_weighted_p_value", float((1 + extreme.sum()) / (1 + null.size))),
        ]
    rows.append(("n_permutations", float(n_permutations)))
    return pd.DataFrame(rows, columns=["statistic", "value"])


def frequency_buckets(
    counts: Any, n_buckets: int = 4, vocab: int | None = None
) -> dict[str, np.ndarray]:
    """Token ids by frequency: ``q1`` (rarest) … ``q{n}`` (most frequent) over the seen
    tokens (equal sizes, ties broken by id), and ``unseen``."""
    if n_buckets < 1:
        raise UsageError(f"n_buckets must be positive; got {n_buckets}.")
    c = _as_f64(counts, "counts").reshape(-1)
    if vocab is not None:
        c = np.pad(c, (0, max(0, vocab - c.size)))[:vocab]
    seen = np.flatnonzero(c > 0)
    order = seen[np.lexsort((seen, c[seen]))]
    out = {f"q{i + 1}": part for i, part in enumerate(np.array_split(order, n_buckets))}
    unseen = np.flatnonzero(c <= 0)
    if unseen.size:
        out["unseen"] = unseen
    return out


def update_split(
    before: Any,
    after: Any,
    basis: TangentBasis | torch.Tensor,
    counts: Any = None,
    *,
    n_buckets: int = 4,
) -> pd.DataFrame:
    """Tangent share of the embedding update ``ΔE = after − before`` given ``Q_T``.

    Per bucket (``all``, then frequency buckets when ``counts`` is given): ``total``
    = ‖ΔE‖², ``tangent`` = ‖ΔE Q‖², ``normal`` = ‖ΔE − ΔE Q Qᵀ‖² (so tangent +
    normal = total), ``tangent_share`` (NaN for a zero update), ``chance_share`` =
    k/d and ``n_tokens``. Returns a long table ``bucket, statistic, value``.
    """
    e0, e1 = _as_f64(before, "before"), _as_f64(after, "after")
    if e0.shape != e1.shape or e0.ndim != 2:
        raise UsageError(
            f"before and after must be (vocab, d) of one shape; got {e0.shape} and {e1.shape}."
        )
    q = basis.basis_ if isinstance(basis, TangentBasis) else torch.as_tensor(basis)
    q = q.detach().cpu().double().numpy()
    if q.shape[0] != e0.shape[1]:
        raise UsageError(
            f"the basis is for d={q.shape[0]} but the embeddings have d={e0.shape[1]}; "
            "fit the basis on this model's embedding space."
        )
    delta = e1 - e0
    coords = delta @ q
    normal = delta - coords @ q.T
    buckets = {"all": np.arange(delta.shape[0])}
    if counts is not None:
        buckets.update(frequency_buckets(counts, n_buckets, vocab=delta.shape[0]))
    rows = []
    for name, idx in buckets.items():
        total = float((delta[idx] ** 2).sum())
        tangent = float((coords[idx] ** 2).sum())
        stats = {
            "total": total,
            "tangent": tangent,
            "normal": float((normal[idx] ** 2).sum()),
            "tangent_share": tangent / total if total > 0 else float("nan"),
            "chance_share": q.shape[1] / q.shape[0],
            "n_tokens": float(idx.size),
        }
        rows += [(name, k, v) for k, v in stats.items()]
    return pd.DataFrame(rows, columns=["bucket", "statistic", "value"])
