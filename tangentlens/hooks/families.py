"""Model families: what the package knows of each Hugging Face family, in one place.

A `FamilySpec` says which ``model_type``\\ s belong to a family, where each site lives in
its blocks (its `Layout`), how to recognise its blocks when the ``model_type`` is not
listed, whether it is a decoder, whether its attention normalises q and k or attends in
local windows, and whether the TransformerLens bridge boots it. Both backends, the
loader and the study ask this registry (`family_of`, `layout`, `is_causal`), so a new
family is one `register_family` call and no other file changes.

Also here, because every question above starts with it: `unwrap`, the Hugging Face
model inside whatever wraps it (a bridge, an nnsight envoy, a loaded model), and
`hf_attention_module`, where a block keeps its attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..core.errors import UsageError
from . import layouts
from .layouts import Layout

__all__ = [
    "FamilySpec",
    "families",
    "family_of",
    "hf_attention_module",
    "is_causal",
    "layout",
    "register_family",
    "unwrap",
]


@dataclass(frozen=True)
class FamilySpec:
    """One model family.

    Attributes:
        name: the family's name (messages, `families`).
        model_types: the HF ``config.model_type`` values that are this family; a config
            alone (no weights loaded) is recognised by these.
        layout: where each site lives in a block: a `Layout`, a function of the HF config
            returning one (GPT-NeoX's residual is parallel or not by config), or None
            for a family known only by its causality (its blocks are then recognised by
            shape).
        shape: recognises the family's base model by its modules, for a ``model_type``
            that is not listed (a fine-tune's own type, a close relative): checked in
            registration order, so a narrower shape is registered before a wider one.
        causal: a decoder (True) or a bidirectional encoder (False; still causal when the
            config says ``is_decoder``).
        qk_norm: the attention normalises q and k (read as a linearisation).
        local_windows: some layers may attend within a sliding window only.
        bridge: the TransformerLens bridge boots it; False: refused before TransformerLens
            is asked, with the nnsight backend as the fix.
    """

    name: str
    model_types: tuple[str, ...]
    layout: Layout | Callable[[Any], Layout] | None
    shape: Callable[[nn.Module], bool] | None = None
    causal: bool = True
    qk_norm: bool = False
    local_windows: bool = False
    bridge: bool = True

    def block_layout(self, config: Any) -> Layout | None:
        """The family's `Layout` for a model with this HF ``config``."""
        if self.layout is None or isinstance(self.layout, Layout):
            return self.layout
        return self.layout(config)

    def fits(self, base: nn.Module) -> bool:
        """Whether ``base`` (the HF base model) has this family's layout and blocks."""
        return self.layout is not None and self.shape is not None and self.shape(base)


_REGISTRY: dict[str, FamilySpec] = {}


def register_family(spec: FamilySpec) -> FamilySpec:
    """Add ``spec`` to the registry (a spec of the same name is replaced, in its place);
    its ``model_types`` must not belong to another family."""
    taken = {t: s.name for s in _REGISTRY.values() if s.name != spec.name for t in s.model_types}
    clash = sorted(t for t in spec.model_types if t in taken)
    if clash:
        raise UsageError(
            f"model_type {clash[0]!r} already belongs to the {taken[clash[0]]!r} family; "
            "register the family under that name to replace it."
        )
    _REGISTRY[spec.name] = spec
    return spec


def families() -> tuple[FamilySpec, ...]:
    """Every registered family, in registration order."""
    return tuple(_REGISTRY.values())


def _config_of(obj: Any) -> Any:
    """The HF config of a config, a model or a wrapper (None when there is none)."""
    if hasattr(obj, "model_type") and not isinstance(obj, nn.Module):
        return obj
    try:
        return getattr(unwrap(obj), "config", None)
    except TypeError:
        return getattr(obj, "config", None)


def _base(hf: nn.Module) -> nn.Module:
    return getattr(hf, "base_model", hf)


def _by_shape(base: nn.Module) -> FamilySpec | None:
    return next((s for s in _REGISTRY.values() if s.fits(base)), None)


def family_of(model_or_config: Any) -> FamilySpec | None:
    """The family of an HF config, model or wrapper: by ``config.model_type``, else (a
    model) by the shape of its blocks; None when no family knows it."""
    config = _config_of(model_or_config)
    model_type = getattr(config, "model_type", None)
    for spec in _REGISTRY.values():
        if model_type in spec.model_types:
            return spec
    if model_or_config is config:
        return None
    try:
        return _by_shape(_base(unwrap(model_or_config)))
    except TypeError:
        return None


def layout(hf: nn.Module) -> tuple[Layout, nn.Module]:
    """The block layout of a Hugging Face model and its base model (the layer stack): its
    family's, where the family has one and the blocks fit it, else the first family whose
    shape they fit."""
    base = _base(hf)
    config = getattr(hf, "config", None)
    spec = family_of(hf)
    if spec is None or not spec.fits(base):
        spec = _by_shape(base)
    found = None if spec is None else spec.block_layout(config)
    if found is None:
        known = ", ".join(s.name for s in _REGISTRY.values() if s.layout is not None)
        raise UsageError(
            f"the nnsight backend does not know the layout of {type(hf).__name__} "
            f"(model_type {getattr(config, 'model_type', '')!r}): known families are "
            f"{known} (tangentlens.hooks.families.register_family adds one). Load it as a "
            "TransformerLens bridge instead (tangentlens.models.load(...))."
        )
    return found, base


def unwrap(model: Any, *, strict: bool = True) -> Any:
    """The Hugging Face torch module inside a wrapper: a TransformerLens bridge's
    ``original_model``, an nnsight envoy's ``_module``, the ``model`` of a loaded model
    (`LoadedModel`, a loaded checkpoint, a backend); a plain module is itself (a TL 3.x
    HookedTransformer too). Envoys are asked for ``_module`` before ``model``, since an
    envoy serves submodules named ``model`` as attributes. What wraps no module is a
    `TypeError`, or (``strict=False``, for messages and optional lookups) itself."""
    inner = model
    for _ in range(4):  # LoadedModel → envoy → module at most, with room to spare
        if isinstance(inner, nn.Module):
            original = getattr(inner, "original_model", None)
            return original if isinstance(original, nn.Module) else inner
        module = getattr(inner, "_module", None)
        inner = module if isinstance(module, nn.Module) else getattr(inner, "model", None)
        if inner is None:
            break
    if not strict:
        return model
    raise TypeError(
        f"expected a torch module, an nnsight wrapper, a TransformerLens model or a loaded "
        f"model; got {type(model).__name__}."
    )


def is_causal(model_or_config: Any) -> bool:
    """Whether a model masks attention causally; the one answer to that question.

    From an HF config, model or any wrapper (`unwrap`): ``config.is_decoder`` (causal),
    ``use_bidirectional_attention`` (not), an encoder family (not) or a ``...ForMaskedLM``
    class (not), else the attention module's own ``is_causal``; causal when nothing says
    otherwise. Never from the block layout alone (a bidirectional EuroBERT looks like
    Llama). A TransformerLens model with no HF model inside (a native bridge, a TL 3.x
    HookedTransformer) answers from its ``cfg.attention_dir``."""
    config = _config_of(model_or_config)
    if config is None:
        tl_cfg = getattr(model_or_config, "cfg", None)
        return getattr(tl_cfg, "attention_dir", "causal") == "causal"
    if getattr(config, "is_decoder", False):
        return True
    if getattr(config, "use_bidirectional_attention", False):
        return False
    spec = family_of(model_or_config)
    if spec is not None and not spec.causal:
        return False
    hf = None if model_or_config is config else unwrap(model_or_config)
    names = [*([type(hf).__name__] if hf is not None else []), *_architectures(config)]
    if any(n.endswith("ForMaskedLM") for n in names):
        return False
    if hf is None:
        return True
    try:
        attn, _ = hf_attention_module(hf, 0)
    except UsageError:
        return True
    flag = getattr(attn, "is_causal", getattr(getattr(attn, "self", None), "is_causal", True))
    return bool(flag)


def _architectures(config: Any) -> list[str]:
    return list(getattr(config, "architectures", None) or [])


def hf_attention_module(model: Any, layer: int) -> tuple[nn.Module, nn.Module | None]:
    """``(attention_module, rotary_emb)`` of ``layer`` in a Hugging Face model.

    The module's first input (``hidden_states``) is the exact input to its q/k
    projections: capture it there for :func:`decompose_scores`. ``rotary_emb`` is the
    model-level rotary module or None. Accepts an nnsight wrapper too.
    """
    hf = unwrap(model)
    base = _base(hf)
    layers = None
    for path in ("h", "layers", "encoder.layer", "decoder.layers"):
        obj: Any = base
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList):
            layers = obj
            break
    if layers is None:
        raise UsageError(f"cannot find the layer list of {type(hf).__name__}.")
    if not 0 <= layer < len(layers):
        raise UsageError(f"layer must be in [0, {len(layers)}); got {layer}.")
    block = layers[layer]
    for attr in ("attn", "self_attn", "attention"):
        attn = getattr(block, attr, None)
        if isinstance(attn, nn.Module):
            return attn, getattr(base, "rotary_emb", None)
    raise UsageError(f"cannot find the attention module of {type(block).__name__}.")


# ------------------------------------------------------------------ block shapes
def _has(module: Any, *names: str) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Module) for n in names)


def _first(base: nn.Module, path: str) -> nn.Module | None:
    """The first block of the ModuleList at ``path`` (None: no such non-empty list)."""
    blocks = getattr(base, path, None)
    return blocks[0] if isinstance(blocks, nn.ModuleList) and len(blocks) else None


def _gpt2_h(base: nn.Module, ln_2: bool) -> bool:
    block = _first(base, "h")
    return hasattr(base, "wte") and block is not None and _has(block, "ln_2") == ln_2


def _decoder_norms(pre: bool, pre_ff: bool, post_ff: bool) -> Callable[[nn.Module], bool]:
    """A ``layers`` stack with ``embed_tokens``, whose blocks have exactly these norms
    (``input_layernorm``, ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``)."""

    def shape(base: nn.Module) -> bool:
        block = _first(base, "layers")
        if block is None or not hasattr(base, "embed_tokens"):
            return False
        if not _has(block, "self_attn", "mlp", "post_attention_layernorm"):
            return False
        norms = ("input_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
        return tuple(_has(block, n) for n in norms) == (pre, pre_ff, post_ff)

    return shape


def _bert_shape(base: nn.Module) -> bool:
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    return hasattr(base, "embeddings") and isinstance(layers, nn.ModuleList)


def _modernbert_shape(base: nn.Module) -> bool:
    block = _first(base, "layers")
    return (
        block is not None
        and hasattr(base, "embeddings")
        and _has(block, "attn_norm", "attn", "mlp_norm", "mlp")
    )


_LLAMA_SHAPE = _decoder_norms(pre=True, pre_ff=False, post_ff=False)

# ------------------------------------------------------------------ the built-in families
# Shapes are tried in this order: GPT-2's before GPT-J's (both keep blocks in ``h``), and
# the decoders told apart by their norms before the encoders.
for _spec in (
    FamilySpec("GPT-2", ("gpt2",), layouts.GPT2, lambda b: _gpt2_h(b, ln_2=True)),
    FamilySpec("GPT-J", ("gptj",), layouts.GPTJ, lambda b: _gpt2_h(b, ln_2=False)),
    FamilySpec(
        "GPT-NeoX",
        ("gpt_neox",),
        lambda config: layouts.neox(bool(getattr(config, "use_parallel_residual", True))),
        lambda b: hasattr(b, "embed_in"),
    ),
    FamilySpec("Llama", ("llama", "olmo"), layouts.LLAMA, _LLAMA_SHAPE),
    FamilySpec("Mistral", ("mistral", "qwen2"), layouts.LLAMA, _LLAMA_SHAPE, local_windows=True),
    FamilySpec("Qwen3", ("qwen3",), layouts.LLAMA, _LLAMA_SHAPE, qk_norm=True, local_windows=True),
    FamilySpec(
        "Gemma 3",
        ("gemma3_text",),
        layouts.GEMMA3,
        _decoder_norms(pre=True, pre_ff=True, post_ff=True),
        qk_norm=True,
        local_windows=True,
    ),
    FamilySpec(
        "OLMo 2",
        ("olmo2",),
        layouts.OLMO2,
        _decoder_norms(pre=False, pre_ff=False, post_ff=True),
        qk_norm=True,
    ),
    FamilySpec("EuroBERT", ("eurobert",), layouts.LLAMA, _LLAMA_SHAPE, causal=False, bridge=False),
    FamilySpec(
        "ModernBERT",
        ("modernbert",),
        layouts.MODERNBERT,
        _modernbert_shape,
        causal=False,
        local_windows=True,
        bridge=False,
    ),
    FamilySpec(
        "BERT",
        ("bert", "roberta", "camembert", "xlm-roberta", "xlm-roberta-xl"),
        layouts.BERT,
        _bert_shape,
        causal=False,
    ),
    # Encoders known by their bidirectional attention only; their blocks take the layout
    # of whichever shape they fit (DeBERTa, ELECTRA and MPNet keep BERT's encoder.layer).
    FamilySpec(
        "other encoders",
        ("albert", "deberta", "deberta-v2", "distilbert", "electra", "mpnet", "nomic_bert"),
        None,
        causal=False,
    ),
):
    register_family(_spec)
