"""The same probes on an nnsight model, and the remote-ready statistics path.

    python examples/nnsight_probe.py [--fast]

`tangentlens.probes.run` (like `tangentlens.probe`) dispatches on the model type, so
the code is the one you would write for TransformerLens. `trace_moments` reduces
activations to sufficient statistics *inside* an nnsight trace, so a `remote=True`
(NDIF) run sends back Moments (count, mean and scatter), never activations.
"""

from _common import model_name, parse_args, token_batches

import tangentlens
from tangentlens import models
from tangentlens.hooks.nnsight import moments_from_saved, trace_moments

args = parse_args(__doc__)
lm, tokenizer = models.load(model_name(args.fast), backend="nnsight")
batches = token_batches(tokenizer)

bases = tangentlens.fit_bases(lm, batches[:2], rank=8, progress=False)
session = tangentlens.probes.run(
    lm, batches[2:], bases, probes=("residual", "gradient"), progress=False
)
print(session.results().query("statistic == 'tangent_share'").head(8).to_string(index=False))

# Remote-ready: only count, mean and scatter leave the trace. Pass remote=True for NDIF.
with lm.trace(batches[0]):
    saved = trace_moments(lm, ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"])
for site, m in moments_from_saved(saved).items():
    iso = tangentlens.core.metrics.isoscore(m)
    print(f"{site.hook_name}: {m.count} tokens, d={m.d}, IsoScore {iso:.3f}")
