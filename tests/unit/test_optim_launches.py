"""The update path is batched: a RowNorm or block step dispatches a number of ops set by the distinct matrix shapes,
not by the number of parameters (on an accelerator every such op is a kernel launch). Counted in the accelerator's
form of the step (``dimuon.optim.devices.cpu_path`` off); the CPU's form computes the same values bit for bit."""

from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dimuon.optim import MuonBP, PeriodicRowMuon, StepKind, devices

WIDTH = 16


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it: ``kernels`` those that compute (views only make metadata)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.kernels[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _layers(count: int, widths: tuple[int, ...] = (WIDTH,)) -> list[nn.Parameter]:
    """``count`` transformer-like layers (qkv, proj, fc1, fc2); layer ``i`` has width ``widths[i % len(widths)]``."""
    g = torch.Generator().manual_seed(0)
    params = []
    for i in range(count):
        d = widths[i % len(widths)]
        params += [
            nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))
        ]
    return params


def _ops_of_second_step(cls, options, params, kind) -> OpCounter:
    opt = cls(params, lr=0.02, weight_decay=0.01, **options)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        if opt.param_groups[0]["step"] == 1:
            assert opt.step_kinds() == [kind]
            with OpCounter() as counter:
                opt.step()
        else:
            opt.step()  # step 0: spectral
    return counter


@pytest.fixture
def accelerator_form(monkeypatch):
    monkeypatch.setattr(devices, "cpu_path", lambda device: False)


CASES = [
    pytest.param(PeriodicRowMuon, {"k": 3}, StepKind.ROWNORM, id="rownorm"),
    pytest.param(MuonBP, {"period": 5, "blocks": 2}, StepKind.BLOCK, id="block-rows"),
    pytest.param(MuonBP, {"period": 5, "blocks": (2, 2)}, StepKind.BLOCK, id="block-grid"),
]


@pytest.mark.parametrize(("cls", "options", "kind"), CASES)
def test_step_ops_grow_with_distinct_shapes_not_with_parameters(cls, options, kind, accelerator_form):
    shallow = _ops_of_second_step(cls, options, _layers(4), kind)
    deep = _ops_of_second_step(cls, options, _layers(16), kind)  # 4x the parameters, the same 4 shapes
    shallow_n, deep_n = sum(shallow.kernels.values()), sum(deep.kernels.values())
    # Measured on torch 2.13: the same count at 4 and 16 layers.
    assert deep_n < 1.25 * shallow_n, (shallow_n, deep_n, deep.kernels - shallow.kernels)
    # Twice the distinct shapes (layers alternate between two widths): more ops, as the batches double.
    mixed = _ops_of_second_step(cls, options, _layers(16, widths=(WIDTH, WIDTH + 8)), kind)
    assert sum(mixed.kernels.values()) > deep_n


@pytest.mark.parametrize(("cls", "options", "kind"), CASES)
def test_the_cpu_form_of_a_step_computes_the_accelerator_form_bit_for_bit(cls, options, kind, monkeypatch):
    """Per-tensor Nesterov, chunked squares and kept buffers (the CPU's form) against the list ops: 4 steps,
    spectral first, then the step kind under test, the momenta and weights equal bitwise."""
    runs = []
    for cpu in (True, False):
        monkeypatch.setattr(devices, "cpu_path", lambda device, cpu=cpu: cpu)
        params = _layers(3, widths=(WIDTH, WIDTH + 8))
        opt = cls(params, lr=0.02, weight_decay=0.01, **options)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        runs.append([t.clone() for p in params for t in (p, opt.state[p]["momentum_buffer"])])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
