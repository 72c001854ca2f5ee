"""``dimuon train``'s flags resolved once, at start-up, into the parts a run needs.

:func:`resolve` checks the flags (:func:`dimuon.train.config.validate`), lets the optimizer check its
own options, finds what ``--resume`` continues from (with ``--resume auto``: whether the run in ``--out``
continues, and from which checkpoint; refusing flags a resumed run cannot change), and returns a
:class:`TrainPlan`: the run directory's layout, the data set, the model, the optimizer (name and ``build``
keywords), the learning-rate schedule, the evaluation settings and the resume point.
The training loop is handed these parts; nothing re-derives them from the flags later. The parallel
environment (:class:`~dimuon.train.distributed.DistEnv`) joins them when the process group is set up.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dimuon.data import DataSpec
from dimuon.dit import DiT, build_dit
from dimuon.dit.parallel import Parallelism
from dimuon.io import RunLayout
from dimuon.optim import OPTIMIZERS, build
from dimuon.optim.build import option_parameters
from dimuon.train.config import (
    RESUME_AUTO,
    ConfigError,
    EvalOptions,
    TrainConfig,
    changed_on_resume,
    check_resume_flags,
    config_to_dict,
    parallelism,
    validate,
)
from dimuon.train.lr_schedule import LrSchedule
from dimuon.train.optim_options import optimizer_kwargs
from dimuon.train.resume import AutoResume, ResumePoint, auto_resume_point, find_resume_point

__all__ = ["ModelSpec", "OptimizerSpec", "TrainPlan", "data_spec", "resolve", "resume_point"]


@dataclass(frozen=True)
class ModelSpec:
    """A DiT by registry name; its input size, channels and classes come from the data set."""

    name: str
    class_dropout: float

    def build(self, image_shape: tuple[int, int, int], num_classes: int) -> DiT:
        return build_dit(
            self.name,
            input_size=image_shape[1],
            in_channels=image_shape[0],
            num_classes=num_classes,
            class_dropout_prob=self.class_dropout,
        )


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer by name with the keyword options ``dimuon.optim.build`` receives."""

    name: str
    kwargs: dict[str, Any]

    def build(self, model: nn.Module, process_group: Any = None, nonfinite: str | None = None) -> torch.optim.Optimizer:
        """The optimizer over ``model``; a combination it refuses (e.g. a one-process baseline on FSDP) names the flag.

        ``process_group``: the ranks that hold the parameters outside a tensor-parallel plan as plain tensors
        (the Muon family splits their Newton-Schulz work over it; other optimizers need nothing). ``nonfinite``:
        the policy, for the optimizers that take one (the Muon family votes on the device).
        """
        takes = option_parameters(OPTIMIZERS[self.name])
        extra: dict[str, Any] = (
            {"process_group": process_group} if process_group is not None and "process_group" in takes else {}
        )
        if nonfinite is not None and "nonfinite" in takes:
            extra["nonfinite"] = nonfinite
        try:
            return build(self.name, model, **self.kwargs, **extra)
        except (NotImplementedError, ValueError) as e:  # a layout the optimizer refuses, named by it
            raise ConfigError(f"--optimizer {self.name}: {e}") from None

    def check(self) -> None:
        """Build it on a two-parameter stand-in, so its own checks run before the real model exists."""
        try:
            build(self.name, nn.Linear(4, 4), **self.kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--optimizer {self.name} rejects its options (--lr / --optim.*): {e}") from None


@dataclass(frozen=True)
class TrainPlan:
    """A training run as its parts: what each component needs, resolved from the flags once."""

    cfg: TrainConfig  # the flags as given: the loop's own settings (steps, intervals, seeds, ...)
    record: dict[str, Any]  # the flags as JSON: config.json and every checkpoint's "config"
    layout: RunLayout
    data: DataSpec
    model: ModelSpec
    optimizer: OptimizerSpec
    parallel: Parallelism  # checked against the model; resolved against the world size when the group exists
    lr_schedule: LrSchedule
    evaluation: EvalOptions | None  # None: no generation-quality evaluation during training
    resume: ResumePoint | None  # what --resume continues from (found on disk at start-up)
    auto_resume: AutoResume | None = None  # what --resume auto found in --out (None without it)
    # The flags that differ from the resumed checkpoint's config: {"--flag": [was, now]} (empty for a new run).
    changed: dict[str, list[Any]] = field(default_factory=dict)


def data_spec(cfg: TrainConfig) -> DataSpec:
    """The data set of ``--dataset`` with the build arguments of ``--data-path``, ``--image-size``, ``--channels``."""
    kwargs: dict[str, Any] = {}
    if cfg.dataset == "folder":
        kwargs["root"] = cfg.data_path
    elif cfg.dataset == "arrays":
        kwargs["path"] = cfg.data_path
    if cfg.image_size is not None:
        kwargs["image_size"] = cfg.image_size
    if cfg.channels is not None:
        kwargs["channels"] = cfg.channels
    if cfg.num_classes is not None:
        kwargs["num_classes"] = cfg.num_classes
    return DataSpec(cfg.dataset, kwargs)


def resume_point(cfg: TrainConfig, auto: AutoResume | None = None) -> ResumePoint | None:
    """What ``--resume`` continues from, with the flags checked against the run's saved config.

    With ``--resume auto`` it is what ``auto`` (found in ``--out`` when not given) continues; None there is a
    new run, as without ``--resume``. A resumed run is checked exactly as ``--resume PATH`` is.
    """
    if not cfg.resume:
        return None
    if cfg.resume == RESUME_AUTO:
        point = (auto or auto_resume_point(cfg.out)).point
        if point is None:
            return None
    else:
        point = find_resume_point(cfg.resume)
    check_resume_flags(cfg, point.config, point.where, point.resolved)
    if point.step > cfg.steps:
        raise ConfigError(
            f"--steps {cfg.steps} is behind the step {point.step} of {point.where}; pass --steps >= {point.step}"
        )
    return point


def resolve(cfg: TrainConfig) -> TrainPlan:
    """Check the flags and resolve them into a :class:`TrainPlan`; :class:`ConfigError` names a bad flag."""
    if cfg.data_path is not None:  # recorded as the run reads it: resumable and evaluable from any directory
        cfg = dataclasses.replace(cfg, data_path=os.path.abspath(cfg.data_path))
    validate(cfg)
    auto = auto_resume_point(cfg.out) if cfg.resume == RESUME_AUTO else None
    resume = resume_point(cfg, auto)  # first: a flag a resumed run cannot change is the error to report
    optimizer = OptimizerSpec(cfg.optimizer, optimizer_kwargs(cfg.optimizer, cfg.optim, cfg.lr))
    optimizer.check()
    record = config_to_dict(cfg)
    return TrainPlan(
        cfg=cfg,
        record=record,
        layout=RunLayout(Path(cfg.out)),
        data=data_spec(cfg),
        model=ModelSpec(cfg.model, cfg.class_dropout),
        optimizer=optimizer,
        parallel=parallelism(cfg),
        lr_schedule=LrSchedule(cfg.lr, cfg.steps, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio),
        evaluation=cfg.eval if cfg.eval.interval > 0 else None,
        resume=resume,
        auto_resume=auto,
        changed=changed_on_resume(resume.config, record) if resume is not None else {},
    )
