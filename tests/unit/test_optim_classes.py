"""The step by shape class (dimuon.optim.classes) against the per-job path it replaces in one process, bit for bit,
and its plans remade where the groups change: a group added after some steps, a parameter replaced, a load."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from golden_steps import OPTIMIZERS, make_groups, make_optimizer, make_params, set_grads

from dimuon.optim import build
from dimuon.optim.distributed.engine import LocalEngine

FIXED = ["muon", "periodic_row_muon", "muon_bp"]  # the schedules that decide per group take the class path


class PerJob(LocalEngine):
    """The local engine under another type: the core takes the per-job path with it."""


def _pair(name: str, nonfinite: str) -> tuple[dict, torch.optim.Optimizer, dict, torch.optim.Optimizer]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ps, qs = make_params(), make_params()
        a = make_optimizer(name, ps, nonfinite)
        groups = [{k: v for k, v in g.items()} for g in a.param_groups]
        for g, src in zip(groups, [[qs[n] for n in g["param_names"]] for g in a.param_groups]):
            g["params"] = src
        options = dict(OPTIMIZERS[name], lr=0.02, weight_decay=0.1, nonfinite=nonfinite)
        b = build(name, groups, engine=PerJob(), **options)
    return ps, a, qs, b


def _step_both(ps: dict, a: torch.optim.Optimizer, qs: dict, b: torch.optim.Optimizer, step: int) -> None:
    set_grads(ps, step, "skip" if a.nonfinite == "skip" else "raise")
    set_grads(qs, step, "skip" if b.nonfinite == "skip" else "raise")
    a.step()
    b.step()


def _same(ps: dict, qs: dict) -> None:
    for n in ps:
        assert torch.equal(ps[n], qs[n]), n


@pytest.mark.parametrize("name", FIXED)
def test_class_path_keeps_up_with_group_changes(name: str) -> None:
    ps, a, qs, b = _pair(name, "skip")
    for step in range(3):
        _step_both(ps, a, qs, b, step)
    assert all(plan is not None for plan in a._plans.values()) and not b._plans.get(0)
    _same(ps, qs)
    # a group added after some steps: planned with it, stepped by class
    late = torch.randn(6, 6, generator=torch.Generator().manual_seed(7))
    for d in (ps, qs):
        d["late"] = torch.nn.Parameter(late.clone())
    a.add_param_group({"params": [ps["late"]], "param_names": ["late"]})
    b.add_param_group({"params": [qs["late"]], "param_names": ["late"]})
    assert a._plans[4] is not None
    for step in range(3, 6):
        _step_both(ps, a, qs, b, step)
    _same(ps, qs)
    # a parameter replaced in its group (as a wrapper does): the plan follows it
    for d, opt in ((ps, a), (qs, b)):
        old, d["wide"] = d["wide"], torch.nn.Parameter(d["wide"].detach().clone())
        opt.state[d["wide"]] = opt.state.pop(old)
        opt.param_groups[0]["params"][0] = d["wide"]
    for step in range(6, 8):
        _step_both(ps, a, qs, b, step)
    assert any(p is ps["wide"] for p in a._plans[0].params)
    _same(ps, qs)


def test_a_load_remakes_the_plans() -> None:
    ps, a, qs, b = _pair("periodic_row_muon", "raise")
    for step in range(2):
        _step_both(ps, a, qs, b, step)
    a.load_state_dict(copy.deepcopy(a.state_dict()))
    plan = a._plans[0]
    assert all(buf is a.state[p]["momentum_buffer"] for p, buf in zip(plan.params, plan.bufs))
    for step in range(2, 5):
        _step_both(ps, a, qs, b, step)
    _same(ps, qs)


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
@pytest.mark.parametrize("name", ["muon", "periodic_row_muon"])
def test_class_path_through_the_fused_kernels(name: str, nonfinite: str) -> None:
    """The fused kernels (Triton's interpreter on the CPU) by class: the per-job path's weights, bit for bit."""
    pytest.importorskip("triton")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ps, qs = make_params(), make_params()
        options = dict(OPTIMIZERS[name], lr=0.02, weight_decay=0.1, nonfinite=nonfinite, kernels="triton")
        a = build(name, make_groups(ps), **options)
        b = build(name, make_groups(qs), engine=PerJob(), **options)
        for step in range(5):
            _step_both(ps, a, qs, b, step)
    assert all(plan is not None and plan.launchable for plan in a._plans.values())
    _same(ps, qs)
