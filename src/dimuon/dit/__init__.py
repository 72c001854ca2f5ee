"""DiT harness building blocks: model, rectified-flow objective, ODE sampler, data and EMA.

This layer knows nothing of optimizers, training loops or metrics. The optional diffusers adapter
lives in ``dimuon.dit.diffusers_adapter`` and is imported on demand.
"""

from dimuon.dit.data import (
    DATASETS,
    ArrayDataset,
    BatchSchedule,
    ImageFolderDataset,
    build_dataset,
    check_image_shape,
    get_batch,
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
    "DATASETS",
    "DEFAULT_T_GRID",
    "DIT_MODELS",
    "EMA",
    "ArrayDataset",
    "BatchSchedule",
    "DiT",
    "ImageFolderDataset",
    "TimestepDist",
    "ValidationLoss",
    "build_dataset",
    "build_dit",
    "check_image_shape",
    "dit_arch",
    "euler",
    "flow_loss",
    "get_batch",
    "guided_velocity",
    "heun",
    "integrate",
    "interpolate",
    "patchify",
    "sample",
    "unpatchify",
    "validation_loss",
    "velocity_target",
]
