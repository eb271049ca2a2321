"""`probe`: a context manager that turns whatever the user runs into probe statistics.

>>> bases = fit_bases(model, batches, rank=16)             # one pass, Moments per site
>>> with probe(model, bases, probes=("residual", "gradient")) as session:
...     loss = model(tokens, return_type="loss")
...     loss.backward()
>>> session.results()                                      # long DataFrame

Or `run(model, batches, bases)`: the same with a progress bar, the forward (and the
backward, for gradients) done for you. Every hook is removed in ``finally``, exactly
the hooks added, so an exception or a KeyboardInterrupt leaves the model as it was.

Padding: the session reads the ``attention_mask`` the model is called with (any call:
``model(...)``, ``run_with_hooks``, ``run_with_cache``) and drops padded positions from
every statistic. Gradients are paired with the mask of their own forward pass (the
most recent one that has not been backpropagated yet). Run the backward pass inside
the block: gradients arriving after it closes are not seen.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..core.compute import threads as compute_threads
from ..core.errors import UsageError
from ..core.results import frame
from ..core.stats import Moments, SharedBatch, state_dtype
from ..core.subspace import TangentBasis
from ..core.validation import check_int, check_layers, check_seed
from ..hooks.base import Backend, Handle, get_backend
from ..hooks.families import unwrap
from ..hooks.sites import NamesFilter, Site, missing_site_error, select_sites
from ..models.batches import check_mask, check_tokens
from . import registry, weight_gradient  # noqa: F401 (each probe module registers its probe)
from .activation import ActivationProbe
from .attention import AttentionProbe
from .base import Observation, Probe, SharedEnergies, row
from .bases import as_bases, site_order, warn_basis_sites, warn_basis_weights
from .gradient import GradientProbe
from .registry import Plan
from .residual import ResidualProbe

__all__ = ["PROBES", "ProbeSession", "open_sessions", "probe"]

PROBES = registry.names()  # the built-in probes; `registry.register` adds more
_MAX_PENDING = 64  # forward masks kept per site while waiting for their backward pass
_OPEN: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # by model module


def open_sessions(model: Any) -> int:
    """How many probe sessions are open on ``model``, through any wrapper of its module:
    a forward-only run stops its passes early only where no other session reads them."""
    return _OPEN.get(unwrap(model, strict=False), 0)


def _as_layers(layers: int | Iterable[int] | None, n_layers: int) -> list[int]:
    return check_layers(layers, n_layers)


class ProbeSession:
    """Hooks that turn every forward (and backward) pass into probe statistics.

    Use as a context manager (`probe`); read `results` afterwards (or inside). Each
    probe is a `tangentlens.probes.base.Probe` in ``self.probes`` (name → probe).
    ``probes`` mixes registered names (`tangentlens.probes.registry`), `ProbeSpec`s
    (registered here) and your own `Probe` objects. ``**options`` are the registered probes'
    own options, with their probe class's defaults (``n_controls``: random frames per gradient test;
    ``head_null``: random frames behind each head's null, 0 turns it off;
    ``head_null_sequences``: the first sequences those frames see, None: all;
    ``reservoir``: activation sample per site); an option no probe takes is an error.
    ``seed`` seeds every probe's random frames. ``group_of(i)`` gives
    the group of the sequences of forward pass i (default: i), for intervals over tokens.
    ``leaves``: set to a list to collect the embedding outputs (made leaves requiring
    grad) of every forward, to take gradients with respect to them (`run` does).
    ``memory``: ``"full"`` (float64 d×d state) or ``"compact"`` (float32, and the
    gradient probe keeps no activation `Moments`), for d ≥ 2048 (`tangentlens.core.stats`).
    """

    def __init__(
        self,
        model: Any,
        bases: Mapping[str | Site, TangentBasis] | None = None,
        probes: Sequence[str | Probe] = ("residual", "attention", "gradient"),
        layers: int | Iterable[int] | None = None,
        *,
        sites: NamesFilter = None,
        seed: int = 0,
        n_groups: int = 10,
        group_of: Callable[[int], int] | None = None,
        memory: str = "full",
        **options: Any,
    ) -> None:
        self.backend: Backend = get_backend(model)
        state_dtype(memory)  # a bad mode fails here, before any probe is built
        self.memory = memory
        self.model = model
        single = str | Probe | registry.ProbeSpec
        chosen = (probes,) if isinstance(probes, single) else tuple(probes)
        for spec in chosen:
            if isinstance(spec, registry.ProbeSpec):
                # a spec travels where a name would not (a spawned worker of
                # `distributed.run_probe` has only the built-in registrations)
                registry.register(spec)
        own = [p for p in chosen if isinstance(p, Probe)]
        names = tuple(
            p.name if isinstance(p, registry.ProbeSpec) else p
            for p in chosen
            if not isinstance(p, Probe)
        )
        unknown = [p for p in names if p not in registry.names()]
        if unknown or not chosen:
            raise UsageError(
                f"probes must be a non-empty mix of names in {registry.names()} (registered), "
                f"ProbeSpec and Probe objects; got {probes!r}."
            )
        known = registry.option_defaults()
        stray = sorted(set(options) - set(known))
        if stray:
            raise UsageError(
                f"unknown probe options {stray}; the registered probes take {sorted(known)} "
                "(and the session sites, seed, n_groups, group_of, memory)."
            )
        self.names = names
        self.layers = _as_layers(layers, self.backend.n_layers)
        check_seed(seed)
        self.n_groups = check_int(n_groups, "n_groups", minimum=2)
        self.group_of = group_of
        self.options = {**known, **options}
        self.bases = as_bases(bases)
        warn_basis_weights(self.bases, model, stacklevel=4)
        self.skipped: dict[str, str] = {}  # probe name -> why it cannot run on this model
        self.probes: dict[str, Probe] = self._plan(sites, seed) if names else {}
        for p in own:
            if p.name in self.probes:
                raise UsageError(f"two probes are named {p.name!r}; give each a distinct name.")
            self.probes[p.name] = p
        # a basis given at a site another than it was fitted at, where a probe reads it, or
        # carried so by a probe built by hand (the attention probe warns for its own sites)
        others = [p for p in self.probes.values() if not isinstance(p, AttentionProbe)]
        read = {s.without_head() for p in others for s in (*p.forward_sites, *p.backward_sites)}
        used = [(s, b) for s, b in self.bases.items() if s in read]
        carried = [getattr(p, "bases", None) for p in own if not isinstance(p, AttentionProbe)]
        pairs = [pair for c in carried if isinstance(c, Mapping) for pair in c.items()]
        used += [(s, b) for s, b in pairs if isinstance(s, Site) and isinstance(b, TangentBasis)]
        warn_basis_sites(used, stacklevel=4, writes=True)
        self.leaves: list[Tensor] | None = None
        self._handles: list[Handle] = []
        self._mask: Tensor | None = None
        self._pending: dict[Site, list[tuple[Tensor | None, int]]] = {}
        self._passes = -1  # forward passes seen
        self._group = 0  # the group of the current pass's sequences (for intervals)
        self._cache = SharedBatch()
        self._energies = SharedEnergies()
        self._last_mask: tuple[tuple, tuple[Tensor, Tensor | None], Tensor] | None = None
        self._active = False
        self._seen = {"forward": 0, "backward": 0}
        self._hooks_lost = False
        self._tag: tuple[str | None, int | None] = (None, None)
        self._tag_empty = True  # the current tag's block holds nothing: no pass, no state
        self.progress = True  # results()' default; run(progress=False) turns it off
        self._saved: dict[tuple[str | None, int | None], dict[str, dict[str, Tensor]]] = {}

    # .................................................................. planning
    def _plan(self, names_filter: NamesFilter, seed: int) -> dict[str, Probe]:
        """Each named probe from its registered spec (`tangentlens.probes.registry`)."""
        available = self.backend.sites()
        d = self.backend.d_model
        for site, basis in self.bases.items():
            if site not in available:
                raise missing_site_error(site, available, self.backend.n_layers)
            if basis.d != d:
                raise UsageError(
                    f"the basis for {site} has d={basis.d} but the model has d_model={d}; "
                    "fit the bases on this model (fit_bases(model, batches, rank=k))."
                )
        in_scope = {
            s
            for s in select_sites(available, names_filter)
            if s.layer in self.layers or s.kind == "embed"
        }
        plan = Plan(
            backend=self.backend,
            bases=self.bases,
            scoped={s: b for s, b in self.bases.items() if s in in_scope},
            in_scope=frozenset(in_scope),
            layers=tuple(self.layers),
            seed=seed,
            n_groups=self.n_groups,
            memory=self.memory,
        )
        planned: dict[str, Probe] = {}
        for name in sorted(self.names, key=registry.names().index):
            spec = registry.get(name)
            sites = spec.sites(plan)
            if not sites:
                warnings.warn(
                    f"the {name} probe has no site to run on: it needs bases at {spec.needs} "
                    f"for layers {self.layers}; it is skipped.",
                    stacklevel=3,
                )
                continue
            try:
                planned[name] = spec.make(plan, sites, self.options)
            except UsageError as err:
                # one that cannot run on this model (an attention module the split does
                # not know, say) is skipped with one warning; the others still run
                self.skipped[name] = str(err)
                warnings.warn(
                    f"{_model_name(self.model)}: the {name} probe cannot run on this model "
                    f"and is skipped ({err}); the other probes run.",
                    stacklevel=3,
                )
        if not any(p.forward_sites or p.backward_sites for p in planned.values()):
            if self.skipped:
                reasons = "; ".join(f"{k}: {v}" for k, v in self.skipped.items())
                raise UsageError(f"nothing to probe on {_model_name(self.model)}: {reasons}")
            raise UsageError(
                "nothing to probe: no basis in "
                f"{sorted(s.hook_name for s in self.bases) or 'bases'} matches "
                f"probes={self.names} at layers {self.layers}. Fit bases at those sites: "
                "fit_bases(model, batches, rank=k, sites=...)."
            )
        return planned

    # .................................................................. probes
    @property
    def residual(self) -> ResidualProbe | None:
        return self.probes.get("residual")  # type: ignore[return-value]

    @property
    def gradient(self) -> GradientProbe | None:
        return self.probes.get("gradient")  # type: ignore[return-value]

    @property
    def attention(self) -> AttentionProbe | None:
        return self.probes.get("attention")  # type: ignore[return-value]

    @property
    def last_layer(self) -> int | None:
        """The deepest layer any probe reads (`Probe.last_layer`); None: the whole forward."""
        layers = [p.last_layer for p in self.probes.values()]
        if not layers or any(layer is None for layer in layers):
            return None
        return max(layer for layer in layers if layer is not None)

    @property
    def activation(self) -> ActivationProbe | None:
        return self.probes.get("activation")  # type: ignore[return-value]

    # .................................................................. hooks
    def __enter__(self) -> ProbeSession:
        if self._active:
            raise UsageError("this session is already open; create a new one with probe().")
        try:
            self._attach()
        except BaseException:
            self._detach()
            raise
        self._active = True
        root = unwrap(self.model, strict=False)
        _OPEN[root] = _OPEN.get(root, 0) + 1
        return self

    def __exit__(self, *exc: object) -> None:
        if self._active:
            root = unwrap(self.model, strict=False)
            _OPEN[root] -= 1
            if not _OPEN[root]:
                del _OPEN[root]
        self._detach()

    def _attach(self) -> None:
        be = self.backend
        self._handles.append(be.watch_inputs(self._on_inputs))
        forward: dict[Site, list[Probe]] = {}
        backward: dict[Site, list[Probe]] = {}
        for p in self.probes.values():
            for site in p.forward_sites:
                forward.setdefault(site, []).append(p)
            for site in p.backward_sites:
                backward.setdefault(site, []).append(p)
        for site in backward:
            forward.setdefault(site, [])
            self._pending[site] = []
        for site, readers in sorted(forward.items(), key=lambda kv: site_order(kv[0])):
            hook = self._forward_hook(site, readers, site in backward)
            self._handles.append(be.add_forward_hook(site, hook))
        for site, readers in backward.items():
            self._handles.append(be.add_backward_hook(site, self._backward_hook(site, readers)))
        for p in self.probes.values():
            self._handles.extend(p.attach(be))
        if backward or any(p.reads_backward for p in self.probes.values()):
            leaves = self.leaves
            collect = None if leaves is None else leaves.append
            self._handles.append(be.require_input_grad(collect, force=leaves is not None))

    def _detach(self) -> None:
        handles, self._handles = self._handles, []
        self._hooks_lost |= _lost(handles)
        self._active = False
        errors = []
        for handle in reversed(handles):
            try:
                handle.remove()
            except Exception as err:  # keep removing the others
                errors.append(err)
        if errors:
            raise errors[0]

    def _on_inputs(self, mask: Tensor | None, ids: Tensor | None = None) -> None:
        self._passes += 1
        self._group = self._passes if self.group_of is None else int(self.group_of(self._passes))
        if ids is not None and not ids.is_meta:
            # the checks `run` makes, for passes the caller runs: named here, not an
            # IndexError deep in an embedding (or a silent run past the context)
            check_tokens(self.model, ids, what="input_ids")
        if mask is not None:
            check_mask(mask)  # 2, -1 or NaN would silently count as "keep"
        # bool once per pass, so every site sees the same mask tensor (see SharedBatch)
        self._mask = None if mask is None else mask.bool()

    def _mask_for(self, site: Site, x: Tensor) -> Tensor | None:
        mask = self._mask
        if mask is None:
            return None
        if tuple(mask.shape) != tuple(x.shape[:-1]):
            raise UsageError(
                f"the attention_mask has shape {tuple(mask.shape)} but the activation at "
                f"{site} is {tuple(x.shape)}; pass a (batch, pos) mask matching the tokens "
                "(incremental decoding with a KV cache is not supported: probe whole sequences)."
            )
        return mask.to(x.device).bool()

    def _forward_hook(
        self, site: Site, readers: list[Probe], track_grad: bool
    ) -> Callable[[Tensor], None]:
        fast = self.memory == "compact" or all(r.float32_products for r in readers)

        def hook(x: Tensor) -> None:
            self._seen["forward"] += 1
            self._tag_empty = False
            mask = self._mask_for(site, x)
            obs = Observation(
                site, x, mask, self._cache, self._group, fast=fast, energy_cache=self._energies
            )
            with torch.no_grad():
                for reader in readers:
                    reader.update(obs)
            if track_grad and x.requires_grad and torch.is_grad_enabled():
                pending = self._pending[site]
                pending.append((mask, self._group))
                del pending[:-_MAX_PENDING]

        return hook

    def _backward_hook(self, site: Site, readers: list[Probe]) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if not self._active:  # a backward after the block: not part of this session
                return
            self._seen["backward"] += 1
            pending = self._pending[site]
            mask, group = pending.pop() if pending else (None, self._group)
            if mask is not None and tuple(mask.shape) != tuple(grad.shape[:-1]):
                raise UsageError(
                    f"cannot pair the gradient at {site} {tuple(grad.shape)} with its forward "
                    f"mask {tuple(mask.shape)}; run one backward per forward pass."
                )
            mask = self._gradient_mask(grad, mask)
            obs = Observation(  # not fast: gradients keep float64 products
                site, grad, mask, self._cache, group, energy_cache=self._energies
            )
            for reader in readers:
                reader.update_gradient(obs)

        return hook

    def _gradient_mask(self, grad: Tensor, mask: Tensor | None) -> Tensor:
        """The forward ``mask`` without positions whose gradient is exactly zero by
        construction (the last position under the next-token loss): they carry no
        gradient. The same object for the same gradient (two names of one tensor, such as
        resid_post[l] and resid_pre[l + 1], are hooked one after the other), so the
        shared batch statistics are computed once."""
        key = (SharedBatch.key_of(grad), SharedBatch.key_of(mask))
        if self._last_mask is not None and self._last_mask[0] == key:
            return self._last_mask[2]
        nonzero = grad.detach().ne(0).any(-1)
        out = nonzero if mask is None else mask.to(nonzero.device) & nonzero
        self._last_mask = (key, (grad.detach(), mask), out)  # held: the key stays valid
        return out

    # .................................................................. results
    @property
    def activation_moments(self) -> dict[str, Moments]:
        """Canonical hook name → activation `Moments` (of the activation probe)."""
        source = self.activation.moments if self.activation else {}
        return {s.hook_name: m for s, m in source.items()}

    @property
    def gradient_moments(self) -> dict[str, Moments]:
        """Canonical hook name → `Moments` of the loss gradient."""
        if self.gradient is None:
            return {}
        return {s.hook_name: m for s, m in self.gradient.moments().items()}

    # .................................................................. tags
    def tag(self, label: str | None = None, *, step: int | None = None) -> ProbeSession:
        """Statistics from here on belong to ``label`` and/or training ``step`` (rows carry
        them in the ``tag`` and ``step`` columns), e.g. once per step of a training loop;
        coming back to an earlier tag continues its statistics. Returns the session."""
        if step is not None:
            step = check_int(step, "step", minimum=0)
        key = (None if label is None else str(label), step)
        if key != self._tag:
            if not self._untouched:
                self._saved[self._tag] = self._state()  # an untouched block makes no rows
            state = self._saved.pop(key, None)
            self._load(state)
            self._tag, self._tag_empty = key, state is None
        return self

    @property
    def _untouched(self) -> bool:  # the tag's block: no pass since it began, nothing loaded
        return self._tag_empty and not any(p.loaded for p in self.probes.values())

    def reset(self) -> ProbeSession:
        """Forget every statistic and tag (the hooks stay); returns the session."""
        self._saved.clear()
        self._load(None)
        self._tag, self._tag_empty = (None, None), True
        self._seen = {"forward": 0, "backward": 0}
        return self

    def _state(self) -> dict[str, dict[str, Tensor]]:
        return {name: p.state_dict() for name, p in self.probes.items()}

    def _load(self, state: dict[str, dict[str, Tensor]] | None) -> None:
        for name, p in self.probes.items():
            if state is None:
                p.reset()
            else:  # a tag's own passes: not a state given from outside (`Probe.loaded`)
                given = p.loaded
                p.load_state_dict(state[name])
                p.loaded = given

    def results(
        self,
        *,
        tag: str | None = None,
        step: int | None = None,
        threads: int | None = None,
        progress: bool | None = None,
    ) -> Any:
        """The long results table (`tangentlens.core.results`): one row per number, ``head``
        <NA> except for per-head attention statistics; with tags, one block of rows per
        tag (``tag=`` / ``step=`` select one). Raises `UsageError` when the session saw no
        forward pass, no backward pass where gradients were asked, or lost its hooks.

        ``threads``: torch/BLAS threads for the tests' d × d algebra (None: as they are;
        1 helps on a busy CPU, see `tangentlens.core.compute`); ``progress``: a
        bar over the sites when the tests take more than a couple of seconds (None: as
        ``run(progress=...)`` said, so ``progress=False`` there silences every bar).

        The columns do not depend on the tags: ``component``, ``ci_low`` and ``ci_high``
        always, ``tag`` and ``step`` whenever the session was tagged, so tables of
        different runs concatenate."""
        self._check_seen()
        progress = self.progress if progress is None else bool(progress)
        for p in self.probes.values():
            p.progress = progress
        live = () if self._untouched and self._saved else (self._tag,)  # empty: no rows
        tags = [k for k in (*self._saved, *live) if tag in (None, k[0]) and step in (None, k[1])]
        if not tags:
            known = ", ".join(f"tag={k[0]!r} step={k[1]!r}" for k in (*self._saved, self._tag))
            raise UsageError(
                f"no statistics with tag={tag!r} step={step!r}; this session has {known}."
            )
        # the live statistics are read in place; other tags' are loaded in turn (a copy
        # of the live ones comes back after)
        current = self._state() if self._saved else None
        rows: list[dict[str, Any]] = []
        try:
            with compute_threads(threads):
                for label, at in tags:
                    state = self._saved.get((label, at), current)
                    if state is not None:
                        self._load(state)
                    extra = {k: v for k, v in (("tag", label), ("step", at)) if v is not None}
                    rows += [{**r, **extra} for p in self.probes.values() for r in p.rows()]
        finally:
            if current is not None:
                self._load(current)
        tagged = bool(self._saved) or self._tag != (None, None)
        columns = ("component", "ci_low", "ci_high", *(("tag", "step") if tagged else ()))
        return frame(rows + self._basis_rows(), columns)

    def _check_seen(self) -> None:
        if self._hooks_lost or (self._active and _lost(self._handles)):
            raise UsageError(
                "the probe session's hooks were removed while it was open (TransformerLens "
                "model.reset_hooks(), or torch hooks cleared on an nnsight model's modules, "
                "inside `with probe(...)`); its statistics stopped there. Remove only the "
                "hooks you added (TransformerLens: model.hooks(...) contexts), then rerun."
            )
        given = any(p.loaded for p in self.probes.values())  # a state loaded or merged in
        if (self._passes < 0 or self._seen["forward"] == 0) and not given:
            raise UsageError(
                "the probe session saw no forward pass: run the model inside "
                "`with probe(model, bases) as session:` (or use tangentlens.probes.run)."
            )
        readers = [p for p in self.probes.values() if p.reads_backward]
        if (
            readers
            and not self._seen["backward"]
            and not any(p.saw_backward() or p.loaded for p in readers)
        ):
            raise UsageError(
                "the gradient probes saw no backward pass: call loss.backward() inside the "
                "`with probe(...)` block (or use tangentlens.probes.run), or drop the "
                "gradient probes."
            )

    def _basis_rows(self) -> list[dict[str, Any]]:
        """``probe="basis"`` rows (`TangentBasis.diagnostics`) for each basis a probe used."""
        used = {s for p in self.probes.values() for s in p.forward_sites + p.backward_sites}
        return [
            row("basis", site, stat, value)
            for site, basis in self.bases.items()
            if site in used
            for stat, value in basis.diagnostics().items()
        ]

    def __repr__(self) -> str:
        return f"ProbeSession(probes={self.names}, layers={self.layers}, open={self._active})"


def probe(
    model: Any,
    bases: Mapping[str | Site, TangentBasis] | None,
    probes: Sequence[str] = ("residual", "attention", "gradient"),
    layers: int | Iterable[int] | None = None,
    **options: Any,
) -> ProbeSession:
    """A context manager that turns every pass run inside it into probe statistics.

    For passes you run yourself (``model(...)``, ``run_with_hooks``, a training step):
    the session hooks each site once, reads the ``attention_mask`` of every call so
    padding is never counted, and removes exactly the hooks it added when the block
    exits, even on an exception. `run` is the same with the passes done for you.

    Args:
        model: A TransformerLens bridge or an nnsight model (`load`).
        bases: A `BasisSet` or a dict hook name → `TangentBasis`; the probes run at the
            sites that have one (attention at ``blocks.{l}.ln1.hook_out``).
        probes: Registered probe names (`tangentlens.probes.PROBES`).
        layers: Layers to probe (default: every layer).
        **options: ``sites`` (a names filter), ``seed``, ``memory`` (``"full"`` or
            ``"compact"``) and the probes' own (``n_controls``, ``head_null``,
            ``reservoir``; see `ProbeSession`).

    Returns:
        An unopened `ProbeSession`; ``session.results()`` is the long results table.

    Raises:
        UsageError: An unknown probe or option, or layers the model lacks;
            ``results()`` raises it when no pass (or, for gradient probes, no backward
            pass) ran inside the block.

    Example:
        With ``model`` a TransformerLens bridge from `load`, ``texts`` a list of
        strings and ``bases`` from `fit_bases`:

        >>> with tangentlens.probe(model, bases, probes=("residual", "gradient")) as session:
        ...     loss = model(model.to_tokens(texts[0]), return_type="loss")
        ...     loss.backward()
        >>> sorted(session.results()["probe"].unique())
        ['basis', 'gradient', 'residual']
    """
    return ProbeSession(model, bases, probes, layers, **options)


def _model_name(model: Any) -> str:
    """The wrapped Hugging Face class (and its name or path), for messages."""
    inner = unwrap(model, strict=False)
    path = getattr(getattr(inner, "config", None), "name_or_path", "")
    return f"{type(inner).__name__} ({path})" if path else type(inner).__name__


def _lost(handles: Sequence[Handle]) -> bool:
    """Whether something else removed one of these hooks (TransformerLens reset_hooks)."""
    return any(getattr(h, "alive", True) is False for h in handles)
