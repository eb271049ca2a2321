"""What a study is: `StudyConfig` (everything that determines its results), the
checkpoint series it reads, and the thread limits it runs under."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.compute import threads
from ..core.errors import CorruptFileError, UsageError
from ..core.files import dataclass_from_dict, read_json
from ..core.folders import writer_of
from ..core.settings import HEAD_NULL, STUDY, ZETA
from ..core.validation import (
    BACKENDS,
    CONTROLS,
    MAX_SEED,
    check_encoding,
    check_limits,
    check_rank,
    check_seq_len,
    check_window_fraction,
    is_int,
    is_seed,
)
from ..data.checkpoints import CheckpointSeries
from ..data.resume import CONFIG_FILE, check_recorded, trained_to
from ..data.train import TrainConfig
from ..hooks.sites import RESIDUAL_KINDS
from ..models.loading import is_hub_id
from ..probes import registry

__all__ = ["FROM_PARTS", "StudyConfig", "open_series", "threads"]

FROM_PARTS = ("residual", "gradient", "weight_gradient", "activation")
"""The probes whose rows the study's analysis makes from its parts (every probe sequence,
every rank): `StudyConfig.probes` may not name them, since a second measurement of theirs
over the ``head_sequences`` would give the table two rows under one key."""


@dataclass
class StudyConfig:
    """Everything that determines a study's results (``progress`` aside).

    The defaults of the settings `tangentlens study` offers are `tangentlens.core.settings.STUDY`
    (the command line shows the same values).
    """

    checkpoints: str  # a folder of step{N} checkpoints, or a hub id (owner/name)
    backend: str = STUDY.backend.default
    sites: tuple[str, ...] = ("resid_pre", "resid_post")
    writes: bool = True  # attn_out / mlp_out activation Moments for the write ratios
    weight_gradient: bool = True  # Σ G Gᵀ of the maps reading attn_in / mlp_in (the paper's)
    # registered probes run on every checkpoint with Q_T (`tangentlens.study.probe_pass`)
    probes: tuple[str, ...] = ("attention",)
    head_sequences: int = STUDY.head_sequences.default  # behind that pass (0: no pass, no heads)
    head_null: int = HEAD_NULL.default  # normal frames behind each head share's null (0: none)
    rank: int | tuple[int, ...] = STUDY.rank.default
    window_fraction: float = STUDY.window_fraction.default
    windows: str = STUDY.windows.default  # "step": of training steps; "index": of checkpoints
    early: tuple[int, int] | None = STUDY.early.default  # inclusive steps; override the fraction
    late: tuple[int, int] | None = STUDY.late.default
    n_controls: int = STUDY.n_controls.default
    controls: str = STUDY.controls.default  # the controls behind the summary's p-value
    zeta: float = ZETA.default
    seed: int = STUDY.seed.default
    n_sequences: int = STUDY.n_sequences.default  # 16,384 tokens at seq_len 64: stable bases
    seq_len: int = STUDY.seq_len.default
    batch_size: int = 16
    n_groups: int = 8  # groups of probe batches for the jackknife intervals over tokens
    probe_fraction: float = 0.05
    corpus: str | None = STUDY.corpus.default  # text file, folder of .txt, or None: the KJV
    encoding: str = STUDY.encoding.default  # of the corpus files (decoded strictly)
    max_chars: int | None = None
    reservoir: int = 1000  # tokens sampled per site for TwoNN (0: no TwoNN)
    n_permutations: int = 200
    num_threads: int | None = 1  # torch threads (None: leave as is); 1 is exact and fast here
    progress: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoints, str | Path) or not str(self.checkpoints):
            raise UsageError("StudyConfig.checkpoints must name a folder or a hub id.")
        self.checkpoints = str(self.checkpoints)
        if self.backend not in BACKENDS:
            raise UsageError(
                f"StudyConfig.backend must be one of {BACKENDS}; got {self.backend!r}."
            )
        sites = (self.sites,) if isinstance(self.sites, str) else tuple(self.sites)
        bad = [s for s in sites if s not in RESIDUAL_KINDS]
        if bad or not sites:
            raise UsageError(
                f"StudyConfig.sites must be a non-empty subset of {RESIDUAL_KINDS}; got {sites!r}."
            )
        self.sites = tuple(k for k in RESIDUAL_KINDS if k in sites)
        self.probes = _check_probes(self.probes)
        for name in ("early", "late"):
            rng = getattr(self, name)
            if rng is None:
                continue
            if len(rng) != 2 or not all(is_int(v) for v in rng) or rng[0] > rng[1]:
                raise UsageError(
                    f"StudyConfig.{name} must be an inclusive step range (lo, hi) with lo <= hi; "
                    f"got {rng!r}."
                )
            setattr(self, name, (int(rng[0]), int(rng[1])))
        ranks = [self.rank] if is_int(self.rank) else self.rank
        if (
            isinstance(ranks, str | bytes | bool)
            or not hasattr(ranks, "__iter__")
            or not (ranks := list(ranks))
            or any(not is_int(r) or r < 1 for r in ranks)
        ):
            raise UsageError(
                f"StudyConfig.rank must be a positive int or a list of them; got {self.rank!r}."
            )
        ranks = sorted({int(r) for r in ranks})
        self.rank = ranks[0] if len(ranks) == 1 else tuple(ranks)
        positive = ("n_controls", "n_sequences", "batch_size", "n_permutations")
        for name in ("head_sequences", "head_null"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise UsageError(f"StudyConfig.{name} must be an int >= 0; got {value!r}.")
            setattr(self, name, int(value))
        if self.head_null == 1:  # one frame: no spread, and no p-value below 1/2
            raise UsageError("StudyConfig.head_null must be 0 (no null) or at least 2 frames.")
        if not is_int(self.n_groups) or self.n_groups < 2:
            raise UsageError(f"StudyConfig.n_groups must be an int >= 2; got {self.n_groups!r}.")
        for name in positive:
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise UsageError(f"StudyConfig.{name} must be a positive int; got {value!r}.")
            setattr(self, name, int(value))
        check_limits(self, "StudyConfig")
        if self.reservoir and self.n_sequences < 3:  # known now, not after every checkpoint
            raise UsageError(
                f"StudyConfig.n_sequences={self.n_sequences}: the TwoNN dimension compares "
                "neighbours from different sequences, so it needs at least 3 probe sequences "
                "(--sequences 3), or reservoir=0 to skip it."
            )
        self.encoding = check_encoding(self.encoding, "StudyConfig.encoding")
        self.seq_len = check_seq_len(self.seq_len, "StudyConfig.seq_len")
        self.window_fraction = check_window_fraction(
            self.window_fraction, "StudyConfig.window_fraction"
        )
        for name in ("zeta", "probe_fraction"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise UsageError(f"StudyConfig.{name} must be a number; got {value!r}.")
            setattr(self, name, float(value))
        checks = {
            "controls": self.controls in CONTROLS,
            "windows": self.windows in ("step", "index"),
            "zeta": 0.0 <= self.zeta <= 1.0,
            "seed": is_seed(self.seed),
            "probe_fraction": 0.0 < self.probe_fraction < 1.0,
            "max_chars": self.max_chars is None or (is_int(self.max_chars) and self.max_chars > 0),
            "reservoir": is_int(self.reservoir) and (self.reservoir == 0 or self.reservoir >= 3),
            "num_threads": self.num_threads is None
            or (is_int(self.num_threads) and self.num_threads >= 1),
        }
        hints = {
            "controls": f"one of {CONTROLS}",
            "windows": "'step' or 'index'",
            "zeta": "[0, 1]",
            "seed": f"an int in [0, {MAX_SEED}]",
            "probe_fraction": "(0, 1)",
            "max_chars": "None or a positive int",
            "reservoir": "0 (no TwoNN) or an int >= 3",
            "num_threads": "None or a positive int",
        }
        for name, ok in checks.items():
            if not ok:
                raise UsageError(
                    f"StudyConfig.{name}={getattr(self, name)!r} is out of range; "
                    f"use {hints[name]}."
                )
        for name in ("seed", "n_groups", "reservoir", "max_chars", "num_threads"):
            value = getattr(self, name)
            setattr(self, name, None if value is None else int(value))  # numpy ints → JSON

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,) if is_int(self.rank) else tuple(self.rank)

    def check_ranks(self, d: int) -> None:
        """Every rank must take normal controls too (``p_value_normal``): 2k < d."""
        for k in self.ranks:
            check_rank(k, d, "normal", name="StudyConfig.rank")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["sites"] = list(self.sites)
        d["probes"] = list(self.probes)
        d["rank"] = self.rank if isinstance(self.rank, int) else list(self.rank)
        for name in ("early", "late"):
            d[name] = None if d[name] is None else list(d[name])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StudyConfig:
        return dataclass_from_dict(cls, d)


def _check_probes(probes: Any) -> tuple[str, ...]:
    """Registered probe names, each once, in table order (`registry.names`): checked when
    the config is made, so a misspelt or unregistered probe fails before any checkpoint is
    loaded, and two configs naming the same probes in another order are one setting."""
    chosen = (probes,) if isinstance(probes, str) else probes
    if not isinstance(chosen, list | tuple) or not all(isinstance(p, str) for p in chosen):
        raise UsageError(
            f"StudyConfig.probes must be a tuple of registered probe names; got {probes!r}."
        )
    known = registry.names()
    unknown = [p for p in chosen if p not in known]
    if unknown:
        raise UsageError(
            f"StudyConfig.probes names {unknown}, which no probe is registered as; the "
            f"registered probes are {known} (register your own with "
            "tangentlens.probes.registry.register before making the config)."
        )
    made = [p for p in chosen if p in FROM_PARTS]
    if made:
        raise UsageError(
            f"StudyConfig.probes names {made}, whose rows the study makes from its parts "
            f"already (every probe sequence, every rank); name probes other than {FROM_PARTS}."
        )
    return tuple(p for p in known if p in chosen)


def trained_config(folder: str | Path) -> TrainConfig | None:
    """The config a `tangentlens train` folder records, None where there is none (another
    series, a hub id); one that does not validate is a `CorruptFileError` naming the file,
    not an error about settings the caller never gave."""
    path = Path(folder).expanduser() / CONFIG_FILE
    if not path.is_file():
        return None
    fix = "restore it, or rerun `tangentlens train` with --restart"
    try:
        return TrainConfig.from_dict(read_json(path, dict, fix=fix))
    except UsageError as err:
        raise CorruptFileError(f"{path} is corrupt ({err}); {fix}.") from None


def open_series(source: str) -> Any:
    """A `CheckpointSeries` from a local folder, or from hub revisions for an ``owner/name``
    id that is not a local path. Errors of the series (missing folder, no checkpoints,
    mixed shapes) surface unchanged; a `tangentlens train` folder missing a checkpoint its
    schedule wrote is a `UsageError` naming the steps (a rerun of train rebuilds them)."""
    path = Path(source).expanduser()
    if not path.exists() and is_hub_id(source):
        return CheckpointSeries.from_hub(source)
    holder = writer_of(path)
    if holder is not None:
        raise UsageError(
            f"{path} is in use by another tangentlens run ({holder}), which is still writing "
            "it; wait for it to finish, then run the study"
        )
    series = CheckpointSeries.from_folder(path)
    config = trained_config(path)
    if config is not None:  # a `tangentlens train` folder: its schedule is known
        upto = max(series.steps[-1], trained_to(path) or 0)  # what its training wrote
        gone = [s for s in config.steps if s <= upto and s not in series.steps]
        check_recorded(path)
        if gone:
            raise UsageError(
                f"{path} lacks the checkpoints of steps {gone}, which its training wrote; "
                "rerun `tangentlens train` with the same options to rebuild them"
            )
    return series
