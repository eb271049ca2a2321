"""Sites: where in a transformer a probe reads, named once for every backend.

A `Site` is ``(layer, kind, head)``. Its canonical name is the TransformerLens
legacy hook name (``blocks.3.hook_resid_pre``); the attention input is named
``blocks.3.ln1.hook_out``, the exact input to W_Q/W_K on a pre-norm model, and the MLP
input ``blocks.3.ln2.hook_out``, the exact input to the MLP's first linear maps. Each
backend maps a site to its own hook point (on a post-norm encoder such as BERT the
attention input is the block input and the MLP input the attention block's output; the
backend resolves that, the name stays).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..core.errors import UsageError

__all__ = [
    "INPUT_KINDS",
    "KINDS",
    "RESIDUAL_KINDS",
    "WRITE_KINDS",
    "NamesFilter",
    "Site",
    "missing_site_error",
    "select_sites",
    "write_targets",
]

KINDS = (
    "embed",
    "resid_pre",
    "attn_in",
    "attn_out",
    "resid_mid",
    "mlp_in",
    "mlp_out",
    "resid_post",
)
RESIDUAL_KINDS = ("resid_pre", "resid_mid", "resid_post")
INPUT_KINDS = ("attn_in", "mlp_in")  # read by linear maps: inputs of weight gradients
WRITE_KINDS = ("attn_out", "mlp_out")

NamesFilter = str | Sequence[str] | Callable[[str], bool] | None

_CANONICAL = {
    "resid_pre": "hook_resid_pre",
    "resid_mid": "hook_resid_mid",
    "resid_post": "hook_resid_post",
    "attn_in": "ln1.hook_out",
    "attn_out": "hook_attn_out",
    "mlp_in": "ln2.hook_out",
    "mlp_out": "hook_mlp_out",
}
# Other spellings of the same tensors: TL 4.x canonical (un-aliased) hook names.
_SYNONYMS = {
    "hook_in": "resid_pre",
    "ln2.hook_in": "resid_mid",
    "hook_out": "resid_post",
    "attn.hook_in": "attn_in",
    "attn.hook_out": "attn_out",
    "mlp.hook_in": "mlp_in",
    "mlp.hook_out": "mlp_out",
}
_BY_SUFFIX = {**{v: k for k, v in _CANONICAL.items()}, **_SYNONYMS}
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_EMBED_NAMES = ("hook_embed", "embed.hook_out")


@dataclass(frozen=True, order=True)
class Site:
    """A place in the model: ``Site(3, "resid_pre")``; ``head`` only labels per-head results.

    ``embed`` (the token embedding output) has layer 0.
    """

    layer: int
    kind: str
    head: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(f"kind must be one of {KINDS}; got {self.kind!r}.")
        if not isinstance(self.layer, int) or self.layer < 0:
            raise UsageError(f"layer must be an int >= 0; got {self.layer!r}.")
        if self.kind == "embed" and self.layer != 0:
            raise UsageError("the embed site has layer 0; use Site(0, 'embed').")
        if self.head is not None and (not isinstance(self.head, int) or self.head < 0):
            raise UsageError(f"head must be None or an int >= 0; got {self.head!r}.")

    @property
    def hook_name(self) -> str:
        """Canonical name, e.g. ``blocks.3.hook_resid_pre`` (the head is not part of it)."""
        if self.kind == "embed":
            return "hook_embed"
        return f"blocks.{self.layer}.{_CANONICAL[self.kind]}"

    @classmethod
    def from_hook_name(cls, name: str) -> Site:
        """Parse a canonical name or a TL 4.x synonym (``blocks.3.hook_in`` → resid_pre)."""
        if name in _EMBED_NAMES:
            return cls(0, "embed")
        match = _BLOCK.match(name)
        if match and match.group(2) in _BY_SUFFIX:
            return cls(int(match.group(1)), _BY_SUFFIX[match.group(2)])
        raise UsageError(
            f"{name!r} is not a probe site; use one of "
            + ", ".join(f"blocks.{{l}}.{s}" for s in _CANONICAL.values())
            + ", hook_embed, or a Site(layer, kind)."
        )

    @classmethod
    def parse(cls, site: Site | str) -> Site:
        """A `Site` from a `Site` or a hook name."""
        if isinstance(site, Site):
            return site
        if isinstance(site, str):
            return cls.from_hook_name(site)
        raise TypeError(f"a site is a Site or a hook name string; got {type(site).__name__}.")

    def without_head(self) -> Site:
        return Site(self.layer, self.kind)

    def __str__(self) -> str:
        return self.hook_name if self.head is None else f"{self.hook_name}[head={self.head}]"


def write_targets(write: Site) -> list[Site]:
    """The residual sites a block's write (attn_out, mlp_out) lands in, nearest first: the
    attention write in resid_mid, both in resid_post and the next layer's resid_pre (which
    a last layer does not have)."""
    targets = [Site(write.layer, "resid_post"), Site(write.layer + 1, "resid_pre")]
    return [Site(write.layer, "resid_mid"), *targets] if write.kind == "attn_out" else targets


def select_sites(available: Iterable[Site], names_filter: NamesFilter = None) -> list[Site]:
    """Filter ``available`` with TransformerLens' ``names_filter`` vocabulary.

    ``None`` keeps all; a string or a list names sites (canonical names or TL 4.x
    synonyms; each must exist); a callable is applied to each canonical name.
    """
    available = list(available)
    if names_filter is None:
        return available
    if callable(names_filter):
        return [s for s in available if names_filter(s.hook_name)]
    names = [names_filter] if isinstance(names_filter, str) else list(names_filter)
    known = set(available)
    out: list[Site] = []
    for name in names:
        site = Site.parse(name)
        if site not in known:
            raise UsageError(
                f"site {site} does not exist on this model; available: "
                f"{sorted({s.kind for s in available})} at layers "
                f"0..{max((s.layer for s in available), default=0)}."
            )
        if site not in out:
            out.append(site)
    return out


def missing_site_error(site: Site, available: Iterable[Site], n_layers: int) -> UsageError:
    """The error for a site the model does not have, naming what it has."""
    hint = (
        " (parallel attention and MLP: no resid_mid; use resid_pre or resid_post)"
        if site.kind == "resid_mid"
        else ""
    )
    kinds = sorted({s.kind for s in available})
    return UsageError(
        f"site {site} does not exist on this model{hint}; it has layers 0..{n_layers - 1} "
        f"with {kinds}. Drop that basis or refit."
    )
