"""The shared argument rules: each entry point (command line, configs, data loaders)
refuses the same values with the rule's one message."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from tangentlens.cli import arguments
from tangentlens.core.errors import UsageError
from tangentlens.core.validation import check_seq_len, check_window_fraction
from tangentlens.data import corpus
from tangentlens.data.train import TrainConfig
from tangentlens.study.config import StudyConfig


@pytest.mark.parametrize("bad", [1, 0, -3, 2.0, "16", True, None])
def test_seq_len_below_two_or_not_an_int_is_refused(bad: object) -> None:
    with pytest.raises(UsageError, match="int >= 2"):
        check_seq_len(bad)


def test_seq_len_accepts_numpy_ints_as_plain_ints() -> None:
    value = check_seq_len(np.int64(2))
    assert value == 2 and type(value) is int


@pytest.mark.parametrize("bad", [0.0, -0.1, 0.51, float("nan"), float("inf"), "0.3", True])
def test_window_fraction_outside_half_open_unit_half_is_refused(bad: object) -> None:
    with pytest.raises(UsageError, match=r"a number in \(0, 0.5\]"):
        check_window_fraction(bad)


def test_window_fraction_accepts_its_bounds() -> None:
    assert check_window_fraction(0.5) == 0.5 and check_window_fraction(np.float32(0.25)) == 0.25


def test_every_entry_point_states_the_same_seq_len_rule() -> None:
    rule = "int >= 2; got 1: a one-token sequence"
    with pytest.raises(argparse.ArgumentTypeError, match=rule):
        arguments.seq_len("1")
    with pytest.raises(argparse.ArgumentTypeError, match="int >= 2; got 'x'"):
        arguments.seq_len("x")
    with pytest.raises(UsageError, match=rule):
        StudyConfig(checkpoints="unused", seq_len=1)
    with pytest.raises(UsageError, match=rule):
        TrainConfig.tiny(seq_len=1)
    with pytest.raises(UsageError, match=rule):
        corpus.token_batches(None, ids=torch.arange(15), seq_len=1)
    assert arguments.seq_len("2") == 2


def test_every_entry_point_states_the_same_window_fraction_rule() -> None:
    rule = r"a number in \(0, 0.5\] so the early and late windows do not overlap; got 0.9"
    with pytest.raises(argparse.ArgumentTypeError, match=rule):
        arguments.fraction("0.9")
    with pytest.raises(argparse.ArgumentTypeError, match="got 'half'"):
        arguments.fraction("half")
    with pytest.raises(UsageError, match=rule):
        StudyConfig(checkpoints="unused", window_fraction=0.9)
    assert arguments.fraction("0.5") == 0.5


def test_every_entry_point_takes_seeds_up_to_the_largest_every_generator_takes() -> None:
    """Seeds beyond `MAX_SEED` overflow a generator (after the offsets a run adds), so every
    entry point refuses them with the rule, and a long --seeds list is checked in one pass."""
    from tangentlens.core.validation import MAX_SEED, check_seed, check_seeds

    assert check_seed(MAX_SEED) == MAX_SEED and check_seeds(f"0,{MAX_SEED}") == (0, MAX_SEED)
    for bad in (MAX_SEED + 1, 2**63, -1, 1.5, "3"):
        with pytest.raises(UsageError, match=str(MAX_SEED)):
            check_seed(bad)
    with pytest.raises(UsageError, match=str(MAX_SEED)):
        check_seeds(f"0,{2**63}")
    with pytest.raises(UsageError, match=r"TrainConfig\.seed"):
        TrainConfig(seed=MAX_SEED + 1)
    with pytest.raises(UsageError, match=r"StudyConfig\.seed"):
        StudyConfig(checkpoints="x", seed=MAX_SEED + 1)
    with pytest.raises(argparse.ArgumentTypeError, match=str(MAX_SEED)):
        arguments.seed(str(2**63))
    assert len(check_seeds(",".join(map(str, range(20_000))))) == 20_000
    with pytest.raises(UsageError, match="repeats seed 7"):
        check_seeds("1,7,3,7")


def test_a_run_shorter_than_its_warmup_names_max_steps() -> None:
    with pytest.raises(UsageError, match="--max-steps"):
        TrainConfig(max_steps=31, warmup_steps=32)
    assert TrainConfig(max_steps=32, warmup_steps=32).max_steps == 32


def test_a_study_too_small_for_the_twonn_dimension_is_refused_before_any_work() -> None:
    with pytest.raises(UsageError, match="--sequences 3"):
        StudyConfig(checkpoints="x", n_sequences=2)
    assert StudyConfig(checkpoints="x", n_sequences=2, reservoir=0).n_sequences == 2
    assert StudyConfig(checkpoints="x", n_sequences=3).n_sequences == 3
