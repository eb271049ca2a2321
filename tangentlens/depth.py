"""Depth profile: where along the layers the tangent bias appears and grows.

From a probe results table, per layer at one residual site (default ``resid_pre``):

- ``tangent_share``, ``chance_share``, ``share_ratio`` of the residual stream;
- ``energy_ratio`` and ``p_value`` of the gradient energy test (when measured);
- ``attn_write_ratio`` and ``mlp_write_ratio``: the share ratio of each block's write;
- ``share_amplification`` = share_ratio[l] / share_ratio[l − 1] and
  ``energy_amplification`` = energy_ratio[l] / energy_ratio[l − 1] (NaN at the first
  layer): values above 1 mean the bias grows through layer l − 1's block.

**Onset.** A layer is *biased* when its ratio (the gradient ``energy_ratio`` when
measured, else the residual ``share_ratio``) is at least ``threshold`` (default 1.5:
50 % more energy in Q_T than chance) and, when a ``p_value`` exists, ``p_value <=
alpha``. The onset layer is the first layer from which every later layer is biased
(the bias *sets in* and stays); None when the last layer is not biased.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import UsageError

__all__ = ["DepthProfile"]

_COLUMNS = (
    "tangent_share",
    "chance_share",
    "share_ratio",
    "energy_ratio",
    "p_value",
    "attn_write_ratio",
    "mlp_write_ratio",
)


class DepthProfile:
    """Per-layer tangent bias from ``session.results()`` (or any table with the
    columns ``probe, site, layer, statistic, value``)."""

    def __init__(
        self,
        results: Any,
        site: str = "resid_pre",
        threshold: float = 1.5,
        alpha: float = 0.05,
    ) -> None:
        import pandas as pd

        missing = {"site", "layer", "statistic", "value"} - set(results.columns)
        if missing:
            raise UsageError(f"results lacks columns {sorted(missing)}; pass session.results().")
        if threshold <= 0 or not 0 < alpha <= 1:
            raise UsageError(f"need threshold > 0 and 0 < alpha <= 1; got {threshold}, {alpha}.")
        self.site, self.threshold, self.alpha = site, threshold, alpha
        probe = (
            results["probe"] if "probe" in results.columns else pd.Series("", index=results.index)
        )

        def pick(kind: str, stat: str, probe_name: str) -> Any:
            rows = results[
                (results["site"] == kind)
                & (results["statistic"] == stat)
                & ((probe == probe_name) | (probe == ""))
            ]
            if rows["layer"].duplicated().any():
                raise UsageError(
                    f"results hold several {stat!r} rows per layer at {kind!r} (several "
                    "checkpoints or runs?); filter them to one first."
                )
            return rows.set_index("layer")["value"]

        table = pd.DataFrame(
            {
                "tangent_share": pick(site, "tangent_share", "residual"),
                "chance_share": pick(site, "chance_share", "residual"),
                "share_ratio": pick(site, "share_ratio", "residual"),
                "energy_ratio": pick(site, "energy_ratio", "gradient"),
                "p_value": pick(site, "p_value", "gradient"),
                "attn_write_ratio": pick("attn_out", "share_ratio", "residual"),
                "mlp_write_ratio": pick("mlp_out", "share_ratio", "residual"),
            },
            columns=list(_COLUMNS),
        ).sort_index()
        if table[["share_ratio", "energy_ratio"]].isna().all().all():
            raise UsageError(
                f"no residual share_ratio or gradient energy_ratio at site {site!r} in results; "
                f"sites present: {sorted(results['site'].unique())}."
            )
        table.index.name = "layer"
        table["share_amplification"] = table["share_ratio"] / table["share_ratio"].shift(1)
        table["energy_amplification"] = table["energy_ratio"] / table["energy_ratio"].shift(1)
        table["biased"] = [self._biased(row) for _, row in table.iterrows()]
        self._table = table

    def _biased(self, row: Any) -> bool:
        ratio = row["energy_ratio"] if not math.isnan(row["energy_ratio"]) else row["share_ratio"]
        if math.isnan(ratio) or ratio < self.threshold:
            return False
        p = row["p_value"]
        return math.isnan(p) or p <= self.alpha

    @property
    def layers(self) -> list[int]:
        return [int(layer) for layer in self._table.index]

    @property
    def onset_layer(self) -> int | None:
        """First layer from which every later layer is biased (module docstring)."""
        onset = None
        for layer, biased in zip(self.layers, self._table["biased"], strict=True):
            if not biased:
                onset = None
            elif onset is None:
                onset = layer
        return onset

    def to_frame(self) -> Any:
        """The per-layer table (index ``layer``), a copy."""
        return self._table.copy()

    def plot(self, ax: Any = None) -> Any:
        """Share ratio (residual and writes) and gradient energy ratio against depth;
        a dotted line at the controls' level (1), a vertical line at the onset. Returns the
        figure."""
        from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

        if ax is None:
            fig = Figure(figsize=(6, 3.5))
            ax = fig.subplots()
        else:
            fig = ax.figure
        t, x = self._table, self.layers
        series = [
            ("share_ratio", f"{self.site} share / chance", "o-"),
            ("attn_write_ratio", "attn write share / chance", "^--"),
            ("mlp_write_ratio", "mlp write share / chance", "v--"),
            ("energy_ratio", "gradient energy ratio", "s-"),
        ]
        for col, label, style in series:
            if t[col].notna().any():
                ax.plot(x, t[col].to_numpy(dtype=float), style, label=label)
        ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
        if self.onset_layer is not None:
            ax.axvline(self.onset_layer, color="red", linewidth=1, label="onset")
        ax.set_xlabel("layer")
        ax.set_ylabel("ratio to chance")
        ax.set_xticks(x)
        ax.legend(fontsize=7)
        fig.tight_layout()
        return fig

    def __repr__(self) -> str:
        return (
            f"DepthProfile(site={self.site!r}, layers={len(self.layers)}, onset={self.onset_layer})"
        )
