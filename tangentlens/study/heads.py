"""Heads inside the study: per-head TT/TN/NT/NN/bias score shares and ``pattern_kl_TT``
at every checkpoint, measured with the study's own ``attn_in`` bases (the smallest rank),
each share with its null (``head_null`` random normal frames of matched rank: rows
``score_share_{t}_null``, ``_null_std``, ``_z``).

The pass needs Q_T, which is fitted from the early window's parts: one forward (no
backward) over the first ``head_sequences`` probe sequences, on the model the study has
loaded anyway for that checkpoint's collection where it can (`tangentlens.study.pipeline`
says when it cannot). It is redone on every run, from the bases of that run: a cache of
head rows could outlive the bases it was measured with (a study rebuilt with other
settings).
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from torch import Tensor

from ..core import results
from ..core.subspace import TangentBasis
from ..hooks.sites import Site
from ..probes.driver import run
from .config import StudyConfig

__all__ = ["HeadPass"]


class HeadPass:
    """The attention rows (``probe="attention"``) of one loaded checkpoint at a time.

    ``bases`` are the study's rank → site → Q_T; the pass is off (`enabled` False) when
    they hold no ``attn_in`` site (``weight_gradient=False``) or ``head_sequences=0``."""

    def __init__(
        self, cfg: StudyConfig, bases: dict[int, dict[Site, TangentBasis]], tokens: Tensor
    ) -> None:
        self.cfg = cfg
        self.rank = min(cfg.ranks)
        self.inputs = {s: b for s, b in bases[self.rank].items() if s.kind == "attn_in"}
        self.batches = list(tokens[: cfg.head_sequences].split(cfg.batch_size))
        self.enabled = bool(self.inputs) and cfg.head_sequences > 0

    def rows(self, loaded: Any, window: str) -> pd.DataFrame:
        """The rows of checkpoint ``loaded`` (a `LoadedCheckpoint` of the study's backend)."""
        model, step = loaded.backend_model, loaded.checkpoint.step
        probes, null = ("attention",), self.cfg.head_null
        table = run(model, self.batches, self.inputs, probes, progress=False, head_null=null)
        rows = table.results(progress=False)
        rows = rows[rows["probe"] == "attention"].assign(
            checkpoint=f"step{step}", step=step, window=window, rank=self.rank
        )
        return results.frame(rows)
