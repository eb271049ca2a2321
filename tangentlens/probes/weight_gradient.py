"""Weight-gradient probe: the input side of the weight gradients of the linear maps that
read a site, tested against the site's Q_T.

The paper's "gradient matrix" is the gradient of the weights that read an activation,
not ∂L/∂h. For a linear map with input X (tokens × d_in) and Δ = ∂L/∂(its output)
(tokens × out), the weight gradient is G = XᵀΔ (d_in × out): its input side lives in
the activation space, where Q_T lives. Per forward/backward pass and per map reading the
site, S += G Gᵀ (d_in × d_in, float64), pooled over the maps: W_Q, W_K, W_V (all heads,
GQA as the model has it; a fused QKV map is the same sum) at ``attn_in``, the MLP's input
maps at ``mlp_in``. S is tested like a gradient second moment (`significance.matrix_tests`):

- ``tangent_share`` tr(Q_TᵀSQ_T)/tr(S), ``chance_share`` k/d, ``energy_ratio`` (closed
  form), ``p_value`` / ``p_value_normal`` (uniform / normal matched-rank controls);
- ``normalized_ratio``: the energy ratio over the same ratio of the inputs' uncentred
  second moment E[x xᵀ]. It is the random-backprop null: were Δ white noise independent
  of X, E[G Gᵀ] ∝ XᵀX and the ratio would be 1;
- ``n_passes``: backward passes folded in.

Intervals: with ``n_groups`` ≥ 2, each group of sequences (forward pass i joins group
i mod G, or the session's ``group_of``) keeps what the jackknife reads, and
``tangent_share`` / ``energy_ratio`` get 95 % delete-a-group jackknife intervals
(`tangentlens.core.uncertainty`). A leave-one-group-out share is
tr(Q_Tᵀ(S − S_g)Q_T)/tr(S − S_g), so with a basis each group keeps just its two energies
tr(Q_TᵀS_gQ_T) and tr(S_g) (`energy_intervals`) beside the one total S: memory per site
2·8d² + 8d bytes (the activation `Moments` and S), or half that with ``memory="compact"``
(float32 state). Without a basis (sites only: Q_T is fitted afterwards, for any rank)
S_g is kept whole per group, (G + 1)·8d² + 8d bytes, and `group_matrices` returns it.

Products (`weight_gram`): G is formed as `input_gradient` forms it; G Gᵀ in the same
`stats.gram_dtype` (G scaled by an exact power of two, so float32 neither overflows nor
underflows), added into float64 state.

X and Δ come from hooks on the maps themselves (`Backend.input_linears`): a forward hook
keeps the detached input and hooks the output tensor; when Δ arrives, G is folded in and
the input dropped. No parameter's ``.grad`` is read or written, so it works inside `run`
(gradients with respect to the embedding output only) and around a user's
``loss.backward()``. Padded positions are dropped from X (Δ is zero there anyway). Run one
backward per forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.errors import UsageError
from ..core.settings import N_CONTROLS
from ..core.significance import energy_ratio, matrix_tests
from ..core.stats import Moments, gram_dtype, state_dtype, unit_scale
from ..core.subspace import TangentBasis, tangent_share
from ..core.uncertainty import jackknife_interval
from ..core.validation import check_int
from ..hooks.base import Backend, Handle, ModuleHandle
from ..hooks.sites import INPUT_KINDS, Site
from .base import MomentProbe, Observation, Sum, ci_columns, row, sites_bar
from .registry import Plan, ProbeSpec, register
from .residual import group_energies

__all__ = [
    "WeightGradientProbe",
    "energy_intervals",
    "input_gradient",
    "matrix_intervals",
    "weight_gram",
]


class WeightGradientProbe(MomentProbe):
    """Σ G Gᵀ of the weight gradients that read each ``attn_in`` / ``mlp_in`` site, and its
    energy test against the site's basis.

    ``bases`` maps each site to its Q_T; or it is just the sites (a list): S is
    basis-free, so a caller that fits Q_T only afterwards (a study) collects S per group,
    and the activations' `Moments` per group, and `compute` tests them against any bases.
    ``backend`` (the model's) finds the maps that read each site; a probe rebuilt to
    compute a saved state needs none, but then ``d_model`` (S is d × d)."""

    name = "weight_gradient"

    def __init__(
        self,
        bases: Mapping[Site, TangentBasis] | Sequence[Site],
        backend: Backend | None,
        *,
        d_model: int | None = None,
        n_controls: int = N_CONTROLS.default,
        seed: int = 0,
        n_groups: int = 1,
        memory: str = "full",
    ) -> None:
        super().__init__()
        dtype = state_dtype(memory)
        for site in bases:
            if site.kind not in INPUT_KINDS:
                raise UsageError(
                    f"the weight_gradient probe reads the inputs of linear maps {INPUT_KINDS}; "
                    f"got {site}."
                )
            if backend is not None:
                backend.input_linears(site)  # fails now, not at the first pass
        if backend is None and d_model is None:
            raise UsageError("give the weight_gradient probe a backend, or d_model to load into.")
        self._set_sites(bases)
        width = backend.d_model if backend is not None else check_int(d_model, "d_model", minimum=2)
        self.n_controls = check_int(n_controls, "n_controls", minimum=1)
        self.seed = check_int(seed, "seed", minimum=0)
        self.n_groups = check_int(n_groups, "n_groups", minimum=1)
        self._masks: dict[Site, tuple[Tensor | None, int]] = {}
        self._q: dict[tuple[Site, torch.device], Tensor] = {}
        for site in self.sites:
            d = self.bases[site].d if site in self.bases else width
            if site in self.bases:  # the total S, and per group tr(Q_TᵀS_gQ_T), tr(S_g)
                self.add_state(f"act/{site.hook_name}", lambda: Moments(dtype=dtype))
                self.add_state(f"wgrad/{site.hook_name}", lambda d=d: Sum((d, d), dtype))
                self.add_state(f"wgrad_energy/{site.hook_name}", lambda: Sum((self.n_groups, 2)))
            else:
                for g in range(self.n_groups):
                    self.add_state(f"wgrad/{g}/{site.hook_name}", lambda d=d: Sum((d, d), dtype))
                    self.add_state(f"act/{g}/{site.hook_name}", lambda: Moments(dtype=dtype))
            self.add_state(f"passes/{site.hook_name}", Sum)

    @property
    def forward_sites(self) -> list[Site]:
        return list(self.sites)

    @property
    def reads_backward(self) -> bool:
        return True

    def attach(self, backend: Backend) -> list[Handle]:
        """A forward hook on every linear map that reads a site (it hooks the outputs)."""
        handles: list[Handle] = []
        try:
            for site in self.sites:
                for i, (_, module) in enumerate(backend.input_linears(site)):
                    handles.append(self._hook(site, module, counts_pass=i == 0))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles

    def _hook(self, site: Site, module: nn.Module, *, counts_pass: bool) -> ModuleHandle:
        handle: ModuleHandle

        def forward_hook(mod: nn.Module, args: tuple, output: Any) -> None:
            if not (
                torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad
            ):
                return
            kept = [(args[0].detach(), *self._masks.get(site, (None, 0)))]

            def on_grad(delta: Tensor) -> None:
                if kept:  # once per forward: a second backward of a kept graph is not read
                    x, mask, group = kept.pop()
                    self._fold(site, x, delta, mask, group, counts_pass)

            handle.add_tensor_hook(output, on_grad)

        handle = ModuleHandle(module.register_forward_hook(forward_hook))
        return handle

    def _fold(
        self,
        site: Site,
        x: Tensor,
        delta: Tensor,
        mask: Tensor | None,
        group: int,
        counts_pass: bool,
    ) -> None:
        """S += G Gᵀ with G = XᵀΔ over the kept positions (`weight_gram`), into float64
        (or ``memory="compact"``: float32) state; with a basis, the group's two energies
        tr(Q_TᵀG GᵀQ_T) and tr(G Gᵀ) into its row."""
        with torch.no_grad():
            x = x.reshape(-1, x.shape[-1])
            delta = delta.detach().reshape(-1, delta.shape[-1]).to(x.device)
            if mask is not None:
                keep = mask.reshape(-1).to(x.device)
                x, delta = x[keep], delta[keep]
            s = weight_gram(x, delta)
            name = site.hook_name
            if site in self.bases:
                self.state(f"wgrad/{name}").add(s)
                key = (site, s.device)
                if key not in self._q:
                    self._q[key] = self.bases[site].basis_.to(s.device, torch.float64)
                q = self._q[key]
                energies = torch.zeros(self.n_groups, 2, dtype=torch.float64, device=s.device)
                energies[group % self.n_groups, 0] = ((s @ q) * q).sum()
                energies[group % self.n_groups, 1] = s.diagonal().sum()
                self.state(f"wgrad_energy/{name}").add(energies)
            else:
                self.state(f"wgrad/{group % self.n_groups}/{name}").add(s)
            if counts_pass:
                self.state(f"passes/{name}").add(torch.ones((), device=s.device))

    def saw_backward(self) -> bool:
        return any(float(self.state(f"passes/{s.hook_name}").value) > 0 for s in self.sites)

    def update(self, obs: Observation) -> None:
        self._masks[obs.site] = (obs.mask, obs.group)  # the maps that read the site run next
        group = "" if obs.site in self.bases else f"{obs.group % self.n_groups}/"
        self.state(f"act/{group}{obs.site.hook_name}").add_batch(*obs.statistics())

    def group_matrices(self, site: Site) -> list[Tensor]:
        """S of each group of sequences at ``site``: kept at sites without a basis only
        (a site with one keeps per group the two energies `group_energies` reads)."""
        if site in self.bases:
            raise UsageError(
                f"{site} has a basis, so its groups keep tr(Q_TᵀS_gQ_T) and tr(S_g) only "
                "(group_energies); pass the sites without bases to keep S_g whole."
            )
        return [
            self.state(f"wgrad/{g}/{site.hook_name}").value.to(torch.float64)
            for g in range(self.n_groups)
        ]

    def group_energies(self, site: Site, basis: TangentBasis | None = None) -> Tensor:
        """``(n_groups, 2)`` float64: tr(Q_TᵀS_gQ_T) and tr(S_g) of each group at ``site``,
        against ``basis`` (a basis-free state) or the site's own."""
        if site in self.bases:
            return self.state(f"wgrad_energy/{site.hook_name}").value.to(torch.float64)
        if basis is None:
            raise UsageError(f"{site} was collected without a basis: pass one.")
        return group_energies(self.group_matrices(site), basis)

    def activation_moments(self, site: Site) -> Moments:
        """The `Moments` of the activations the maps at ``site`` read."""
        if site in self.bases:
            return self.state(f"act/{site.hook_name}")
        return Moments.merged(self.activation_groups(site))

    def activation_groups(self, site: Site) -> list[Moments]:
        """The activations' `Moments` per group (a basis-free state)."""
        return [self.state(f"act/{g}/{site.hook_name}") for g in range(self.n_groups)]

    def matrices(self) -> dict[Site, Tensor]:
        """Site → S = Σ G Gᵀ (d × d, float64), summed over passes, maps and groups."""
        return {
            s: self.state(f"wgrad/{s.hook_name}").value.to(torch.float64)
            if s in self.bases
            else sum(self.group_matrices(s))
            for s in self.sites
        }

    def compute(
        self, bases: Mapping[Site, TangentBasis] | None = None, **context: Any
    ) -> list[dict[str, Any]]:
        """`matrix_tests` of each site's S against its basis, ``n_passes``, and jackknife
        intervals of ``tangent_share`` and ``energy_ratio`` over the groups."""
        bases = self.against(bases)
        out = []
        matrices = self.matrices()
        for site, basis in sites_bar(bases.items(), self):
            passes = float(self.state(f"passes/{site.hook_name}").value)
            if passes == 0:
                continue
            s, acts = matrices[site], self.activation_moments(site)
            values = matrix_tests(
                s,
                basis,
                n_controls=self.n_controls,
                seed=self.seed,
                activation_moments=acts if acts.count else None,
            )
            values["n_passes"] = passes
            energies = self.group_energies(site, basis)
            cis = energy_intervals(energies, tangent_share(s, basis), basis)
            out += [row(self.name, site, k, v, **ci_columns(cis.get(k))) for k, v in values.items()]
        return out


def input_gradient(x: Tensor, delta: Tensor) -> Tensor:
    """G = XᵀΔ (d_in × out) in float64, the product formed in `stats.gram_dtype`: X about
    its mean rounded to float32, G = (X − 1cᵀ)ᵀΔ + c·(1ᵀΔ) with the rank-one part in
    float64, Δ scaled by an exact power of two (`stats.unit_scale`)."""
    work = gram_dtype(x)
    if work == torch.float64:
        return x.to(torch.float64).T @ delta.to(torch.float64)
    centre = (x.sum(0, dtype=torch.float64) / max(x.shape[0], 1)).to(work)
    scale = unit_scale(delta)
    g = ((x.to(work) - centre).T @ (delta.to(work) * scale)).to(torch.float64)
    g /= scale.to(torch.float64)
    return g + torch.outer(centre.to(torch.float64), delta.sum(0, dtype=torch.float64))


def weight_gram(x: Tensor, delta: Tensor) -> Tensor:
    """G Gᵀ (d_in × d_in, float64) of one map's weight gradient G = XᵀΔ (`input_gradient`),
    the product formed in `stats.gram_dtype` of ``x``: in float32, G is scaled by an exact
    power of two (`stats.unit_scale`) and rounded once, the product read back in float64."""
    g = input_gradient(x, delta)
    if gram_dtype(x) == torch.float64:
        return g @ g.T
    scale = unit_scale(g)
    g32 = (g * scale).to(torch.float32)
    return (g32 @ g32.T).to(torch.float64) / scale.to(torch.float64) ** 2


def energy_intervals(
    energies: Tensor, share: float, basis: TangentBasis
) -> dict[str, tuple[float, float]]:
    """Jackknife intervals of ``tangent_share`` (``share`` = tr(Q_TᵀSQ_T)/tr(S)) and
    ``energy_ratio`` from each group's (tr(Q_TᵀS_gQ_T), tr(S_g)) in ``energies``: the share
    without group g is the difference of the sums over the groups that saw data (none with
    fewer than two)."""
    seen = energies[energies[:, 1] > 0].to(torch.float64)
    if len(seen) < 2:
        return {}
    total = seen.sum(0)
    shares = [float((total[0] - e[0]) / (total[1] - e[1])) for e in seen]
    ratios = [energy_ratio(x, basis.k, basis.d) for x in shares]
    return {
        "tangent_share": jackknife_interval(shares, share),
        "energy_ratio": jackknife_interval(
            ratios, energy_ratio(share, basis.k, basis.d), log_scale=True
        ),
    }


def matrix_intervals(groups: list[Tensor], basis: TangentBasis) -> dict[str, tuple[float, float]]:
    """`energy_intervals` of S = Σ_g S_g from the groups' matrices."""
    seen = [m for m in groups if float(torch.trace(m)) > 0]
    if len(seen) < 2:
        return {}
    return energy_intervals(group_energies(seen, basis), tangent_share(sum(seen), basis), basis)


def _input_sites(plan: Plan) -> dict[Site, TangentBasis]:
    return {s: b for s, b in plan.scoped.items() if s.kind in INPUT_KINDS}


def _build(plan: Plan, sites: Mapping[Site, TangentBasis], **options: Any) -> WeightGradientProbe:
    shared = plan.shared(WeightGradientProbe)
    return WeightGradientProbe(sites, plan.backend, **shared, **options)


register(
    ProbeSpec(
        "weight_gradient",
        WeightGradientProbe,
        _input_sites,
        needs="attn_in or mlp_in (blocks.{l}.ln1/ln2.hook_out)",
        options=("n_controls",),
        build=_build,
        order=3,
    )
)
