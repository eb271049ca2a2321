"""Reading a study's results table with pandas.

    python examples/read_results.py [STUDY_DIR]   # default: the demo's runs/demo/decoder/seed0

One long table: checkpoint, step, window, rank, layer, head, site, probe,
statistic, value (+ ci_low, ci_high). Pivot it however the question needs.
"""

import sys
from pathlib import Path

import pandas as pd

results_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/demo/decoder/seed0")
df = pd.read_csv(results_dir / "results.csv")

# Gradient energy ratio of Q_T per layer, early vs late window.
ratio = df[df.statistic == "energy_ratio"]
print(ratio.pivot_table(index="layer", columns="window", values="value", aggfunc="mean"))

# How often Q_T's gradient energy beats uniformly random k-frames at the 1 % level: a
# p-value floors at 1/(n_controls + 1), recorded in the study's manifest.json.
p = df[df.statistic == "p_value"]
print(f"p-values: median {p.value.median():.4f}, share <= 0.01: {(p.value <= 0.01).mean():.2f}")

# Frequency vs distance to the centre, per centre convention, over training.
emb = df[df.statistic.str.startswith("pearson_")]
print(emb.pivot_table(index="step", columns="statistic", values="value").round(3))
