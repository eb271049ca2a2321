"""Exactness of the score split per family and backend: the measurements behind
``tests/test_exactness.py`` and ``docs/EXACTNESS.md`` (``benchmarks/exactness_table.py``).

For each tiny random family (``models.FAMILIES``, ``sharp=True``: O(1) scores, random
biases and norm weights, sliding windows shorter than the sequences) and each backend
that runs it, on two padded batches of 3 × 12 tokens:

- ``scores``: max over layers of max |TT + TN + NT + NN + bias − s| / max |s|, with s the
  model's own eager-attention scores (the q and k its ``eager_attention_forward`` gets,
  ``q·kᵀ·scaling``; on TransformerLens bridges that compute attention themselves,
  their pre-softmax ``hook_attn_scores`` on the entries the model keeps);
- ``pattern``: max |softmax(sum + mask) − the model's attention weights| over kept query
  rows, the mask from `tangentlens.core.decompose.keep_mask` (causal, window, padding);
- ``table``: ``fit_bases`` then ``probes.run(("residual", "attention", "gradient"))`` with
  ``loss="lm"`` (decoders) or ``loss="mlm"`` (encoders), all on shared bases, so
  ``agreement`` can compare the TransformerLens and nnsight tables row by row.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import numpy as np
import torch
from models import BRIDGE_FAMILIES, ENCODERS, FAMILIES, hf_folder, hf_model, tl_bridge
from torch import Tensor

from tangentlens.core.decompose import decompose_scores, keep_mask
from tangentlens.core.errors import UnstableBasisWarning
from tangentlens.core.subspace import TangentBasis
from tangentlens.hooks import Site, get_backend
from tangentlens.hooks.transformer_lens import is_transformer_lens
from tangentlens.probes import BasisSet, fit_bases, run

BACKENDS = ("transformer_lens", "nnsight")
PROBES = ("residual", "attention", "gradient")
QK_NORM = ("gemma3", "qwen3", "olmo2")
KEY = ["probe", "site", "layer", "head", "statistic"]
CASES = [(f, b) for f in FAMILIES for b in BACKENDS if b == "nnsight" or f in BRIDGE_FAMILIES]


@cache
def load(family: str, backend: str) -> Any:
    """The sharp ``family`` model on ``backend`` (cached): a bridge, or an nnsight
    ``TransformersModel`` with eager attention and the family's tokenizer."""
    if backend == "transformer_lens":
        return tl_bridge(family, sharp=True)
    import nnsight
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(hf_folder(family, sharp=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BERT's `output` submodules are renamed E_output
        return nnsight.TransformersModel(hf_model(family, sharp=True), tokenizer=tokenizer)


def batches(family: str) -> list[dict[str, Tensor]]:
    """Two batches of 3 × 12 random non-special tokens, right padding on rows 1 and 2."""
    vocab = load(family, "nnsight")._module.config.vocab_size
    out = []
    for seed in range(2):
        ids = torch.randint(5, vocab, (3, 12), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones_like(ids)
        mask[1, 10:], mask[2, 7:] = 0, 0
        out.append({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask})
    return out


def _fit(model: Any, data: list[dict[str, Tensor]]) -> BasisSet:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnstableBasisWarning)  # 72 tokens: expected
        return fit_bases(model, data, rank=4, progress=False)


@cache
def shared_bases(family: str) -> BasisSet:
    """Rank-4 bases fitted on the nnsight model, used by both backends' tables."""
    return _fit(load(family, "nnsight"), batches(family))


def _hf(model: Any) -> torch.nn.Module:
    return getattr(model, "original_model", None) or model._module


@contextmanager
def eager_scores(hf: torch.nn.Module) -> Iterator[list[Tensor]]:
    """The pre-mask scores ``q·kᵀ·scaling`` (float64, kv heads repeated) of every call to
    a module file's ``eager_attention_forward`` inside the block, in call order."""
    files = {sys.modules[type(m).__module__] for m in hf.modules()}
    files = {f for f in files if hasattr(f, "eager_attention_forward")}
    seen: list[Tensor] = []
    originals = {f: f.eager_attention_forward for f in files}

    def wrap(eager: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(module: Any, query: Tensor, key: Tensor, *args: Any, **kwargs: Any) -> Any:
            scaling = kwargs.get("scaling", args[2] if len(args) > 2 else None)
            scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
            key_rep = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
            seen.append(query.double() @ key_rep.double().transpose(-1, -2) * scaling)
            return eager(module, query, key, *args, **kwargs)

        return wrapper

    for f, eager in originals.items():
        f.eager_attention_forward = wrap(eager)
    try:
        yield seen
    finally:
        for f, eager in originals.items():
            f.eager_attention_forward = eager


def _rel(a: Tensor, b: Tensor) -> float:
    diff = float((a.double() - b.double()).abs().max())
    return diff / max(float(b.double().abs().max()), 1e-300) if diff else 0.0


def _random_basis(d: int, seed: int) -> TangentBasis:
    gen = torch.Generator().manual_seed(seed)
    return TangentBasis(torch.linalg.qr(torch.randn(d, 8, generator=gen, dtype=torch.float64)).Q)


def split_errors(family: str, backend: str) -> dict[str, Any]:
    """``scores`` and ``pattern`` errors (max over layers) on the first batch, plus what
    the layers are: their ``windows`` and whether the split is ``linearised``."""
    return measure_split(load(family, backend), batches(family)[0])


def measure_split(
    model: Any, batch: dict[str, Tensor], layers: list[int] | None = None
) -> dict[str, Any]:
    """:func:`split_errors` of any model (eager attention) on ``batch``, over ``layers``
    (default all)."""
    be = get_backend(model)
    layers = list(range(be.n_layers)) if layers is None else layers
    ids, mask = batch["input_ids"], batch["attention_mask"]
    inputs: dict[int, Tensor] = {}
    handles = [
        be.add_forward_hook(Site(layer, "attn_in"), lambda x, l=layer: inputs.update({l: x}))
        for layer in range(be.n_layers)
    ]
    tl_scores: dict[int, Tensor] = {}
    tl_pattern: dict[int, Tensor] = {}
    try:
        with torch.no_grad(), eager_scores(_hf(model)) as eager:
            if is_transformer_lens(model):
                hooks = [
                    (f"blocks.{layer}.attn.hook_{name}", _saver(store, layer))
                    for layer in range(be.n_layers)
                    for name, store in (("attn_scores", tl_scores), ("pattern", tl_pattern))
                ]
                with model.hooks(fwd_hooks=hooks):
                    model(ids, attention_mask=mask)
                weights = tl_pattern
            else:
                out = model(ids, attention_mask=mask, output_attentions=True)
                weights = dict(enumerate(out.attentions))
    finally:
        for h in handles:
            h.remove()
    scores_err, pattern_err, windows, linearised = 0.0, 0.0, [], set()
    for layer in layers:
        params = be.attention_params(layer)
        windows.append(params.window)
        linearised.add(params.linearised)
        total = sum(
            decompose_scores(inputs[layer], _random_basis(be.d_model, layer), params).values()
        )
        keep = keep_mask(
            tuple(total.shape), causal=params.causal, window=params.window, attention_mask=mask
        )
        if len(eager) == be.n_layers:  # the model ran its own eager attention
            scores_err = max(scores_err, _rel(total, eager[layer]))
        else:  # a bridge that computes attention itself: its pre-softmax scores
            kept = keep.expand_as(total)
            scores_err = max(scores_err, _rel(total[kept], tl_scores[layer][kept]))
        pattern = torch.softmax(total.masked_fill(~keep, float("-inf")), -1)
        rows = keep.any(-1, keepdim=True)
        diff = torch.where(rows, pattern - weights[layer].double(), 0.0)
        pattern_err = max(pattern_err, float(diff.abs().max()))
    return {
        "scores": scores_err,
        "pattern": pattern_err,
        "windows": windows,
        "linearised": linearised - {None},
        "causal": be.causal,
    }


def _saver(store: dict[int, Tensor], layer: int) -> Callable[..., None]:
    def hook(x: Tensor, hook: Any) -> None:
        store[layer] = x.detach()

    return hook


@cache
def table(family: str, backend: str) -> Any:
    """The results table of all probes on shared bases (``fit_bases`` on this backend
    runs too), with the family's built-in loss."""
    model = load(family, backend)
    _fit(model, batches(family)[:1])
    loss = "mlm" if family in ENCODERS else "lm"
    opts = {"loss": loss, "progress": False, "n_controls": 20}
    return run(model, batches(family), shared_bases(family), PROBES, **opts).results()


def agreement(a: Any, b: Any) -> tuple[int, float]:
    """Rows matched on every key (all must match); the largest difference relative to
    max(1, |value|)."""
    merged = a.merge(b, on=KEY, how="outer", suffixes=("_a", "_b"), indicator=True)
    unmatched = merged[merged["_merge"] != "both"]
    assert unmatched.empty, unmatched[KEY].to_string()
    va, vb = merged["value_a"].to_numpy(float), merged["value_b"].to_numpy(float)
    diff = np.abs(va - vb) / np.maximum(1.0, np.abs(va))
    return len(merged), float(np.nanmax(diff))
