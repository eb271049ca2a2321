"""The command line's argument types: each flag's text converted and checked with the
package's own rule (`tangentlens.core.validation`), so the command line and the API refuse
a value with one message, and argparse prints it as one line."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from typing import Any

from ..core.errors import UsageError
from ..core.validation import (
    check_int,
    check_seed,
    check_seeds,
    check_seq_len,
    check_window_fraction,
)

__all__ = [
    "checked",
    "fraction",
    "head_sequences",
    "layer",
    "path",
    "positive_int",
    "seed",
    "seeds",
    "seq_len",
    "step_range",
]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def seeds(text: str) -> tuple[int, ...]:
    try:
        return check_seeds(text, "--seeds")
    except UsageError as error:
        raise argparse.ArgumentTypeError(str(error).rstrip(".")) from None


def path(text: str) -> str:
    """A path argument: an empty one would silently mean the working folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path would mean the working folder; pass one")
    return text


def checked(
    convert: Callable[[str], Any], rule: Callable[[Any, str], Any], flag: str
) -> Callable[[str], Any]:
    """An argparse type that converts the text and applies the package's own ``rule`` (so
    the CLI and the API refuse a value with one message); text that does not convert is
    handed to the rule as it is, which refuses it too."""

    def parse(text: str) -> Any:
        try:
            value: object = convert(text)
        except ValueError:
            value = text
        try:
            return rule(value, flag)
        except UsageError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


seq_len = checked(int, check_seq_len, "--seq-len")
head_sequences = checked(int, partial(check_int, minimum=0), "--head-sequences")
seed = checked(int, check_seed, "--seed")
fraction = checked(float, check_window_fraction, "--window-fraction")


def layer(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"a layer is an integer >= 0, got {text!r}")
    return value


def step_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        pair = (int(lo), int(hi))
    except ValueError:
        pair = (-1, -1)
    if not sep or pair[0] < 0 or pair[0] > pair[1]:
        raise argparse.ArgumentTypeError(f"a step range is LO:HI with 0 <= LO <= HI, got {text!r}")
    return pair
