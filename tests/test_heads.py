"""Head attribution: each head's write z·W_O in Q_T (brute force, both backends, every
family the layouts know), GQA groups, the basis-site warning, and the (layer, head)
arrays and heatmaps."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from einops import rearrange
from matplotlib.colors import LogNorm
from models import BRIDGE_FAMILIES, FAMILIES, hf_model, tl_bridge
from torch import Tensor

import tangentlens
from tangentlens.analysis.heads import TERM_PANELS, head_arrays, plot_heads
from tangentlens.core.errors import BasisSiteWarning, UsageError
from tangentlens.core.head_writes import head_write_energies, random_share_std, z_gram
from tangentlens.core.subspace import TangentBasis, uniform_controls
from tangentlens.hooks.base import get_backend
from tangentlens.hooks.families import layout
from tangentlens.probes.attention import WRITE_STATISTICS, score_terms

D, LAYER, K = 32, 1, 4


def random_basis(seed: int, provenance: dict | None = None) -> TangentBasis:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(D, K, generator=gen, dtype=torch.float64))
    return TangentBasis(q, provenance=provenance)


def nnsight_model(arch: str) -> Any:
    from nnsight import NNsight

    return NNsight(hf_model(arch, sharp=True))


def inputs(n: int = 3, pos: int = 9) -> tuple[Tensor, Tensor]:
    """Token ids and a left-padded mask (row 1 has 3 padded positions)."""
    ids = torch.randint(5, 20, (n, pos), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(n, pos, dtype=torch.long)
    mask[1, :3] = 0
    return ids, mask


def forward(model: Any, ids: Tensor, mask: Tensor) -> None:
    with torch.no_grad():
        if hasattr(model, "cfg"):
            model(ids, attention_mask=mask, return_type=None)
        else:
            model(ids, attention_mask=mask)


def head_rows(table: pd.DataFrame, statistic: str) -> np.ndarray:
    rows = table[(table.statistic == statistic) & table["head"].notna()].sort_values("head")
    return rows["value"].to_numpy(dtype=float)


# ------------------------------------------------------------------------------ maths
def test_write_energies_match_materialised_writes() -> None:
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2, 5, 3, 4, generator=gen, dtype=torch.float64)
    w_o = torch.randn(3, 4, 10, generator=gen, dtype=torch.float64)
    q = uniform_controls(10, 2, 1, seed=1)[0]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    e = head_write_energies(z_gram(z, mask), w_o, q)
    writes = torch.einsum("bphe,hed->bphd", z, w_o)[mask]  # (tokens, head, d)
    assert torch.allclose(e["total"], writes.pow(2).sum((0, 2)), rtol=1e-12)
    assert torch.allclose(e["tangent"], (writes @ q).pow(2).sum((0, 2)), rtol=1e-12)
    c = torch.einsum("thd,the->hde", writes, writes)  # each head's write second moment
    assert torch.allclose(e["square"], (c @ c).diagonal(dim1=1, dim2=2).sum(-1), rtol=1e-12)


def test_random_share_std_matches_random_frames() -> None:
    """Mean k/d and the closed-form spread against 20,000 Haar frames."""
    d, k = 12, 3
    gen = torch.Generator().manual_seed(0)
    b = torch.randn(d, d, generator=gen, dtype=torch.float64)
    c = b @ b.T + torch.diag(torch.arange(d, dtype=torch.float64) ** 2)
    frames = uniform_controls(d, k, 20_000, seed=2)
    share = torch.einsum("ndk,de,nek->n", frames, c, frames) / torch.trace(c)
    std = random_share_std(torch.trace(c), torch.trace(c @ c), k, d)
    assert abs(float(share.mean()) - k / d) < 4 * float(std) / 20_000**0.5
    assert float(share.std()) == pytest.approx(float(std), rel=0.03)
    with pytest.raises(UsageError):
        random_share_std(torch.tensor(1.0), torch.tensor(1.0), 0, d)


# ------------------------------------------------------------------ brute force, both
def brute_force_shares(arch: str, basis: TangentBasis, ids: Tensor, mask: Tensor) -> Tensor:
    """Per-head write shares from the HF weights (z at the output projection's input,
    W_O from its weight by hand), padded tokens dropped."""
    hf = hf_model(arch, sharp=True)
    lay, base = layout(hf)
    proj = base.get_submodule(lay.layers)[LAYER].get_submodule(lay.out_proj)
    seen: dict[str, Tensor] = {}
    handle = proj.register_forward_pre_hook(lambda m, a: seen.setdefault("z", a[0].detach()))
    try:
        forward(hf, ids, mask)
    finally:
        handle.remove()
    n = hf.config.num_attention_heads
    weight = proj.weight.detach().double()
    w_o = weight.T if type(proj).__name__ == "Conv1D" else weight  # (d_model, n * e)
    z = rearrange(seen["z"].double(), "b p (h e) -> b p h e", h=n)
    writes = torch.einsum("bphe,dhe->bphd", z, w_o.reshape(D, n, -1))[mask.bool()]
    q = basis.basis_
    return (writes @ q).pow(2).sum((0, 2)) / writes.pow(2).sum((0, 2))


@pytest.mark.parametrize(
    ("arch", "target"),
    [("llama", "resid_mid"), ("gpt2", "resid_mid"), ("neox", "resid_post"), ("bert", "resid_mid")],
)
def test_write_share_brute_force_on_both_backends(arch: str, target: str) -> None:
    """TransformerLens bridge and nnsight agree within 1e-6 and match the hand-made
    writes; the row names the basis it used (GQA Llama, GPT-2's Conv1D, NeoX's parallel
    block writing into resid_post, BERT), with padding."""
    ids, mask = inputs()
    if arch in ("gpt2", "bert"):  # right padding: absolute positions agree on both
        mask = mask.flip(1)
    write_basis = random_basis(2)
    bases = {f"blocks.{LAYER}.ln1.hook_out": random_basis(1)}
    bases[f"blocks.{LAYER}.hook_{target}"] = write_basis
    expected = brute_force_shares(arch, write_basis, ids, mask).numpy()
    tables = []
    for model in (tl_bridge(arch, sharp=True), nnsight_model(arch)):
        with tangentlens.probe(model, bases, probes=("attention",), head_null=2) as session:
            forward(model, ids, mask)
        tables.append(session.results())
    for table in tables:
        at = table[table.hook == f"blocks.{LAYER}.hook_attn_out"]
        assert set(at.loc[at["head"].notna(), "statistic"]) == set(WRITE_STATISTICS)
        np.testing.assert_allclose(head_rows(table, "write_share"), expected, atol=1e-6)
        assert table[table.statistic == f"write_basis_{target}"]["value"].tolist() == [LAYER]
        np.testing.assert_allclose(head_rows(table, "write_chance_share"), K / D)
    for stat in ("write_share", "write_share_null_std", "write_share_z"):
        assert len(head_rows(tables[0], stat)) == 4
        np.testing.assert_allclose(
            head_rows(tables[0], stat), head_rows(tables[1], stat), atol=1e-6
        )


@pytest.mark.parametrize("arch", [f for f in BRIDGE_FAMILIES if f not in ("llama", "gpt2")])
def test_backends_agree_on_every_bridge_family(arch: str) -> None:
    """W_O and the per-head write shares agree between the bridge and nnsight (measured:
    W_O identical, write_share within 1.2e-8 on all twelve bridge families)."""
    ids, _ = inputs()
    mask = torch.ones_like(ids)
    bases = {f"blocks.{LAYER}.ln1.hook_out": random_basis(1)}
    bases[f"blocks.{LAYER}.hook_resid_post"] = random_basis(2)
    models = (tl_bridge(arch, sharp=True), nnsight_model(arch))
    w_o = [get_backend(m).output_weight(LAYER).double() for m in models]
    torch.testing.assert_close(w_o[0], w_o[1], rtol=0, atol=1e-7)
    shares = []
    for model in models:
        with tangentlens.probe(model, bases, probes=("attention",), head_null=2) as session:
            forward(model, ids, mask)
        shares.append(head_rows(session.results(), "write_share"))
    np.testing.assert_allclose(shares[0], shares[1], atol=1e-6)


@pytest.mark.parametrize("arch", FAMILIES)
def test_output_weight_and_z_rebuild_the_projection(arch: str) -> None:
    """For every layout: Σ_h z_h W_O[h] + bias is the output projection's output."""
    model = nnsight_model(arch)
    backend = get_backend(model)
    lay, base = layout(backend.module)
    proj = base.get_submodule(lay.layers)[0].get_submodule(lay.out_proj)
    seen: dict[str, Tensor] = {}
    handles = [
        backend.add_z_hook(0, lambda z: seen.setdefault("z", z.detach())),
        proj.register_forward_hook(lambda m, a, out: seen.setdefault("out", out.detach())),
    ]
    try:
        forward(backend.module, *inputs(2, 6))
    finally:
        for h in handles:
            h.remove()
    w_o = backend.output_weight(0)
    bias = 0 if proj.bias is None else proj.bias.detach()
    rebuilt = torch.einsum("bphe,hed->bpd", seen["z"], w_o) + bias
    assert w_o.shape[0] == backend.attention_params(0).n_heads
    torch.testing.assert_close(rebuilt, seen["out"], atol=1e-5, rtol=1e-5)


def test_gqa_groups_on_both_backends() -> None:
    """Tiny Llama: 4 query heads share 2 key/value heads."""
    ids, mask = inputs()
    bases = {f"blocks.{LAYER}.ln1.hook_out": random_basis(1)}
    for model in (tl_bridge("llama", sharp=True), nnsight_model("llama")):
        with tangentlens.probe(model, bases, probes=("attention",), head_null=0) as session:
            forward(model, ids, mask)
        table = session.results()
        assert head_rows(table, "kv_group").tolist() == [0, 0, 1, 1]
        assert not (table.statistic == "write_share").any()  # no residual basis: no writes


# ------------------------------------------------------------------------ the warning
def test_basis_site_warning() -> None:
    model = tl_bridge("llama", sharp=True)
    ids, _ = inputs()
    resid = random_basis(1, {"site": f"blocks.{LAYER}.hook_resid_pre"})
    with pytest.warns(BasisSiteWarning, match=r"blocks\.1\.ln1\.hook_out.*hook_resid_pre"):
        score_terms(model, ids, LAYER, resid)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BasisSiteWarning)
        score_terms(model, ids, LAYER, resid, site="resid_pre")  # where it was fitted
        own = random_basis(1, {"site": f"blocks.{LAYER}.ln1.hook_out"})
        score_terms(model, ids, LAYER, own)
    with pytest.warns(BasisSiteWarning, match="site='resid_pre'"):
        tangentlens.probe(model, {f"blocks.{LAYER}.ln1.hook_out": resid}, probes=("attention",))


# ------------------------------------------------------------------- arrays and plots
@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    model = tl_bridge("llama", sharp=True)
    ids, mask = inputs()
    bases = {f"blocks.{layer}.ln1.hook_out": random_basis(layer) for layer in (0, 1)}
    bases |= {f"blocks.{layer}.hook_resid_mid": random_basis(5 + layer) for layer in (0, 1)}
    with tangentlens.probe(model, bases, probes=("attention",), head_null=99) as session:
        forward(model, ids, mask)  # 99 frames: the null has its z too
    return session.results()


def test_head_arrays_shape_labels_and_values(table: pd.DataFrame) -> None:
    arrays = tangentlens.head_arrays(table, "score_share_TT")
    assert arrays.values.shape == (2, 4) and np.asarray(arrays).shape == (2, 4)
    assert arrays.layers == (0, 1) and arrays.heads == (0, 1, 2, 3)
    assert arrays.kv_groups == (0, 0, 1, 1)
    rows = table[(table.statistic == "score_share_TT") & (table.layer == 1)].sort_values("head")
    np.testing.assert_array_equal(arrays.values[1], rows["value"].to_numpy())
    assert arrays.frame().loc[1, 2] == arrays.values[1, 2]
    twice = pd.concat([table, table.assign(value=table["value"] + 1)])
    with pytest.raises(UsageError, match="mean=True"):
        head_arrays(twice, "score_share_TT")
    np.testing.assert_allclose(head_arrays(twice, "score_share_TT", mean=True).values,
                               arrays.values + 0.5)  # fmt: skip
    with pytest.raises(UsageError, match="per-head"):
        head_arrays(table, "no_such_statistic")


def test_plot_heads_panels_and_group_lines(table: pd.DataFrame) -> None:
    fig = tangentlens.plot_heads(table)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == [*TERM_PANELS, "write_share"]
    for ax in panels:  # one separator between the two key/value groups, at head 1.5
        assert [line.get_xdata()[0] for line in ax.lines] == [1.5]
    z = plot_heads(table, ["score_share_TT_z", "write_share_z", "score_share_TT_p_value"])
    image = z.axes[0].images[0]
    assert image.norm.vmin == -image.norm.vmax  # diverging, centred on 0
    p = z.axes[2].images[0].norm  # log scale from the smallest p-value (at most 0.1) to 1
    assert isinstance(p, LogNorm) and p.vmax == 1 and 1 / 100 <= p.vmin <= 0.1
