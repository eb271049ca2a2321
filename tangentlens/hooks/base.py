"""The backend protocol: the only place where probes touch a model.

A backend wraps one model of one library (TransformerLens, nnsight) and offers
hooks on `Site`s. Every ``add_*`` method returns a `Handle` whose ``remove()``
removes exactly that hook and nothing else; probes remove them in ``finally``.

Backends register themselves (`register_backend`) when their module is imported;
``tangentlens.hooks`` imports every built-in one, so this module names none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..core.decompose import AttentionParams
from .sites import Site

__all__ = [
    "Backend",
    "Handle",
    "InputFn",
    "ModuleHandle",
    "TensorFn",
    "backend_names",
    "get_backend",
    "register_backend",
]

TensorFn = Callable[[Tensor], Tensor | None]
"""A hook body: gets the activation (forward) or its gradient (backward); returns
``None`` to observe, or a tensor to replace the activation (forward only)."""

InputFn = Callable[[Tensor | None, Tensor | None], None]
"""What `Backend.watch_inputs` calls: ``fn(attention_mask, input_ids)``, each None when the
pass was called without it."""


@runtime_checkable
class Handle(Protocol):
    def remove(self) -> None: ...


class ModuleHandle:
    """Removes one torch module hook and every tensor hook registered through it that a
    backward could still run, and nothing else."""

    def __init__(self, module_handle: Any) -> None:
        self._module_handle: Any = module_handle
        self._tensor_hooks: list[RemovableHandle] = []

    def add_tensor_hook(self, tensor: Tensor, fn: Callable[[Tensor], None]) -> None:
        # Forget hooks whose hook dict is freed, so a long session holds O(sites × graphs
        # alive) handles. The dict outlives its tensor while a kept graph holds it (a loss
        # backpropagated after the session): its hook must stay removable, not the tensor.
        self._tensor_hooks = [h for h in self._tensor_hooks if h.hooks_dict_ref() is not None]
        self._tensor_hooks.append(tensor.register_hook(fn))

    @property
    def alive(self) -> bool:
        """False once the module hook is gone, also when something else removed it (a
        user's ``module._forward_hooks.clear()``): the session reports that instead of
        dropping the passes its hooks miss without a word."""
        return _registered(self._module_handle)

    def remove(self) -> None:
        for handle in self._tensor_hooks:
            handle.remove()
        self._tensor_hooks.clear()
        if self._module_handle is not None:
            self._module_handle.remove()
            self._module_handle = None


def _registered(handle: Any) -> bool:
    """Whether a torch ``RemovableHandle``'s hook is still in its module's hook dict."""
    if handle is None:
        return False
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks


@runtime_checkable
class Backend(Protocol):
    """Hooks on sites of one model. Implemented by `TransformerLensBackend` and the
    nnsight backend (`tangentlens.hooks.nnsight`)."""

    model: Any

    @property
    def n_layers(self) -> int: ...

    @property
    def d_model(self) -> int: ...

    @property
    def causal(self) -> bool:
        """True for decoder LMs (next-token loss applies), False for encoders."""
        ...

    def sites(self) -> list[Site]:
        """Every site this model has (a parallel-residual block has no resid_mid)."""
        ...

    def add_forward_hook(self, site: Site, fn: TensorFn) -> Handle: ...

    def mid_on_branch(self, layer: int) -> bool:
        """Whether ``layer``'s resid_mid hook reads the MLP branch's input only (a pre-norm
        block's second norm or its MLP takes it, and the skip path carries the stream
        past it): a forward edit there reaches resid_post only through the MLP."""
        ...

    def add_backward_hook(self, site: Site, fn: TensorFn) -> Handle:
        """``fn`` gets the gradient of the loss with respect to the site's activation."""
        ...

    def watch_inputs(self, fn: InputFn) -> Handle:
        """Call ``fn(attention_mask or None, input_ids or None)`` at the start of every
        forward pass: the ids too, so they are checked before an embedding indexes them."""
        ...

    def require_input_grad(
        self, fn: Callable[[Tensor], None] | None = None, *, force: bool = False
    ) -> Handle:
        """In grad mode, replace the embedding output by a leaf that requires grad when it
        does not (frozen models), so backward hooks fire; ``force``: always (to take
        gradients with respect to it). ``fn`` (optional) receives that leaf."""
        ...

    def attention_params(self, layer: int) -> AttentionParams:
        """`AttentionParams` of ``layer``: what the score decomposition needs."""
        ...

    def input_linears(self, site: Site) -> list[tuple[str, nn.Module]]:
        """``(name, module)`` of the torch linear maps the forward pass calls on ``site``'s
        activation (an ``attn_in`` or ``mlp_in`` site): the q/k/v projections, or the
        MLP's input maps. Their weight gradients are ``Xᵀ·∂L/∂(output)``."""
        ...

    def output_weight(self, layer: int) -> Tensor:
        """W_O of ``layer`` ``(n_heads, d_head, d_model)``, detached: head h writes
        z_h @ W_O[h] (the output projection's bias belongs to no head)."""
        ...

    def add_z_hook(self, layer: int, fn: Callable[[Tensor], None]) -> Handle:
        """``fn(z)`` with z ``(batch, pos, n_heads, d_head)``, the heads' outputs entering
        ``layer``'s attention output projection (TransformerLens ``hook_z``); observe only."""
        ...


_REGISTRY: dict[str, tuple[Callable[[Any], bool], Callable[[Any], Backend]]] = {}


def register_backend(
    name: str, matches: Callable[[Any], bool], factory: Callable[[Any], Backend]
) -> None:
    """Make `get_backend` wrap every model for which ``matches(model)`` holds with
    ``factory(model)``; backends are tried in registration order."""
    _REGISTRY[name] = (matches, factory)


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_backend(model: Any) -> Backend:
    """The backend for ``model`` (TransformerLens `HookedRootModule` / `TransformerBridge`,
    or an nnsight model). A `Backend` passes through unchanged."""
    for matches, factory in _REGISTRY.values():
        if matches(model):
            return factory(model)
    if isinstance(model, Backend):
        return model
    raise TypeError(
        f"no tangentlens backend for {type(model).__name__}: pass a TransformerLens model "
        "(TransformerBridge, HookedTransformer) or an nnsight model (NNsight, "
        "LanguageModel); wrap a plain Hugging Face model with nnsight.NNsight(model)."
    )


def embedding_leaf(
    fn: Callable[[Tensor], None] | None, force: bool
) -> Callable[[Tensor], Tensor | None]:
    """A forward hook for the embedding output: replace it by a leaf that requires grad
    when grad mode is on and it does not already (``force``: always), so backward hooks
    fire on frozen models and gradients can be taken with respect to it."""

    def make_leaf(x: Tensor) -> Tensor | None:
        if not torch.is_grad_enabled() or (x.requires_grad and not force):
            return None
        leaf = x.detach().requires_grad_(True)
        if fn is not None:
            fn(leaf)
        return leaf

    return make_leaf
