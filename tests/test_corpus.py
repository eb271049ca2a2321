"""Corpus loading, token batches, token counts and unigram entropy."""

from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tangentlens.data import corpus

TEXT = "In the beginning God created the heaven and the earth.\nAnd the earth was void.\n"


@pytest.fixture(scope="module")
def raw_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.load_lines(max_chars=20_000), trainer)
    return tok


def test_kjv_is_the_default_corpus():
    lines = corpus.load_lines()
    assert len(lines) > 30_000
    assert lines[0] == "In the beginning God created the heaven and the earth."
    assert corpus.load_lines("kjv") == lines
    short = corpus.load_lines(max_chars=1000)
    assert 0 < len(short) < 30 and short == lines[: len(short)]


def test_file_and_folder_read_the_same(tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "a.txt").write_text(TEXT)
    (tmp_path / "docs" / "sub" / "b.txt").write_text("  second file  \n\n")
    (tmp_path / "docs" / "ignored.md").write_text("not text")
    (tmp_path / "one.txt").write_text(TEXT + "second file\n")
    assert corpus.load_lines(tmp_path / "docs") == corpus.load_lines(tmp_path / "one.txt")
    assert corpus.load_text(tmp_path / "one.txt").endswith("second file\n")


def test_empty_or_missing_corpus_fails_clearly(tmp_path):
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match="is empty; pass a file or folder"):
        corpus.load_lines(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match=r"no \.txt files"):
        corpus.load_lines(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        corpus.load_lines(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="max_chars"):
        corpus.load_lines(max_chars=0)


def test_counts_agree_across_tokenizer_kinds(raw_tokenizer, tmp_path):
    (tmp_path / "t.txt").write_text(TEXT)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw_tokenizer)
    raw = corpus.token_counts(raw_tokenizer, tmp_path / "t.txt")
    wrapped = corpus.token_counts(hf, tmp_path / "t.txt")
    assert torch.equal(raw, wrapped)
    assert raw.shape == (corpus.vocab_size(raw_tokenizer),)
    ids = corpus.encode(raw_tokenizer, corpus.load_lines(tmp_path / "t.txt"))
    assert int(raw.sum()) == ids.numel()
    assert raw_tokenizer.decode(ids.tolist()) == TEXT


def test_unigram_entropy():
    assert corpus.unigram_entropy(torch.tensor([5, 5, 5, 5, 0])) == pytest.approx(math.log(4))
    assert corpus.unigram_entropy(torch.tensor([7, 0])) == pytest.approx(0.0)
    p = torch.tensor([0.5, 0.25, 0.25])
    assert corpus.unigram_entropy(torch.tensor([2, 1, 1])) == pytest.approx(
        float(-(p * p.log()).sum())
    )
    with pytest.raises(ValueError, match="all zero"):
        corpus.unigram_entropy(torch.zeros(3))


def test_token_batches_are_disjoint_seeded_and_resumable():
    ids = torch.arange(1000)
    tb = corpus.token_batches(None, ids=ids, seq_len=10, probe_fraction=0.2, seed=3)
    assert tb.train.shape == (80, 10) and tb.probe.shape == (20, 10)
    starts_train = set(tb.train[:, 0].tolist())
    starts_probe = set(tb.probe[:, 0].tolist())
    assert not starts_train & starts_probe
    assert starts_train | starts_probe == set(range(0, 1000, 10))
    again = corpus.token_batches(None, ids=ids, seq_len=10, probe_fraction=0.2, seed=3)
    other = corpus.token_batches(None, ids=ids, seq_len=10, probe_fraction=0.2, seed=4)
    assert torch.equal(tb.probe, again.probe) and not torch.equal(tb.probe, other.probe)
    # One epoch of batches visits every training block exactly once; batches are a
    # pure function of the step.
    epoch = torch.cat([tb.batch(s, 8) for s in range(10)])
    assert sorted(epoch[:, 0].tolist()) == sorted(starts_train)
    assert torch.equal(tb.batch(13, 8), again.batch(13, 8))
    assert sum(b.shape[0] for b in tb.probe_batches(6)) == 20


def test_token_batches_bad_input():
    with pytest.raises(ValueError, match="too few"):
        corpus.token_batches(None, ids=torch.arange(15), seq_len=10)
    with pytest.raises(ValueError, match="seq_len"):
        corpus.token_batches(None, ids=torch.arange(15), seq_len=1)
    with pytest.raises(ValueError, match="probe_fraction"):
        corpus.token_batches(None, ids=torch.arange(100), probe_fraction=1.0)
    tb = corpus.token_batches(None, ids=torch.arange(100), seq_len=10)
    with pytest.raises(ValueError, match="smaller batch"):
        tb.batch(0, 50)
