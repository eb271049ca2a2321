"""Token ids padded by ``model.to_tokens(texts)`` are read with TransformerLens' own mask:
the tables equal those of the texts, and an ambiguous pad token is named."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from models import tl_bridge

import tangentlens
from tangentlens.core.errors import PaddingWarning
from tangentlens.models.batches import as_batches, derive_mask

TEXTS = [
    "every layer writes into the residual stream",
    "small models learn fast",
    "the cat sat",
]
KEY = ["probe", "hook", "site", "layer", "head", "statistic"]


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(KEY).reset_index(drop=True)


def _assert_same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    """Equal tables; z-scores and control means with the padding test's tolerances."""
    a, b = _sorted(a), _sorted(b)
    pd.testing.assert_frame_equal(a[KEY], b[KEY])
    stat = a["statistic"]
    z = stat.str.endswith("_z").to_numpy()
    mc = stat.isin(["iso_statistic", "delta_iso_normal"]).to_numpy()
    exact = ~(z | mc)
    np.testing.assert_allclose(a["value"][exact], b["value"][exact], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(a["value"][z], b["value"][z], rtol=1e-3)
    np.testing.assert_allclose(a["value"][mc], b["value"][mc], rtol=1e-5, atol=1e-8)


def test_to_tokens_gives_the_table_of_the_texts() -> None:
    model = tl_bridge("llama")
    padded = model.to_tokens(TEXTS)  # BOS, as the tokenizer adds it to each text
    assert bool((padded == model.tokenizer.pad_token_id).any())  # right padding to read
    with warnings.catch_warnings():
        warnings.simplefilter("error", PaddingWarning)  # pad is not BOS/EOS here
        from_ids = tangentlens.fit_bases(model, padded, rank=2, layers=[0], progress=False)
    from_text = tangentlens.fit_bases(model, TEXTS, rank=2, layers=[0], progress=False)
    for site, basis in from_text.items():
        assert from_ids.moments[site].count == from_text.moments[site].count
        torch.testing.assert_close(from_ids[site].projector(), basis.projector(), atol=1e-6, rtol=0)
    opts = {"progress": False, "n_controls": 3, "head_null": 4}  # every probe `run` runs
    table_ids = tangentlens.probes.run(model, padded, from_text, **opts).results()
    table_text = tangentlens.probes.run(model, TEXTS, from_text, **opts).results()
    assert {"residual", "attention", "gradient"} <= set(table_ids["probe"])
    _assert_same(table_ids, table_text)
    counts = table_ids.query("statistic == 'n_tokens' and probe == 'residual'")["value"]
    assert (counts == sum(len(model.tokenizer(t)["input_ids"]) for t in TEXTS)).all()


def test_to_tokens_with_bos_equals_each_text_unpadded() -> None:
    model = tl_bridge("gpt2")
    padded = model.to_tokens(TEXTS)
    singles = [model.to_tokens(t) for t in TEXTS]
    bases = tangentlens.fit_bases(model, singles * 2, rank=2, layers=[0], progress=False)
    opts = {"progress": False, "n_controls": 3}
    _assert_same(
        tangentlens.probes.run(model, padded, bases, ("residual",), **opts).results(),
        tangentlens.probes.run(model, singles, bases, ("residual",), **opts).results(),
    )


def _fake(pad: int, bos: int, eos: int, side: str = "right", prepend: bool = True):
    tok = SimpleNamespace(pad_token_id=pad, bos_token_id=bos, eos_token_id=eos, padding_side=side)
    return SimpleNamespace(tokenizer=tok, cfg=SimpleNamespace(default_prepend_bos=prepend))


def test_derive_mask_follows_transformer_lens() -> None:
    from transformer_lens.utilities import get_attention_mask

    ids = torch.tensor([[5, 6, 7, 0], [5, 0, 6, 0], [0, 0, 5, 6], [0, 5, 0, 0]])
    for side in ("right", "left"):
        for pad, bos in ((0, 2), (0, 0)):
            model = _fake(pad, bos, 1, side)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PaddingWarning)
                ours = derive_mask(model, ids)
            theirs = get_attention_mask(model.tokenizer, ids, True, padding_side=side)
            assert torch.equal(torch.ones_like(ids) if ours is None else ours, theirs)
    assert derive_mask(_fake(9, 2, 1), ids) is None  # nothing padded: no mask
    assert derive_mask(SimpleNamespace(), ids) is None  # no tokenizer: as TransformerLens
    model = tl_bridge("llama")
    ids = torch.tensor([[5, 6, 7]])
    assert as_batches(model, ids)[0] is ids  # unpadded ids pass through unchanged


def test_a_pad_token_shared_with_eos_is_named() -> None:
    ids = torch.tensor([[5, 6, 7], [5, 1, 1]])
    with pytest.warns(PaddingWarning, match="EOS token.*Pass the texts"):
        mask = derive_mask(_fake(1, 2, 1), ids)
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
