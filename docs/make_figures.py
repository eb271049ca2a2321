"""Make the figures of docs/TUTORIAL.md from the README tour's own run (SmolLM2-135M, offline).

.venv/bin/python docs/make_figures.py      # writes docs/figures/{heads,layerwise,depth}.png
"""

from __future__ import annotations

from pathlib import Path

import tangentlens
from tangentlens import models
from tangentlens.analysis.layerwise import layerwise_probe, plot_layerwise
from tangentlens.data.corpus import token_batches

OUT = Path(__file__).parent / "figures"


def main() -> None:
    bridge, tokenizer = models.load("smollm2-135m")
    batches = token_batches(tokenizer, seq_len=64, max_chars=200_000).probe_batches(4)[:4]
    bases = tangentlens.fit_bases(bridge, batches[:2], rank=16, layers=[0, 3, 6], progress=False)
    table = tangentlens.probes.run(bridge, batches[2:], bases, progress=False).results()
    OUT.mkdir(exist_ok=True)
    tangentlens.plot_heads(table).savefig(OUT / "heads.png", dpi=110)
    tangentlens.DepthProfile(table).plot().savefig(OUT / "depth.png", dpi=110)
    linear = layerwise_probe(
        bridge, batches, bases, "position", tokens_per_layer=512, n_folds=3, progress=False
    )
    plot_layerwise(linear).savefig(OUT / "layerwise.png", dpi=110)


if __name__ == "__main__":
    main()
