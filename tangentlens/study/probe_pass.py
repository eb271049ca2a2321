"""Registered probes inside the study: on every checkpoint's loaded model, one pass of
each probe named in `StudyConfig.probes` (`tangentlens.probes.registry`), with the
study's own Q_T at its smallest rank. By default that is the attention probe: per-head
TT/TN/NT/NN/bias score shares and ``pattern_kl_TT``, each with its null (``head_null``
random normal frames of matched rank: ``score_share_{t}_null``, ``_null_std``,
``_p_value``, and ``_z`` from 99 frames on).

**Which bases a probe is given.** Each probe runs in a session of its own, given the
study's bases at the sites its spec reads (``spec.sites(plan)``, from a plan of every
study basis) and no others. A probe's build may read bases beyond the sites it hooks:
the attention probe measures its heads' writes wherever it is given the residual basis
its layer writes into. Given every basis, or the union of what the chosen probes read,
one probe's rows would depend on which other probes run, and the default table would
grow head-write rows. Per probe, the attention probe sees the ``attn_in`` bases only,
so adding a probe adds that probe's rows and changes no other row. It costs one pass
over the ``head_sequences`` sequences per probe (a backward too, for a probe that reads
gradients, with the loss the collection uses).

**Options.** Each probe gets those of its registered options that `StudyConfig` has a
field for (``head_null`` for the attention probe), and the study's ``seed`` and
``n_groups``, so one config fixes every number of the table; its other options keep its
class's defaults.

**Processes.** The pass runs in the process that runs `Study.run`, never in the
collection's worker processes (``world_size > 1``), so a probe registered in that
process is enough: the workers never plan it.

The pass needs Q_T, which is fitted from the early window's parts: it runs on the model
the study has loaded anyway for that checkpoint's collection where it can
(`tangentlens.study.pipeline` says when it cannot). It is redone on every run, from the
bases of that run: cached rows could outlive the bases they were measured with (a study
rebuilt with other settings).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pandas as pd
from torch import Tensor

from ..core import catalogue, results
from ..core.subspace import TangentBasis
from ..hooks.base import get_backend
from ..hooks.families import is_causal
from ..hooks.sites import Site
from ..probes import registry
from ..probes.driver import lm_loss, mlm_loss, run
from .config import StudyConfig

__all__ = ["ProbePass"]

_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(StudyConfig))


class ProbePass:
    """The rows of the probes in ``cfg.probes``, for one loaded checkpoint at a time.

    ``bases`` are the study's rank → site → Q_T. `enabled` is False when no probe is
    chosen or ``head_sequences=0``, and turns False after the first checkpoint where no
    chosen probe reads a site with these bases (the attention probe without ``attn_in``
    bases, ``weight_gradient=False``): the study then loads no checkpoint for the pass."""

    def __init__(
        self, cfg: StudyConfig, bases: dict[int, dict[Site, TangentBasis]], tokens: Tensor
    ) -> None:
        self.cfg = cfg
        self.rank = min(cfg.ranks)
        self.bases = dict(bases[self.rank])
        self.batches = list(tokens[: cfg.head_sequences].split(cfg.batch_size))
        self.enabled = bool(cfg.probes) and cfg.head_sequences > 0 and bool(self.bases)

    def _reads(self, model: Any) -> dict[str, dict[Site, TangentBasis]]:
        """Probe name → the bases at the sites its spec reads (empty ones left out)."""
        backend = get_backend(model)
        available = frozenset(backend.sites())
        plan = registry.Plan(
            backend=backend,
            bases=self.bases,
            scoped={s: b for s, b in self.bases.items() if s in available},
            in_scope=available,
            layers=tuple(range(backend.n_layers)),
            seed=self.cfg.seed,
            n_groups=self.cfg.n_groups,
        )
        reads = {}
        for name in self.cfg.probes:
            mine = {s: self.bases[s] for s in registry.get(name).sites(plan) if s in self.bases}
            if mine:
                reads[name] = mine
        return reads

    def rows(self, loaded: Any, window: str) -> pd.DataFrame:
        """The rows of checkpoint ``loaded`` (a `LoadedCheckpoint` of the study's backend),
        probe by probe in the config's order. Their statistics are checked against the
        catalogue here, so a probe whose statistics are not registered stops the study at
        its first checkpoint rather than when the table is written."""
        cfg, model, step = self.cfg, loaded.backend_model, loaded.checkpoint.step
        reads = self._reads(model)
        self.enabled = bool(reads)
        loss = lm_loss if is_causal(loaded.model) else mlm_loss
        frames = []
        for name, bases in reads.items():
            spec = registry.get(name)
            options = {o: getattr(cfg, o) for o in spec.options if o in _CONFIG_FIELDS}
            if "head_null_sequences" in spec.options:  # the pass is already a bounded
                options["head_null_sequences"] = None  # sample: its null sees all of it
            session = run(
                model,
                self.batches,
                bases,
                (name,),
                loss=loss,
                progress=False,
                seed=cfg.seed,
                n_groups=cfg.n_groups,
                **options,
            )
            table = session.results(progress=False)
            frames.append(table[table["probe"] != "basis"])  # the study writes its own
        if not frames:
            return results.frame([])
        rows = pd.concat(frames, ignore_index=True)
        catalogue.check_names(rows["statistic"].unique(), f"the probe pass at step {step}")
        rows = rows.assign(checkpoint=f"step{step}", step=step, window=window, rank=self.rank)
        return results.frame(rows)
