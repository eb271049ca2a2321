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
tr(Q_TᵀS_gQ_T) and tr(S_g) (`energy_intervals`) beside the one total S, and of the
activations the two energies ``normalized_ratio`` reads (Σ‖x‖², Σ‖x Q_T‖², as the
residual probe keeps them): memory per site 8d² bytes, or half that with
``memory="compact"`` (float32 state). Without a basis (sites only: Q_T is fitted
afterwards, for any rank) S_g and the activations' `Moments` are kept whole per group,
G·(16d² + 8d) bytes (half the d² part compact), and `group_matrices` returns S_g.

Products (`pooled_weight_gram`): the maps of a site read one X, so the Δ of every map of
a pass are folded together, Σ_m G_mG_mᵀ either from each G_m = X̃ᵀΔ_m or as X̃ᵀKX̃ with
the token Gram K = Σ_m Δ_mΔ_mᵀ (n × n), whichever takes fewer flops (`fold_flops`: the
token form when a pass has few tokens against d and Σ out), symmetric products exactly
symmetric (`compute.syrk`); in `stats.gram_dtype` (float32 for float32 activations on an
IEEE device) about X's mean, scaled by exact powers of two, read back into float64 state.

X and Δ come from hooks on the maps themselves (`Backend.input_linears`): a forward hook
keeps the detached input once per site and pass and hooks each map's output tensor; when
every map of the pass has its Δ, they are folded and the input dropped. A map a backward
does not reach sends none: the pass is then folded with the Δ it has at the next forward
through the site, or when the state is read, and a Δ arriving after that alone, so no
pass is lost or counted twice. No parameter's ``.grad`` is read or written, so it works
inside `run` (gradients with respect to the embedding output only) and around a user's
``loss.backward()``. Padded positions are dropped from X (Δ is zero there anyway). Run one
backward per forward pass.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.compute import syrk
from ..core.errors import UsageError
from ..core.settings import N_CONTROLS
from ..core.significance import energy_ratio, matrix_tests
from ..core.stats import Moments, gram_dtype, state_dtype, unit_scale
from ..core.subspace import TangentBasis, tangent_share
from ..core.uncertainty import jackknife_interval
from ..core.validation import check_int
from ..hooks.base import Backend, Handle, ModuleHandle
from ..hooks.sites import INPUT_KINDS, Site
from .base import MomentProbe, Observation, Probe, Sum, ci_columns, row, sites_bar
from .registry import Plan, ProbeSpec, register
from .residual import check_finite, energy_sums, group_energies

__all__ = [
    "WeightGradientProbe",
    "energy_intervals",
    "fold_flops",
    "input_gradient",
    "matrix_intervals",
    "pooled_weight_gram",
    "weight_gram",
]


class _Pass:
    """One forward pass through the maps that read a site: their shared input, which maps
    ran (``hooked``) and which of them have sent their Δ (``received``)."""

    def __init__(self, site: Site, x: Tensor, mask: Tensor | None, group: int) -> None:
        self.site, self.x, self.mask, self.group = site, x, mask, group
        self.hooked: set[int] = set()
        self.received: set[int] = set()
        self.deltas: list[Tensor] = []
        self.flushed = False  # folded: a Δ still to come is folded on its own
        self.counted = False


def _same_input(a: Tensor, b: Tensor) -> bool:
    """Whether two maps read the same activation (the same tensor, or equal ones)."""
    if a.shape != b.shape or a.device != b.device:
        return False
    same_view = a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.dtype == b.dtype
    return same_view or bool(torch.equal(a, b))


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
        self._open: dict[Site, weakref.ref[_Pass]] = {}
        self._waiting: list[_Pass] = []
        self._q: dict[tuple[Site, torch.device], Tensor] = {}
        for site in self.sites:
            d = self.bases[site].d if site in self.bases else width
            if site in self.bases:  # the total S, and per group tr(Q_TᵀS_gQ_T), tr(S_g)
                self.add_state(f"act_energy/{site.hook_name}", lambda: Sum((3,)))
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
                    handles.append(self._hook(site, module, i))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles

    def _hook(self, site: Site, module: nn.Module, index: int) -> ModuleHandle:
        handle: ModuleHandle

        def forward_hook(mod: nn.Module, args: tuple, output: Any) -> None:
            if not (
                torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad
            ):
                return
            pending = self._pass_of(site, index, args[0].detach())

            def on_grad(delta: Tensor) -> None:
                self._receive(pending, index, delta)

            handle.add_tensor_hook(output, on_grad)

        handle = ModuleHandle(module.register_forward_hook(forward_hook))
        return handle

    def _pass_of(self, site: Site, index: int, x: Tensor) -> _Pass:
        """The pass map ``index`` of ``site`` joins: the site's open one, unless this map
        already ran in it (a new forward: the site's passes still short of a Δ are folded
        first, their backward being over) or reads another input."""
        ref = self._open.get(site)
        pending = ref() if ref is not None else None
        if pending is None or index in pending.hooked or not _same_input(pending.x, x):
            self._flush(site)
            pending = _Pass(site, x, *self._masks.get(site, (None, 0)))
            # weakly: a pass is kept by its tensor hooks, so a graph never backpropagated
            # frees it with its input
            self._open[site] = weakref.ref(pending)
        pending.hooked.add(index)
        return pending

    def _receive(self, pending: _Pass, index: int, delta: Tensor) -> None:
        """Keep map ``index``'s Δ until every map of the pass has one, then fold them
        together; a Δ arriving after its pass was flushed is folded alone."""
        if index in pending.received:  # a second backward of a kept graph is not read
            return
        pending.received.add(index)
        delta = delta.detach()
        if pending.flushed:
            self._fold(pending, [delta])
        else:
            pending.deltas.append(delta)
            if len(pending.received) == len(pending.hooked):
                self._close(pending)
            elif len(pending.deltas) == 1:
                self._waiting.append(pending)  # folded by `_flush` if the rest never come
        if len(pending.received) == len(pending.hooked):
            pending.x = pending.x.new_empty(0)  # every map is in: its input is not needed

    def _close(self, pending: _Pass) -> None:
        if pending.flushed:
            return
        pending.flushed = True
        deltas, pending.deltas = pending.deltas, []
        if pending in self._waiting:
            self._waiting.remove(pending)
        if deltas:
            self._fold(pending, deltas)

    def _flush(self, site: Site | None = None) -> None:
        """Fold the passes (of ``site``, or all) that got the Δ of some of their maps and
        wait for the rest: a map whose output a backward did not reach gets none."""
        for pending in [p for p in self._waiting if site is None or p.site == site]:
            self._close(pending)

    def _fold(self, pending: _Pass, deltas: list[Tensor]) -> None:
        """S += Σ_m G_mG_mᵀ with G_m = XᵀΔ_m over the kept positions (`pooled_weight_gram`),
        into float64 (or ``memory="compact"``: float32) state; with a basis, the group's
        two energies tr(Q_TᵀS_bQ_T) and tr(S_b) into its row. The first fold of a pass
        counts it."""
        site, group, states = pending.site, pending.group, self._states
        with torch.no_grad():
            x = pending.x.reshape(-1, pending.x.shape[-1])
            deltas = [t.reshape(-1, t.shape[-1]).to(x.device) for t in deltas]
            if pending.mask is not None:
                keep = pending.mask.reshape(-1).to(x.device)
                x, deltas = x[keep], [t[keep] for t in deltas]
            s = pooled_weight_gram(x, deltas)
            name = site.hook_name
            if site in self.bases:
                states[f"wgrad/{name}"].add(s)
                key = (site, s.device)
                if key not in self._q:
                    self._q[key] = self.bases[site].basis_.to(s.device, torch.float64)
                q = self._q[key]
                energies = torch.zeros(self.n_groups, 2, dtype=torch.float64, device=s.device)
                energies[group % self.n_groups, 0] = ((s @ q) * q).sum()
                energies[group % self.n_groups, 1] = s.diagonal().sum()
                states[f"wgrad_energy/{name}"].add(energies)
            else:
                states[f"wgrad/{group % self.n_groups}/{name}"].add(s)
            if not pending.counted:
                pending.counted = True
                states[f"passes/{name}"].add(torch.ones((), device=s.device))

    # every read of the state first folds the passes still waiting for a Δ
    def state(self, key: str) -> Any:
        self._flush()
        return super().state(key)

    def state_dict(self) -> dict[str, Tensor]:
        self._flush()
        return super().state_dict()

    def merge(self, other: Probe) -> Probe:
        self._flush()
        if isinstance(other, WeightGradientProbe):
            other._flush()
        return super().merge(other)

    def all_reduce_(self, group: Any = None, *, d: int | None = None) -> Probe:
        self._flush()
        return super().all_reduce_(group, d=d)

    def reset(self) -> None:
        for pending in self._waiting:  # forgotten, with the Δ still to come
            pending.flushed, pending.deltas = True, []
            pending.received |= pending.hooked
        self._waiting.clear()
        super().reset()

    def saw_backward(self) -> bool:
        return any(float(self.state(f"passes/{s.hook_name}").value) > 0 for s in self.sites)

    def update(self, obs: Observation) -> None:
        self._masks[obs.site] = (obs.mask, obs.group)  # the maps that read the site run next
        if obs.site in self.bases:  # all normalized_ratio reads: Σ‖x‖², Σ‖x Q_T‖², n
            sums = energy_sums(obs.tensor, self.bases[obs.site], obs.mask)
            check_finite(sums, obs.site)
            self.state(f"act_energy/{obs.site.hook_name}").add(sums)
            return
        group = obs.group % self.n_groups
        self.state(f"act/{group}/{obs.site.hook_name}").add_batch(*obs.statistics())

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

    def activation_share(self, site: Site, basis: TangentBasis | None = None) -> float | None:
        """The tangent share of the uncentred second moment of the activations the maps at
        ``site`` read (None before any): from the two energies a site with a basis keeps,
        or from the `Moments` of a basis-free state against ``basis``."""
        if site in self.bases:
            total, tangent, n = self.state(f"act_energy/{site.hook_name}").value.tolist()
            return tangent / total if n else None
        if basis is None:
            raise UsageError(f"{site} was collected without a basis: pass one.")
        moments = Moments.merged(self.activation_groups(site))
        return tangent_share(moments, basis) if moments.count else None

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
            s = matrices[site]
            values = matrix_tests(
                s,
                basis,
                n_controls=self.n_controls,
                seed=self.seed,
                activation_share=self.activation_share(site, basis),
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


def fold_flops(n: int, d: int, outs: int, form: str) -> int:
    """Flops of Σ_m G_mG_mᵀ for ``n`` tokens, ``d`` inputs and ``outs`` = Σ_m out_m
    outputs, each symmetric product counted at one triangle's flops (as BLAS ``?syrk``
    spends them; torch's product spends twice as many, in less time on two threads):
    "direct" forms each G_m = XᵀΔ_m and their Gram, "token" the token Gram
    K = Σ_m Δ_mΔ_mᵀ and XᵀKX. Which is cheaper turns on n against d."""
    if form == "direct":
        return 2 * n * d * outs + d * d * outs
    return n * n * outs + 2 * n * n * d + 2 * n * d * d


def pooled_weight_gram(x: Tensor, deltas: Sequence[Tensor], form: str = "auto") -> Tensor:
    """Σ_m G_mG_mᵀ (d_in × d_in, float64), G_m = XᵀΔ_m, over maps that read the same
    ``x`` (n × d_in), in the cheaper ``form`` of `fold_flops` ("auto"), or the one named.
    In `stats.gram_dtype` float32 both forms work about X's mean c rounded to float32,
    X = X̃ + 1cᵀ, with every Δ_m scaled by one exact power of two (`stats.unit_scale`):

    - "direct": each G_m = X̃ᵀΔ_m + c s_mᵀ (s_m its column sums, in float64), scaled and
      rounded once as `weight_gram` rounds it, G_mG_mᵀ (`compute.syrk`) read back map by
      map (one float32 sum over every map's columns rounds several times more);
    - "token": S = X̃ᵀKX̃ + w cᵀ + c wᵀ + ‖s‖² ccᵀ with K = Σ_m Δ_mΔ_mᵀ (`compute.syrk`),
      u = K·1 = Σ_m Δ_m s_m and w = X̃ᵀu; X̃ scaled too, so X̃ᵀKX̃ stays in range.

    Each is read back into float64; in float64 (no IEEE float32 matmul) the same forms
    run unscaled."""
    if form == "auto":
        n, d = x.shape
        outs = sum(delta.shape[-1] for delta in deltas)
        cheaper = fold_flops(n, d, outs, "token") < fold_flops(n, d, outs, "direct")
        form = "token" if cheaper else "direct"
    if form not in ("direct", "token"):
        raise UsageError(f"form must be 'auto', 'direct' or 'token'; got {form!r}.")
    work = gram_dtype(x)
    if x.shape[0] == 0:
        return torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64, device=x.device)
    if work == torch.float64:
        x64, d64 = x.to(torch.float64), [delta.to(torch.float64) for delta in deltas]
        if form == "direct":
            return syrk([torch.cat([x64.T @ delta for delta in d64], 1)])
        s = x64.T @ (syrk(d64) @ x64)
        return (s + s.T) / 2
    centre = (x.sum(0, dtype=torch.float64) / x.shape[0]).to(work)
    c = centre.to(torch.float64)
    scale = unit_scale(*deltas)
    scaled = [delta.to(work) * scale for delta in deltas]
    sums = torch.cat([delta.sum(0, dtype=torch.float64) for delta in scaled])
    widths = [delta.shape[1] for delta in scaled]
    x_c = x.to(work) - centre
    if form == "direct":
        s = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64, device=x.device)
        for delta, s_m in zip(scaled, sums.split(widths), strict=True):
            g = (x_c.T @ delta).to(torch.float64).addr_(c, s_m)
            g_scale = unit_scale(g)
            gram = syrk([g.mul_(g_scale).to(work)]).to(torch.float64)
            s += gram.mul_(g_scale.to(torch.float64) ** -2)  # exact: a power of two
        return s.mul_(scale.to(torch.float64) ** -2)
    x_scale = unit_scale(x_c)
    x_c *= x_scale
    k = syrk(scaled)
    u = torch.zeros(x.shape[0], dtype=work, device=x.device)
    for delta, s_m in zip(scaled, sums.split(widths), strict=True):
        u.addmv_(delta, s_m.to(work))
    # in X̃'s scaled frame (c and w times x_scale, exact): m = A + 2 c wᵀ + ‖s‖² ccᵀ in
    # place, then (m + mᵀ)/2, symmetric bit for bit, unscaled by powers of two
    c_x = c * x_scale.to(torch.float64)
    m = (x_c.T @ (k @ x_c)).to(torch.float64)
    m.addr_(c_x, (x_c.T @ u).to(torch.float64), alpha=2).addr_(c_x * (sums @ sums), c_x)
    return (m + m.T).mul_((x_scale.to(torch.float64) * scale.to(torch.float64)) ** -2 / 2)


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
