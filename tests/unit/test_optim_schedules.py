"""Schedules own their options, state and decisions: the core asks and applies. A new schedule is one schedule
class, one optimizer class with its declared signature and one registry entry, all written here, outside dimuon."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor, nn

from dimuon.optim import OPTIMIZERS, MuonFamily, StepKind, build
from dimuon.optim.schedules import Option, Schedule, StepContext, Work, _positive, _positive_int


@pytest.mark.parametrize(
    "name", [n for n, cls in OPTIMIZERS.items() if isinstance(cls, type) and issubclass(cls, MuonFamily)]
)
def test_every_optimizers_signature_declares_its_schedules_options_with_their_defaults(name):
    cls = OPTIMIZERS[name]
    params = inspect.signature(cls.__init__).parameters
    options = cls.schedule.options
    assert set(cls._schedule_defaults()) == set(options), name
    for key, option in options.items():
        assert params[key].default == option.default, (name, key)


@dataclass(frozen=True)
class EveryNthPerMatrix(Schedule):
    """A toy per-matrix schedule: matrix ``i`` of a group refreshes every ``n + i`` of its own steps, RowNorm
    between (scaled by ``gamma``); its state is a host counter per matrix."""

    name: str = "every_nth"
    kinds: tuple[StepKind, ...] = (StepKind.SPECTRAL, StepKind.ROWNORM)
    options: ClassVar[Mapping[str, Option]] = {"n": Option(2, _positive_int), "gamma": Option(0.15, _positive)}

    def kind(self, step: int, group: Mapping[str, Any]) -> StepKind | None:
        return None

    def multiplier(self, kind: StepKind, group: Mapping[str, Any]) -> float:
        return float(group["gamma"]) if kind is StepKind.ROWNORM else 1.0

    def init_state(self, p: Tensor, group: Mapping[str, Any], state: dict[str, Any]) -> None:
        state.setdefault("toy_steps", 0)

    def decide(self, works: Sequence[Work], ctx: StepContext) -> list[list[StepKind]]:
        return [
            [
                StepKind.SPECTRAL if ctx.state[p]["toy_steps"] % (w.group["n"] + i) == 0 else StepKind.ROWNORM
                for i, p in enumerate(w.params)
            ]
            for w in works
        ]

    def after_step(self, work, kinds, directions, mask, ctx) -> None:
        for p in work.params:
            ctx.state[p]["toy_steps"] += 1


class _EveryNthMuon(MuonFamily):  # a leading underscore: not offered as a taker of other optimizers' options
    schedule = EveryNthPerMatrix()

    def __init__(self, params: Any, lr: float | Tensor = 1e-3, n: int = 2, gamma: float = 0.15, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, n=n, gamma=gamma, **kwargs)


def test_a_new_schedule_needs_no_edit_of_dimuon(monkeypatch):
    monkeypatch.setitem(OPTIMIZERS, "every_nth_muon", _EveryNthMuon)
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(6, 8)), nn.Parameter(torch.randn(8, 6))
    opt = build("every_nth_muon", [("a", a), ("b", b)], lr=0.1, n=2)
    kinds = []
    for _ in range(6):
        a.grad, b.grad = torch.randn(6, 8), torch.randn(8, 6)
        opt.reset_refresh_stats()
        opt.step()
        kinds.append([m["spectral"] for m in opt.refresh_stats()["matrices"].values()])
    # a refreshes every 2 of its steps, b every 3: the schedule's own state and decision, applied by the core
    assert kinds == [[1, 1], [0, 0], [1, 0], [0, 1], [1, 0], [0, 0]]
    assert opt.state[a]["toy_steps"] == 6 and opt.step_kinds() == [None]
    with pytest.raises(ValueError, match="n"):
        _EveryNthMuon([("a", a)], n=0)
    saved = opt.state_dict()
    again = _EveryNthMuon([("a", a), ("b", b)], lr=0.1)
    again.load_state_dict(saved)
    assert again.state[b]["toy_steps"] == 6
