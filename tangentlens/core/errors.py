"""Typed errors and warnings: what went wrong decides what the CLI does with it.

- `UsageError` (a `ValueError`): the person's mistake (bad argument, wrong basis,
  a folder that belongs to another run). The CLI prints one line and exits 2.
- `MissingFileError` (a `UsageError` and a `FileNotFoundError`): a path the caller
  named does not exist.
- `CorruptFileError` (a `ValueError`): a file on disk is damaged, truncated or not
  what its name says. One line naming the file and the fix, exit 2.
- `HubUnavailableError`: a hub id was named but the hub cannot be reached.
- `UnstableBasisWarning`: bases fitted on two halves of the sequences barely overlap:
  Q_T is mostly sampling noise at this many tokens.
- `BasisSiteWarning`: a basis is used at a site other than the one it was fitted at
  (its provenance says so), e.g. a ``resid_pre`` basis splitting the attention input.
- `BasisWeightsWarning`: a basis is used on a model whose weights differ from those it
  was fitted on (its provenance records their hash), e.g. another model of the same width.
- `ExchangeabilityWarning`: normal controls are not exchangeable with Q_T at this
  k/d, so their p-values are anti-conservative. Filter it by class, never by text.
- `PaddingWarning`: token ids came without a mask and their pad token is also the BOS
  or EOS token, so a real one at the padded end is read as padding.

Anything else that escapes is a bug: the CLI says so and exits 1.
"""

from __future__ import annotations

__all__ = [
    "BasisSiteWarning",
    "BasisWeightsWarning",
    "CorruptFileError",
    "ExchangeabilityWarning",
    "HubUnavailableError",
    "MissingFileError",
    "PaddingWarning",
    "ResumeRefusedError",
    "TangentlensError",
    "UnstableBasisWarning",
    "UsageError",
]


class TangentlensError(Exception):
    """Base class of every error tangentlens raises on purpose."""


class UsageError(TangentlensError, ValueError):
    """An argument, input or folder the caller can fix; the message names the fix."""


class ResumeRefusedError(UsageError):
    """A training run's folder holds steps made with other inputs, options or code, which
    a resume would mix with its own; the fixes: restore them, restart, or a new folder."""


class MissingFileError(UsageError, FileNotFoundError):
    """A file or folder the caller named does not exist."""


class CorruptFileError(TangentlensError, ValueError):
    """A file that cannot be trusted (truncated, tampered, not ours); names the file."""


class HubUnavailableError(UsageError, ConnectionError):
    """A Hugging Face hub id was named but the hub cannot be reached (offline)."""


class ExchangeabilityWarning(UserWarning):
    """Normal controls are not exchangeable with Q_T: their p-values are anti-conservative."""


class UnstableBasisWarning(UserWarning):
    """Q_T fitted on two halves of the sequences overlaps little more than chance."""


class BasisSiteWarning(UserWarning):
    """A basis is used at a site other than the one its provenance says it was fitted at."""


class PaddingWarning(UserWarning):
    """Padding read from token ids alone, where the pad token is also a real token."""


class BasisWeightsWarning(UserWarning):
    """A basis is used on other weights than its provenance says it was fitted on."""
