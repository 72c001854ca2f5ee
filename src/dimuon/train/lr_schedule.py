"""Learning-rate multiplier as a pure function of the step, so a resumed run needs no scheduler state."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LrSchedule", "lr_factor"]


def lr_factor(step: int, steps: int, warmup_steps: int, shape: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at 0-based ``step`` of ``steps``: linear warmup, then ``shape``.

    Warmup reaches 1 at step ``warmup_steps - 1``; ``cosine`` and ``linear`` then decay to ``min_ratio``
    at the last step; ``constant`` stays at 1.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if shape == "constant":
        return 1.0
    span = max(1, steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if shape == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    raise ValueError(f"unknown lr schedule {shape!r}; choose cosine, linear or constant")


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate of every step: ``peak`` times :func:`lr_factor`."""

    peak: float
    steps: int
    warmup_steps: int
    shape: str
    min_ratio: float

    def lr(self, step: int) -> float:
        """The learning rate of 0-based ``step``."""
        return self.peak * lr_factor(step, self.steps, self.warmup_steps, self.shape, self.min_ratio)
