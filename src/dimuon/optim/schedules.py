"""Schedules: which direction map each matrix of a Muon-family group takes at a step, and what a schedule owns.

The optimizers share one core and differ only here (docs/algorithms.md, "Schedules"). A schedule owns its options
(defaults and checks), the multiplier of each step kind, and the decision of every matrix's kind at a step; one that
keeps state per matrix (:class:`~dimuon.optim.adaptive.AdaptiveRowSchedule`) also makes that state, reads it for
its decision and updates it after the weights move, through the hooks of :class:`Schedule`. The core asks and
applies, with no branch on which schedule it runs. Options are read from the parameter group, so they live in
``state_dict`` with the step counter and a resumed run continues the exact same sequence of step kinds.

Adding a schedule is one subclass here (or in a module of its own), one optimizer class with its declared signature
(:mod:`dimuon.optim.muon`) and one entry in :data:`dimuon.optim.build.OPTIMIZERS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from dimuon.optim.common import StepKind
from dimuon.optim.validation import check_number

if TYPE_CHECKING:
    from torch import Tensor

    from dimuon.optim.distributed.engine import DirectionEngine, MatrixJob


@dataclass(frozen=True)
class Option:
    """A schedule option: its default, its check (``check(name, value)`` raises naming ``name``) and its text (the
    optimizer's docstring and the ``--optim.*`` flag's help are made from it)."""

    default: Any
    check: Callable[[str, Any], None]
    doc: str = ""


def _positive_int(name: str, value: Any) -> None:
    check_number(name, value, low=1, integer=True)


def _positive(name: str, value: Any) -> None:
    check_number(name, value, low=0.0, low_open=True)


def _non_negative(name: str, value: Any) -> None:
    check_number(name, value, low=0.0)


def _blocks(name: str, value: Any) -> None:
    if isinstance(value, (tuple, list)):
        if len(value) not in (1, 2):
            raise ValueError(f"{name} must be an int or a pair (row_blocks, col_blocks), got {value!r}")
        for index, (side, v) in enumerate(zip(("row_blocks", "col_blocks"), value)):
            check_number(f"{name}[{index}] ({side})", v, low=1, integer=True)
    else:
        check_number(name, value, low=1, integer=True)


GAMMA_DOC = "step multiplier of the RowNorm steps (1 = as large as a spectral step)."


class Work(Protocol):
    """One Muon group's step as a schedule sees it: the group, its stepped parameters and their matrix jobs."""

    group: dict[str, Any]
    params: list[Tensor]
    jobs: list[MatrixJob]


class StepContext(Protocol):
    """What the core lends a schedule at one step."""

    state: Mapping[Any, dict[str, Any]]  # the optimizer state, per parameter
    engine: DirectionEngine
    scratch: dict[str, Any]  # the schedule's own, kept from step to step by the optimizer (not saved; a load clears it)

    def read(self, values: Tensor) -> list[float]:
        """The host reads ``values`` (with the step's non-finite vote where it is still unread: one read for both,
        raising where the vote failed)."""
        ...


@dataclass(frozen=True)
class Schedule:
    """Base: spectral every step (plain Muon). Subclasses override what they own."""

    name: str = "muon"
    kinds: tuple[StepKind, ...] = (StepKind.SPECTRAL,)  # every kind the schedule may take
    options: ClassVar[Mapping[str, Option]] = {}
    # Its decision reads values on the host (then nonfinite="raise" reads the vote with them, once).
    reads_signals: ClassVar[bool] = False
    # Why it needs matrices sharded by rows only (None: any layout the engine runs).
    whole_rows: ClassVar[str | None] = None
    # Its per-matrix state tensors whose saved dtype a checkpoint load keeps (torch would cast them).
    state_dtypes: ClassVar[tuple[str, ...]] = ()
    # Options added after checkpoints were saved without them: such a state_dict loads, with their defaults.
    late_options: ClassVar[tuple[str, ...]] = ()

    def defaults(self) -> dict[str, Any]:
        return {key: option.default for key, option in self.options.items()}

    def check(self, group: Mapping[str, Any], where: str) -> None:
        """Every option of a parameter group (``where`` names the group in the message)."""
        for key, option in self.options.items():
            option.check(f"{key}{where}", group[key])

    def kind(self, step: int, group: Mapping[str, Any]) -> StepKind | None:
        """The kind of the group's step ``step``; None where the schedule decides per matrix at the step."""
        return StepKind.SPECTRAL

    def multiplier(self, kind: StepKind, group: Mapping[str, Any]) -> float:
        return 1.0

    def init_state(self, p: Tensor, group: Mapping[str, Any], state: dict[str, Any]) -> None:
        """Make the schedule's state of matrix parameter ``p`` where missing (at construction and after a move)."""

    def state_shape(self, name: str, p: Tensor, group: Mapping[str, Any]) -> tuple[int, ...] | None:
        """The shape of state tensor ``name`` of ``p`` where it is not ``p``'s (for checking a checkpoint)."""
        return None

    def decide(self, works: Sequence[Work], ctx: StepContext) -> list[list[StepKind]]:
        """The kind of every job of every group at this step (a fixed schedule: the group's kind for all)."""
        return [[self.kind(w.group["step"], w.group)] * len(w.jobs) for w in works]  # type: ignore[list-item]

    def after_step(
        self,
        work: Work,
        kinds: Sequence[StepKind],
        directions: Sequence[Any],
        mask: Tensor | None,
        ctx: StepContext,
    ) -> None:
        """After the weights of ``work`` moved: update the schedule's state (``mask``: the vote of a step that
        ``nonfinite="skip"`` masks). ``directions``: per job; on the class path (``work.plan`` set) a mapping of
        each kind taken to its part of the work and that part's directions by class."""


@dataclass(frozen=True)
class PeriodicRowSchedule(Schedule):
    """Spectral when ``t % k == 0``, RowNorm (scaled by ``gamma``) otherwise."""

    name: str = "periodic_row_muon"
    kinds: tuple[StepKind, ...] = (StepKind.SPECTRAL, StepKind.ROWNORM)
    options: ClassVar[Mapping[str, Option]] = {
        "k": Option(
            3,
            _positive_int,
            "a spectral (Newton-Schulz) step every ``k`` steps, RowNorm steps in between (``k=1`` is Muon).",
        ),
        "gamma": Option(0.15, _positive, GAMMA_DOC),
    }

    def kind(self, step: int, group: Mapping[str, Any]) -> StepKind:
        return StepKind.SPECTRAL if step % int(group["k"]) == 0 else StepKind.ROWNORM

    def multiplier(self, kind: StepKind, group: Mapping[str, Any]) -> float:
        return float(group["gamma"]) if kind is StepKind.ROWNORM else 1.0


@dataclass(frozen=True)
class BlockPeriodicSchedule(Schedule):
    """MuonBP: full spectral when ``t % period == 0``, block-wise spectral (``block_lr_ratio``) otherwise."""

    name: str = "muon_bp"
    kinds: tuple[StepKind, ...] = (StepKind.SPECTRAL, StepKind.BLOCK)
    options: ClassVar[Mapping[str, Option]] = {
        "period": Option(5, _positive_int, "a full spectral step every ``period`` steps, block steps in between."),
        "blocks": Option(
            1,
            _blocks,
            "blocks of a block step on unsharded parameters (sharded ones use their pieces): row blocks, or a pair "
            "(row blocks, column blocks); a 1-tuple is row blocks.",
        ),
        "block_lr_ratio": Option(1.0, _positive, "step multiplier of the block steps."),
    }

    def kind(self, step: int, group: Mapping[str, Any]) -> StepKind:
        return StepKind.SPECTRAL if step % int(group["period"]) == 0 else StepKind.BLOCK

    def multiplier(self, kind: StepKind, group: Mapping[str, Any]) -> float:
        return float(group["block_lr_ratio"]) if kind is StepKind.BLOCK else 1.0


NEVER_REFRESHED = -1  # the age of a matrix that has not taken a spectral step yet
