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
the block input on post-norm BERT), and the MLP input at ``mlp.hook_in``;
``hook_resid_mid`` is ``ln2.hook_in``, on the MLP branch only, so its backward misses
the skip path (gradients are read at ``attn_out`` instead); ``hook.name`` is the
canonical name, so hook bodies close over their `Site` instead of reading it. Fused
QKV weights (GPT-2, NeoX) are split into ``attn.q/k/v`` modules, which are what the
bridge calls: weight gradients are read there (`TransformerLensBackend.input_linears`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import Tensor, nn
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.model_bridge.sources.native.model import NativeAttention
from transformers import AutoConfig

from ..core.decompose import AttentionParams, NormParams
from ..core.errors import UsageError
from .base import InputFn, ModuleHandle, TensorFn, embedding_leaf, register_backend
from .families import family_of, is_causal, unwrap
from .huggingface import norm_from_module, params_from_hf
from .sites import KINDS, Site, missing_site_error

__all__ = [
    "TransformerLensBackend",
    "attention_input_hook",
    "boot_bridge",
    "is_transformer_lens",
    "norm_from_bridge",
    "params_from_bridge",
]

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
    # the MLP module's input (bridges); TL 3.x: ln2.hook_normalized of a folded norm
    "mlp_in": ("blocks.{l}.mlp.hook_in", "blocks.{l}.ln2.hook_normalized"),
    "mlp_out": ("blocks.{l}.hook_mlp_out",),
}
# The bridge components that read a site: the q/k/v projections (fused QKV weights are
# split into q/k/v modules by the bridge, and those are what it calls) and the MLP's
# input maps (``gate`` only on gated MLPs).
_INPUT_LINEARS = {"attn_in": ("attn", ("q", "k", "v")), "mlp_in": ("mlp", ("gate", "in"))}


class _TLHandle:
    """Removes one hook from one HookPoint: the torch hook and TL's list entry."""

    def __init__(self, hook_point: Any, direction: str, lens_handle: Any) -> None:
        self._hook_point = hook_point
        self._direction = direction
        self._lens_handle = lens_handle

    @property
    def alive(self) -> bool:
        """False once the hook is gone, also when something else removed it (a user's
        ``model.reset_hooks()``): the session reports that instead of going silent."""
        if self._lens_handle is None:
            return False
        attr = "fwd_hooks" if self._direction == "fwd" else "bwd_hooks"
        return any(h is self._lens_handle for h in getattr(self._hook_point, attr))

    def remove(self) -> None:
        if self._lens_handle is None:
            return
        self._lens_handle.hook.remove()
        attr = "fwd_hooks" if self._direction == "fwd" else "bwd_hooks"
        handles = getattr(self._hook_point, attr)
        setattr(self._hook_point, attr, [h for h in handles if h is not self._lens_handle])
        self._lens_handle = None


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
        # Where gradients are read. On TL 4.x bridges resid_mid is ln2.hook_in (mlp.hook_in
        # on OLMo 2, which has no ln2), on the MLP branch only: its backward misses the skip
        # path. Where attention writes the residual stream (every block but BERT's, whose
        # ln1 sits inside attention) resid_mid = resid_pre + attn_out, so ∂L/∂attn_out is
        # the full ∂L/∂resid_mid.
        self._grad_points = dict(self._points)
        self._mid_on_branch: set[int] = set()
        for layer in range(self.n_layers):
            mid, attn_out = Site(layer, "resid_mid"), Site(layer, "attn_out")
            branch = [hook_dict.get(f"blocks.{layer}.{m}.hook_in") for m in ("ln2", "mlp")]
            if (
                mid in self._points
                and any(self._points[mid] is b for b in branch if b is not None)
                and not _ln1_inside_attention(model, layer)
            ):
                self._mid_on_branch.add(layer)
                if attn_out in self._points:
                    self._grad_points[mid] = self._points[attn_out]

    def _usable(self, kind: str, layer: int, name: str) -> bool:
        if not name.endswith("hook_normalized"):
            return True
        # TL 3.x: hook_normalized is W_Q's (W_in's) input only when the norm has no affine.
        norm = self.model.blocks[layer].ln1 if kind == "attn_in" else self.model.blocks[layer].ln2
        return type(norm).__name__.endswith("Pre")

    # ------------------------------------------------------------------ facts
    @property
    def n_layers(self) -> int:
        return int(self.cfg.n_layers)

    @property
    def d_model(self) -> int:
        return int(self.cfg.d_model)

    @property
    def causal(self) -> bool:
        return is_causal(self.model)

    def sites(self) -> list[Site]:
        return list(self._points)

    def hook_point(self, site: Site) -> Any:
        site = site.without_head()
        if site not in self._points:
            raise missing_site_error(site, self._points, self.n_layers)
        return self._points[site]

    def mid_on_branch(self, layer: int) -> bool:
        """True on bridges whose resid_mid is ``ln2.hook_in`` (``mlp.hook_in`` on OLMo 2);
        False on BERT's, whose ln2 is the stream's own LayerNorm, and on TL 3.x's
        ``hook_resid_mid``, a hook on the stream."""
        self.hook_point(Site(layer, "resid_mid"))  # validates the site
        return layer in self._mid_on_branch

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

    def watch_inputs(self, fn: InputFn) -> ModuleHandle:
        root = unwrap(self.model)

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            mask = kwargs.get("attention_mask")
            ids = kwargs.get("input_ids", args[0] if args else None)
            fn(
                mask if isinstance(mask, Tensor) and mask.ndim == 2 else None,
                ids if isinstance(ids, Tensor) else None,
            )

        return ModuleHandle(root.register_forward_pre_hook(pre_hook, with_kwargs=True))

    def require_input_grad(
        self, fn: Callable[[Tensor], None] | None = None, *, force: bool = False
    ) -> _TLHandle:
        """Replace the embedding output by a leaf that requires grad when grad mode is on
        and it does not already (``force``: always, to take gradients w.r.t. it)."""

        return self._add(Site(0, "embed"), embedding_leaf(fn, force), "fwd")

    # -------------------------------------------------------------- attention
    def attention_params(self, layer: int) -> AttentionParams:
        """`AttentionParams` of ``layer`` (weights, scale and the model's own rotary, read
        from the bridge)."""
        if not 0 <= layer < self.n_layers:
            raise UsageError(f"layer must be in 0..{self.n_layers - 1}; got {layer}.")
        return params_from_bridge(self.model, layer)

    def input_linears(self, site: Site) -> list[tuple[str, nn.Module]]:
        """The torch modules a TransformerBridge calls on ``site``'s activation: the
        wrapped ``attn.q/k/v`` (GPT-2's and NeoX's fused QKV come split) or ``mlp.gate/in``.
        TL 3.x HookedTransformers multiply by parameters, with no module to hook."""
        site = site.without_head()
        self.hook_point(site)  # validates the site
        if site.kind not in _INPUT_LINEARS:
            raise UsageError(
                f"only {sorted(_INPUT_LINEARS)} sites are read by linear maps; got {site}."
            )
        component, names = _INPUT_LINEARS[site.kind]
        parent = getattr(self.model.blocks[site.layer], component)
        out = []
        for name in names:
            bridge = parent._modules.get(name)
            module = getattr(bridge, "original_component", None)
            if isinstance(module, nn.Module):
                out.append((f"blocks.{site.layer}.{component}.{name}", module))
        if not out:
            raise UsageError(
                f"{type(self.model).__name__} has no linear modules reading {site}: weight "
                "gradients need a TL 4.x TransformerBridge (boot_transformers / boot_native) "
                "or the nnsight backend (nnsight.NNsight(hf_model))."
            )
        return out

    def output_weight(self, layer: int) -> Tensor:
        """The bridge's (or HookedTransformer's) ``W_O`` ``(n_heads, d_head, d_model)``."""
        return _tl_attention(self.model, layer).W_O.detach()

    def add_z_hook(self, layer: int, fn: Callable[[Tensor], None]) -> _TLHandle:
        """``fn(z)`` at ``blocks.{layer}.attn.hook_z`` (on bridges, ``attn.o.hook_in``), as
        ``(batch, pos, n_heads, d_head)``."""
        attn = _tl_attention(self.model, layer)
        name = f"blocks.{layer}.attn.hook_z"
        if name not in self.model.hook_dict:
            raise UsageError(f"{type(self.model).__name__} has no {name}; head writes need it.")
        n_heads = int(attn.W_O.shape[0])

        def hook(z: Tensor, *, hook: Any) -> None:
            fn(z if z.ndim == 4 else z.unflatten(-1, (n_heads, -1)))

        hook.__name__ = f"tangentlens:{name}"
        point = self.model.hook_dict[name]
        return _TLHandle(point, "fwd", point.add_hook(hook, dir="fwd", level=self._level))


def _tl_attention(model: Any, layer: int) -> Any:
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(
            f"{type(model).__name__} has no .blocks: pass a TransformerLens TransformerBridge "
            "(or use params_from_hf for a plain Hugging Face model)."
        )
    if not 0 <= layer < len(blocks):
        raise UsageError(f"layer must be in [0, {len(blocks)}); got {layer}.")
    return blocks[layer].attn


def params_from_bridge(model: Any, layer: int) -> AttentionParams:
    """:class:`AttentionParams` of ``layer`` from a TransformerLens 4.x bridge.

    Weights come from the bridge's ``W_Q``/``W_K``/``b_Q``/``b_K``; the scale and the
    rotary from the wrapped module (HF ``scaling`` and the model's ``rotary_emb`` with
    its ``apply_rotary_pos_emb``; the native model's ``rotary.apply_rope`` and
    ``1/scale``).
    """
    attn = _tl_attention(model, layer)
    orig = getattr(attn, "original_component", None)
    if orig is None:
        raise UsageError(
            f"blocks.{layer}.attn wraps no module: params_from_bridge needs a TransformerLens "
            "4.x TransformerBridge (boot_transformers / boot_native)."
        )
    w_q, w_k, b_q, b_k = (
        None if t is None else t.detach() for t in (attn.W_Q, attn.W_K, attn.b_Q, attn.b_K)
    )
    if w_q.ndim != 3:
        raise UsageError(f"blocks.{layer}.attn.W_Q has shape {tuple(w_q.shape)}; expected 3-D.")
    if isinstance(orig, NativeAttention):
        if orig.attn_scores_soft_cap > 0:
            raise UsageError("attn_scores_soft_cap is set: soft-capped scores are not additive.")
        rotary = None
        if orig.rotary is not None:
            native_rotary = orig.rotary

            def rotary(q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
                return native_rotary.apply_rope(q, k, position_ids=positions)

        return AttentionParams(w_q, w_k, b_q, b_k, 1.0 / float(orig.scale), rotary, orig.causal)
    hf_params = params_from_hf(orig, rotary_emb=_bridge_rotary_emb(model))
    return replace(hf_params, W_Q=w_q, W_K=w_k, b_Q=b_q, b_K=b_k)


def _bridge_rotary_emb(model: Any) -> nn.Module | None:
    """The bridge's rotary module, else the wrapped HF model's (GPT-J's bridge has none)."""
    rot = getattr(model, "rotary_emb", None)
    if rot is None:
        original = unwrap(model)
        rot = getattr(getattr(original, "base_model", original), "rotary_emb", None)
    if rot is None:
        return None
    return getattr(rot, "original_component", None) or rot


def _ln1_inside_attention(model: Any, layer: int) -> bool:
    """BERT's post-norm: the bridge's ln1 is the LayerNorm inside the attention block."""
    block = model.blocks[layer]
    ln1 = getattr(block, "ln1", None)
    if ln1 is None:
        return False
    ln_mod = getattr(ln1, "original_component", None) or ln1
    attn_mod = getattr(block.attn, "original_component", None) or block.attn
    return any(m is ln_mod for m in attn_mod.modules())


def _is_post_norm(model: Any, layer: int) -> bool:
    """No norm before attention: BERT (ln1 inside it) and OLMo 2 (no ln1)."""
    return getattr(model.blocks[layer], "ln1", None) is None or _ln1_inside_attention(model, layer)


def attention_input_hook(model: Any, layer: int) -> str:
    """Hook name of ``layer``'s attention input, where its basis should be fitted.

    ``blocks.{l}.ln1.hook_out`` on pre-norm models; ``blocks.{l}.attn.hook_in`` (the
    residual stream) on post-norm models: BERT, whose ``ln1`` comes after attention, and
    OLMo 2, which normalises sublayer outputs only.
    """
    _tl_attention(model, layer)
    if _is_post_norm(model, layer):
        return f"blocks.{layer}.attn.hook_in"
    return f"blocks.{layer}.ln1.hook_out"


def norm_from_bridge(model: Any, layer: int) -> NormParams:
    """The ``ln1`` of a pre-norm bridge layer as :class:`NormParams`."""
    if _is_post_norm(model, layer):
        raise UsageError(
            f"layer {layer} is post-norm (ln1 follows attention): its attention input is "
            "the residual stream; use site='attn_in'."
        )
    ln1 = model.blocks[layer].ln1
    return norm_from_module(getattr(ln1, "original_component", None) or ln1)


def is_transformer_lens(model: Any) -> bool:
    """A TL 3.x `HookedRootModule` or a TL 4.x `TransformerBridge` (not a subclass of it)."""
    return (
        isinstance(model, nn.Module)
        and hasattr(model, "hook_dict")
        and hasattr(model, "run_with_hooks")
    )


def boot_bridge(name_or_path: str, **kwargs: Any) -> Any:
    """``TransformerBridge.boot_transformers(name_or_path, **kwargs)``, in eval mode.

    What the bridge cannot boot is a one-line `UsageError` naming the backend that runs
    it: nnsight on the plain Hugging Face model, with eager attention so its patterns can
    be checked. A family the registry marks as not bootable (`FamilySpec.bridge`) is
    refused before TransformerLens is asked, so the caller never sees its own error.
    """
    config = getattr(kwargs.get("hf_model"), "config", None)
    if config is None:
        config = _config(name_or_path, kwargs.get("revision"))
    family = family_of(config) if config is not None else None
    if family is not None and not family.bridge:
        raise _unbootable(name_or_path, config)
    try:
        return TransformerBridge.boot_transformers(name_or_path, **kwargs).eval()
    except ValueError as err:
        if "supported architecture" not in str(err):
            raise
        raise _unbootable(name_or_path, config) from None


def _config(name_or_path: str, revision: str | None) -> Any:
    """The HF config of a folder or hub id, or None where it cannot be read (TransformerLens
    then reports that itself)."""
    try:
        return AutoConfig.from_pretrained(name_or_path, revision=revision)
    except (OSError, ValueError):
        return None


def _unbootable(name_or_path: str, config: Any) -> UsageError:
    arch = ", ".join(getattr(config, "architectures", None) or []) or "its architecture"
    return UsageError(
        f"TransformerLens cannot boot {name_or_path} ({arch}) as a bridge; use the nnsight "
        "backend: tangentlens.models.load(name, backend='nnsight'), or nnsight.NNsight("
        "AutoModelFor...from_pretrained(name_or_path, attn_implementation='eager'))."
    )


register_backend("transformer_lens", is_transformer_lens, TransformerLensBackend)
