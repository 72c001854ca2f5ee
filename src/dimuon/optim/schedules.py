"""Schedules: which direction map a Muon-family group applies at step ``t``, and its step multiplier.

The optimizers share one core and differ only here (docs/algorithms.md, "Schedules"). A schedule
reads its hyperparameters from the parameter group, so they live in ``state_dict`` with the
step counter and a resumed run continues the exact same sequence of step kinds. A fixed schedule
picks one kind per group and step; a per-matrix schedule (:class:`AdaptiveRowSchedule`) picks one per
matrix from the matrix's own phase and staleness signal, which the core keeps in the optimizer state.
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
    per_matrix: bool = False  # True: kinds are decided per matrix by ``decide``, not per group by ``kind``
    kinds: tuple[StepKind, ...] = (StepKind.SPECTRAL,)  # every kind the schedule may take

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
    kinds: tuple[StepKind, ...] = (StepKind.SPECTRAL, StepKind.ROWNORM)

    def kind(self, step: int, group: Mapping[str, Any]) -> StepKind:
        return StepKind.SPECTRAL if step % int(group["k"]) == 0 else StepKind.ROWNORM


@dataclass(frozen=True)
class BlockPeriodicSchedule(Schedule):
    """MuonBP: full spectral when ``t % period == 0``, block-wise spectral otherwise."""

    name: str = "muon_bp"
    kinds: tuple[StepKind, ...] = (StepKind.SPECTRAL, StepKind.BLOCK)

    def kind(self, step: int, group: Mapping[str, Any]) -> StepKind:
        return StepKind.SPECTRAL if step % int(group["period"]) == 0 else StepKind.BLOCK


NEVER_REFRESHED = -1  # the age of a matrix that has not taken a spectral step yet


@dataclass(frozen=True)
class AdaptiveRowSchedule(Schedule):
    """Per matrix: spectral when its staleness (``dimuon.optim.staleness``) is above ``threshold``, RowNorm
    (scaled by ``gamma``) otherwise, with ``k_min <= interval <= k_max`` between its spectral steps.

    ``age`` is ``t - s``: the steps from the matrix's last spectral step ``s`` to the coming step ``t``
    (:data:`NEVER_REFRESHED` before its first). The signal is only needed where the bounds leave the choice
    open (``k_min <= age < k_max``); see :meth:`needs_signal`.
    """

    name: str = "adaptive_row_muon"
    per_matrix: bool = True
    kinds: tuple[StepKind, ...] = (StepKind.SPECTRAL, StepKind.ROWNORM)

    def kind(self, step: int, group: Mapping[str, Any]) -> StepKind:
        raise TypeError("AdaptiveRowSchedule picks a kind per matrix (decide), not per group")

    def needs_signal(self, age: int, group: Mapping[str, Any]) -> bool:
        return age != NEVER_REFRESHED and int(group["k_min"]) <= age < int(group["k_max"])

    def decide(self, age: int, signal: float | None, group: Mapping[str, Any]) -> StepKind:
        """The kind of one matrix's coming step; ``signal`` is read only where :meth:`needs_signal` holds."""
        if age == NEVER_REFRESHED or age >= int(group["k_max"]):
            return StepKind.SPECTRAL
        if age < int(group["k_min"]):
            return StepKind.ROWNORM
        assert signal is not None, "the staleness signal is needed when k_min <= age < k_max"
        return StepKind.SPECTRAL if signal > float(group["threshold"]) else StepKind.ROWNORM


SCHEDULES: dict[str, Schedule] = {
    s.name: s for s in (Schedule(), PeriodicRowSchedule(), BlockPeriodicSchedule(), AdaptiveRowSchedule())
}
