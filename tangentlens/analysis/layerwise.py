"""Layerwise linear probes: which layers carry a label, and in which subspace.

>>> table = layerwise_probe(model, batches, bases, "position")
>>> plot_layerwise(table)

Per layer, a bounded seeded sample of tokens (a reservoir of ``tokens_per_layer`` rows per
site) is split into its tangent and normal parts with the site's basis (`TangentBasis.split`,
so tangent + normal == full), and a scikit-learn logistic regression is fitted on each of
``full``, ``tangent`` and ``normal`` with cross-validation over *sequences* (`GroupKFold`:
tokens of one sequence never sit on both sides of a split). Accuracy, balanced accuracy and
ROC AUC (one-vs-rest macro for more than two labels) are means over folds with a t
interval over the folds, clipped to [0, 1]; ``chance_accuracy`` is the majority-class rate
and ``chance_balanced_accuracy`` 1/(number of labels). Accuracy alone can look good on
unbalanced labels by guessing the majority; the other two cannot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
from scipy import stats
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import balanced_accuracy_score, roc_auc_score
from sklearn.model_selection import GroupKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from torch import Tensor

from ..core import results
from ..core.errors import UsageError
from ..core.subspace import TangentBasis
from ..core.validation import check_int, check_layers
from ..hooks.base import get_backend
from ..hooks.sites import Site
from ..models.batches import as_batches, unpack_batch
from ..probes.activation import Reservoir
from ..probes.base import Observation, Probe
from ..probes.bases import as_bases, check_basis_sites, warn_basis_weights
from ..probes.driver import run

__all__ = ["COMPONENTS", "LABELS", "layerwise_probe", "plot_layerwise"]

COMPONENTS = ("full", "tangent", "normal")
LABELS = ("position", "frequency")
Labels = str | Sequence[Tensor] | Callable[[Tensor], Tensor]


class _LabelledSample(Probe):
    """A reservoir of (activation, label, sequence) rows per site; not mergeable."""

    name = "linear_sample"

    def __init__(self, sites: list[Site], size: int, labels: list[Tensor], seed: int) -> None:
        super().__init__()
        self.reservoirs = {s: Reservoir(size, seed=seed + i) for i, s in enumerate(sites)}
        self.labels = labels
        self.first_sequence = np.cumsum([0] + [int(lab.shape[0]) for lab in labels])

    @property
    def forward_sites(self) -> list[Site]:
        return list(self.reservoirs)

    def update(self, obs: Observation) -> None:
        labels = self.labels[obs.group]
        batch, pos = labels.shape
        sequence = self.first_sequence[obs.group] + torch.arange(batch)[:, None].expand(batch, pos)
        tags = torch.stack([labels, sequence], -1).to(obs.tensor.device)
        self.reservoirs[obs.site].update(obs.tensor, obs.mask, tags)

    def rows(self) -> list[dict[str, Any]]:
        return []


def _label_tensors(labels: Labels, ids: list[Tensor], masks: list[Tensor | None]) -> list[Tensor]:
    """One ``(batch, pos)`` int64 label tensor per batch (``masks``: which tokens are real;
    padding is no token of the text, so it counts toward no frequency)."""
    if isinstance(labels, str):
        if labels == "position":  # four buckets of equal width over the positions
            return [
                (torch.arange(x.shape[1]) * 4 // x.shape[1]).expand(x.shape).clone() for x in ids
            ]
        if labels == "frequency":  # quartiles of each real token's frequency in these batches
            real = [x if m is None else x[m.bool()] for x, m in zip(ids, masks, strict=True)]
            flat = torch.cat([x.reshape(-1) for x in real])
            counts = torch.bincount(flat)[flat].double()
            edges = torch.quantile(counts, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
            out = []
            for x in ids:  # padding's own class is never sampled (the sample is masked)
                c = torch.bincount(flat, minlength=int(x.max()) + 1)[x].double()
                out.append(torch.bucketize(c, edges))
            return out
        raise UsageError(f"built-in labels are {LABELS}; got {labels!r}.")
    made = [labels(x) for x in ids] if callable(labels) else list(labels)
    if len(made) != len(ids):
        raise UsageError(f"labels has {len(made)} tensors for {len(ids)} batches; align them.")
    out = []
    for lab, x in zip(made, ids, strict=True):
        lab = torch.as_tensor(lab)
        if tuple(lab.shape) != tuple(x.shape) or lab.dtype.is_floating_point:
            raise UsageError(
                f"each label tensor must be integer (batch, pos) = {tuple(x.shape)}; "
                f"got {tuple(lab.shape)} {lab.dtype}."
            )
        if lab.numel() and int(lab.min()) < 0:  # e.g. -100, Hugging Face's "ignore"
            raise UsageError(
                f"labels must be integers >= 0 (classes 0, 1, …); got {int(lab.min())}. "
                "Give every token a class, or probe a batch without those tokens."
            )
        out.append(lab.long())
    return out


SCORES = ("accuracy", "balanced_accuracy", "roc_auc")


def _auc(y: np.ndarray, proba: np.ndarray, classes: np.ndarray) -> float:
    """One-vs-rest ROC AUC, the macro mean over the classes a test fold holds with both
    members and non-members (a fold of whole sequences may miss a class; sklearn's
    multiclass AUC then refuses the fold). With every class present it is sklearn's
    ``roc_auc_score(..., multi_class="ovr", average="macro")``; binary: the usual AUC."""
    scores = [
        roc_auc_score(y == c, proba[:, j])
        for j, c in enumerate(classes)
        if 0 < int((y == c).sum()) < len(y)
    ]
    return float(np.mean(scores)) if scores else math.nan


def _fold_scores(model: Any, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    pred = model.predict(x)
    return {
        "accuracy": float(np.mean(pred == y)),
        "balanced_accuracy": float(balanced_accuracy_score(y, pred)),
        "roc_auc": _auc(y, model.predict_proba(x), model.classes_),
    }


def _interval(scores: list[float]) -> tuple[float, float, float]:
    """Mean over folds with a t interval over the folds, clipped to [0, 1] (the scores'
    range: a few folds of a score near 1 would otherwise reach past it)."""
    values = np.asarray([v for v in scores if math.isfinite(v)])
    if not len(values):
        return math.nan, math.nan, math.nan
    mean = float(values.mean())
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = float(
        stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values))
    )
    return mean, max(0.0, mean - half), min(1.0, mean + half)


def _cross_validated(
    x: np.ndarray, y: np.ndarray, groups: np.ndarray, n_folds: int, seed: int
) -> dict[str, tuple[float, float, float]]:
    """Per score of `SCORES`: the mean over folds of whole sequences, with a t interval
    over the folds. Accuracy alone flatters a probe on unbalanced labels (the majority
    class scores its rate); balanced accuracy and AUC do not."""
    folds = GroupKFold(n_splits=n_folds)
    scores: dict[str, list[float]] = {name: [] for name in SCORES}
    for train, test in folds.split(x, y, groups):
        if len(np.unique(y[train])) < 2:  # nothing to fit: the one class it saw
            pred = np.full(len(test), y[train][0])
            fold = {
                "accuracy": float(np.mean(y[test] == pred)),
                "balanced_accuracy": float(balanced_accuracy_score(y[test], pred)),
                "roc_auc": math.nan,  # no scores to rank: left out of the mean
            }
        else:
            model = make_pipeline(
                StandardScaler(), LogisticRegression(max_iter=2000, random_state=seed)
            )
            model.fit(x[train], y[train])
            fold = _fold_scores(model, x[test], y[test])
        for name, value in fold.items():
            scores[name].append(value)
    return {name: _interval(values) for name, values in scores.items()}


def layerwise_probe(
    model: Any,
    batches: Iterable[Any],
    bases: Mapping[str | Site, TangentBasis],
    labels: Labels,
    *,
    layers: Iterable[int] | None = None,
    site: str = "resid_pre",
    tokens_per_layer: int = 4096,
    n_folds: int = 5,
    seed: int = 0,
    progress: bool = True,
) -> pd.DataFrame:
    """Linear probes for a label on each layer's full activation, tangent and normal part.

    Probing the parts apart says which subspace carries the label, not only whether the
    layer does. Folds split by sequence (tokens of one sequence never sit on both sides), and
    balanced accuracy and ROC AUC sit beside accuracy with the majority-class chance,
    since accuracy alone can look good on unbalanced labels by guessing the majority.
    Memory is bounded: a seeded sample of ``tokens_per_layer`` tokens per layer.

    Args:
        model: A TransformerLens bridge or an nnsight model (`load`).
        batches: ``(batch, pos)`` token ids, dicts with an ``attention_mask``, text or an
            iterable of those; padding is masked.
        bases: A `BasisSet` or a dict hook name → `TangentBasis` with a basis at ``site``.
        labels: ``"position"`` (four position buckets), ``"frequency"`` (quartiles of the
            token frequency in these batches), a callable on token ids
            ``(batch, pos) -> labels`` or integer ``(batch, pos)`` tensors, one per batch.
        layers: Layers to probe (default: every layer with a basis at ``site``).
        site: The residual site: ``resid_pre``, ``resid_mid`` or ``resid_post``.
        tokens_per_layer: Tokens sampled per layer (at least ``2 * n_folds``).
        n_folds: Cross-validation folds over sequences (at least 2).
        seed: Seeds the token sample and the classifier (the folds follow the sequences'
            order).
        progress: Show a progress bar.

    Returns:
        A results table (``probe="linear"``, ``component`` in full / tangent / normal):
        ``accuracy``, ``balanced_accuracy`` and ``roc_auc`` with a t interval over folds
        clipped to [0, 1], and ``chance_accuracy`` and ``chance_balanced_accuracy``.

    Raises:
        UsageError: Unknown ``labels``, labels not aligned with the batches, no basis at
            ``site`` for these layers, fewer sequences than folds, or a token sample with
            one class or fewer sequences than folds.

    Example:
        With ``model`` from `load`, ``texts`` a list of strings and ``bases`` from
        `fit_bases`:

        >>> table = tangentlens.layerwise_probe(model, texts, bases, "position",
        ...                                     layers=[0], progress=False)
        >>> sorted(table["component"].unique())
        ['full', 'normal', 'tangent']
    """
    batches = as_batches(model, batches)
    unpacked = [unpack_batch(b) for b in batches]
    ids = [x for x, _ in unpacked]
    label_list = _label_tensors(labels, ids, [m for _, m in unpacked])
    n_folds = check_int(n_folds, "n_folds", minimum=2)
    size = check_int(tokens_per_layer, "tokens_per_layer", minimum=2 * n_folds)
    backend = get_backend(model)
    by_site = as_bases(bases)
    check_basis_sites(by_site)
    warn_basis_weights(by_site, model)
    wanted = check_layers(layers, backend.n_layers)
    sites = [Site(layer, site) for layer in wanted if Site(layer, site) in by_site]
    if not sites:
        raise UsageError(
            f"no basis at {site} for layers {list(wanted)}; fit them with "
            f"fit_bases(model, batches, rank=k, sites=lambda n: n.endswith('hook_{site}'))."
        )
    if sum(b.shape[0] for b in ids) < n_folds:
        raise UsageError(f"{n_folds} folds over sequences need at least {n_folds} sequences.")
    sample = _LabelledSample(sites, size, label_list, seed)
    run(model, batches, None, (sample,), progress=progress)
    rows = []
    for s in sites:
        reservoir = sample.reservoirs[s]
        x, tags = reservoir.sample().double(), reservoir.tags().numpy()
        y, groups = tags[:, 0], tags[:, 1]
        counts = np.unique(y, return_counts=True)[1]  # class ids may be any integers
        if len(counts) < 2 or len(np.unique(groups)) < n_folds:
            raise UsageError(
                f"the token sample at {s.hook_name} holds {len(counts)} class(es) in "
                f"{len(np.unique(groups))} sequences; a probe needs 2 classes and n_folds="
                f"{n_folds} sequences: give labels that vary, raise tokens_per_layer or "
                "lower n_folds."
            )
        tangent, normal = by_site[s].split(x)
        parts = {"full": x, "tangent": tangent, "normal": normal}
        chance = {
            "chance_accuracy": float(counts.max() / len(y)),
            "chance_balanced_accuracy": 1 / len(counts),
        }
        for stat, value in chance.items():
            rows.append(results.row("linear", s, stat, value, component="full"))
        for name in COMPONENTS:
            scored = _cross_validated(parts[name].numpy(), y, groups, n_folds, seed)
            for stat, (mean, low, high) in scored.items():
                rows.append(
                    results.row("linear", s, stat, mean, component=name, ci_low=low, ci_high=high)
                )
    return results.frame(rows)


def plot_layerwise(table: pd.DataFrame, ax: Any = None) -> Figure:
    """Accuracy by layer for each component, with its interval, and the chance level."""
    fig = None
    if ax is None:
        fig = Figure(figsize=(6.0, 3.6), dpi=100, layout="constrained")
        ax = fig.subplots()
    acc = results.select(table, probe="linear", statistic="accuracy")
    if acc.empty:
        raise UsageError("the table has no linear-probe rows; pass layerwise_probe's result.")
    for colour, name in zip(("#000000", "#0072B2", "#E69F00"), COMPONENTS, strict=True):
        rows = acc[acc["component"] == name].sort_values("layer")
        layers = rows["layer"].astype(float).to_numpy()
        ax.plot(layers, rows["value"], "o-", color=colour, ms=4, label=name)
        ax.fill_between(layers, rows["ci_low"], rows["ci_high"], color=colour, alpha=0.15, lw=0)
    chance = results.select(table, probe="linear", statistic="chance_accuracy")
    if len(chance):
        ax.axhline(float(chance["value"].mean()), color="gray", ls="--", lw=1, label="chance")
    ax.set(xlabel="layer", ylabel="accuracy (CV over sequences)", ylim=(0, 1.02))
    ax.set_xticks(sorted(acc["layer"].astype(int).unique()))
    ax.legend(fontsize=8, frameon=False)
    return fig if fig is not None else ax.figure
