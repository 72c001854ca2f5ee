"""What every part of the optimizer shares: the step kinds, the group algorithms, the non-finite policies and the
few helpers that read a parameter as the step sees it. It imports nothing of dimuon's but the layout's DTensor test,
so any module can use it without an import circle."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from dimuon.optim.distributed.layout import is_dtensor


class StepKind(str, enum.Enum):
    """The direction map of one step."""

    SPECTRAL = "spectral"  # Newton-Schulz on the whole matrix
    ROWNORM = "rownorm"  # each oriented row normalized
    BLOCK = "block"  # Newton-Schulz on each row block (shard) on its own


ALGORITHMS = ("muon", "adamw")

Nonfinite = Literal["raise", "skip"]

NONFINITE_POLICIES: tuple[str, ...] = get_args(Nonfinite)


def group_lr(group: dict[str, Any]) -> float | Tensor:
    """A group's lr as the step uses it: a number, or a 0-d Tensor (a view of a one-element lr of any shape, so a
    scheduler's in-place ``fill_`` still reaches it)."""
    lr = group["lr"]
    return lr.view(()) if isinstance(lr, Tensor) and lr.dim() != 0 else lr


def local_tensor(t: Tensor) -> Tensor:
    """The process-local data of a (possibly DTensor) tensor."""
    return t.to_local() if is_dtensor(t) else t


def local_tensors(tensors: Sequence[Any]) -> list[Any]:
    """Each (possibly DTensor) tensor's process-local data (None stays None), in one Python call for the list: its
    own data, as ``to_local()`` gives it under no_grad (which a compiled step traces instead)."""
    if torch.compiler.is_compiling():
        return [None if t is None else local_tensor(t) for t in tensors]
    return [getattr(t, "_local_tensor", t) for t in tensors]


def matrix_shape(p: Tensor, stacked: bool) -> tuple[int, int, int]:
    """``(count, rows, cols)`` of the matrices parameter ``p`` holds: one ``(shape[0], rest)`` matrix (a conv
    weight's flattening), or with ``stacked`` ``shape[0]`` matrices of ``(shape[1], rest)``."""
    if stacked:
        return p.shape[0], p.shape[1], math.prod(p.shape[2:])
    return 1, p.shape[0], math.prod(p.shape[1:])


def _some_names(names: Sequence[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names``, quoted, and how many more there are."""
    listed = ", ".join(repr(n) for n in names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")
