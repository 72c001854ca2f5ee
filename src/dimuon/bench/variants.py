"""One optimizer configuration of a benchmark, as ``bench optimizer``, ``bench comm`` and ``bench census`` tabulate
them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Variant:
    """A table label, the ``dimuon.optim.build`` name and options, the steps after which its schedule repeats
    (``bench comm`` averages over one such period, ``bench optimizer`` times one per sample), the steps
    ``bench census`` records (1-based), how the parameters are grouped (``per_head``: every attention head its own
    matrix) and the steps ``bench optimizer`` takes untimed first (to time one step kind alone)."""

    label: str
    name: str
    options: dict[str, Any]
    period: int = 1
    steps: tuple[int, ...] = (1,)
    groups: Literal["default", "per_head"] = "default"
    untimed_steps: int = 0


def check_lr(lr: float) -> None:
    """``--lr``, the learning rate every variant of a benchmark takes: one the optimizers take, checked at start-up
    (each optimizer would refuse it later, one configuration at a time)."""
    if not 0 <= lr < math.inf:  # NaN too
        raise ValueError(f"--lr must be a finite number >= 0, got {lr}")
