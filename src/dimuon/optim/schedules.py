"""Schedules: which direction map a Muon-family group applies at step ``t``, and its step multiplier.

The three optimizers share one core and differ only here (docs/algorithms.md, "Schedules"). A schedule
reads its hyperparameters from the parameter group, so they live in ``state_dict`` with the
step counter and a resumed run continues the exact same sequence of step kinds.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class StepKind(str, enum.Enum):
    """The direction map of one step."""

    SPECTRAL = "spectral"  # Newton-Schulz on the whole matrix
    ROWNORM = "rownorm"  # each oriented row normalized
    BLOCK = "block"  # Newton-Schulz on each row block (shard) on its own


@dataclass(frozen=True)
class Schedule:
    """Base: spectral every step (plain Muon)."""

    name: str = "muon"

    def kind(self, step: int, group: Mapping[str, Any]) -> StepKind:
        return StepKind.SPECTRAL

    def multiplier(self, kind: StepKind, group: Mapping[str, Any]) -> float:
        if kind is StepKind.ROWNORM:
            return float(group["gamma"])
        if kind is StepKind.BLOCK:
            return float(group["block_lr_ratio"])
        return 1.0


@dataclass(frozen=True)
class PeriodicRowSchedule(Schedule):
    """Spectral when ``t % k == 0``, RowNorm (scaled by ``gamma``) otherwise."""

    name: str = "periodic_row_muon"

    def kind(self, step: int, group: Mapping[str, Any]) -> StepKind:
        return StepKind.SPECTRAL if step % int(group["k"]) == 0 else StepKind.ROWNORM


@dataclass(frozen=True)
class BlockPeriodicSchedule(Schedule):
    """MuonBP: full spectral when ``t % period == 0``, block-wise spectral otherwise."""

    name: str = "muon_bp"

    def kind(self, step: int, group: Mapping[str, Any]) -> StepKind:
        return StepKind.SPECTRAL if step % int(group["period"]) == 0 else StepKind.BLOCK


SCHEDULES: dict[str, Schedule] = {
    s.name: s for s in (Schedule(), PeriodicRowSchedule(), BlockPeriodicSchedule())
}
