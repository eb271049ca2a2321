"""The exactness table: per family and backend, the five terms sum to the model's own
eager-attention scores and rebuild its attention weights, every probe runs, and the
TransformerLens and nnsight tables agree (measurements: ``tests/exactness.py``;
``docs/EXACTNESS.md`` is written from them by ``benchmarks/exactness_table.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from exactness import CASES, PROBES, QK_NORM, agreement, split_errors, table
from models import BRIDGE_FAMILIES, ENCODERS, WINDOW

TOL = 1e-5
DOC = Path(__file__).resolve().parents[1] / "docs" / "EXACTNESS.md"

# expected window per layer: Mistral slides everywhere, Qwen2 and Gemma 3 on one layer,
# ModernBERT's local middle layer keeps |q − k| ≤ WINDOW (its window attribute is + 1)
WINDOWS = {
    "mistral": [WINDOW, WINDOW],
    "qwen2": [None, WINDOW],
    "gemma3": [WINDOW, None],
    "modernbert": [None, WINDOW + 1, None],
}


@pytest.mark.parametrize(("family", "backend"), CASES)
def test_split_is_exact_and_every_probe_runs(family: str, backend: str) -> None:
    errors = split_errors(family, backend)
    print(f"\n{family} / {backend}: {errors}")
    assert errors["scores"] < TOL
    assert errors["pattern"] < TOL
    assert errors["causal"] == (family not in ENCODERS)
    assert errors["windows"] == WINDOWS.get(family, [None] * len(errors["windows"]))
    assert errors["linearised"] == ({"qk_norm"} if family in QK_NORM else set())

    results = table(family, backend)
    assert set(PROBES) <= set(results["probe"])
    marked = results[results["statistic"] == "linearised_qk_norm"]
    attention = results[results["probe"] == "attention"]
    attention_sites = attention.loc[attention["site"] == "attn_in", "hook"].nunique()
    assert len(marked) == (attention_sites if family in QK_NORM else 0)
    assert (marked["value"] == 1).all() and marked["head"].isna().all()


@pytest.mark.parametrize("family", BRIDGE_FAMILIES)
def test_backends_agree(family: str) -> None:
    rows, err = agreement(table(family, "transformer_lens"), table(family, "nnsight"))
    print(f"\n{family}: {rows} rows agree, max diff {err:.1e}")
    assert rows > 100
    assert err < TOL


def test_exactness_doc_lists_every_case() -> None:
    """docs/EXACTNESS.md is regenerated when a family or backend is added."""
    text = DOC.read_text(encoding="utf-8")
    for family, backend in CASES:
        assert f"| {family} | {backend} |" in text, (family, backend)
