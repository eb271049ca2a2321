"""Tangent probes inside an existing TransformerLens `run_with_hooks` analysis.

    python examples/tl_run_with_hooks.py [--fast]

You keep your own hooks (here: one that records the attention pattern norm);
tangentlens adds its own around them and removes exactly those afterwards.
"""

from _common import model_name, parse_args, token_batches

import tangentlens
from tangentlens import models

args = parse_args(__doc__)
bridge, tokenizer = models.load(model_name(args.fast), backend="transformer_lens")
batches = token_batches(tokenizer)

# 1. Fit Q_T per layer (PCA of rank 8 on streamed activations; no activation cache).
bases = tangentlens.fit_bases(bridge, batches[:2], rank=8, progress=False)

# 2. Your analysis, unchanged, runs inside the probe context.
seen = []


def my_hook(pattern, hook):
    seen.append((hook.name, float(pattern.detach().norm())))


def hook_counts(model):
    """TransformerLens' own bookkeeping: hooks on every HookPoint."""
    return {name: (len(hp.fwd_hooks), len(hp.bwd_hooks)) for name, hp in model.hook_dict.items()}


hooks_before = hook_counts(bridge)
with tangentlens.probe(bridge, bases, probes=("residual", "attention", "gradient")) as session:
    for tokens in batches[2:]:
        loss = bridge.run_with_hooks(
            tokens, return_type="loss", fwd_hooks=[("blocks.0.attn.hook_pattern", my_hook)]
        )
        loss.backward()
assert hook_counts(bridge) == hooks_before  # exactly the hooks we added were removed

df = session.results()
print(f"your hook ran {len(seen)} times; the model has exactly the hooks it had before")
print(df[df.statistic.isin(["tangent_share", "energy_ratio"])].head(12).to_string(index=False))
if args.out:
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out / "results.csv", index=False)
