"""Fit tangent bases per site, then probe a model around whatever the user runs.

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

import json
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..hooks.base import Backend, Handle, get_backend
from ..hooks.sites import (
    RESIDUAL_KINDS,
    WRITE_KINDS,
    NamesFilter,
    Site,
    missing_site_error,
    select_sites,
)
from ..stats import Moments
from ..subspace import TangentBasis
from .activation import ActivationProbe
from .gradient import GradientProbe
from .residual import ResidualProbe, _row, write_basis_site

__all__ = ["PROBES", "BasisSet", "ProbeSession", "fit_bases", "probe", "run"]

PROBES = ("residual", "attention", "gradient", "activation")
COLUMNS = ["probe", "site", "layer", "head", "statistic", "value"]
_MAX_PENDING = 64  # forward masks kept per site while waiting for their backward pass


# ------------------------------------------------------------------ BasisSet
class BasisSet(Mapping[str, TangentBasis]):
    """Site → `TangentBasis`, keyed by canonical hook name (``blocks.3.hook_resid_pre``).

    Lookups accept a `Site` or any hook name `Site.parse` knows. ``moments`` holds the
    activation `Moments` the bases were fitted on (when built by `fit_bases`; not saved).
    ``save``/``load`` use one safetensors file with the provenance as JSON in its header.
    """

    def __init__(
        self,
        bases: Mapping[str | Site, TangentBasis],
        provenance: dict[str, Any] | None = None,
        moments: Mapping[str | Site, Moments] | None = None,
    ) -> None:
        by_site: dict[Site, TangentBasis] = {}
        for key, basis in bases.items():
            if not isinstance(basis, TangentBasis):
                raise TypeError(
                    f"bases[{key!r}] must be a TangentBasis; got {type(basis).__name__}."
                )
            by_site[Site.parse(key).without_head()] = basis
        self._bases = dict(sorted(by_site.items(), key=lambda kv: _site_order(kv[0])))
        self.provenance = dict(provenance or {})
        self.moments = {Site.parse(k).hook_name: m for k, m in (moments or {}).items()}

    def __getitem__(self, key: str | Site) -> TangentBasis:
        site = Site.parse(key).without_head()
        if site not in self._bases:
            raise KeyError(f"no basis for {site}; this set has {list(self)}.")
        return self._bases[site]

    def __contains__(self, key: object) -> bool:
        try:
            return Site.parse(key).without_head() in self._bases  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return False

    def __iter__(self) -> Iterator[str]:
        return (s.hook_name for s in self._bases)

    def __len__(self) -> int:
        return len(self._bases)

    def sites(self) -> list[Site]:
        return list(self._bases)

    def by_site(self) -> dict[Site, TangentBasis]:
        return dict(self._bases)

    def save(self, path: str | Path) -> Path:
        """Write all bases to one ``.safetensors`` file (atomic)."""
        from ..io import save_tensors

        tensors = {
            f"{site.hook_name}/{name}": t
            for site, basis in self._bases.items()
            for name, t in basis.tensors().items()
        }
        meta = {
            "provenance": self.provenance,
            "bases": {s.hook_name: b.to_dict() for s, b in self._bases.items()},
        }
        return save_tensors(path, tensors, {"tangentlens_basis_set": json.dumps(meta)})

    @classmethod
    def load(cls, path: str | Path) -> BasisSet:
        from ..io import load_tensors

        tensors, header = load_tensors(path)
        if "tangentlens_basis_set" not in header:
            raise ValueError(f"{path} is not a saved BasisSet (no tangentlens_basis_set header).")
        meta = json.loads(header["tangentlens_basis_set"])
        bases = {}
        for name, info in meta["bases"].items():
            own = {k.split("/", 1)[1]: t for k, t in tensors.items() if k.startswith(name + "/")}
            bases[name] = TangentBasis.from_tensors(own, info)
        return cls(bases, provenance=meta.get("provenance"))

    def __repr__(self) -> str:
        return f"BasisSet({len(self)} sites: {', '.join(self)})"


def _site_order(site: Site) -> tuple[int, int]:
    from ..hooks.sites import KINDS

    return site.layer, KINDS.index(site.kind)


def _as_bases(bases: Mapping[str | Site, TangentBasis] | None) -> dict[Site, TangentBasis]:
    if bases is None:
        return {}
    if isinstance(bases, BasisSet):
        return bases.by_site()
    if not isinstance(bases, Mapping):
        raise TypeError(
            f"bases must be a BasisSet or a dict hook name -> TangentBasis; "
            f"got {type(bases).__name__}. Build one with fit_bases(model, batches, rank=k)."
        )
    return BasisSet(bases).by_site()


def _as_layers(layers: int | Iterable[int] | None, n_layers: int) -> list[int]:
    if layers is None:
        return list(range(n_layers))
    chosen = [layers] if isinstance(layers, int) else list(layers)
    bad = [layer for layer in chosen if not isinstance(layer, int) or not 0 <= layer < n_layers]
    if bad:
        raise ValueError(
            f"layers {bad} do not exist: this model has layers 0..{n_layers - 1}; "
            "pass layers=None for all."
        )
    return sorted(set(chosen))


# ------------------------------------------------------------------ session
class ProbeSession:
    """Hooks that turn every forward (and backward) pass into probe statistics.

    Use as a context manager (`probe`); read `results` afterwards (or inside).
    """

    def __init__(
        self,
        model: Any,
        bases: Mapping[str | Site, TangentBasis] | None = None,
        probes: Sequence[str] = ("residual", "attention", "gradient"),
        layers: int | Iterable[int] | None = None,
        *,
        sites: NamesFilter = None,
        n_controls: int = 1000,
        seed: int = 0,
        controls: str = "normal",
        reservoir: int = 0,
    ) -> None:
        self.backend: Backend = get_backend(model)
        self.model = model
        probes = (probes,) if isinstance(probes, str) else tuple(probes)
        unknown = [p for p in probes if p not in PROBES]
        if unknown or not probes:
            raise ValueError(f"probes must be a non-empty subset of {PROBES}; got {probes!r}.")
        self.probes = probes
        self.layers = _as_layers(layers, self.backend.n_layers)
        self._plan(_as_bases(bases), sites, n_controls, seed, controls, reservoir)
        self._handles: list[Handle] = []
        self._mask: Tensor | None = None
        self._pending: dict[Site, list[Tensor | None]] = {}
        self._leaves: list[Tensor] | None = None  # set by `run` to take gradients itself
        self._active = False

    # .................................................................. planning
    def _plan(
        self,
        bases: dict[Site, TangentBasis],
        names_filter: NamesFilter,
        n_controls: int,
        seed: int,
        controls: str,
        reservoir: int,
    ) -> None:
        available = self.backend.sites()
        d = self.backend.d_model
        for site, basis in bases.items():
            if site not in available:
                raise missing_site_error(site, available, self.backend.n_layers)
            if basis.d != d:
                raise ValueError(
                    f"the basis for {site} has d={basis.d} but the model has d_model={d}; "
                    "fit the bases on this model (fit_bases(model, batches, rank=k))."
                )
        in_scope = set(select_sites(available, names_filter))
        in_scope = {s for s in in_scope if s.layer in self.layers or s.kind == "embed"}
        scoped = {s: b for s, b in bases.items() if s in in_scope}

        self.residual: ResidualProbe | None = None
        self.gradient: GradientProbe | None = None
        self.activation: ActivationProbe | None = None
        self._attention: dict[Site, Any] = {}
        if "residual" in self.probes:
            measured = {s: b for s, b in scoped.items() if s.kind in RESIDUAL_KINDS}
            for layer in self.layers:
                for kind in WRITE_KINDS:
                    write = Site(layer, kind)
                    target = write_basis_site(write, bases, self.backend.n_layers)
                    if write in available and write in in_scope and target is not None:
                        measured[write] = bases[target]
            self.residual = ResidualProbe(measured) if measured else None
            self._warn_if_empty("residual", measured, "resid_pre/resid_mid/resid_post")
        if "gradient" in self.probes:
            graded = {s: b for s, b in scoped.items() if s.kind in RESIDUAL_KINDS}
            self.gradient = GradientProbe(graded, n_controls, seed, controls) if graded else None
            self._warn_if_empty("gradient", graded, "resid_pre/resid_mid/resid_post")
        if "attention" in self.probes:
            from .attention import AttentionAccumulator

            for site, basis in scoped.items():
                if site.kind == "attn_in":
                    params = self.backend.attention_params(site.layer)
                    self._attention[site] = (basis, params, AttentionAccumulator())
            self._warn_if_empty("attention", self._attention, "attn_in (blocks.{l}.ln1.hook_out)")
        act_sites = set(self.gradient.sites if self.gradient else [])
        if "activation" in self.probes:
            act_sites |= set(scoped) if bases else in_scope
        if act_sites or "activation" in self.probes:
            self.activation = ActivationProbe(
                sorted(act_sites, key=_site_order), reservoir=reservoir, seed=seed
            )
        if not any((self.residual, self.gradient, self._attention, act_sites)):
            raise ValueError(
                f"nothing to probe: no basis in {sorted(s.hook_name for s in bases) or 'bases'} "
                f"matches probes={self.probes} at layers {self.layers}. Fit bases at those "
                "sites: fit_bases(model, batches, rank=k, sites=...)."
            )

    def _warn_if_empty(self, name: str, sites: Mapping, needed: str) -> None:
        if not sites:
            warnings.warn(
                f"the {name} probe has no site to run on: it needs bases at {needed} "
                f"for layers {self.layers}; it is skipped.",
                stacklevel=4,
            )

    # .................................................................. hooks
    def __enter__(self) -> ProbeSession:
        if self._active:
            raise RuntimeError("this session is already open; create a new one with probe().")
        try:
            self._attach()
        except BaseException:
            self._detach()
            raise
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._detach()

    def _attach(self) -> None:
        be = self.backend
        self._handles.append(be.watch_inputs(self._on_inputs))
        forward: dict[Site, list[Callable[[Site, Tensor, Tensor | None], None]]] = {}
        for probe_ in (self.residual, self.activation):
            for site in probe_.sites if probe_ else []:
                forward.setdefault(site, []).append(probe_.update)
        for site in self._attention:
            forward.setdefault(site, []).append(self._update_attention)
        grad_sites = self.gradient.sites if self.gradient else []
        for site in grad_sites:
            forward.setdefault(site, [])
            self._pending[site] = []
        for site, consumers in sorted(forward.items(), key=lambda kv: _site_order(kv[0])):
            self._handles.append(
                be.add_forward_hook(site, self._forward_hook(site, consumers, site in grad_sites))
            )
        for site in grad_sites:
            self._handles.append(be.add_backward_hook(site, self._backward_hook(site)))
        if grad_sites:
            leaves = self._leaves
            self._handles.append(
                be.require_input_grad(
                    leaves.append if leaves is not None else None, force=leaves is not None
                )
            )

    def _detach(self) -> None:
        handles, self._handles = self._handles, []
        self._active = False
        errors = []
        for handle in reversed(handles):
            try:
                handle.remove()
            except Exception as err:  # keep removing the others
                errors.append(err)
        if errors:
            raise errors[0]

    def _on_inputs(self, mask: Tensor | None) -> None:
        # bool once per pass, so every site sees the same mask tensor (see SharedBatch)
        self._mask = None if mask is None else mask.bool()

    def _mask_for(self, site: Site, x: Tensor) -> Tensor | None:
        mask = self._mask
        if mask is None:
            return None
        if tuple(mask.shape) != tuple(x.shape[:-1]):
            raise ValueError(
                f"the attention_mask has shape {tuple(mask.shape)} but the activation at "
                f"{site} is {tuple(x.shape)}; pass a (batch, pos) mask matching the tokens "
                "(incremental decoding with a KV cache is not supported: probe whole sequences)."
            )
        return mask.to(x.device).bool()

    def _forward_hook(
        self, site: Site, consumers: list[Callable], track_grad: bool
    ) -> Callable[[Tensor], None]:
        def hook(x: Tensor) -> None:
            mask = self._mask_for(site, x)
            with torch.no_grad():
                for consume in consumers:
                    consume(site, x, mask)
            if track_grad and x.requires_grad and torch.is_grad_enabled():
                pending = self._pending[site]
                pending.append(mask)
                del pending[:-_MAX_PENDING]

        return hook

    def _backward_hook(self, site: Site) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            pending = self._pending[site]
            mask = pending.pop() if pending else None
            if mask is not None and tuple(mask.shape) != tuple(grad.shape[:-1]):
                raise ValueError(
                    f"cannot pair the gradient at {site} {tuple(grad.shape)} with its forward "
                    f"mask {tuple(mask.shape)}; run one backward per forward pass."
                )
            self.gradient.update(site, grad, mask)

        return hook

    def _update_attention(self, site: Site, x: Tensor, mask: Tensor | None) -> None:
        from .attention import decompose_scores

        basis, params, acc = self._attention[site]
        acc.update(decompose_scores(x, basis, params), attention_mask=mask, causal=params.causal)

    # .................................................................. results
    @property
    def activation_moments(self) -> dict[str, Moments]:
        """Canonical hook name → activation `Moments` (sites of the gradient and
        activation probes)."""
        if self.activation is None:
            return {}
        return {s.hook_name: m for s, m in self.activation.moments.items()}

    @property
    def gradient_moments(self) -> dict[str, Moments]:
        """Canonical hook name → `Moments` of the loss gradient."""
        if self.gradient is None:
            return {}
        return {s.hook_name: m for s, m in self.gradient.moments.items()}

    def results(self) -> Any:
        """Long `pandas.DataFrame`: ``probe, site, layer, head, statistic, value``
        (``head`` is <NA> except for per-head attention statistics)."""
        import pandas as pd

        rows: list[dict] = []
        if self.residual is not None:
            rows += self.residual.rows()
        if self.gradient is not None:
            acts = self.activation.moments if self.activation else None
            rows += self.gradient.rows(acts)
        for site, (_, _, acc) in self._attention.items():
            if acc.entries == 0:
                continue
            for stat, per_head in acc.results().items():
                rows += [
                    _row("attention", Site(site.layer, site.kind, h), stat, float(v))
                    for h, v in enumerate(per_head.tolist())
                ]
        if self.activation is not None and "activation" in self.probes:
            rows += self.activation.rows()
        frame = pd.DataFrame(rows, columns=COLUMNS)
        frame["head"] = frame["head"].astype("Int64")
        frame["layer"] = frame["layer"].astype("int64")
        return frame

    def __repr__(self) -> str:
        return f"ProbeSession(probes={self.probes}, layers={self.layers}, open={self._active})"


def probe(
    model: Any,
    bases: Mapping[str | Site, TangentBasis] | None,
    probes: Sequence[str] = ("residual", "attention", "gradient"),
    layers: int | Iterable[int] | None = None,
    **options: Any,
) -> ProbeSession:
    """A context manager that probes every pass run inside it; see `ProbeSession`.

    ``bases``: a `BasisSet` or a dict hook name → `TangentBasis`; the probes run at the
    sites that have a basis (``blocks.{l}.hook_resid_pre`` …; attention at
    ``blocks.{l}.ln1.hook_out``). Options: ``sites`` (names filter), ``n_controls``,
    ``seed`` and ``controls`` ("normal" or "uniform") for the gradient tests, ``reservoir``
    (activation sample size per site).
    """
    return ProbeSession(model, bases, probes, layers, **options)


# ------------------------------------------------------------------ driver
def _unpack(batch: Any) -> tuple[Tensor, Tensor | None]:
    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise ValueError(f"a dict batch needs 'input_ids'; got keys {sorted(batch)}.")
        ids, mask = batch["input_ids"], batch.get("attention_mask")
    else:
        ids, mask = batch, None
    ids = torch.as_tensor(ids)
    if ids.ndim != 2 or ids.dtype.is_floating_point:
        raise ValueError(
            f"a batch must be (batch, pos) integer token ids or a dict with input_ids and "
            f"attention_mask; got {tuple(ids.shape)} {ids.dtype}. Use ids[None] for one row."
        )
    if mask is not None:
        mask = torch.as_tensor(mask)
        if mask.shape != ids.shape:
            raise ValueError(
                f"attention_mask {tuple(mask.shape)} must match input_ids {tuple(ids.shape)}."
            )
    return ids, mask


def _device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError, TypeError):
        return torch.device("cpu")


def _forward(model: Any, ids: Tensor, mask: Tensor | None) -> Tensor:
    return model(ids) if mask is None else model(ids, attention_mask=mask)


def lm_loss(model: Any, batch: Any) -> Tensor:
    """Summed next-token cross-entropy over real (unpadded) token pairs.

    Summed, not averaged, so each token's gradient does not depend on the batch size.
    """
    ids, mask = _unpack(batch)
    ids = ids.to(_device(model))
    out = _forward(model, ids, None if mask is None else mask.to(ids.device))
    logits = getattr(out, "logits", out)  # Hugging Face models return a ModelOutput
    if not isinstance(logits, Tensor) or logits.ndim != 3:
        raise ValueError(
            "the model did not return (batch, pos, vocab) logits; pass loss=callable(model, "
            "batch) -> scalar."
        )
    logp = logits[:, :-1].float().log_softmax(-1)
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
    if mask is not None:
        m = mask.to(ids.device).bool()
        nll = nll * (m[:, 1:] & m[:, :-1])
    return nll.sum()


def run(
    model: Any,
    batches: Iterable[Any],
    bases: Mapping[str | Site, TangentBasis] | None,
    probes: Sequence[str] = ("residual", "attention", "gradient"),
    *,
    loss: Callable[[Any, Any], Tensor] | None = None,
    layers: int | Iterable[int] | None = None,
    progress: bool = True,
    **options: Any,
) -> ProbeSession:
    """Probe ``model`` over ``batches`` and return the closed session (`results()`).

    Each batch is a ``(batch, pos)`` tensor of token ids or a dict with ``input_ids``
    and ``attention_mask``. Without the gradient probe: one forward under ``no_grad``.
    With it: the loss, then gradients with respect to the embedding output only (model
    parameters' ``.grad`` are left untouched). ``loss(model, batch) -> scalar`` defaults
    to the summed next-token loss (`lm_loss`) for causal models; encoders need one.
    """
    from tqdm.auto import tqdm

    session = ProbeSession(model, bases, probes, layers, **options)
    wants_grad = session.gradient is not None
    if wants_grad and loss is None:
        if not session.backend.causal:
            raise ValueError(
                "the gradient probe on an encoder needs a loss: pass loss=callable(model, "
                "batch) -> scalar (e.g. a masked-token loss), or drop 'gradient' from probes."
            )
        loss = lm_loss
    session._leaves = [] if wants_grad else None
    total = len(batches) if hasattr(batches, "__len__") else None
    device = _device(model)
    with session:
        for batch in tqdm(batches, total=total, disable=not progress, desc="probing"):
            ids, mask = _unpack(batch)
            if not wants_grad:
                with torch.no_grad():
                    _forward(model, ids.to(device), None if mask is None else mask.to(device))
                continue
            session._leaves.clear()
            with torch.enable_grad():
                value = loss(model, batch)
                if not session._leaves:
                    raise RuntimeError("the loss did not run the model's embedding; no gradient.")
                torch.autograd.grad(value, session._leaves, allow_unused=True)
    session._leaves = None
    return session


# ------------------------------------------------------------------ fit_bases
def fit_bases(
    model: Any,
    batches: Iterable[Any],
    rank: int | None = None,
    *,
    variance: float | None = None,
    sites: NamesFilter = None,
    layers: int | Iterable[int] | None = None,
    progress: bool = True,
    provenance: dict[str, Any] | None = None,
) -> BasisSet:
    """One pass over ``batches``: activation `Moments` per site, then PCA per site.

    ``rank=k`` or ``variance=0.9`` (see `TangentBasis.fit`). ``sites`` is a names filter
    (default: ``resid_pre``, ``resid_mid``, ``resid_post`` and ``attn_in`` of every
    layer). The returned `BasisSet` keeps the Moments in ``.moments``.
    """
    import tangentlens

    if (rank is None) == (variance is None):
        raise ValueError("pass exactly one of rank= (an int) or variance= (a fraction in (0, 1]).")
    backend = get_backend(model)

    def default_sites(name: str) -> bool:
        return Site.from_hook_name(name).kind in (*RESIDUAL_KINDS, "attn_in")

    sites = default_sites if sites is None else sites
    session = run(
        model, batches, None, ("activation",), layers=layers, sites=sites, progress=progress
    )
    moments = session.activation.moments
    empty = [s.hook_name for s, m in moments.items() if m.count < 2]
    if empty:
        raise ValueError(
            f"too few tokens reached {empty} to fit a basis; pass more batches (and check "
            "the attention masks)."
        )
    info = {
        "model": str(getattr(getattr(model, "cfg", None), "model_name", type(model).__name__)),
        "d_model": backend.d_model,
        "n_layers": backend.n_layers,
        "rank": rank,
        "variance": variance,
        "n_tokens": max(m.count for m in moments.values()),
        "weight_hash": _weight_hash(model),
        "library": f"tangentlens {tangentlens.__version__}",
        **(provenance or {}),
    }
    bases = {
        s: TangentBasis.fit(m, rank, variance=variance, provenance={"site": s.hook_name, **info})
        for s, m in moments.items()
    }
    return BasisSet(bases, provenance=info, moments=moments)


def _weight_hash(model: Any) -> str | None:
    from ..io import tensor_hash

    try:
        return tensor_hash(model.state_dict())
    except (AttributeError, TypeError, RuntimeError):
        return None
