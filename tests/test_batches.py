"""What a model is fed: tensors, dicts and text all become the same batches."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from models import tl_bridge

import tangentlens
from tangentlens.core.errors import UsageError
from tangentlens.models.batches import (
    as_batches,
    check_tokens,
    draw_masked,
    iter_batches,
    text_batches,
    unpack_batch,
)

TEXTS = [
    "every layer writes into the residual stream",
    "small models learn fast",
    "every layer writes into the residual stream",
]


def _table(session: tangentlens.probes.ProbeSession) -> pd.DataFrame:
    df = session.results(progress=False)
    return df.sort_values(["hook", "statistic"]).reset_index(drop=True)


def test_text_batches_pad_right_with_a_mask_and_leave_the_tokenizer_alone():
    tok = tl_bridge("llama").tokenizer
    padding_side = tok.padding_side
    out = text_batches(tok, TEXTS, batch_size=2)
    assert len(out) == 2
    first, second = out
    lengths = [len(tok(t)["input_ids"]) for t in TEXTS]
    assert lengths[0] != lengths[1]  # the first batch needs padding
    assert set(first) == {"input_ids", "attention_mask"}
    for row, text in enumerate(TEXTS[:2]):
        ids = tok(text)["input_ids"]
        assert first["input_ids"][row, : len(ids)].tolist() == ids
        assert first["attention_mask"][row].tolist() == [1] * len(ids) + [0] * (
            first["input_ids"].shape[1] - len(ids)
        )
    assert isinstance(second, torch.Tensor)  # one text, one length: a plain tensor
    assert second[0].tolist() == tok(TEXTS[2])["input_ids"]
    assert text_batches(tok, TEXTS[0], max_length=3)[0].shape == (1, 3)
    assert tok.padding_side == padding_side


def test_as_batches_accepts_tensors_dicts_text_and_streams():
    model = tl_bridge("llama")
    ids = torch.randint(0, 20, (4, 7))
    assert [b is ids for b in as_batches(model, ids)] == [True]  # one (4, 7) tensor: one batch
    assert as_batches(model, ids[0])[0].shape == (1, 7)
    assert len(as_batches(model, torch.stack([ids, ids]))) == 2
    assert as_batches(model, {"input_ids": ids})[0]["input_ids"] is ids
    assert len(as_batches(model, [ids, ids])) == 2
    texts = as_batches(model, TEXTS)
    assert len(texts) == 1 and texts[0]["input_ids"].shape[0] == 3
    assert len(as_batches(model, [TEXTS[0], TEXTS[1]], batch_size=1)) == 2
    seen = []

    def stream():
        for i in range(3):
            seen.append(i)
            yield ids

    lazy = iter_batches(model, stream())
    next(lazy)
    assert seen == [0]  # read one batch at a time


def test_text_needs_a_tokenizer_and_a_text_batch_names_the_fix():
    with pytest.raises(UsageError, match="no tokenizer"):
        as_batches(torch.nn.Linear(2, 2), "some text")
    with pytest.raises(UsageError, match="as_batches"):
        unpack_batch(["some text"])
    with pytest.raises(UsageError, match="iterable"):
        as_batches(tl_bridge("llama"), 3.5)


def test_run_on_text_equals_run_on_its_token_ids():
    model = tl_bridge("llama")
    tok = model.tokenizer
    ids = [torch.tensor([tok(TEXTS[0])["input_ids"]])]
    bases = tangentlens.fit_bases(model, ids * 2, rank=2, layers=[0], progress=False)
    probes = ("residual", "gradient")
    from_text = tangentlens.probes.run(model, TEXTS[0], bases, probes, progress=False)
    from_ids = tangentlens.probes.run(model, ids[0], bases, probes, progress=False)
    pd.testing.assert_frame_equal(_table(from_text), _table(from_ids))
    counts = _table(from_text).query("statistic == 'n_tokens' and probe == 'residual'")["value"]
    assert (counts == ids[0].numel()).all()


def test_padded_text_counts_only_real_tokens():
    model = tl_bridge("llama")
    tok = model.tokenizer
    bases = tangentlens.fit_bases(model, TEXTS, rank=2, layers=[0], progress=False)
    session = tangentlens.probes.run(model, TEXTS, bases, ("residual",), progress=False)
    counts = _table(session).query("statistic == 'n_tokens' and probe == 'residual'")["value"]
    assert (counts == sum(len(tok(t)["input_ids"]) for t in TEXTS)).all()


@pytest.mark.parametrize(
    "model",
    [
        SimpleNamespace(cfg=SimpleNamespace(d_vocab=10, n_ctx=4)),
        SimpleNamespace(config=SimpleNamespace(vocab_size=10, max_position_embeddings=4)),
    ],
    ids=["transformer_lens", "huggingface"],
)
def test_check_tokens_refuses_foreign_ids_and_sequences_past_the_context(model) -> None:
    check_tokens(model, torch.tensor([[0, 9, 3, 1]]))
    with pytest.raises(UsageError, match=r"from 0 to 10, outside the vocabulary \[0, 10\)"):
        check_tokens(model, torch.tensor([[0, 10]]))
    with pytest.raises(UsageError, match="from -1 to 0"):
        check_tokens(model, torch.tensor([[-1, 0]]))
    with pytest.raises(UsageError, match="seq_len=5 exceeds the 4 positions of ckpt"):
        check_tokens(model, torch.zeros(2, 5, dtype=torch.long), source="ckpt")
    check_tokens(SimpleNamespace(), torch.tensor([[10**6] * 9]))  # a model that says nothing


def test_draw_masked_masks_only_eligible_positions_and_at_least_one_per_row() -> None:
    eligible = torch.ones(64, 12, dtype=torch.bool)
    eligible[:, :2] = False
    eligible[-1] = False
    chosen = draw_masked(eligible, 0.15, seed=7)
    assert not (chosen & ~eligible).any()
    assert chosen[:-1].any(1).all() and not chosen[-1].any()
    assert torch.equal(chosen, draw_masked(eligible, 0.15, seed=7))
    assert not torch.equal(chosen, draw_masked(eligible, 0.15, seed=8))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_text_gives_both_backends_the_same_ids(arch: str) -> None:
    """A bridge's tokenizer adds BOS, the same Hugging Face tokenizer under nnsight may
    not: text reads as `to_tokens` does on both (BOS first where there is one)."""
    from models import hf_folder
    from transformers import AutoTokenizer

    bridge = tl_bridge(arch)
    plain = AutoTokenizer.from_pretrained(hf_folder(arch))
    ours, theirs = text_batches(bridge.tokenizer, TEXTS), text_batches(plain, TEXTS)
    for a, b in zip(ours, theirs, strict=True):
        a, b = (x if isinstance(x, dict) else {"input_ids": x} for x in (a, b))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for text in TEXTS:  # one text: a plain (1, pos) tensor, as to_tokens gives it
        ids = text_batches(plain, text)[0]
        assert int(ids[0, 0]) == plain.bos_token_id
        assert torch.equal(ids, bridge.to_tokens(text).cpu())
