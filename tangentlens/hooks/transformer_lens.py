"""TransformerLens backend: hooks on any `HookedRootModule` (TL 3.x HookedTransformer,
TL 4.x TransformerBridge).

Hooks go through each `HookPoint.add_hook` at a private context level, and every
handle removes exactly its own hook (the torch handle and TL's bookkeeping entry),
so ``reset_hooks`` is never needed and a user's hooks are never touched.

Traps on TL 4.3 bridges this module avoids: ``hook_attn_scores`` is post-mask on HF
bridges and the post-softmax pattern on native and BERT bridges (never read here);
``hook_q``/``hook_k`` are before rotary (rotary comes from the HF module itself);
``ln1.hook_normalized`` is before the norm's affine, so the attention input is read
at ``attn.hook_in``, the exact input to W_Q/W_K (``ln1.hook_out`` on pre-norm models,
the block input on post-norm BERT); ``hook_resid_mid`` is ``ln2.hook_in``, on the MLP
branch only, so its backward misses the skip path (gradients are read at ``attn_out``
instead); ``hook.name`` is the canonical name, so hook bodies close over their `Site`
instead of reading it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from .base import TensorFn, embedding_leaf
from .sites import KINDS, Site, missing_site_error

__all__ = ["TransformerLensBackend", "hook_counts"]

# Negative levels are never used by TL's own context managers (they count up from 0).
_LEVELS = itertools.count(start=-(1 << 20), step=-1)

_CANDIDATES: dict[str, tuple[str, ...]] = {
    "embed": ("hook_embed", "embed.hook_out"),
    "resid_pre": ("blocks.{l}.hook_resid_pre",),
    "resid_mid": ("blocks.{l}.hook_resid_mid",),
    "resid_post": ("blocks.{l}.hook_resid_post",),
    # TL 4.x: the attention module's input; TL 3.x: ln1.hook_normalized when the norm
    # is folded (LayerNormPre / RMSNormPre), which is then W_Q's exact input.
    "attn_in": ("blocks.{l}.attn.hook_in", "blocks.{l}.ln1.hook_normalized"),
    "attn_out": ("blocks.{l}.hook_attn_out",),
    "mlp_out": ("blocks.{l}.hook_mlp_out",),
}


class _TLHandle:
    """Removes one hook from one HookPoint: the torch hook and TL's list entry."""

    def __init__(self, hook_point: Any, direction: str, lens_handle: Any) -> None:
        self._hook_point = hook_point
        self._direction = direction
        self._lens_handle = lens_handle

    def remove(self) -> None:
        if self._lens_handle is None:
            return
        self._lens_handle.hook.remove()
        attr = "fwd_hooks" if self._direction == "fwd" else "bwd_hooks"
        handles = getattr(self._hook_point, attr)
        setattr(self._hook_point, attr, [h for h in handles if h is not self._lens_handle])
        self._lens_handle = None


class _TorchHandle:
    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def remove(self) -> None:
        self._handle.remove()


def hook_counts(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Hooks on every module (and on a bridge's wrapped HF model): torch's forward-pre,
    forward, backward-pre and backward hooks, plus TL's fwd/bwd handle lists on
    HookPoints. Hook hygiene means this is identical before and after any probe."""
    from transformer_lens.hook_points import HookPoint

    roots = [("", model)]
    original = getattr(model, "original_model", None)
    if isinstance(original, nn.Module) and original is not model:
        roots.append(("original_model.", original))
    counts: dict[str, tuple[int, ...]] = {}
    for prefix, root in roots:
        for name, module in root.named_modules():
            row = (
                len(module._forward_pre_hooks),
                len(module._forward_hooks),
                len(module._backward_pre_hooks),
                len(module._backward_hooks),
            )
            if isinstance(module, HookPoint):
                row += (len(module.fwd_hooks), len(module.bwd_hooks))
            counts[prefix + name] = row
    return counts


class TransformerLensBackend:
    """`Backend` for a TransformerLens model; see `tangentlens.hooks.base.Backend`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.cfg = model.cfg
        self._level = next(_LEVELS)
        hook_dict = model.hook_dict
        self._points: dict[Site, Any] = {}
        for layer in range(self.n_layers):
            for kind in KINDS:
                if kind == "embed" and layer > 0:
                    continue
                for pattern in _CANDIDATES[kind]:
                    name = pattern.format(l=layer)
                    if name in hook_dict and self._usable(kind, layer, name):
                        self._points[Site(layer, kind)] = hook_dict[name]
                        break
        # Where gradients are read. On TL 4.x bridges resid_mid is ln2.hook_in, which sits on
        # the MLP branch only: its backward misses the skip path. In a pre-norm block
        # resid_mid = resid_pre + attn_out, so ∂L/∂attn_out is the full ∂L/∂resid_mid.
        self._grad_points = dict(self._points)
        for layer in range(self.n_layers):
            mid, attn_out = Site(layer, "resid_mid"), Site(layer, "attn_out")
            ln2_in = hook_dict.get(f"blocks.{layer}.ln2.hook_in")
            if (
                mid in self._points
                and attn_out in self._points
                and self._points[mid] is ln2_in
                and self._pre_norm(layer)
            ):
                self._grad_points[mid] = self._points[attn_out]

    def _usable(self, kind: str, layer: int, name: str) -> bool:
        if kind != "attn_in" or name.endswith("attn.hook_in"):
            return True
        # TL 3.x: hook_normalized is W_Q's input only when the norm has no affine.
        return type(self.model.blocks[layer].ln1).__name__.endswith("Pre")

    def _pre_norm(self, layer: int) -> bool:
        """ln1 is applied before attention (not inside it, as in BERT's post-norm)."""
        block = self.model.blocks[layer]
        ln1, attn = getattr(block, "ln1", None), getattr(block, "attn", None)
        if ln1 is None or attn is None:
            return False
        ln_module = getattr(ln1, "original_component", None) or ln1
        attn_module = getattr(attn, "original_component", None) or attn
        return not any(m is ln_module for m in attn_module.modules())

    # ------------------------------------------------------------------ facts
    @property
    def n_layers(self) -> int:
        return int(self.cfg.n_layers)

    @property
    def d_model(self) -> int:
        return int(self.cfg.d_model)

    @property
    def causal(self) -> bool:
        return getattr(self.cfg, "attention_dir", "causal") == "causal"

    def sites(self) -> list[Site]:
        return list(self._points)

    def hook_point(self, site: Site) -> Any:
        site = site.without_head()
        if site not in self._points:
            raise missing_site_error(site, self._points, self.n_layers)
        return self._points[site]

    # ------------------------------------------------------------------ hooks
    def add_forward_hook(self, site: Site, fn: TensorFn) -> _TLHandle:
        return self._add(site, fn, "fwd")

    def add_backward_hook(self, site: Site, fn: TensorFn) -> _TLHandle:
        """``fn`` gets the full ∂L/∂activation (for a bridge's resid_mid: read at attn_out,
        whose gradient equals it, since ln2.hook_in only sees the MLP branch)."""

        def observe(grad: Tensor) -> None:
            fn(grad)

        self.hook_point(site)  # validates the site
        return self._add(site, observe, "bwd", self._grad_points[site.without_head()])

    def _add(
        self, site: Site, fn: TensorFn, direction: str, hook_point: Any | None = None
    ) -> _TLHandle:
        hook_point = self.hook_point(site) if hook_point is None else hook_point

        def hook(tensor: Tensor, *, hook: Any) -> Tensor | None:
            return fn(tensor)

        hook.__name__ = f"tangentlens:{site}"
        lens_handle = hook_point.add_hook(hook, dir=direction, level=self._level)
        return _TLHandle(hook_point, direction, lens_handle)

    def watch_inputs(self, fn: Callable[[Tensor | None], None]) -> _TorchHandle:
        root = getattr(self.model, "original_model", None)
        root = root if isinstance(root, nn.Module) else self.model

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            mask = kwargs.get("attention_mask")
            fn(mask if isinstance(mask, Tensor) and mask.ndim == 2 else None)

        return _TorchHandle(root.register_forward_pre_hook(pre_hook, with_kwargs=True))

    def require_input_grad(
        self, fn: Callable[[Tensor], None] | None = None, *, force: bool = False
    ) -> _TLHandle:
        """Replace the embedding output by a leaf that requires grad when grad mode is on
        and it does not already (``force``: always, to take gradients w.r.t. it)."""

        return self._add(Site(0, "embed"), embedding_leaf(fn, force), "fwd")

    # -------------------------------------------------------------- attention
    def attention_params(self, layer: int) -> Any:
        """`tangentlens.probes.attention.AttentionParams` of ``layer`` (weights, scale and
        the model's own rotary, read from the bridge)."""
        from ..probes.attention import params_from_bridge

        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer must be in 0..{self.n_layers - 1}; got {layer}.")
        return params_from_bridge(self.model, layer)
