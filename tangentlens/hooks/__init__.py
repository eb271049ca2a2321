"""Where the model is touched: sites, the backend protocol, and its backends.

Importing this package registers the built-in backends (TransformerLens, nnsight), so
`get_backend` knows them; `tangentlens.hooks.families` says what each model family is
(its layout, causality, what the bridge boots), `tangentlens.hooks.layouts` where each
site lives in its blocks and `tangentlens.hooks.huggingface` reads plain HF modules.
"""

from . import nnsight, transformer_lens
from .base import Backend, Handle, backend_names, get_backend, register_backend
from .sites import INPUT_KINDS, KINDS, RESIDUAL_KINDS, WRITE_KINDS, Site, select_sites

__all__ = [
    "INPUT_KINDS",
    "KINDS",
    "RESIDUAL_KINDS",
    "WRITE_KINDS",
    "Backend",
    "Handle",
    "Site",
    "backend_names",
    "get_backend",
    "nnsight",
    "register_backend",
    "select_sites",
    "transformer_lens",
]
