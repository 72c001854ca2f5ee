"""The AdamW groups' plan (dimuon.optim.adamw_group): made once after the first step, made again after a load or
a replaced parameter (bit for bit as a run that never planned), and per-step Python that does not grow with the
group's parameters."""

from __future__ import annotations

import copy

import pytest
import torch

from dimuon.bench import host_probe
from dimuon.optim import build


def _params(n: int = 3) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(6, 8, generator=g))] + [
        torch.nn.Parameter(torch.randn(5, 4, generator=g)) for _ in range(n)
    ]


def _build(ps: list[torch.nn.Parameter], **options: object) -> torch.optim.Optimizer:
    groups = [{"params": ps[:1]}, {"params": ps[1:], "algorithm": "adamw"}]
    return build("muon", groups, lr=0.02, weight_decay=0.1, **options)


def _step(ps: list[torch.nn.Parameter], opt: torch.optim.Optimizer, step: int, unplanned: bool = False) -> None:
    """One step on seeded gradients; ``unplanned``: the AdamW plan made afresh for it (a run that keeps none)."""
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    if unplanned:
        opt._adamw_plans.clear()
    opt.step()


def _planned(opt: torch.optim.Optimizer) -> bool:
    """Whether the AdamW group's plan holds the state's tensors as they are now."""
    plan = opt._adamw_plans[1]
    return all(part.current() for part in plan.parts) and plan.state is opt.state


@pytest.mark.parametrize("options", [{}, {"adamw_fused": False, "nonfinite": "skip"}])
def test_the_plan_follows_a_load_and_a_replaced_parameter(options: dict) -> None:
    ps, qs = _params(), _params()
    a, b = _build(ps, **options), _build(qs, **options)
    for step in range(2):
        _step(ps, a, step)
        _step(qs, b, step, unplanned=True)
    assert _planned(a)
    # a load brings new state tensors, a moment laid out column-major among them: the plan is made again
    saved = copy.deepcopy(a.state_dict())
    saved["state"][1]["exp_avg"] = saved["state"][1]["exp_avg"].t().contiguous().t()
    a.load_state_dict(saved)
    assert 1 not in a._adamw_plans
    _step(ps, a, 2)
    _step(qs, b, 2, unplanned=True)
    assert _planned(a) and a._adamw_plans[1].parts[0].tensors[0][0] is a.state[ps[1]]["exp_avg"]
    # a parameter replaced in its group (as a wrapper does), its state moved along
    for p, opt in ((ps, a), (qs, b)):
        old, p[2] = p[2], torch.nn.Parameter(p[2].detach().clone())
        opt.state[p[2]] = opt.state.pop(old)
        opt.param_groups[1]["params"][1] = p[2]
    for step in range(3, 5):
        _step(ps, a, step)
        _step(qs, b, step, unplanned=True)
    assert any(q is ps[2] for q in a._adamw_plans[1].parts[0].params)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)


@pytest.mark.parametrize("options", [{}, {"adamw_fused": False}, {"adamw_fused": False, "nonfinite": "skip"}])
def test_step_calls_do_not_grow_with_adamw_params(options: dict) -> None:
    counts = []
    for n in (4, 64):
        ps = _params(n)
        opt = _build(ps, **options)
        for step in range(3):
            _step(ps, opt, step)
        counts.append(host_probe.dimuon_calls(opt.step))
    assert counts[0] == counts[1], counts
