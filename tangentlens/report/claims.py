"""The paper's claims as one typed object: what the verdicts produce, ``summary.json``
stores, the pages show and the CLI prints.

A `Claim` carries the number its verdict reads (`Claim.estimate`, a value with its 95 %
interval) and the numbers that put it in context (the late window beside a difference,
each model's own beside decoder − encoder, the other embedding centres beside the
weighted one). With several training seeds the estimate is the between-seed interval
(`between`) and each seed's own number, with its interval over probe tokens, is in
`per_seed`; with one seed the estimate is that seed's number and its interval covers
probe tokens only (the frequency claim: embedding rows; decoder − encoder: no interval,
the two models' token intervals are compared) (`interval_covers`). A dynamics claim also
carries its window panel (`panel`, one `PanelEntry` per window definition), a
"concentrated" claim its threshold τ and strength,
and a claim tested across seeds its p-value and Holm-adjusted p-value.

Its JSON form is a flat record (``claim``, ``paper``, ``statistic``, ``model``,
``gradient_object``, ``rank``, ``verdict``, one ``{"value", "ci"}`` entry per number under
the window's or centre's name, then ``interval_covers``, ``seeds``, ``per_seed``,
``between``, ``panel``, ``threshold``, ``strength``, ``p_value``, ``p_holm`` and
``scope``), so a ``summary.json`` is readable without this package; `Claim.from_dict`
reads it back, and reads records without the later keys as one seed's claims.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import CorruptFileError
from .table import PAPER

__all__ = ["OBJECTS", "VERDICTS", "Claim", "Estimate", "PanelEntry", "SeedEstimate"]

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
    "encoders_weaker": "difference",
}
# the order numbers are shown in (a difference after the two windows it compares; the
# frequency claim's other embedding centres after the weighted one, "last")
_NUMBER_KEYS = ("early", "late", "difference", "decoder", "encoder", "last", "mean_all",
                "mean_seen", "norm")  # fmt: skip


VERDICTS = (
    "agrees",
    "disagrees",
    "inconclusive",
    "suggests agrees",
    "suggests disagrees",
    "window-dependent",
    "centre-dependent",
)
_OBJECT_NAMES = {
    "gradient": "activation gradient",
    "weight_gradient": "weight gradient",
    "embedding": "embedding",
}
_KNOWN = {"claim", "paper", "statistic", "model", "gradient_object", "rank", "verdict",
          "interval_covers", "seeds", "per_seed", "between", "panel", "threshold", "strength",
          "p_value", "p_holm", "scope"}  # fmt: skip


def _comparison_of_two_numbers(numbers: Mapping[str, Any]) -> dict[str, Any]:
    """A one-seed decoder-vs-encoder record that holds the two models' numbers only (the
    form without ``difference``): their difference, which has no interval with one seed
    each (the verdict compares the two token intervals)."""
    dec, enc = (Estimate.from_dict(numbers[k]) for k in ("decoder", "encoder"))
    return {**numbers, "difference": {"value": dec.value - enc.value, "ci": [math.nan] * 2}}


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


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

    @classmethod
    def maybe(cls, record: Mapping[str, Any] | None) -> Estimate | None:
        return None if record is None else cls.from_dict(record)

    def __str__(self) -> str:
        return f"{self.value:.3g} [{self.low:.3g}, {self.high:.3g}]"


@dataclass(frozen=True)
class SeedEstimate:
    """One training seed's own number for a claim (``model``: which model's seed, as a
    comparison holds both), with its interval over probe tokens; None where that seed's
    table lacks it."""

    model: str
    seed: int
    estimate: Estimate | None

    def to_dict(self) -> dict[str, Any]:
        est = None if self.estimate is None else self.estimate.to_dict()
        return {"model": self.model, "seed": self.seed, "estimate": est}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> SeedEstimate:
        return cls(str(record["model"]), int(record["seed"]), Estimate.maybe(record["estimate"]))


@dataclass(frozen=True)
class PanelEntry:
    """A dynamics claim under one window definition (`tangentlens.report.panel`): each
    seed's window mean from the per-checkpoint rows (``per_seed``: model, seed, value),
    their mean (for a comparison, the decoder's minus the encoder's), the between-seed
    interval (None with one seed per model) and the verdict under this definition."""

    definition: str
    value: float | None
    interval: tuple[float, float] | None
    per_seed: tuple[tuple[str, int, float | None], ...]
    verdict: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "definition": self.definition,
            "value": self.value,
            "ci": None if self.interval is None else list(self.interval),
            "per_seed": [list(x) for x in self.per_seed],
            "verdict": self.verdict,
        }

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> PanelEntry:
        ci = record["ci"]
        return cls(
            str(record["definition"]),
            _opt_float(record["value"]),
            None if ci is None else (float(ci[0]), float(ci[1])),
            tuple((str(m), int(s), _opt_float(v)) for m, s, v in record["per_seed"]),
            str(record["verdict"]),
        )

    def __str__(self) -> str:
        if self.value is None:
            return f"{self.definition}: n/a"
        text = f"{self.definition} {self.value:.3g}"
        if self.interval is not None:
            text += f" [{self.interval[0]:.3g}, {self.interval[1]:.3g}]"
        return f"{text} ({self.verdict})"


@dataclass(frozen=True)
class Claim:
    """One claim of the paper against one model and gradient object: the number the
    verdict reads (``estimate``), the numbers shown beside it (``context``: key and
    estimate, None where a window is missing) and the verdict (one of `VERDICTS`).
    ``name`` is a key of `PAPER`.

    ``per_seed``: each training seed's own tested number (its interval over probe
    tokens); ``between``: the between-seed interval, None with one seed, where the
    verdict can at most *suggest*. ``panel``: the claim under each window definition
    (dynamics claims); ``threshold`` τ and ``strength`` (strong / weak / none) for the
    "concentrated early" claim; ``p_value`` (between-seed t-test against the claim's
    line) and ``p_holm`` (Holm-adjusted across the claims of one summary). ``scope``: the
    sites and checkpoints the tested number averages, in the words the figures use
    (`tangentlens.report.scope`), so a page can say what each number is a mean of."""

    name: str
    model: str
    gradient_object: str
    statistic: str
    rank: int
    estimate: Estimate
    verdict: str
    context: tuple[tuple[str, Estimate | None], ...] = ()
    per_seed: tuple[SeedEstimate, ...] = ()
    between: Estimate | None = None
    panel: tuple[PanelEntry, ...] = ()
    threshold: float | None = None
    strength: str | None = None
    p_value: float | None = None
    p_holm: float | None = None
    scope: str = ""

    def __post_init__(self) -> None:
        if self.name not in _TESTED:
            raise ValueError(f"unknown claim {self.name!r}; known: {sorted(_TESTED)}.")
        unknown = [k for k, _ in self.context if k not in _NUMBER_KEYS]
        if unknown:
            raise ValueError(f"unknown numbers {unknown}; known: {_NUMBER_KEYS}.")
        # display order, so a claim read back from JSON equals the one written
        ordered = tuple(sorted(self.context, key=lambda kv: _NUMBER_KEYS.index(kv[0])))
        object.__setattr__(self, "context", ordered)

    @property
    def paper(self) -> str:
        return PAPER[self.name]

    @property
    def interval(self) -> tuple[float, float]:
        return self.estimate.low, self.estimate.high

    @property
    def seeds(self) -> tuple[int, ...]:
        """The training seeds behind the claim (of either model, for a comparison)."""
        return tuple(sorted({e.seed for e in self.per_seed}))

    @property
    def interval_covers(self) -> str:
        """What the tested interval resamples: ``training seeds``; with one seed ``probe
        tokens``, or for the frequency claim ``embedding rows`` (Fisher's interval over the
        vocabulary rows the corpus holds)."""
        if self.between is not None:
            return "training seeds"
        if self.name == "encoders_weaker":  # one seed each: the two token intervals
            return "probe tokens of each model"
        return "embedding rows" if self.name == "frequency" else "probe tokens"

    def numbers(self) -> dict[str, Estimate | None]:
        """Every number by its key, in display order (the tested one included)."""
        found = dict(self.context) | {_TESTED[self.name]: self.estimate}
        return {key: found[key] for key in _NUMBER_KEYS if key in found}

    @property
    def quantity(self) -> str:
        """What was measured, in words (the summary's first column)."""
        obj = _OBJECT_NAMES.get(self.gradient_object, self.gradient_object)
        ratio = "Energy ratio"
        if self.gradient_object == "weight_gradient":  # the ratio over the random-backprop null
            ratio = "Energy ratio over the random-backprop null"
        ci = f"95 % CI over {self.interval_covers}"
        if self.name == "energy_early":
            text = f"{ratio}, early window ({obj}), {ci}"
        elif self.name == "energy_late":
            text = f"{ratio}, late − early ({obj}), {ci}"
        elif self.name == "frequency":
            text = f"Frequency vs distance to the embedding centres, Pearson r, {ci}"
        elif self.name == "isotropy":
            text = f"ΔIsoScore*: remove Q_T minus a normal control, early window, {ci}"
        else:
            text = f"Early {ratio.lower()}, decoder − encoder ({obj}), {ci}"
        return f"{text} (rank {self.rank})"

    @property
    def measured(self) -> str:
        """The tested number with its interval, then its context where one explains it."""
        text = str(self.estimate)
        late = self.numbers().get("late")
        if self.name == "energy_late" and late is not None:
            text += f"; late {late}"
        if self.name == "frequency":  # the claim's own centre first, each named
            others = [f"{k} {v}" for k, v in self.numbers().items() if k != "last" and v]
            text = f"weighted {text}" + "".join(f"; {o}" for o in others)
        if self.name == "encoders_weaker":  # decoder − encoder, then each model's own
            if self.between is None:  # one seed each: no interval for the difference
                text = f"{self.estimate.value:.3g}"
            text += "".join(f"; {k} {v}" for k, v in self.context if v is not None)
        if self.strength is not None:
            text += f"; {self.strength} (τ = {self.threshold:g})"
        return text

    def describe_seeds(self) -> str:
        """Each seed's own number with its interval over probe tokens: ``seed 0 3.1 [..]``
        (prefixed by the model in a comparison); empty for a claim of one seed."""
        if len(self.per_seed) <= len({e.model for e in self.per_seed}):
            return ""
        both = len({e.model for e in self.per_seed}) > 1
        return "; ".join(
            (f"{e.model} " if both else "") + f"seed {e.seed} {e.estimate or 'n/a'}"
            for e in self.per_seed
        )

    def describe_test(self) -> str:
        """The between-seed test the verdict turns on: ``p 0.033, Holm-adjusted 0.4``
        (a claim agrees or disagrees only when the Holm-adjusted p is below alpha, so an
        interval that excludes the line can still be inconclusive); empty with one seed."""
        if self.p_value is None:
            return ""
        text = f"p {self.p_value:.3g}"
        return text if self.p_holm is None else f"{text}, Holm-adjusted {self.p_holm:.3g}"

    def describe_panel(self) -> str:
        """The claim under each window definition, one after another."""
        return "; ".join(str(p) for p in self.panel)

    def describe_numbers(self) -> str:
        """Every number, each under its key: ``early 3.1 [0.8, 5.4]; late ...``."""
        return "; ".join(
            f"{k} {v}" if math.isfinite(v.low) else f"{k} {v.value:.3g}"
            for k, v in self.numbers().items()
            if v is not None
        )

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
            "interval_covers": self.interval_covers,
            "seeds": list(self.seeds),
            "per_seed": [e.to_dict() for e in self.per_seed],
            "between": None if self.between is None else self.between.to_dict(),
            "panel": [p.to_dict() for p in self.panel],
            "threshold": self.threshold,
            "strength": self.strength,
            "p_value": self.p_value,
            "p_holm": self.p_holm,
            "scope": self.scope,
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
            if tested not in numbers and name == "encoders_weaker":
                numbers = _comparison_of_two_numbers(numbers)
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
                per_seed=tuple(SeedEstimate.from_dict(e) for e in record.get("per_seed", ())),
                between=Estimate.maybe(record.get("between")),
                panel=tuple(PanelEntry.from_dict(p) for p in record.get("panel", ())),
                threshold=_opt_float(record.get("threshold")),
                strength=None if record.get("strength") is None else str(record["strength"]),
                p_value=_opt_float(record.get("p_value")),
                p_holm=_opt_float(record.get("p_holm")),
                scope=str(record.get("scope") or ""),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptFileError(f"not a claim record ({err!r}): {dict(record)}") from err
