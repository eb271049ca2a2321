"""What is measured at a site: residual, attention, gradient, weight-gradient and
activation probes.

`probe` (context manager), `run` (driver with a progress bar) and `fit_bases` work on
any model with a backend (`tangentlens.hooks.get_backend`). Every probe follows the
`Probe` protocol (`tangentlens.probes.base`).
"""

from __future__ import annotations

from . import registry
from .activation import ActivationProbe
from .attention import AttentionProbe
from .base import Observation, Probe
from .bases import BasisSet
from .driver import LOSSES, fit_bases, lm_loss, mlm_loss, run
from .gradient import GradientProbe
from .residual import ResidualProbe
from .session import PROBES, ProbeSession, probe
from .weight_gradient import WeightGradientProbe

__all__ = [
    "LOSSES",
    "PROBES",
    "ActivationProbe",
    "AttentionProbe",
    "BasisSet",
    "GradientProbe",
    "Observation",
    "Probe",
    "ProbeSession",
    "ResidualProbe",
    "WeightGradientProbe",
    "fit_bases",
    "lm_loss",
    "mlm_loss",
    "probe",
    "registry",
    "run",
]
