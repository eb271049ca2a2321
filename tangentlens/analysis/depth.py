"""Depth profile: where along the layers the tangent bias appears, and where it amplifies.

From a probe results table, per layer present at one residual site (default
``resid_pre``; any subset of layers: "previous" always means the previous layer *present*):

- ``tangent_share``, ``chance_share``, ``share_ratio`` of the residual stream;
- ``energy_ratio`` and ``p_value`` of the gradient energy test (when measured);
- ``attn_write_ratio`` / ``mlp_write_ratio`` and ``attn_write_share`` / ``mlp_write_share``:
  block l's writes, measured in the basis of the stream they write into;
- ``share_amplification`` = share_ratio[l] / share_ratio[p] and ``energy_amplification``
  = energy_ratio[l] / energy_ratio[p], p the previous layer present (NaN at the first):
  above 1, the bias grew between p and l.

**Amplification with intervals** (`DepthProfile.amplification`, one row per number): the
two amplifications, and the share ratio of every block write that lands in the stream
between p and l (``attn_write``, ``mlp_write``: what each write brings, its ``block``),
each with a 95 % interval and its null (1: no change; for a write, a share at chance).
An amplification's interval is the probes' *joint* jackknife over groups of sequences
(``interval="jackknife"``: each group is left out of both layers at once) when the table
holds it for this pair of layers (its value is the quotient of the two layers' ratios,
to 1e-4: the gradient's per-layer ratio comes from its `Moments`, the joint one from sums).
Otherwise (a study table, a table sliced after the run) it is the box
[low_l / high_p, high_l / low_p] of the two layers' own intervals (``"bounds"``): it
covers whenever both do, so at least 90 % of the time whatever the dependence between
layers (Bonferroni), conservatively. Without per-layer intervals it is NaN (``""``).

**Onsets.** `amplification_onset`: the first layer whose amplification interval lies
wholly above 1 (the bias *grows* there; later layers may hold it, so nothing is asked of
them). `onset_layer`: a layer is *biased* when its ratio (the gradient ``energy_ratio``
when measured, else ``share_ratio``) is at least ``threshold`` (default 1.5) and, when a
``p_value`` exists, ``p_value <= alpha``; the onset is the first layer from which every
later layer is biased (the bias *sets in* and stays); None when the last layer is not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from ..core.errors import UsageError

__all__ = ["DepthProfile", "plot_profiles"]

_COLUMNS = (
    "tangent_share",
    "chance_share",
    "share_ratio",
    "energy_ratio",
    "p_value",
    "attn_write_ratio",
    "mlp_write_ratio",
    "attn_write_share",
    "mlp_write_share",
)
# quantity -> (per-layer ratio column, probe, the probes' amplification statistic)
_AMPLIFIED = {
    "share": ("share_ratio", "residual", "share_amplification"),
    "energy": ("energy_ratio", "gradient", "energy_amplification"),
}
_WRITES = {"attn_write": "attn_out", "mlp_write": "mlp_out"}
# where in block b (at 3b + this) each site sits (resid_post of b is resid_pre of b + 1) and
# each write lands: a write counts for the change p -> l when it lands between the two sites
_POSITION = {"resid_pre": 0.0, "attn_out": 1.0, "resid_mid": 1.5, "mlp_out": 2.0, "resid_post": 3.0}
_AMPLIFICATION_COLUMNS = (
    "layer",
    "from_layer",
    "quantity",
    "block",
    "value",
    "ci_low",
    "ci_high",
    "null",
    "interval",
    "above_null",
)


class DepthProfile:
    """Where along the layers the tangent bias appears, and where it grows.

    A bias in one layer says little on its own; the profile puts every layer's ratio to
    chance beside the previous layer's, with intervals, so an onset is read from the
    depth at which the bias sets in and stays, not from a single layer's number.

    Args:
        results: ``session.results()`` or any table with the columns ``probe, site,
            layer, statistic, value`` (``ci_low`` / ``ci_high`` where there are
            intervals), one row per statistic and layer.
        site: The residual site: ``resid_pre``, ``resid_mid`` or ``resid_post``.
        threshold: The ratio from which a layer counts as biased.
        alpha: The p-value at or below which a layer's gradient test counts.

    Returns:
        The profile: `to_frame` (per-layer table), `amplification` (per-layer growth
        with intervals), `onset_layer`, `amplification_onset` and `plot`.

    Raises:
        UsageError: Missing columns, several rows per layer (filter to one checkpoint
            first), no residual or gradient ratio at ``site``, or an invalid ``site``,
            ``threshold`` or ``alpha``.

    Example:
        With ``table`` from ``tangentlens.run(model, texts, bases).results()``:

        >>> profile = tangentlens.DepthProfile(table)
        >>> list(profile.to_frame().columns[:3])
        ['tangent_share', 'chance_share', 'share_ratio']
        >>> fig = profile.plot()
    """

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
            """value, ci_low, ci_high (NaN where absent) by layer, layers sorted."""
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
            out = pd.DataFrame({c: rows.get(c, math.nan) for c in ("value", "ci_low", "ci_high")})
            out.index = pd.Index(rows["layer"].astype(int), name="layer")
            return out.astype(float).sort_index()

        self._pick = pick
        stream = {stat: pick(site, stat, "residual") for stat in _COLUMNS[:3]}
        stream |= {stat: pick(site, stat, "gradient") for stat in ("energy_ratio", "p_value")}
        if stream["share_ratio"]["value"].dropna().empty and (
            stream["energy_ratio"]["value"].dropna().empty
        ):
            raise UsageError(
                f"no residual share_ratio or gradient energy_ratio at site {site!r} in results; "
                f"sites present: {sorted(results['site'].dropna().unique())}."
            )
        if site not in ("resid_pre", "resid_mid", "resid_post"):
            raise UsageError(f"site must be resid_pre, resid_mid or resid_post; got {site!r}.")
        # block writes at every block measured (they may lie between the layers present)
        self._writes = {
            name: {stat: pick(kind, stat, "residual") for stat in ("share_ratio", "tangent_share")}
            for name, kind in _WRITES.items()
        }
        layers = sorted(
            set(stream["share_ratio"]["value"].dropna().index)
            | set(stream["energy_ratio"]["value"].dropna().index)
        )
        table = pd.DataFrame(index=pd.Index(layers, name="layer"))
        for stat, frame in stream.items():
            table[stat] = frame["value"].reindex(layers)
        for name in _WRITES:
            table[f"{name}_ratio"] = self._writes[name]["share_ratio"]["value"].reindex(layers)
            table[f"{name}_share"] = self._writes[name]["tangent_share"]["value"].reindex(layers)
        table = table[list(_COLUMNS)]
        self._stream = stream
        self._amplification = self._amplify(layers)
        amp = self._amplification.set_index("layer")
        for quantity, (_, _, stat) in _AMPLIFIED.items():
            table[stat] = amp[amp["quantity"] == quantity]["value"].reindex(layers)
        table["biased"] = [self._biased(row) for _, row in table.iterrows()]
        self._table = table

    # ------------------------------------------------------------------ amplification
    def _amplify(self, layers: list[int]) -> Any:
        import pandas as pd

        rows: list[dict[str, Any]] = []
        for quantity, (column, probe, stat) in _AMPLIFIED.items():
            per_layer = self._stream[column].dropna(subset=["value"])
            joint = self._pick(self.site, stat, probe)
            for p, layer in pairwise(per_layer.index.tolist()):
                now, before = per_layer.loc[layer], per_layer.loc[p]
                ratio = float(now["value"]), float(before["value"])  # inf / inf: nan, quietly
                value = ratio[0] / ratio[1] if ratio[1] else math.nan
                if layer in joint.index and math.isclose(
                    joint.loc[layer, "value"], value, rel_tol=1e-4
                ):
                    low, high = joint.loc[layer, ["ci_low", "ci_high"]]
                    kind = "jackknife" if math.isfinite(low) else ""
                elif before["ci_low"] > 0 and math.isfinite(now["ci_low"]):
                    low, high = now["ci_low"] / before["ci_high"], now["ci_high"] / before["ci_low"]
                    kind = "bounds"
                else:
                    low, high, kind = math.nan, math.nan, ""
                rows.append(_amp_row(layer, p, quantity, None, value, low, high, kind))
        start = _POSITION[self.site]
        for p, layer in pairwise(layers):
            for name, kind in _WRITES.items():
                writes = self._writes[name]["share_ratio"].dropna(subset=["value"])
                for block, w in writes.iterrows():
                    if 3 * p + start < 3 * block + _POSITION[kind] < 3 * layer + start:
                        has_ci = math.isfinite(w["ci_low"])
                        rows.append(
                            _amp_row(
                                layer, p, name, int(block), w["value"], w["ci_low"],
                                w["ci_high"], "jackknife" if has_ci else "",
                            )
                        )  # fmt: skip
        frame = pd.DataFrame(rows, columns=list(_AMPLIFICATION_COLUMNS))
        for col in ("layer", "from_layer", "block"):
            frame[col] = frame[col].astype("Int64")
        order = {q: i for i, q in enumerate([*_AMPLIFIED, *_WRITES])}
        frame = frame.sort_values(
            ["layer", "quantity", "block"],
            key=lambda c: c.map(order) if c.name == "quantity" else c,
        )
        return frame.reset_index(drop=True)

    def amplification(self) -> Any:
        """One row per number, a copy: ``layer``, ``from_layer`` (previous layer present),
        ``quantity`` (``share``, ``energy``, ``attn_write``, ``mlp_write``), ``block`` (a
        write's block), ``value``, ``ci_low``, ``ci_high`` (95 %), ``null`` (1),
        ``interval`` (``jackknife``, ``bounds`` or ``""``: see the module docstring) and
        ``above_null`` (ci_low > null)."""
        return self._amplification.copy()

    def amplification_onset(self, quantity: str | None = None) -> int | None:
        """The first layer whose ``quantity`` amplification interval lies wholly above 1;
        None when no layer's does. Default: ``energy`` where its amplification has
        intervals, else ``share``."""
        amp = self._amplification
        if quantity is None:
            energy = amp[(amp["quantity"] == "energy") & (amp["interval"] != "")]
            quantity = "energy" if len(energy) else "share"
        if quantity not in _AMPLIFIED:
            raise UsageError(f"quantity must be one of {sorted(_AMPLIFIED)}; got {quantity!r}.")
        above = amp[(amp["quantity"] == quantity) & amp["above_null"]]
        return int(above["layer"].iloc[0]) if len(above) else None

    # ------------------------------------------------------------------ bias onset
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

    # ------------------------------------------------------------------ plot
    def plot(self, axes: Any = None) -> Any:
        """Three panels against depth: tangent shares (stream and writes, chance dotted);
        ratios to chance / controls on a log axis; the amplifications on a log axis, each
        stream statistic and amplification with its 95 % interval where the table has one
        (a point alone cannot say whether a layer differs from its neighbour); 1 dotted,
        the amplification onset as a red line. ``axes``: three matplotlib Axes to draw on
        (default: a new figure). Each series is one line through the layers where it was
        measured. Returns the figure."""
        return plot_profiles([(self.site, self)], axes)

    def _draw(self, axes: Any, label: str | None, colour: Any, shift: float, floor: Any) -> None:
        """This profile's lines on the three panels: every series, each labelled, when
        ``label`` is None (a profile alone); else only the stream's, in ``colour``, the
        share panel's line labelled ``label``, the amplifications moved by ``shift`` so
        the profiles' intervals stand side by side (several profiles on one figure)."""
        ax_s, ax_r, ax_a = axes
        t, alone = self._table, label is None
        style = {} if alone else {"color": colour}

        def line(ax: Any, series: Any, fmt: str, text: str | None, dx: float = 0.0) -> Any:
            series = series.dropna()
            if len(series):
                x, y = series.index.to_numpy(int) + dx, series.to_numpy(float)
                return ax.plot(x, y, fmt, label=text if alone or ax is ax_s else None, **style)[0]
            return None

        def bars(ax: Any, drawn: Any, stat: str, dx: float = 0.0) -> None:
            """The stream statistic's 95 % interval per layer, where the table has one (a
            bound at or below 0 on a log axis is drawn from the panel's bottom)."""
            ci = self._stream[stat].dropna(subset=["ci_low", "ci_high"])
            if drawn is None or ci.empty:
                return
            low = ci["ci_low"]
            if ax is ax_r:
                low = low.where(low > 0, ci["value"].where(ci["value"] > 0).min() / 10)
            x = ci.index.to_numpy(float) + dx + shift
            ax.vlines(x, low, ci["ci_high"], color=drawn.get_color(), lw=1.2, alpha=0.8)

        writes = {n: {s: f["value"] for s, f in w.items()} for n, w in self._writes.items()}
        drawn = line(ax_s, t["tangent_share"], "o-", self.site if alone else label, shift)
        bars(ax_s, drawn, "tangent_share")
        drawn = line(ax_r, t["share_ratio"], "o-", f"{self.site} share / chance", shift)
        bars(ax_r, drawn, "share_ratio")
        if alone:
            line(ax_s, writes["attn_write"]["tangent_share"], "^--", "attn write")
            line(ax_s, writes["mlp_write"]["tangent_share"], "v--", "mlp write")
            line(ax_r, writes["attn_write"]["share_ratio"], "^--", "attn write share / chance")
            line(ax_r, writes["mlp_write"]["share_ratio"], "v--", "mlp write share / chance")
        drawn = line(ax_r, t["energy_ratio"], "s-", "gradient energy ratio", shift)
        bars(ax_r, drawn, "energy_ratio")
        amp = self._amplification[lambda a: a["quantity"].isin(list(_AMPLIFIED))]
        for quantity, fmt, side in (("share", "o-", -0.05), ("energy", "s-", 0.05)):
            a = amp[amp["quantity"] == quantity].set_index("layer")
            drawn = line(ax_a, a["value"], fmt, f"{quantity} amplification", shift)
            bars = a.dropna(subset=["ci_low", "ci_high"])
            if drawn is not None and len(bars) and floor is not None:
                x = bars.index.to_numpy(float) + side + shift  # side by side, not stacked
                low = bars["ci_low"].clip(lower=floor)
                ax_a.vlines(x, low, bars["ci_high"], color=drawn.get_color(), lw=1.5)

    def __repr__(self) -> str:
        return (
            f"DepthProfile(site={self.site!r}, layers={len(self.layers)}, "
            f"onset={self.onset_layer}, amplification_onset={self.amplification_onset()})"
        )


def plot_profiles(
    profiles: Sequence[tuple[str, DepthProfile]],
    axes: Any = None,
    *,
    colours: Sequence[Any] | None = None,
    legend: bool = True,
) -> Any:
    """The depth figure, for one profile or several (``(label, profile)``: a study's checkpoints or
    windows), so a lone profile and a report's series are drawn by the same code. Three panels
    against depth: tangent shares (chance dotted); ratios to chance / controls on a log axis;
    the amplifications on a log axis (1 dotted); the stream's statistics and the amplifications
    with their intervals where the table has them. One profile: every series (its block writes
    too) and the amplification onset as a red line. Several: the stream's lines only, one colour
    per profile (``colours``, default matplotlib's cycle), ``o`` for shares and ``s`` for
    gradient energy, so the profiles compare at a glance. ``axes``: three Axes to draw on
    (default: a new figure, laid out here); ``legend``: a legend per panel (off when the caller
    gathers the handles itself). Returns the figure."""
    from matplotlib import rcParams
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    from matplotlib.ticker import MaxNLocator

    if not profiles:
        raise UsageError("plot_profiles needs at least one (label, DepthProfile).")
    created = axes is None
    if created:
        fig = Figure(figsize=(12, 3.6))
        axes = fig.subplots(1, 3)
    if len(axes) != 3:
        raise UsageError(f"plot needs three Axes (shares, ratios, amplification); got {axes}.")
    fig = axes[0].figure
    ax_s, ax_r, ax_a = axes
    alone = len(profiles) == 1
    palette = list(colours or rcParams["axes.prop_cycle"].by_key()["color"])
    amps = [p._amplification for _, p in profiles]
    amps = [a[a["quantity"].isin(list(_AMPLIFIED))] for a in amps]
    # an interval reaching 0 or below runs to the panel's floor (unbounded on a log axis)
    lows = [v for a in amps for v in (a["value"].min(), a["ci_low"].where(a["ci_low"] > 0).min())]
    floor = min((v for v in lows if math.isfinite(v)), default=math.nan)
    floor = floor / 1.5 if math.isfinite(floor) and floor > 0 else None
    spread = 0.0 if alone else 0.3 / len(profiles)  # the profiles' bars side by side
    for i, (label, profile) in enumerate(profiles):
        shift = (i - (len(profiles) - 1) / 2) * spread
        profile._draw(axes, None if alone else label, palette[i % len(palette)], shift, floor)
    chance = [p._table["chance_share"].dropna() for _, p in profiles]
    chance = [float(c.mean()) for c in chance if len(c)]
    if chance:
        mean = sum(chance) / len(chance)
        ax_s.axhline(mean, color="gray", ls=":", lw=1, label="chance (k/d)")
    ax_s.set(title="energy share in Q_T", ylabel="tangent share", ylim=(0, 1))
    ax_r.set(title="ratios (log axis)", ylabel="ratio to chance / controls")
    if floor is not None:
        ax_a.set_ylim(bottom=floor)
    ax_a.set(title="amplification (log axis)", ylabel="ratio to the previous layer")
    if alone:
        onset = profiles[0][1].amplification_onset()
        if onset is not None:
            ax_a.axvline(onset, color="red", lw=1, label="amplification onset")
    else:  # the markers, once: the colours are the profiles
        ax_r.plot([], [], "o-", color="gray", label="share / chance; share amplification")
        ax_r.plot([], [], "s-", color="gray", label="gradient energy ratio; its amplification")
    low, high = ax_r.get_xlim()
    pad = spread * (len(profiles) - 1) / 2 + 0.1  # room for the intervals beside a point
    for ax in axes:  # the layers line up across panels, however few
        ax.set_xlim(low - pad, high + pad)
    for ax in (ax_r, ax_a):
        _log_axis(ax)
        ax.axhline(1.0, color="gray", ls=":", lw=1)
    for ax in axes:
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if legend and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if created:
        fig.tight_layout()
    return fig


def _log_axis(ax: Any) -> None:
    """A log y axis labelled 0.8, 1, 2, 30 (not 8×10⁻¹): every minor tick within a decade,
    else only those at 2 and 5, so labels never collide."""
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")

    def minor(value: float, _: Any) -> str:
        low, high = ax.get_ylim()
        lead = round(value / 10 ** math.floor(math.log10(value) + 1e-9))
        return f"{value:g}" if high / low < 10 or lead in (2, 5) else ""

    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def _amp_row(
    layer: int,
    p: int,
    quantity: str,
    block: int | None,
    value: float,
    low: float,
    high: float,
    interval: str,
) -> dict[str, Any]:
    return {
        "layer": layer,
        "from_layer": p,
        "quantity": quantity,
        "block": block,
        "value": float(value),
        "ci_low": float(low),
        "ci_high": float(high),
        "null": 1.0,
        "interval": interval,
        "above_null": bool(low > 1.0),
    }
