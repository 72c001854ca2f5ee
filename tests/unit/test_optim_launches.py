"""The update path is batched: a RowNorm or block step dispatches a number of ops set by the distinct matrix shapes,
not by the number of parameters (on an accelerator every such op is a kernel launch). Counted in the accelerator's
form of the step (``dimuon.optim.devices.cpu_path`` off); the CPU's form computes the same values bit for bit."""

from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dimuon.bench.census import _writes_tensor as writes_tensor
from dimuon.optim import AdaptiveRowMuon, MuonBP, PeriodicRowMuon, StepKind, devices

WIDTH = 16


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it: ``kernels`` those that compute (views only make metadata)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            self.views += 1
        elif writes_tensor(func, out):  # not metadata only (promote_types): a kernel
            self.kernels[str(func.overloadpacket)] += 1
        return out


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
    # masked by the vote on the device: the gradients of one shape masked in one where
    pytest.param(PeriodicRowMuon, {"k": 3, "nonfinite": "skip"}, StepKind.ROWNORM, id="rownorm-skip"),
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


def _adaptive_ops(params, nonfinite: str) -> list[int]:
    """Ops of AdaptiveRowMuon's first two steps: every matrix refreshed (its reference and row sums written), then
    every matrix's staleness measured and RowNorm taken (the threshold is out of reach)."""
    opt = AdaptiveRowMuon(params, lr=0.02, weight_decay=0.01, k_min=1, threshold=1e9, nonfinite=nonfinite)
    g = torch.Generator().manual_seed(1)
    counts = []
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        with OpCounter() as counter:
            opt.step()
        counts.append(sum(counter.kernels.values()))
    stats = opt.refresh_stats()  # the first step spectral for every matrix, the second RowNorm for every one
    assert stats["spectral"] == len(params) and stats["steps"] == 2 * len(params)
    return counts


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_adaptive_refresh_and_signal_ops_grow_with_distinct_shapes_not_with_parameters(nonfinite, accelerator_form):
    """The reference directions, their row sums, the staleness sums and the gradients' masking (AdaptiveRowMuon
    masks under ``raise`` too, reading the vote with its signals) are batched by shape like the update."""
    shallow = _adaptive_ops(_layers(4), nonfinite)
    deep = _adaptive_ops(_layers(16), nonfinite)  # 4x the parameters, the same 4 shapes
    for a, b in zip(shallow, deep):
        assert b < 1.25 * a, (shallow, deep)


@pytest.mark.parametrize("cpu", [True, False])
def test_masked_gradients_take_the_momentum_where_the_vote_fails(cpu, monkeypatch):
    """A failed vote gives every gradient's momentum back bitwise (NaNs left behind), a passed one the gradient in
    the momentum's dtype, whether the gradients are masked one by one (CPU, large ones) or stacked by shape."""
    from dimuon.optim.core import MASK_BATCH_NUMEL, masked_gradients

    monkeypatch.setattr(devices, "cpu_path", lambda device: cpu)
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 4), (8, 4), (4, 8), (MASK_BATCH_NUMEL + 1,)]
    grads = [torch.randn(s, generator=g).bfloat16() for s in shapes]
    grads[1][0, 0] = float("nan")
    bufs = [torch.randn(s, generator=g) for s in shapes]
    failed = masked_gradients(torch.tensor(False), grads, bufs)
    passed = masked_gradients(torch.tensor(True), grads, bufs)
    for f, p, grad, buf in zip(failed, passed, grads, bufs):
        assert torch.equal(f, buf) and p.dtype == torch.float32
        torch.testing.assert_close(p, grad.float(), rtol=0, atol=0, equal_nan=True)
