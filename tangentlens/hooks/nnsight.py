"""nnsight backend: the same sites as the TransformerLens backend on nnsight models.

Works on ``nnsight.NNsight(hf_model)``, ``nnsight.TransformersModel`` and the deprecated
``nnsight.LanguageModel`` wrapping Hugging Face GPT-2, GPT-J, GPT-NeoX, Llama-family
(Llama, Qwen, Mistral, OLMo, EuroBERT), Gemma 3, OLMo 2, ModernBERT and BERT-style
models. Two ways in:

* **Hooks** (:class:`NNsightBackend`, used by ``tangentlens.probe`` / ``probes.run``):
  plain torch hooks on the wrapped HF modules. They fire the same inside and outside
  an nnsight trace, need no execution order, and each handle removes exactly its own
  hooks (the module hook and every tensor hook it registered). Gradients come from
  tensor hooks registered in the forward pass, so any backward works, including one a
  user runs inside ``with loss.backward():`` in a trace.
* **Remote-ready statistics** (:func:`trace_moments` / :func:`moments_from_saved`): called
  inside ``with model.trace(...)``, reads the sites through nnsight envoys in forward
  order and ``.save()``\\ s only each site's count, mean and centred scatter (float64,
  the ``Moments`` state). A ``remote=True`` (NDIF) run therefore transmits O(d²) per
  site, never activations; merge batches on the client with ``Moments.merge``.
  Importing this module registers ``tangentlens`` with ``nnsight.register``, so
  that code ships by value (an NDIF server has no tangentlens installed).

The site of each kind in each supported block layout: `tangentlens.hooks.layouts`; which
family a model is: `tangentlens.hooks.families`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import nnsight
import torch
from torch import Tensor, nn

from ..core.decompose import AttentionParams
from ..core.errors import UsageError
from ..core.stats import Moments
from .base import InputFn, ModuleHandle, TensorFn, embedding_leaf, register_backend
from .families import hf_attention_module, is_causal, layout, unwrap
from .huggingface import first_tensor, output_weight_from_hf, params_from_hf
from .layouts import input_linears, submodule
from .sites import KINDS, Site

__all__ = ["NNsightBackend", "is_nnsight_model", "moments_from_saved", "trace_moments"]


def is_nnsight_model(model: Any) -> bool:
    """Whether ``model`` is an nnsight envoy (``NNsight``, ``TransformersModel``, ...)."""
    return type(model).__module__.split(".")[0] == "nnsight" and isinstance(
        getattr(model, "_module", None), nn.Module
    )


def _replacement(new: Any, label: str) -> Tensor | None:
    if new is None or isinstance(new, Tensor):
        return new
    raise TypeError(
        f"a forward hook at {label} returned a {type(new).__name__}; return None to observe "
        "or a tensor to replace the activation."
    )


class NNsightBackend:
    """`Backend` for an nnsight model wrapping a Hugging Face transformer.

    See `tangentlens.hooks.base.Backend` for the protocol and the module docstring for
    the site mapping. ``model`` is the nnsight envoy; ``module`` the wrapped HF model.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.module = unwrap(model)
        self.layout, self.base = layout(self.module)
        self.blocks: nn.ModuleList = submodule(self.base, self.layout.layers)  # type: ignore[assignment]
        config = self.module.config
        self._d_model = int(getattr(config, "hidden_size", None) or config.n_embd)
        self._causal = is_causal(self.module)

    # ------------------------------------------------------------------ facts
    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    @property
    def d_model(self) -> int:
        return self._d_model

    @property
    def causal(self) -> bool:
        """From the model's config and class (`is_causal`), not its block layout."""
        return self._causal

    def sites(self) -> list[Site]:
        """``embed`` then, per layer, the block sites in forward execution order."""
        block_kinds = [k for k in KINDS if k in self.layout.block]
        return [Site(0, "embed")] + [
            Site(layer, kind) for layer in range(self.n_layers) for kind in block_kinds
        ]

    def locate(self, site: Site) -> tuple[nn.Module, str]:
        """``(module, "in" | "out")``: where ``site``'s activation is read."""
        site = site.without_head()
        if site.kind == "embed":
            path, where = self.layout.embed
            return submodule(self.base, path), where
        if site.kind not in self.layout.block or not 0 <= site.layer < self.n_layers:
            extra = ""
            if site.kind == "resid_mid":
                extra = " (parallel attention and MLP: no resid_mid; use resid_pre or resid_post)"
            raise UsageError(
                f"site {site} does not exist on this {type(self.module).__name__}{extra}; it has "
                f"layers 0..{self.n_layers - 1} with {sorted(self.layout.block)} and embed."
            )
        path, where = self.layout.block[site.kind]
        return submodule(self.blocks[site.layer], path), where

    def mid_on_branch(self, layer: int) -> bool:
        """resid_mid is a module's input: a pre-norm block's second norm or MLP, on the MLP
        branch, except BERT's output LayerNorm, which is the stream (`Layout.mid_on_stream`)."""
        self.locate(Site(layer, "resid_mid"))  # validates the site
        return not self.layout.mid_on_stream

    # ------------------------------------------------------------------ hooks
    def add_forward_hook(self, site: Site, fn: TensorFn) -> ModuleHandle:
        """``fn(activation)``; a returned tensor replaces the activation."""
        return self._hook(site, fn, prepend=False)

    def add_backward_hook(self, site: Site, fn: TensorFn) -> ModuleHandle:
        """``fn(gradient)`` for the site's activation, from a tensor hook registered as the
        forward pass produces it (only when it requires grad)."""
        handle: ModuleHandle

        def observe(grad: Tensor) -> None:
            fn(grad)

        def register(x: Tensor) -> None:
            if x.requires_grad:
                handle.add_tensor_hook(x, observe)

        handle = self._hook(site, register, prepend=False)
        return handle

    def _hook(self, site: Site, fn: TensorFn, *, prepend: bool) -> ModuleHandle:
        module, where = self.locate(site)
        label = f"{type(module).__name__} ({site})"
        if where == "out":

            def forward_hook(mod: nn.Module, args: tuple, output: Any) -> Any:
                new = _replacement(fn(first_tensor(output, label)), label)
                if new is None:
                    return None
                if isinstance(output, Tensor):
                    return new
                return type(output)((new, *output[1:]))

            return ModuleHandle(module.register_forward_hook(forward_hook, prepend=prepend))

        def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> Any:
            if args:
                new = _replacement(fn(first_tensor(args, label)), label)
                return None if new is None else ((new, *args[1:]), kwargs)
            if "hidden_states" not in kwargs:
                raise TypeError(f"{label} was called without hidden_states.")
            new = _replacement(fn(kwargs["hidden_states"]), label)
            return None if new is None else (args, {**kwargs, "hidden_states": new})

        return ModuleHandle(
            module.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=prepend)
        )

    def watch_inputs(self, fn: InputFn) -> ModuleHandle:
        """``fn(attention_mask or None, input_ids or None)`` at the start of every forward
        of the HF model. The arguments are bound to the class's own ``forward`` (with
        ``self``): nnsight replaces the instance's with a wrapper whose signature still
        names ``self``, which would take the ids."""
        signature = inspect.signature(type(self.module).forward)

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            try:
                bound = signature.bind_partial(module, *args, **kwargs).arguments
            except TypeError:
                bound = kwargs
            mask, ids = bound.get("attention_mask"), bound.get("input_ids")
            fn(
                mask if isinstance(mask, Tensor) and mask.ndim == 2 else None,
                ids if isinstance(ids, Tensor) else None,
            )

        return ModuleHandle(self.module.register_forward_pre_hook(pre_hook, with_kwargs=True))

    def require_input_grad(
        self, fn: Callable[[Tensor], None] | None = None, *, force: bool = False
    ) -> ModuleHandle:
        """Replace the embed-site output by a leaf that requires grad when grad mode is on
        and it does not already (``force``: always), so backward hooks fire on frozen
        models. Runs before any other hook on that module."""

        return self._hook(Site(0, "embed"), embedding_leaf(fn, force), prepend=True)

    # -------------------------------------------------------------- attention
    def attention_params(self, layer: int) -> AttentionParams:
        """`AttentionParams` of ``layer``, from the HF attention module (its weights,
        ``scaling`` and the model's own rotary). Its input is the ``attn_in`` site."""
        if not 0 <= layer < self.n_layers:
            raise UsageError(f"layer must be in 0..{self.n_layers - 1}; got {layer}.")
        attn, rotary_emb = hf_attention_module(self.module, layer)
        params = params_from_hf(attn, rotary_emb=rotary_emb)
        return replace(params, causal=self.causal) if params.causal != self.causal else params

    def input_linears(self, site: Site) -> list[tuple[str, nn.Module]]:
        """The HF linear maps that read ``site`` (`tangentlens.hooks.layouts`): fused maps
        (GPT-2's ``c_attn``, NeoX's ``query_key_value``, ModernBERT's ``Wqkv``) count once."""
        self.locate(site)  # validates the site
        return input_linears(self.blocks, self.layout, site.layer, site.kind)

    def _out_proj(self, layer: int) -> tuple[nn.Module, int]:
        """``layer``'s attention output projection (`Layout.out_proj`) and its head count."""
        n_heads = self.attention_params(layer).n_heads  # validates the layer
        return submodule(self.blocks[layer], self.layout.out_proj), n_heads

    def output_weight(self, layer: int) -> Tensor:
        """W_O ``(n_heads, d_head, d_model)`` from the output projection's weight."""
        module, n_heads = self._out_proj(layer)
        return output_weight_from_hf(module, n_heads)

    def add_z_hook(self, layer: int, fn: Callable[[Tensor], None]) -> ModuleHandle:
        """``fn(z)``: the output projection's input, ``(batch, pos, n_heads, d_head)``."""
        module, n_heads = self._out_proj(layer)
        label = f"{type(module).__name__} (layer {layer} output projection)"

        def pre_hook(mod: nn.Module, args: tuple) -> None:
            fn(first_tensor(args, label).unflatten(-1, (n_heads, -1)))

        return ModuleHandle(module.register_forward_pre_hook(pre_hook))


register_backend("nnsight", is_nnsight_model, NNsightBackend)


# ---------------------------------------------------------------- remote-ready statistics
# nnsight serializes tangentlens code by value: an NDIF server does not have tangentlens
# installed, so :func:`trace_moments` travels with the request.
nnsight.register("tangentlens")


def _envoy_at(root: Any, path: str) -> Any:
    """The envoy of the module at ``path`` below ``root``: nnsight moves a submodule named
    like one of its own attributes (BERT's ``output``) to ``E_<name>``."""
    envoy = root
    for part in filter(None, path.split(".")):
        if inspect.isdatadescriptor(getattr(nnsight.Envoy, part, None)):
            part = f"{nnsight.Envoy.OVERLOAD_PREFIX}{part}"
        envoy = getattr(envoy, part)
    return envoy


def _base_path(model: Any, base: nn.Module) -> str:
    for name, module in unwrap(model).named_modules():
        if module is base:
            return name
    raise UsageError("the base model is not part of the wrapped module.")


def _reduce(x: Tensor, mask: Tensor | None) -> dict[str, Tensor]:
    """count, mean and centred scatter (float64) of the rows of ``x`` where ``mask``."""
    rows = x.detach().reshape(-1, x.shape[-1])
    if mask is not None:
        if tuple(mask.shape) != tuple(x.shape[:-1]):
            raise UsageError(
                f"trace_moments' mask {tuple(mask.shape)} must be the traced batch's (batch, "
                f"pos) {tuple(x.shape[:-1])}: pass that batch's attention_mask."
            )
        rows = rows[mask.reshape(-1).to(rows.device).bool()]
    rows = rows.double()
    count = torch.tensor(rows.shape[0], dtype=torch.int64)
    if rows.shape[0] == 0:
        zeros = torch.zeros(rows.shape[1], dtype=torch.float64, device=rows.device)
        return {"count": count, "mean": zeros, "scatter": torch.outer(zeros, zeros)}
    mean = rows.mean(0)
    centred = rows - mean
    return {"count": count, "mean": mean, "scatter": centred.T @ centred}


def _execution_order(backend: NNsightBackend, sites: Iterable[Site]) -> list[Site]:
    wanted = {s.without_head() for s in sites}
    ordered = [Site(0, "embed")] + [
        Site(layer, kind) for layer in range(backend.n_layers) for kind in backend.layout.order
    ]
    missing = wanted - set(ordered)
    if missing:
        backend.locate(sorted(missing)[0])  # raises with the list of valid sites
    return [s for s in ordered if s in wanted]


def trace_moments(
    model: Any, sites: Sequence[Site | str], mask: Tensor | None = None
) -> dict[str, dict[str, Tensor]]:
    """Inside ``with model.trace(...)``: each site's sufficient statistics, ``.save()``\\ d.

    Reads the sites through nnsight envoys in forward order (any order may be passed)
    and reduces each activation at once to ``count``, ``mean`` and centred ``scatter``
    (float64; equivalently count, sum and Gram). Only that dict of plain tensors, keyed
    by canonical hook name, is saved, so a ``remote=True`` run transmits O(d²) per site
    and never an activation. ``mask`` ``(batch, pos)`` (e.g. the attention mask) drops
    padding. After the block, :func:`moments_from_saved` gives `Moments` per `Site`::

        with lm.trace(batch, remote=True):
            saved = trace_moments(lm, ["blocks.3.hook_resid_post"], batch["attention_mask"])
        moments = moments_from_saved(saved)
    """
    backend = NNsightBackend(model)
    prefix = _base_path(model, backend.base)
    stats: dict[str, dict[str, Tensor]] = {}
    for site in _execution_order(backend, [Site.parse(s) for s in sites]):
        if site.kind == "embed":
            path, where = backend.layout.embed
        else:
            block, where = backend.layout.block[site.kind]
            path = ".".join(filter(None, (backend.layout.layers, str(site.layer), block)))
        envoy = _envoy_at(model, f"{prefix}.{path}" if prefix else path)
        value = envoy.input if where == "in" else envoy.output
        stats[site.hook_name] = _reduce(first_tensor(value, str(site)), mask)
    return nnsight.save(stats)


def moments_from_saved(saved: Mapping[str, Mapping[str, Tensor]]) -> dict[Site, Any]:
    """`Moments` per `Site` from what :func:`trace_moments` saved."""
    return {
        Site.from_hook_name(name): Moments().load_state_dict(dict(state))
        for name, state in saved.items()
    }
