"""The DiT training harness: ``dimuon train`` (config, loop, checkpoints, logs) and ``dimuon sample``.

The flow of a run: ``config`` (the flags, checked) -> ``plan`` (resolved once into data, model,
optimizer, schedule, evaluation, run layout and what ``resume`` continues from) -> ``loop`` (a
:class:`~dimuon.train.loop.Trainer`: the step and its log / validate / sample / evaluate / checkpoint
hooks), writing through ``records``, ``rundir``, ``checkpoint``, ``gen_eval`` and ``plots``; ``failures``
holds the non-finite policy and :class:`RunFailed`, the error of a run that stopped early; ``stop`` the stop
signals and :class:`RunStopped`, raised once a signal's checkpoint is saved.

Layering: a command. It may import the building blocks (``dimuon.dit``, ``dimuon.data``,
``dimuon.metrics``), ``dimuon.optim``, ``dimuon.io`` and ``dimuon.log``; it must not import the other
commands (``dimuon.eval``, ``dimuon.bench``). It uses ``dimuon.optim`` like any user script: the
optimizer is built by name with ``dimuon.optim.build``, and its ``--optim.*`` flags are derived from
the optimizers' signatures. Checkpoints are read back with ``dimuon.dit.load_model_for_eval``.
"""

from dimuon.train.config import ConfigError, OptimOptions, TrainConfig
from dimuon.train.failures import RunFailed
from dimuon.train.loop import train
from dimuon.train.stop import RunStopped

__all__ = ["ConfigError", "OptimOptions", "RunFailed", "RunStopped", "TrainConfig", "train"]
