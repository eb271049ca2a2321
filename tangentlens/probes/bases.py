"""`BasisSet`: one tangent basis per site, saved as one file with its provenance."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..core.digests import tensor_hash
from ..core.errors import BasisSiteWarning, BasisWeightsWarning, CorruptFileError, UsageError
from ..core.files import load_tensors, save_tensors
from ..core.stats import Moments
from ..core.subspace import TangentBasis
from ..hooks.families import unwrap
from ..hooks.sites import KINDS, WRITE_KINDS, Site, write_targets

__all__ = [
    "BasisSet",
    "as_bases",
    "check_basis_sites",
    "site_order",
    "warn_basis_sites",
    "warn_basis_weights",
    "weights_hash",
]


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
        self._bases = dict(sorted(by_site.items(), key=lambda kv: site_order(kv[0])))
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
        """Read a file written by `save`; anything damaged is a `CorruptFileError`."""
        tensors, header = load_tensors(path, verified=True)
        if "tangentlens_basis_set" not in header:
            raise CorruptFileError(
                f"{path} is not a saved BasisSet (no tangentlens_basis_set header); "
                "pass a file written by BasisSet.save or fit_bases."
            )
        try:
            meta = json.loads(header["tangentlens_basis_set"])
            bases = {}
            for name, info in meta["bases"].items():
                prefix = name + "/"
                own = {
                    k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix)
                }
                bases[name] = TangentBasis.from_tensors(own, info)
            return cls(bases, provenance=meta.get("provenance"))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError, ValueError) as err:
            raise CorruptFileError(
                f"{path} is a damaged BasisSet ({type(err).__name__}: {err}); fit the bases again."
            ) from err

    def __repr__(self) -> str:
        return f"BasisSet({len(self)} sites: {', '.join(self)})"


def site_order(site: Site) -> tuple[int, int]:
    """Sort key: by layer, then in forward order within a block."""
    return site.layer, KINDS.index(site.kind)


def as_bases(bases: Mapping[str | Site, TangentBasis] | None) -> dict[Site, TangentBasis]:
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


def _misplaced(used: Iterable[tuple[Site, TangentBasis]], writes: bool) -> list[tuple[Site, Site]]:
    """(site, the site its basis records it was fitted at) wherever the two differ, each
    pair once; with ``writes``, a block's write may also read the basis of a residual site
    it lands in (as the residual probe reads writes). Bases without a readable recorded
    site are trusted."""
    out = []
    for site, basis in used:
        fitted = basis.provenance.get("site")
        try:
            fitted_site = None if fitted is None else Site.parse(fitted).without_head()
        except (UsageError, TypeError):
            fitted_site = None
        site = site.without_head()
        own = [site, *(write_targets(site) if writes and site.kind in WRITE_KINDS else [])]
        if fitted_site is not None and fitted_site not in own and (site, fitted_site) not in out:
            out.append((site, fitted_site))
    return out


def warn_basis_sites(
    used: Iterable[tuple[Site, TangentBasis]],
    *,
    stacklevel: int = 3,
    writes: bool = False,
) -> None:
    """One `BasisSiteWarning` naming every site of ``used`` (site, basis pairs) whose basis
    says (``provenance["site"]``, as `fit_bases` records it) that it was fitted at another
    site (``writes``: a block's write may read a residual site's basis, `_misplaced`);
    bases without a recorded site are trusted."""
    wrong = [f"{site} (fitted at {fitted})" for site, fitted in _misplaced(used, writes)]
    if wrong:
        warnings.warn(
            BasisSiteWarning(
                "a basis is used at a site other than where it was fitted: "
                f"{'; '.join(wrong)}. Its statistics are exact for any basis, but Q_T then "
                "is not the tangent space there. Use the basis fitted at each site "
                "(fit_bases(model, batches, rank=k) fits every site the probes read, "
                "ln1.hook_out the attention input), and give score_terms the site its "
                "basis was fitted at: site='attn_in' or site='resid_pre'."
            ),
            stacklevel=stacklevel,
        )


def weights_hash(model: Any) -> str | None:
    """`tensor_hash` of the input and output embeddings of the Hugging Face model inside
    ``model``: the tensors every wrapper keeps as they are (a TransformerLens bridge
    renames modules, splits fused projections and adds zero biases, so a hash of the
    whole state would differ between backends for one model), and that differ between
    two models of one width or a model and its fine-tuned copy. None when the model has
    no embeddings to read."""
    try:
        inner = unwrap(model, strict=False)
        found = {"in": inner.get_input_embeddings().weight}
        out = inner.get_output_embeddings()
        if out is not None and out.weight.data_ptr() != found["in"].data_ptr():
            found["out"] = out.weight
    except (AttributeError, TypeError, RuntimeError, NotImplementedError):
        return None
    return tensor_hash(found)


def warn_basis_weights(
    used: Mapping[Site, TangentBasis], model: Any, *, stacklevel: int = 3
) -> None:
    """One `BasisWeightsWarning` naming the sites whose basis records (``weight_hash`` in
    its provenance, as `fit_bases` writes it) other weights than ``model`` holds: a basis
    of another model of the same width fits every shape check and measures nothing. The
    model is hashed only when a basis records a hash. Using a basis on other weights on
    purpose (a fine-tuned or later checkpoint): filter the warning by its class."""
    recorded = {s: b.provenance.get("weight_hash") for s, b in used.items()}
    if not any(isinstance(h, str) for h in recorded.values()):
        return
    now = weights_hash(model)
    other = [s.hook_name for s, h in recorded.items() if isinstance(h, str) and h != now]
    if now is not None and other:
        warnings.warn(
            BasisWeightsWarning(
                f"the bases at {other[:4]}{' ...' if len(other) > 4 else ''} were fitted on "
                "other weights than this model holds (their provenance's weight_hash "
                "differs: another model or checkpoint, or these weights cast to another "
                "dtype): refit them with fit_bases on this model, or filter "
                "BasisWeightsWarning if other weights are meant."
            ),
            stacklevel=stacklevel,
        )


def check_basis_sites(used: Mapping[Site, TangentBasis], argument: str = "bases") -> None:
    """A `UsageError` naming each site whose basis records (``provenance["site"]``) that it
    was fitted at another site: removing a part of an activation in the coordinates of
    another site's subspace measures nothing about this one."""
    wrong = [
        f"{site.hook_name} (fitted at {fitted.hook_name})"
        for site, fitted in _misplaced(used.items(), writes=False)
    ]
    if wrong:
        raise UsageError(
            f"{argument} holds bases fitted at other sites: {'; '.join(wrong)}; pass the "
            "BasisSet fit_bases returned, keyed by the site each basis was fitted at."
        )
