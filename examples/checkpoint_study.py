"""A checkpoint study from Python: train a small model, test Q_T across training.

    python examples/checkpoint_study.py [--fast] [--out DIR]

The same as `tangentlens train` then `tangentlens study`, as library calls.
"""

import tempfile
from pathlib import Path

from _common import parse_args

from tangentlens.data.train import TrainConfig, train
from tangentlens.study import Study, StudyConfig

args = parse_args(__doc__)
out = args.out or Path(tempfile.mkdtemp(prefix="tangentlens-study-"))
config = TrainConfig.tiny() if args.fast else TrainConfig()
checkpoints = train(config, out / "checkpoints", progress=not args.fast)

fast = {"rank": 4, "n_controls": 100, "seq_len": 32, "n_sequences": 8} if args.fast else {}
study = StudyConfig(checkpoints=str(checkpoints), **fast)
results = Study(study).run(out / "study", progress=not args.fast)
energy = results.query("statistic == 'energy_ratio'")
print(energy.groupby("window")["value"].describe()[["count", "mean", "min", "max"]])
print(f"results in {out / 'study'}")
