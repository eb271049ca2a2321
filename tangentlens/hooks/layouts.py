"""Hugging Face block layouts: where each `Site` lives in a block (`Layout`) and which
linear maps read it (`input_linears`). Plain data, no model code and no dispatch: each
family's `FamilySpec` (`tangentlens.hooks.families`) names its layout, and
`families.layout` finds a model's.

Site → HF module (``in`` = the module's first input, ``out`` = its first output), matching
TransformerLens 4.x bridges of the same weights where one boots:

=========  ==========  ===============  ===============  ================  ================
site       GPT-2 h[l]  GPT-NeoX         Llama, Qwen,     Gemma 3           BERT, RoBERTa
                                        Mistral, OLMo,                     encoder.layer[l]
                                        EuroBERT
=========  ==========  ===============  ===============  ================  ================
embed      wte out     embed_in out     embed_tokens     embed_tokens      embeddings out
resid_pre  block in    block in         block in         block in          block in
attn_in    ln_1 out    input_ln out     input_ln out     input_ln out      attention in
attn_out   attn out    attention out    self_attn out    post_attn_ln out  attention out
resid_mid  ln_2 in     (parallel: none) post_attn_ln in  pre_ff_ln in      output.LN in
mlp_in     ln_2 out    post_attn_ln out post_attn_ln out pre_ff_ln out     intermediate in
mlp_out    mlp out     mlp out          mlp out          post_ff_ln out    output.dense out
resid_post block out   block out        block out        block out         block out
=========  ==========  ===============  ===============  ================  ================

=========  ===================  ===================  ==================================
site       GPT-J h[l]           OLMo 2 layers[l]     ModernBERT layers[l]
=========  ===================  ===================  ==================================
embed      wte out              embed_tokens out     embeddings out (after its norm)
attn_in    ln_1 out             self_attn in         attn in (attn_norm out; layer 0:
                                (= resid_pre)        the block input, no norm)
attn_out   attn out             post_attn_ln out     attn out
resid_mid  (parallel: none)     mlp in               mlp_norm in
mlp_in     mlp in (= ln_1 out)  mlp in               mlp_norm out
mlp_out    mlp out              post_ff_ln out       mlp out
=========  ===================  ===================  ==================================

BERT is post-norm: its attention input is the block input, ``attn_out`` is the attention
block's (normalised) output, which is also ``mlp_in``, and ``resid_mid`` the sum entering
the second LayerNorm, exactly as on the TransformerLens BERT bridge. OLMo 2 normalises
the sublayers' outputs, not their inputs: its attention reads the residual stream.
Gemma 3 and OLMo 2 write the normalised outputs (``post_*``) into the residual stream,
and that is what ``attn_out`` and ``mlp_out`` are, as on their bridges.

The linear maps that read a site (`input_linears`: the weights whose gradients have the
site's activation on their input side): ``attn_in`` → GPT-2 ``attn.c_attn``, NeoX
``attention.query_key_value``, ModernBERT ``attn.Wqkv``, BERT ``attention.self.query/key/
value``, the others ``q/k/v_proj``; ``mlp_in`` → GPT-2 ``mlp.c_fc``, NeoX
``mlp.dense_h_to_4h``, GPT-J ``mlp.fc_in``, ModernBERT ``mlp.Wi``, BERT
``intermediate.dense``, gated MLPs ``mlp.gate_proj/up_proj``.

The attention's output projection (`Layout.out_proj`), whose input is the heads' outputs
z concatenated (TransformerLens ``hook_z``) and whose weight is W_O: GPT-2 ``attn.c_proj``,
GPT-J ``attn.out_proj``, NeoX ``attention.dense``, ModernBERT ``attn.Wo``, BERT
``attention.output.dense``, the others ``self_attn.o_proj``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from ..core.errors import UsageError
from .sites import KINDS

__all__ = [
    "BERT",
    "GEMMA3",
    "GPT2",
    "GPTJ",
    "LLAMA",
    "MODERNBERT",
    "OLMO2",
    "Layout",
    "input_linears",
    "neox",
    "submodule",
]

# (module path relative to the block, "in" | "out") per site kind, per block layout.
_Where = tuple[str, str]


@dataclass(frozen=True)
class Layout:
    layers: str  # path from the base model to the ModuleList of blocks
    embed: _Where  # path from the base model
    block: Mapping[str, _Where]
    order: tuple[str, ...]  # block kinds in forward execution order
    linears: Mapping[str, tuple[str, ...]]  # site kind -> paths of the linear maps reading it
    out_proj: str  # the attention's output projection: its input is the heads' z
    # resid_mid's module sits on the residual stream itself (BERT's output LayerNorm), not
    # on the MLP branch (a pre-norm block's second norm or MLP, which the skip path passes)
    mid_on_stream: bool = False


_PRE_NORM_ORDER = tuple(k for k in KINDS if k != "embed")  # KINDS is in forward order
_PARALLEL_ORDER = tuple(k for k in _PRE_NORM_ORDER if k != "resid_mid")
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATED = ("mlp.gate_proj", "mlp.up_proj")


def _block(attn_in: _Where, attn_out: _Where, mid: str, mlp_in: _Where, mlp_out: _Where) -> dict:
    """The block sites of a layout; ``mid`` is the module whose input is resid_mid."""
    sites = {
        "resid_pre": ("", "in"),
        "attn_in": attn_in,
        "attn_out": attn_out,
        "resid_mid": (mid, "in"),
        "mlp_in": mlp_in,
        "mlp_out": mlp_out,
        "resid_post": ("", "out"),
    }
    return sites if mid else {k: v for k, v in sites.items() if k != "resid_mid"}


GPT2 = Layout(
    "h",
    ("wte", "out"),
    _block(("ln_1", "out"), ("attn", "out"), "ln_2", ("ln_2", "out"), ("mlp", "out")),
    _PRE_NORM_ORDER,
    {"attn_in": ("attn.c_attn",), "mlp_in": ("mlp.c_fc",)},
    "attn.c_proj",
)

# GPT-J: one norm feeds attention and the MLP side by side (parallel block)
GPTJ = Layout(
    "h",
    ("wte", "out"),
    _block(("ln_1", "out"), ("attn", "out"), "", ("mlp", "in"), ("mlp", "out")),
    _PARALLEL_ORDER,
    {"attn_in": tuple(p.replace("self_attn", "attn") for p in _QKV), "mlp_in": ("mlp.fc_in",)},
    "attn.out_proj",
)

_NEOX_LINEARS = {"attn_in": ("attention.query_key_value",), "mlp_in": ("mlp.dense_h_to_4h",)}


def neox(parallel: bool) -> Layout:
    mid = "" if parallel else "post_attention_layernorm"
    sites = _block(
        ("input_layernorm", "out"),
        ("attention", "out"),
        mid,
        ("post_attention_layernorm", "out"),
        ("mlp", "out"),
    )
    order = _PARALLEL_ORDER if parallel else _PRE_NORM_ORDER
    return Layout("layers", ("embed_in", "out"), sites, order, _NEOX_LINEARS, "attention.dense")


LLAMA = Layout(
    "layers",
    ("embed_tokens", "out"),
    _block(
        ("input_layernorm", "out"),
        ("self_attn", "out"),
        "post_attention_layernorm",
        ("post_attention_layernorm", "out"),
        ("mlp", "out"),
    ),
    _PRE_NORM_ORDER,
    {"attn_in": _QKV, "mlp_in": _GATED},
    "self_attn.o_proj",
)

GEMMA3 = Layout(
    "layers",
    ("embed_tokens", "out"),
    _block(
        ("input_layernorm", "out"),
        ("post_attention_layernorm", "out"),
        "pre_feedforward_layernorm",
        ("pre_feedforward_layernorm", "out"),
        ("post_feedforward_layernorm", "out"),
    ),
    _PRE_NORM_ORDER,
    {"attn_in": _QKV, "mlp_in": _GATED},
    "self_attn.o_proj",
)

OLMO2 = Layout(
    "layers",
    ("embed_tokens", "out"),
    _block(
        ("self_attn", "in"),
        ("post_attention_layernorm", "out"),
        "mlp",
        ("mlp", "in"),
        ("post_feedforward_layernorm", "out"),
    ),
    _PRE_NORM_ORDER,
    {"attn_in": _QKV, "mlp_in": _GATED},
    "self_attn.o_proj",
)

MODERNBERT = Layout(
    "layers",
    ("embeddings", "out"),
    _block(("attn", "in"), ("attn", "out"), "mlp_norm", ("mlp_norm", "out"), ("mlp", "out")),
    _PRE_NORM_ORDER,
    {"attn_in": ("attn.Wqkv",), "mlp_in": ("mlp.Wi",)},
    "attn.Wo",
)

BERT = Layout(
    "encoder.layer",
    ("embeddings", "out"),
    {
        "resid_pre": ("", "in"),
        "attn_in": ("attention", "in"),
        "attn_out": ("attention", "out"),
        "mlp_in": ("intermediate", "in"),
        "mlp_out": ("output.dense", "out"),
        "resid_mid": ("output.LayerNorm", "in"),
        "resid_post": ("", "out"),
    },
    ("resid_pre", "attn_in", "attn_out", "mlp_in", "mlp_out", "resid_mid", "resid_post"),
    {
        "attn_in": ("attention.self.query", "attention.self.key", "attention.self.value"),
        "mlp_in": ("intermediate.dense",),
    },
    "attention.output.dense",
    mid_on_stream=True,
)


def submodule(module: nn.Module, path: str) -> nn.Module:
    return module.get_submodule(path) if path else module


def input_linears(
    blocks: nn.ModuleList, layout: Layout, layer: int, kind: str
) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of each linear map of block ``layer`` that reads site ``kind``:
    the weights whose gradients have that site's activation on their input side."""
    if kind not in layout.linears:
        raise UsageError(
            f"only {sorted(layout.linears)} sites are read by linear maps; got {kind!r}."
        )
    return [
        (f"{layout.layers}.{layer}.{path}", submodule(blocks[layer], path))
        for path in layout.linears[kind]
    ]
