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
pass is lost or counted twice. Padded positions are dropped from X (Δ is zero there
anyway). Run one backward per forward pass.

A backward that computes the weights' own gradients (a caller's ``loss.backward()`` on
trainable weights) has already formed every G: a gradient hook on each ``nn.Linear`` or
``Conv1D`` weight reads this backward's gradient (never ``.grad``, which it neither reads
nor writes) and adds G Gᵀ (`gradient_gram`), so that map's Δ needs no product with X.
Whether the backward computes a weight's gradient is asked of the autograd engine at the
Δ's hook. The weight's gradient sums over every use of the weight in the backward, so it
stands for a pass only when that pass sent the one Δ of the weight the backward carried,
kept every position and `fold_flops` counts it cheaper; otherwise (two forwards under one
backward, a weight two sites share, padding, autocast, `run`'s backward with respect to
the embedding output, frozen weights, few tokens) the pass folds X and Δ as above. A use of
the weight outside its module (an intervention multiplying by it) is not seen: keep such
a weight out of the graph, or its G Gᵀ will hold that use's gradient too.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.errors import UsageError
from ..core.settings import N_CONTROLS
from ..core.significance import energy_ratio, matrix_tests
from ..core.stats import Moments, gram_dtype, state_dtype
from ..core.subspace import TangentBasis, tangent_share
from ..core.uncertainty import jackknife_interval
from ..core.validation import check_int, check_seed
from ..core.weight_grams import (
    fold_flops,
    fold_form,
    gradient_gram,
    input_gradient,
    pooled_weight_gram,
    weight_gram,
)
from ..hooks.base import Backend, Handle, ModuleHandle
from ..hooks.sites import INPUT_KINDS, Site
from .base import MomentProbe, Observation, Probe, Sum, ci_columns, row, sites_bar
from .registry import Plan, ProbeSpec, register
from .residual import check_finite, group_energies

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
    ran (``hooked``), which of them have sent their Δ (``received``), and of those the
    maps whose G comes from their weight's gradient (``expect``, `_weight_pays`)."""

    def __init__(self, site: Site, x: Tensor, mask: Tensor | None, group: int) -> None:
        self.site, self.x, self.mask, self.group = site, x, mask, group
        self.hooked: set[int] = set()
        self.received: set[int] = set()
        self.deltas: dict[int, Tensor] = {}
        self.weights: dict[int, tuple[Tensor, Any]] = {}  # map → weight, its grad's node
        self.outs: dict[int, int] = {}  # map → its output width
        self.rounded: set[int] = set()  # maps run in another dtype than their weight
        self.expect: set[int] = set()
        self.gram: Tensor | None = None  # Σ G_mG_mᵀ of the maps whose weight sent G_m
        self.flushed = False  # folded: a Δ still to come is folded on its own
        self.counted = False

    @property
    def complete(self) -> bool:
        return len(self.received) == len(self.hooked) and not self.expect


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
        self.seed = check_seed(seed)
        self.n_groups = check_int(n_groups, "n_groups", minimum=1)
        self._masks: dict[Site, tuple[Tensor | None, int]] = {}
        self._open: dict[Site, weakref.ref[_Pass]] = {}
        self._waiting: list[_Pass] = []
        self._expecting: dict[tuple[Site, int], list[_Pass]] = {}
        self._uses: dict[int, int] = {}  # id(weight) → Δ of it in the running backward
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
        """A forward hook on every linear map that reads a site (it hooks the outputs),
        and a gradient hook on its weight where G can be read from it (`_gradient_weight`)."""
        handles: list[Handle] = []
        try:
            for site in self.sites:
                for i, (_, module) in enumerate(backend.input_linears(site)):
                    weighted = _gradient_weight(module) is not None
                    if weighted:
                        handles.append(self._weight_hook(site, module, i))
                    handles.append(self._hook(site, module, i, weighted))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles

    def _hook(self, site: Site, module: nn.Module, index: int, weighted: bool) -> ModuleHandle:
        handle: ModuleHandle

        def forward_hook(mod: nn.Module, args: tuple, output: Any) -> None:
            if not (
                torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad
            ):
                return
            pending = self._pass_of(site, index, args[0].detach(), output.shape[-1])
            weight = _gradient_weight(module) if weighted else None
            if weight is not None:  # with its gradient's own node, for `_computes_weight`
                node = weight.view_as(weight).grad_fn.next_functions[0][0]
                pending.weights[index] = (weight, node)
                if not output.dtype == args[0].dtype == weight.dtype:
                    pending.rounded.add(index)  # autocast: its G has rounded factors

            def on_grad(delta: Tensor) -> None:
                self._receive(pending, index, delta)

            handle.add_tensor_hook(output, on_grad)

        handle = ModuleHandle(module.register_forward_hook(forward_hook))
        return handle

    def _weight_hook(self, site: Site, module: nn.Module, index: int) -> Handle:
        """A hook on the map's weight: its gradient of this backward (before it joins
        ``.grad``) is Δᵀ X, or G = XᵀΔ itself for GPT-2's ``Conv1D``, so G Gᵀ needs no
        product of X and Δ. It stands for one pass only when that pass sent the one Δ of
        this weight in the backward (``_uses``): through two forwards, or a weight two
        sites share, it is G_1 + G_2, and those passes fold their Δ instead."""
        transposed, weight = _is_conv1d(module), module.weight

        def on_weight_grad(grad: Tensor) -> None:
            alone = self._uses.pop(id(weight), 0) == 1
            passes = self._expecting.pop((site, index), [])
            g = (grad if transposed else grad.T) if alone and len(passes) == 1 else None
            for pending in passes:
                pending.expect.discard(index)
                if g is not None and g.shape == (pending.x.shape[-1], pending.outs[index]):
                    self._add_weight_gram(pending, index, g)
                if pending.complete:
                    self._close(pending)

        return weight.register_hook(on_weight_grad)

    def _add_weight_gram(self, pending: _Pass, index: int, g: Tensor) -> None:
        """Map ``index``'s G Gᵀ from its weight's gradient G, in place of its Δ."""
        with torch.no_grad():  # a backward with create_graph runs its hooks with grad on
            gram = gradient_gram(g.detach(), gram_dtype(g))
        pending.gram = gram if pending.gram is None else pending.gram.add_(gram)
        del pending.deltas[index]

    def _pass_of(self, site: Site, index: int, x: Tensor, out: int) -> _Pass:
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
        pending.outs[index] = out
        return pending

    def _receive(self, pending: _Pass, index: int, delta: Tensor) -> None:
        """Keep map ``index``'s Δ until every map of the pass has one, then fold them
        together; a Δ arriving after its pass was flushed is folded alone."""
        if index in pending.received:  # a second backward of a kept graph is not read
            return
        pending.received.add(index)
        delta = delta.detach()
        computes = _computes_weight(pending, index)
        if computes:  # this Δ is part of the weight's gradient this backward forms
            key = id(pending.weights[index][0])
            self._uses[key] = self._uses.get(key, 0) + 1
        if pending.flushed:
            self._fold(pending, [delta])
        else:
            pending.deltas[index] = delta
            if computes and index not in pending.rounded and _weight_pays(pending):
                pending.expect.add(index)
                self._expecting.setdefault((pending.site, index), []).append(pending)
            if pending.complete:
                self._close(pending)
            elif pending not in self._waiting:
                self._waiting.append(pending)  # folded by `_flush` if the rest never come
        if pending.flushed and len(pending.received) == len(pending.hooked):
            pending.x = pending.x.new_empty(0)  # every map is in: its input is not needed

    def _close(self, pending: _Pass) -> None:
        """Fold what a pass has: the G Gᵀ of the weights that sent G, and X with the Δ of
        the other maps (also those whose weight's gradient never came)."""
        if pending.flushed:
            return
        pending.flushed = True
        deltas, pending.deltas = list(pending.deltas.values()), {}
        for index in pending.expect:
            self._expecting[(pending.site, index)].remove(pending)
        pending.expect.clear()
        if pending in self._waiting:
            self._waiting.remove(pending)
        if deltas or pending.gram is not None:
            self._fold(pending, deltas, pending.gram)
            pending.gram = None
        if len(pending.received) == len(pending.hooked):
            pending.x = pending.x.new_empty(0)

    def _flush(self, site: Site | None = None) -> None:
        """Fold the passes (of ``site``, or all) that got the Δ of some of their maps and
        wait for the rest: a map whose output a backward did not reach gets none."""
        for pending in [p for p in self._waiting if site is None or p.site == site]:
            self._close(pending)

    def _fold(self, pending: _Pass, deltas: list[Tensor], gram: Tensor | None = None) -> None:
        """S += ``gram`` (the weights' own G Gᵀ) + Σ_m G_mG_mᵀ with G_m = XᵀΔ_m over the
        kept positions (`pooled_weight_gram`), into float64 (or ``memory="compact"``:
        float32) state; with a basis, the group's two energies tr(Q_TᵀS_bQ_T) and tr(S_b)
        into its row. The first fold of a pass counts it."""
        site, group, states = pending.site, pending.group, self._states
        with torch.no_grad():
            parts = [] if gram is None else [gram]
            if deltas:
                x = pending.x.reshape(-1, pending.x.shape[-1])
                deltas = [t.reshape(-1, t.shape[-1]).to(x.device) for t in deltas]
                if pending.mask is not None:
                    keep = pending.mask.reshape(-1).to(x.device)
                    x, deltas = x[keep], [t[keep] for t in deltas]
                parts.append(pooled_weight_gram(x, deltas))
            s = parts[0] if len(parts) == 1 else parts[0].add_(parts[1])
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
            pending.flushed, pending.deltas, pending.gram = True, {}, None
            pending.received |= pending.hooked
            pending.expect.clear()
        self._waiting.clear()
        self._expecting.clear()
        self._uses.clear()
        super().reset()

    def saw_backward(self) -> bool:
        return any(float(self.state(f"passes/{s.hook_name}").value) > 0 for s in self.sites)

    def update(self, obs: Observation) -> None:
        self._masks[obs.site] = (obs.mask, obs.group)  # the maps that read the site run next
        if obs.site in self.bases:  # all normalized_ratio reads: Σ‖x‖², Σ‖x Q_T‖², n
            sums = obs.energies(self.bases[obs.site])
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


def _is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``Conv1D`` computes x @ W with W (in, out): its weight's gradient is G."""
    return type(module).__name__ == "Conv1D"


def _gradient_weight(module: nn.Module) -> nn.Parameter | None:
    """``module``'s weight where its gradient is the map's G (or Gᵀ): an ``nn.Linear``'s
    or ``Conv1D``'s float32/float64 leaf that requires a gradient; else None (the passes
    fold X and Δ)."""
    weight = getattr(module, "weight", None)
    if not (isinstance(module, nn.Linear) or _is_conv1d(module)):
        return None
    if not (isinstance(weight, nn.Parameter) and weight.requires_grad and weight.is_leaf):
        return None
    return weight if weight.dtype in (torch.float32, torch.float64) else None


# whether the running backward computes a node (a graph task's own pruning, which
# `torch.autograd.graph.register_multi_grad_hook` reads too)
_will_execute = getattr(torch._C, "_will_engine_execute_node", None)


def _computes_weight(pending: _Pass, index: int) -> bool:
    """Whether the running backward computes the gradient of map ``index``'s weight (not
    `run`'s, which takes the embedding output's only; not on frozen weights)."""
    weight = pending.weights.get(index)
    if weight is None or _will_execute is None:
        return False
    try:
        return bool(_will_execute(weight[1]))
    except RuntimeError:  # inside `torch.autograd.grad`, which accumulates no leaf
        return False


def _weight_pays(pending: _Pass) -> bool:
    """Whether the pass reads G from its weights' gradients: it keeps every position (the
    weight's gradient sums over padded ones too), and G Gᵀ of its maps takes fewer flops
    than folding X and Δ (`fold_flops`: not for a pass of few tokens against d)."""
    if not (pending.mask is None or bool(pending.mask.all())):
        return False
    d = pending.x.shape[-1]
    n, outs = pending.x.numel() // d, sum(pending.outs.values())
    fold = fold_flops(n, d, outs, fold_form(n, d, outs))
    return fold_flops(n, d, outs, "weights") < fold


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
        "tangent_share": jackknife_interval(shares, share, logit_scale=True),
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
