"""Heads inside the study: per-head TT/TN/NT/NN/bias score shares and ``pattern_kl_TT``
at every checkpoint, measured with the study's own ``attn_in`` bases (the smallest rank),
each share with its null (``head_null`` random normal frames of matched rank: rows
``score_share_{t}_null``, ``_null_std``, ``_z``).

The pass needs Q_T, which the analysis fits from the early window, so it runs after the
analysis: one forward (no backward) per checkpoint over the first ``head_sequences``
probe sequences. It is redone on every run, from the bases of that run: a cache of head
rows could outlive the bases it was measured with (a study rebuilt with other settings).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from torch import Tensor
from tqdm.auto import tqdm

from .. import results
from ..models import quiet_transformers
from ..probes.bases import BasisSet
from ..probes.driver import run
from .config import StudyConfig

__all__ = ["head_rows"]


def head_rows(
    cfg: StudyConfig,
    series: Any,
    window: dict[int, str],
    out: Path,
    tokens: Tensor,
    progress: bool,
) -> pd.DataFrame | None:
    """The attention rows of every checkpoint (``probe="attention"``), or None when the
    study has no ``attn_in`` bases (``weight_gradient=False``) or ``head_sequences=0``."""
    rank = min(cfg.ranks)
    bases = BasisSet.load(out / "bases" / f"rank{rank}.safetensors").by_site()
    inputs = {s: b for s, b in bases.items() if s.kind == "attn_in"}
    if not inputs or cfg.head_sequences == 0:
        return None
    batches = list(tokens[: cfg.head_sequences].split(cfg.batch_size))
    frames = []
    for i, ckpt in enumerate(tqdm(list(series), desc="study: heads", disable=not progress)):
        with quiet_transformers():
            model = series.load(i, backend=cfg.backend).backend_model
        table = run(model, batches, inputs, ("attention",), progress=False, head_null=cfg.head_null)
        rows = table.results(progress=False)
        rows = rows[rows["probe"] == "attention"].assign(
            checkpoint=f"step{ckpt.step}", step=ckpt.step, window=window[ckpt.step], rank=rank
        )
        frames.append(results.frame(rows))
    return pd.concat(frames, ignore_index=True)
