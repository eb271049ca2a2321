"""The paper's claims as one typed object: what the verdicts produce, ``summary.json``
stores, the pages show and the CLI prints.

A `Claim` carries the number its verdict reads (`Claim.estimate`, a value with its 95 %
interval) and the numbers that put it in context (the late window beside a difference,
the encoder beside the decoder). Its JSON form is a flat record (``claim``, ``paper``,
``statistic``, ``model``, ``gradient_object``, ``rank``, ``verdict`` and one
``{"value", "ci"}`` entry per number, under the window's name), so a ``summary.json`` is
readable without this package; `Claim.from_dict` reads it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import CorruptFileError
from .table import PAPER

__all__ = ["OBJECTS", "Claim", "Estimate"]

OBJECTS = {
    "gradient": "activation gradient ∂L/∂h (residual stream)",
    "weight_gradient": "weight gradient Σ G Gᵀ of W_Q/W_K/W_V and the MLP input maps",
}
# the number each claim's verdict reads, by its key in the JSON record
_TESTED = {
    "energy_early": "early",
    "energy_late": "difference",
    "frequency": "last",
    "isotropy": "early",
    "encoders_weaker": "decoder",
}
# the order numbers are shown in (a difference after the two windows it compares)
_NUMBER_KEYS = ("early", "late", "difference", "decoder", "encoder", "last")
_OBJECT_NAMES = {
    "gradient": "activation gradient",
    "weight_gradient": "weight gradient",
    "embedding": "embedding",
}
_KNOWN = {"claim", "paper", "statistic", "model", "gradient_object", "rank", "verdict"}


@dataclass(frozen=True)
class Estimate:
    """A value with its 95 % interval [low, high]."""

    value: float
    low: float
    high: float

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "ci": [self.low, self.high]}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Estimate:
        low, high = record["ci"]
        return cls(float(record["value"]), float(low), float(high))

    def __str__(self) -> str:
        return f"{self.value:.3g} [{self.low:.3g}, {self.high:.3g}]"


@dataclass(frozen=True)
class Claim:
    """One claim of the paper against one model and gradient object: the number the
    verdict reads (``estimate``), the numbers shown beside it (``context``: key and
    estimate, None where a window is missing) and the verdict (``agrees``,
    ``disagrees`` or ``inconclusive``). ``name`` is a key of `PAPER`."""

    name: str
    model: str
    gradient_object: str
    statistic: str
    rank: int
    estimate: Estimate
    verdict: str
    context: tuple[tuple[str, Estimate | None], ...] = ()

    def __post_init__(self) -> None:
        if self.name not in _TESTED:
            raise ValueError(f"unknown claim {self.name!r}; known: {sorted(_TESTED)}.")

    @property
    def paper(self) -> str:
        return PAPER[self.name]

    @property
    def interval(self) -> tuple[float, float]:
        return self.estimate.low, self.estimate.high

    def numbers(self) -> dict[str, Estimate | None]:
        """Every number by its key, in display order (the tested one included)."""
        found = dict(self.context) | {_TESTED[self.name]: self.estimate}
        return {key: found[key] for key in _NUMBER_KEYS if key in found}

    @property
    def quantity(self) -> str:
        """What was measured, in words (the summary's first column)."""
        obj = _OBJECT_NAMES.get(self.gradient_object, self.gradient_object)
        if self.name == "energy_early":
            text = f"Energy ratio, early window ({obj}), 95 % CI"
        elif self.name == "energy_late":
            text = f"Energy ratio, late − early ({obj}), 95 % CI"
        elif self.name == "frequency":
            text = "Frequency vs distance to the frequency-weighted centre, Pearson r, 95 % CI"
        elif self.name == "isotropy":
            text = "ΔIsoScore*: remove Q_T minus a normal control, early window, 95 % CI"
        else:
            text = f"Early energy ratio, decoder vs encoder ({obj}), 95 % CI"
        return f"{text} (rank {self.rank})"

    @property
    def measured(self) -> str:
        """The tested number with its interval, then its context where one explains it."""
        text = str(self.estimate)
        late = self.numbers().get("late")
        if self.name == "energy_late" and late is not None:
            text += f"; late {late}"
        return text

    def describe_numbers(self) -> str:
        """Every number, each under its key: ``early 3.1 [0.8, 5.4]; late ...``."""
        return "; ".join(f"{k} {v}" for k, v in self.numbers().items() if v is not None)

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (see the module docstring)."""
        numbers = {k: None if v is None else v.to_dict() for k, v in self.numbers().items()}
        return {
            "claim": self.name,
            "paper": self.paper,
            "statistic": self.statistic,
            "model": self.model,
            "gradient_object": self.gradient_object,
            "rank": self.rank,
            **numbers,
            "verdict": self.verdict,
        }

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Claim:
        """A claim from its JSON record; a record this module could not have written is a
        `CorruptFileError`."""
        try:
            name = record["claim"]
            tested = _TESTED[name]
            numbers = {k: v for k, v in record.items() if k not in _KNOWN}
            if set(numbers) - set(_NUMBER_KEYS):
                raise KeyError(sorted(set(numbers) - set(_NUMBER_KEYS)))
            context = tuple(
                (k, None if numbers[k] is None else Estimate.from_dict(numbers[k]))
                for k in _NUMBER_KEYS
                if k in numbers and k != tested
            )
            return cls(
                name=name,
                model=str(record["model"]),
                gradient_object=str(record["gradient_object"]),
                statistic=str(record["statistic"]),
                rank=int(record["rank"]),
                estimate=Estimate.from_dict(numbers[tested]),
                verdict=str(record["verdict"]),
                context=context,
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptFileError(f"not a claim record ({err!r}): {dict(record)}") from err
