"""The DiT training harness: ``dimuon train`` (config, loop, checkpoints, logs) and ``dimuon sample``.

It uses ``dimuon.dit`` and ``dimuon.optim`` like any user script: the optimizer is built by name with
``dimuon.optim.build``. Checkpoints are read back with ``dimuon.dit.load_model_for_eval``.
"""

from dimuon.train.config import ConfigError, OptimOptions, TrainConfig
from dimuon.train.loop import train

__all__ = ["ConfigError", "OptimOptions", "TrainConfig", "train"]
