"""The DiT and what acts on it: model, rectified-flow objective, ODE sampler, EMA, and checkpoints read back.

Layering: a building block. It may import ``dimuon.io``; it must not import ``dimuon.data``,
``dimuon.metrics``, ``dimuon.optim`` or the commands (``train``, ``eval``, ``bench``): the model
knows nothing of data sets, optimizers, training loops or metrics. The optional diffusers adapter
lives in ``dimuon.dit.diffusers_adapter`` and is imported on demand.
"""

from dimuon.dit.checkpoint import (
    CheckpointError,
    find_checkpoint,
    list_checkpoints,
    load_model_for_eval,
    read_meta,
    verify_checkpoint,
)
from dimuon.dit.ema import EMA
from dimuon.dit.flow import (
    DEFAULT_T_GRID,
    TimestepDist,
    ValidationLoss,
    flow_loss,
    interpolate,
    validation_loss,
    velocity_target,
)
from dimuon.dit.model import DIT_MODELS, DiT, build_dit, dit_arch, patchify, unpatchify
from dimuon.dit.sampler import euler, guided_velocity, heun, integrate, sample

__all__ = [
    "DEFAULT_T_GRID",
    "DIT_MODELS",
    "EMA",
    "CheckpointError",
    "DiT",
    "TimestepDist",
    "ValidationLoss",
    "build_dit",
    "dit_arch",
    "euler",
    "find_checkpoint",
    "flow_loss",
    "guided_velocity",
    "heun",
    "integrate",
    "interpolate",
    "list_checkpoints",
    "load_model_for_eval",
    "patchify",
    "read_meta",
    "sample",
    "unpatchify",
    "validation_loss",
    "velocity_target",
    "verify_checkpoint",
]
