"""Process-group setup and FSDP2 sharding for training: one process, or ``torchrun`` with N ranks."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from dimuon.dit.parallel import Parallelism, apply_parallelism, build_mesh, tp_process_group

T = TypeVar("T")

__all__ = [
    "DataParallel",
    "DistEnv",
    "all_gather_objects",
    "barrier",
    "data_parallel",
    "mean_over_ranks",
    "on_main",
    "setup",
    "shard_model",
]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: its rank, the world size and its device."""

    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def _pick_device(flag: str, local_rank: int) -> torch.device:
    if flag == "cuda" or (flag == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(device: str = "auto", threads: int | None = None) -> DistEnv:
    """Join the process group that torchrun describes in the environment (if any) and pick the device.

    A group that is already initialized (e.g. by a test launcher) is used as it is.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _pick_device(device, local_rank)
    if world > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            # The current device first: NCCL, object collectives and barriers use it. device_id binds the
            # group to it (the communicator forms now, so a broken NCCL set-up fails here, not mid-step).
            torch.cuda.set_device(dev)
            dist.init_process_group("nccl", device_id=dev)
        else:
            dist.init_process_group("gloo")
    if dist.is_initialized():
        return DistEnv(rank=dist.get_rank(), world=dist.get_world_size(), device=dev)
    return DistEnv(rank=0, world=1, device=dev)


@dataclass(frozen=True)
class DataParallel:
    """Which slice of every batch this rank trains on: ranks of one context- or tensor-parallel group share a
    slice."""

    rank: int
    world: int


def data_parallel(env: DistEnv, par: Parallelism) -> DataParallel:
    """The data-parallel rank and size: the mesh puts cp and tp last, so the ranks that share samples (a cp x tp
    group) are consecutive."""
    peers = par.cp * par.tp
    return DataParallel(rank=env.rank // peers, world=env.world // peers)


def shard_model(
    model: nn.Module, env: DistEnv, par: Parallelism, param_dtype: torch.dtype | None = None
) -> ProcessGroup | None:
    """Lay the model out on one device mesh of the ``par`` degrees (dimuon.dit.parallel): the tensor-parallel
    plan over ``tp``, the token split over ``cp``, then FSDP2 per block and root over the data-parallel dimensions
    (HSDP with replicas), all-gathering in ``param_dtype`` with fp32 gradient reductions where given
    (``--precision bf16``).

    The root also reshards after forward: gradient-free forwards (validation, sampling) then leave
    every parameter sharded, which the EMA's weight swap relies on. Returns the group that shares the plain
    parameters under tensor parallelism alone (the optimizer's ``process_group``), else None.
    """
    mesh = build_mesh(par, env.device.type)
    apply_parallelism(model, par, mesh, reshard_root=True, param_dtype=param_dtype)
    return tp_process_group(par, mesh)


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def mean_over_ranks(value: torch.Tensor, env: DistEnv) -> float:
    """The mean of a scalar tensor over all ranks (the value itself in one process)."""
    if env.distributed:
        value = value.detach().clone()
        dist.all_reduce(value)
        value /= env.world
    return float(value)


def all_gather_objects(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's ``obj``, in rank order (a one-item list in one process)."""
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world
    dist.all_gather_object(out, obj)
    return out


def on_main(fn: Callable[[], T], env: DistEnv) -> T:
    """Run ``fn`` on rank 0 only and give every rank its result, or raise its exception on every rank.

    Checks of the file system go through here, so that all ranks agree and none waits forever in a
    collective that a failed rank never reaches.
    """
    result: Any = None
    error: BaseException | None = None
    if env.is_main:
        try:
            result = fn()
        except Exception as e:
            error = e
    if env.distributed:
        result, error = all_gather_objects((result, error), env)[0]
    if error is not None:
        raise error
    return result
