"""The probe registry: how a session builds each probe, declared once, next to the probe.

A session is given probe names; it asks the registry for each one. A `ProbeSpec` says
which sites the probe reads (from the bases and the sites in scope), what it needs
when it finds none (for the warning), which options it takes, and how it is built. A
new probe, built in or a user's, is one `register` call: the session, `run`, the
distributed runner and the results writer need no edit.

Options (``n_controls``, ``head_null``, ``reservoir``, ...) belong to the probes that
read them. Their defaults are the defaults of the probe class's own keyword arguments,
so the API, the session and the command line read one value.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import UsageError
from ..core.subspace import TangentBasis
from ..hooks.base import Backend
from ..hooks.sites import Site
from .base import Probe

__all__ = ["Plan", "ProbeSpec", "get", "names", "option_defaults", "register"]


@dataclass(frozen=True)
class Plan:
    """What every probe is planned from, once per session.

    ``bases``: every basis given (site → Q_T); ``scoped``: those at sites in scope (the
    session's layers and names filter); ``in_scope``: the model's sites in scope, with
    or without a basis. ``seed``, ``n_groups`` (groups of sequences for intervals over
    tokens) and ``memory`` are shared by every probe that takes them."""

    backend: Backend
    bases: Mapping[Site, TangentBasis]
    scoped: Mapping[Site, TangentBasis]
    in_scope: frozenset[Site]
    layers: tuple[int, ...]
    seed: int = 0
    n_groups: int = 10
    memory: str = "full"

    def shared(self, cls: type) -> dict[str, Any]:
        """The session-wide arguments ``cls`` takes (seed, n_groups, memory)."""
        params = inspect.signature(cls).parameters
        return {k: getattr(self, k) for k in ("seed", "n_groups", "memory") if k in params}


@dataclass(frozen=True)
class ProbeSpec:
    """One probe, as the session plans it.

    ``sites(plan)`` gives what the probe reads (site → its basis, or whatever ``build``
    takes); empty means the probe has nothing to run on and is skipped with a warning
    that says it ``needs`` those sites. ``build(plan, sites, **options)`` makes the probe
    (default: ``cls(sites, **plan.shared(cls), **options)``). ``options``: the keyword
    arguments of ``cls`` a user may set through the session; their defaults are
    ``cls``'s. ``order``: where its rows come in a session's table (lower first; ties
    in registration order), so a table's layout does not depend on import order."""

    name: str
    cls: type[Probe]
    sites: Callable[[Plan], Mapping[Site, Any]]
    needs: str = "residual sites (blocks.{l}.hook_resid_pre, ...)"
    options: tuple[str, ...] = ()
    order: int = 100
    build: Callable[..., Probe] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        params = inspect.signature(self.cls).parameters
        empty = inspect.Parameter.empty
        bad = [o for o in self.options if o not in params or params[o].default is empty]
        if bad:
            raise UsageError(
                f"probe {self.name!r}: options {bad} are not keyword arguments with a default "
                f"of {self.cls.__name__}; declare only those."
            )

    def defaults(self) -> dict[str, Any]:
        """Option → its default (``cls``'s keyword default)."""
        params = inspect.signature(self.cls).parameters
        return {o: params[o].default for o in self.options}

    def make(self, plan: Plan, sites: Mapping[Site, Any], options: Mapping[str, Any]) -> Probe:
        mine = {k: v for k, v in options.items() if k in self.options}
        if self.build is not None:
            return self.build(plan, sites, **mine)
        return self.cls(sites, **plan.shared(self.cls), **mine)


_REGISTRY: dict[str, ProbeSpec] = {}


def register(spec: ProbeSpec) -> ProbeSpec:
    """Make ``spec.name`` a probe every session can plan. Registering the same spec again
    is harmless; another spec under a taken name is a `UsageError`."""
    known = _REGISTRY.get(spec.name)
    if known is not None and known != spec:
        raise UsageError(
            f"a probe named {spec.name!r} is registered already ({known.cls.__name__}); "
            "choose another name."
        )
    _REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> ProbeSpec:
    """The spec registered under ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UsageError(
            f"no probe is named {name!r}; the registered probes are {names()} (register your "
            "own with tangentlens.probes.registry.register)."
        ) from None


def names() -> tuple[str, ...]:
    """The registered probe names, in table order (`ProbeSpec.order`)."""
    return tuple(sorted(_REGISTRY, key=lambda n: _REGISTRY[n].order))


def option_defaults() -> dict[str, Any]:
    """Every option any registered probe takes, with its default. Two probes that share
    an option (``n_controls``) must agree on its default."""
    out: dict[str, Any] = {}
    for spec in _REGISTRY.values():
        for option, default in spec.defaults().items():
            if option in out and out[option] != default:
                raise UsageError(
                    f"probes disagree on the default of {option!r} ({out[option]!r} and "
                    f"{default!r} for {spec.name!r}); give them one default."
                )
            out[option] = default
    return out
