"""The paper's experiment over a checkpoint series: config, collection, analysis.

>>> from tangentlens.study import Study, StudyConfig
>>> frame = Study(StudyConfig(checkpoints="runs/train")).run("runs/study")  # a `train` folder
"""

from .config import StudyConfig, open_series
from .pipeline import Study

__all__ = ["Study", "StudyConfig", "open_series"]
