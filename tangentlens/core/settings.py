"""The settings the command line offers: one default and one help text each, no torch.

`tangentlens.study.StudyConfig`, `tangentlens.data.train.TrainConfig` and the workflow
functions (`tangentlens.cli.workflows.probe_model`, `run_study`) take their defaults from these
records, and `tangentlens.cli` reads the same records for its argparse defaults and its
help, so a default cannot differ between the API, the command line and ``--help`` (which
answers without importing torch). Each group's field names are the API's parameter names;
``tests/test_settings.py`` checks every option of every command against the API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .validation import BACKENDS, CONTROLS, OBJECTIVES

__all__ = [
    "DEMO",
    "DEMO_STUDY",
    "HEAD_NULL",
    "HEAD_NULL_SEQUENCES",
    "N_CONTROLS",
    "PROBE",
    "QUICK_DEMO",
    "QUICK_STUDY",
    "QUICK_TRAIN",
    "STUDY",
    "TRAIN",
    "ZETA",
    "Setting",
    "shown",
]


@dataclass(frozen=True)
class Setting:
    """One setting: its default and what it means (help adds "(default: ...)").

    ``shown`` names a default of None in words ("all", "the King James Bible").
    """

    default: Any
    help: str
    shown: str | None = None

    @property
    def default_text(self) -> str:
        """The default as help shows it."""
        return shown(self.default) if self.shown is None else self.shown


def shown(value: Any) -> str:
    """A default value as help shows it: ``16``, ``0.3``, ``uniform``; a list of values
    as the option takes it: ``0,1,2``."""
    if isinstance(value, tuple | list):
        return ",".join(shown(v) for v in value)
    return str(value)


# Shared by several commands, with one meaning and one default.
BACKEND = Setting(BACKENDS[0], "model library")
ENCODING = Setting("utf-8", "encoding of the text files, read strictly, e.g. latin-1")
TEXT = Setting(None, "text file or folder of .txt files", shown="the King James Bible")
RANK = Setting(16, "rank of Q_T")
N_CONTROLS = Setting(
    1000, "random frames per energy and isotropy test; the heads' null has its own"
)
SEED = Setting(0, "random seed")
WORLD_SIZE = Setting(1, "data-parallel processes")
SEEDS = Setting(None, "training seeds, comma-separated", shown="one series")
N_SEEDS = Setting(None, "seeds 0 to N-1, in place of --seeds", shown="none")
# Options of the probes (their classes' keyword defaults) that the study shares.
ZETA = Setting(0.1, "IsoScore* shrinkage toward the pooled reference (the paper's ζ)")
HEAD_NULL = Setting(
    99, "random frames behind each head's null: its p-values reach 1/(N + 1) (0: none)"
)

HEAD_NULL_SEQUENCES = Setting(
    8,
    "sequences the head null's frames see (the first ones; None: all): the null's cost is "
    "then fixed, not a multiple of every batch",
)


@dataclass(frozen=True)
class ProbeSettings:
    """`tangentlens probe`: the keyword parameters of `workflows.probe_model`."""

    backend: Setting = BACKEND
    text: Setting = TEXT
    encoding: Setting = ENCODING
    rank: Setting = RANK
    layers: Setting = Setting(None, "layers", shown="all")
    tokens: Setting = Setting(1024, "tokens probed; as many again fit the bases")
    seq_len: Setting = Setting(128, "tokens per row")
    batch_size: Setting = Setting(8, "rows per batch")
    n_controls: Setting = N_CONTROLS
    world_size: Setting = WORLD_SIZE


@dataclass(frozen=True)
class TrainSettings:
    """`tangentlens train`: fields of `TrainConfig`."""

    corpus: Setting = TEXT
    encoding: Setting = ENCODING
    max_steps: Setting = Setting(256, "training steps")
    seed: Setting = SEED
    objective: Setting = Setting(
        OBJECTIVES[0], "causal: a decoder, next-token loss; masked: an encoder, masked-token loss"
    )
    seeds: Setting = Setting(
        SEEDS.default, "train one series per seed into OUT/seed{S}/, e.g. 0,1,2", SEEDS.shown
    )
    n_seeds: Setting = N_SEEDS
    restart: Setting = Setting(
        False,
        "delete OUT's checkpoints and train again from step 0 (a rerun otherwise resumes, and "
        "refuses a changed corpus, tokenizer or options)",
    )


@dataclass(frozen=True)
class StudySettings:
    """`tangentlens study`: fields of `StudyConfig`, and ``world_size`` of `run_study`."""

    backend: Setting = BACKEND
    rank: Setting = Setting(RANK.default, "rank(s) of Q_T")
    n_controls: Setting = N_CONTROLS
    controls: Setting = Setting(
        CONTROLS[0], "the frames behind the summary's p-values: uniform, exact; normal, the paper's"
    )
    window_fraction: Setting = Setting(0.3, "early/late window, as a fraction of the steps")
    windows: Setting = Setting(
        "step",
        "the window fraction counts training steps (step) or checkpoints (index, the paper's)",
    )
    early: Setting = Setting(None, "early steps", shown="the first --window-fraction")
    late: Setting = Setting(None, "late steps", shown="the last --window-fraction")
    n_sequences: Setting = Setting(256, "probe set, in sequences")
    seq_len: Setting = Setting(64, "tokens per probe sequence, at most the model's context")
    head_sequences: Setting = Setting(
        8, "the first probe sequences behind the heads' rows, at most --sequences (0: no heads)"
    )
    corpus: Setting = TEXT
    encoding: Setting = ENCODING
    seed: Setting = SEED
    world_size: Setting = WORLD_SIZE


@dataclass(frozen=True)
class DemoSettings:
    """`tangentlens demo`: the keyword parameters of `cli.demo.demo`."""

    seeds: Setting = Setting(
        (0, 1, 2),
        "training seeds per model kind, each its own run: verdicts that hold across seeds "
        "are about the design, not one initialisation",
    )
    n_seeds: Setting = N_SEEDS


PROBE = ProbeSettings()
TRAIN = TrainSettings()
STUDY = StudySettings()
DEMO = DemoSettings()

QUICK_TRAIN = {"max_steps": 8}
"""`--quick` training: five checkpoints (0, 1, 2, 4, 8) of `TrainConfig.tiny`: seconds."""

QUICK_STUDY = {
    "rank": 8,  # a quarter of the quick model's width: normal controls fit beside Q_T
    "n_controls": 50,
    "n_permutations": 20,
    "n_sequences": 8,
    "batch_size": 4,
    "reservoir": 256,
}
"""`--quick` study: `StudyConfig` fields set before the options given."""

QUICK_DEMO = {"seeds": (0, 1)}
"""`--quick` demo: two seeds, so the quick run has every part of the full one."""

DEMO_STUDY = {"n_sequences": 128, "head_sequences": 4, "early": (0, 8)}
"""The demo's study of each series (`QUICK_STUDY` in its place with ``--quick``). The demo studies
three seeds of two designs in minutes, so each study takes half the probe sequences of
`tangentlens study` (the jackknife keeps its groups), and half its head sequences: the heads'
pass carries the null of every head statistic (`HEAD_NULL` frames, each a full set of score
terms), so halving its tokens halves the pass and keeps every null and p-value. The early
window is the log-spaced steps 0 to 8: a window of the first steps by fraction would reach
well into the loss drop of so short a run, where gradients are no longer those of early
training."""
