"""The fused momentum and update kernels (dimuon.optim.fused): the same values as the eager list ops, one launch
per dtype pair whatever the number of tensors, a failed vote touching nothing, and the optimizers' steps through
them matching their eager steps. On the CPU the kernels run in Triton's interpreter (``kernels="triton"``); the
same tests compile them on CUDA where there is one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dimuon.optim import build, fused

pytest.importorskip("triton")

from dimuon.optim import triton_step

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
    ),
]
SHAPES = [(8, 12), (8, 12), (20, 6), (3, 2100)]  # two of one shape, a tall one, one over two blocks


class Launches:
    """A count of kernel launches."""

    launches = 0


@pytest.fixture
def launches(monkeypatch):
    """The four kernels wrapped to count their launches, {"momentum": Launches, "update": Launches} (the
    compiled and interpreted forms counted together)."""
    counters = {"momentum": Launches(), "update": Launches()}
    for name, key in [
        ("MOMENTUM", "momentum"),
        ("MOMENTUM_INTERPRETED", "momentum"),
        ("UPDATE", "update"),
        ("UPDATE_INTERPRETED", "update"),
    ]:
        counter, kernel = counters[key], getattr(triton_step, name)

        class Bound:
            def __getitem__(self, grid, kernel=kernel, counter=counter):
                counter.launches += 1
                return kernel[grid]

        monkeypatch.setattr(triton_step, name, Bound())
    return counters


def randn(shape, device, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vote", [None, True, False], ids=["no-mask", "passed", "failed"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_kernel_is_the_eager_lerps(device, grad_dtype, vote, nesterov, launches):
    grads = [randn(s, device, grad_dtype, seed=i) for i, s in enumerate(SHAPES)]
    bufs = [randn(s, device, seed=10 + i) for i, s in enumerate(SHAPES)]
    before = [b.clone() for b in bufs]
    outs = [torch.full(s, float("nan"), device=device) for s in SHAPES] if nesterov else None
    mask = None if vote is None else torch.tensor(vote, device=device)
    fused.momentum_(fused.Tables(), grads, bufs, outs, 0.95, mask)
    assert launches["momentum"].launches == 1
    for i, (g, m0) in enumerate(zip(grads, before)):
        g = g.float()
        if mask is not None:
            g = torch.where(mask, g, m0)
        m = torch.lerp(m0, g, 0.05)
        if vote is False:  # a failed vote: the momentum bit for bit, U = M
            assert torch.equal(bufs[i], m0)
        torch.testing.assert_close(bufs[i], m, rtol=0, atol=4e-7)
        if nesterov:
            torch.testing.assert_close(outs[i], torch.lerp(g, m, 0.95), rtol=0, atol=4e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step_kind", ["number", "tensor"])
@pytest.mark.parametrize("vote", [None, True, False], ids=["no-mask", "passed", "failed"])
def test_update_kernel_is_decay_then_factored_step(device, weight_dtype, step_kind, vote, launches):
    weights = [randn(s, device, weight_dtype, seed=i) for i, s in enumerate(SHAPES)]
    dirs = [randn(s, device, seed=20 + i) for i, s in enumerate(SHAPES)]
    # per row, none, per column (tall), per row
    factors = [torch.rand(8, 1, device=device), None, torch.rand(1, 6, device=device), torch.rand(3, 1, device=device)]
    before = [w.clone() for w in weights]
    step = 0.1 if step_kind == "number" else torch.tensor(0.1, device=device)
    mask = None if vote is None else torch.tensor(vote, device=device)
    fused.update_(fused.Tables(), weights, dirs, factors, step, 0.99, mask)
    assert launches["update"].launches == 1
    for w, w0, d, f in zip(weights, before, dirs, factors):
        if vote is False:
            assert torch.equal(w, w0)
            continue
        want = w0.float() * 0.99 - 0.1 * (d * (f if f is not None else 1.0))
        tol = 1e-6 if weight_dtype is torch.float32 else 1e-2  # one rounding to bf16
        torch.testing.assert_close(w.float(), want, rtol=tol, atol=tol)


def model_on(device, dtype=torch.float32, width=32, layers=3, seed=0):
    torch.manual_seed(seed)
    mods = [nn.Linear(16, width), nn.Tanh()]
    for _ in range(layers - 2):
        mods += [nn.Linear(width, width, bias=False), nn.Tanh()]
    mods += [nn.Linear(width, 8)]
    return nn.Sequential(*mods).to(device=device, dtype=dtype)


def train(model, opt, steps, nan_at=None, step=None):
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    for t in range(steps):
        x = randn((4, 16), device, dtype, seed=100 + t)
        loss = model(x).float().square().mean()
        if t == nan_at:
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        (step or opt.step)()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "name,options",
    [
        ("muon", {}),
        ("periodic_row_muon", {"k": 3}),
        ("muon_bp", {"period": 3}),
        ("adaptive_row_muon", {}),
    ],
)
@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_optimizer_through_the_kernels_is_its_eager_step(device, name, options, nonfinite, launches):
    """Six steps (a NaN loss at the fourth under "skip": skipped alike), weight decay on: the fused step and the
    eager one end within rounding of each other, and the fused one launched its kernels every step. Newton-Schulz
    in fp32 on every device: in bf16 (CUDA's default) one rounding flip in its input, from the fused kernel's
    fused multiply-adds, moves its output by a bf16 ulp, far above the kernels' own rounding."""
    eager, fast = model_on(device), model_on(device)
    kw = dict(lr=0.02, weight_decay=0.1, nonfinite=nonfinite, ns_dtype=torch.float32, **options)
    opt_e = build(name, eager, kernels="torch", **kw)
    opt_f = build(name, fast, kernels="triton", **kw)
    nan_at = 3 if nonfinite == "skip" else None
    train(eager, opt_e, 6, nan_at)
    assert launches["momentum"].launches == 0 and launches["update"].launches == 0
    train(fast, opt_f, 6, nan_at)
    assert launches["momentum"].launches == 6 and launches["update"].launches >= 6
    for p, q in zip(fast.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for p, q in zip(fast.parameters(), eager.parameters()):
        if p.ndim == 2:
            torch.testing.assert_close(opt_f.state[p]["momentum_buffer"], opt_e.state[q]["momentum_buffer"])
    if nonfinite == "skip":
        assert opt_f.skipped_steps == opt_e.skipped_steps == 1


@pytest.mark.parametrize(
    "device,nonfinite",
    # "skip" by default (its masked kernels hold "raise"'s): each compilation costs 20 s here and the GPU check's
    # test budget there
    [
        pytest.param("cpu", "raise", marks=pytest.mark.slow),
        ("cpu", "skip"),
        pytest.param(*DEVICES[1].values, "skip", marks=DEVICES[1].marks),
    ],
)
def test_a_compiled_step_through_the_kernels_is_the_eager_one(device, nonfinite):
    """``torch.compile(opt.step)`` over the kernels (Triton's interpreter on the CPU, compiled kernels on CUDA), a
    Tensor lr, spectral and RowNorm steps, a NaN loss skipped under "skip": the weights of the eager step."""
    eager, fast = model_on(device), model_on(device)
    kw = dict(weight_decay=0.1, nonfinite=nonfinite, ns_dtype=torch.float32, kernels="triton", k=2)
    opt_e = build("periodic_row_muon", eager, lr=torch.tensor(0.02), **kw)
    opt_c = build("periodic_row_muon", fast, lr=torch.tensor(0.02), **kw)
    nan_at = 2 if nonfinite == "skip" else None
    train(eager, opt_e, 5, nan_at)
    train(fast, opt_c, 5, nan_at, step=torch.compile(opt_c.step))
    for p, q in zip(fast.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert opt_c.skipped_steps == opt_e.skipped_steps == (1 if nonfinite == "skip" else 0)


@pytest.mark.parametrize("layers", [3, 12])
def test_launches_per_step_do_not_grow_with_the_parameters(layers, launches):
    model = model_on("cpu", layers=layers)
    opt = build("periodic_row_muon", model, lr=0.02, weight_decay=0.1, kernels="triton", k=2)
    train(model, opt, 2)  # a spectral step, then a RowNorm step: one momentum and one update launch each
    assert (launches["momentum"].launches, launches["update"].launches) == (2, 2)


def test_bf16_weights_and_a_tensor_lr_take_the_kernels(launches):
    eager, fast = model_on("cpu", torch.bfloat16), model_on("cpu", torch.bfloat16)
    opt_e = build("periodic_row_muon", eager, lr=torch.tensor(0.02), kernels="torch")
    opt_f = build("periodic_row_muon", fast, lr=torch.tensor(0.02), kernels="triton")
    train(eager, opt_e, 4)
    train(fast, opt_f, 4)
    assert launches["update"].launches >= 4
    for p, q in zip(fast.parameters(), eager.parameters()):  # bf16 weights: one rounding against two
        torch.testing.assert_close(p.float(), q.float(), rtol=2e-2, atol=2e-2)


def test_a_weight_no_launch_takes_steps_in_the_eager_form_beside_the_rest(launches):
    """A non-contiguous weight (a transposed view) is left to the eager ops; the others still fuse."""
    eager, fast = model_on("cpu"), model_on("cpu")
    for m in (eager, fast):
        w = m[2].weight
        w.data = w.data.t().contiguous().t()  # same values, column-major
        assert not w.is_contiguous()
    opt_e = build("periodic_row_muon", eager, lr=0.02, weight_decay=0.1, kernels="torch")
    opt_f = build("periodic_row_muon", fast, lr=0.02, weight_decay=0.1, kernels="triton")
    train(eager, opt_e, 4)
    train(fast, opt_f, 4)
    assert launches["update"].launches >= 4
    for p, q in zip(fast.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_one_row_and_one_column_matrices_index_their_single_factor(launches):
    """A (16, 1) matrix's RowNorm factor is its one column's, a (1, 16) one's its one row's: both (1, 1)."""
    runs = []
    for kernels in ("torch", "triton"):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(16, 1)), nn.Parameter(torch.randn(1, 16)), nn.Parameter(torch.randn(4, 8))]
        opt = build("periodic_row_muon", [{"params": params}], lr=0.02, weight_decay=0.1, kernels=kernels)
        for t in range(4):
            for p in params:
                p.grad = randn(p.shape, "cpu", seed=t)
            opt.step()
        runs.append(params)
    assert launches["update"].launches == 4
    for p, q in zip(*runs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_auto_takes_the_eager_ops_on_the_cpu(launches):
    model = model_on("cpu")
    train(model, build("muon", model, lr=0.02), 2)
    assert launches["momentum"].launches == launches["update"].launches == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_fuses_on_cuda(launches):
    model = model_on("cuda")
    train(model, build("periodic_row_muon", model, lr=0.02, weight_decay=0.1), 3)
    assert launches["momentum"].launches == 3 and launches["update"].launches == 3


def test_kernels_option_is_checked_at_construction(monkeypatch):
    model = model_on("cpu")
    with pytest.raises(ValueError, match=r"kernels must be one of 'auto', 'torch', 'triton', got 'cuda'"):
        build("muon", model, lr=0.02, kernels="cuda")
    monkeypatch.setattr(fused, "triton_available", lambda: False)
    with pytest.raises(ValueError, match=r"kernels='triton' needs the triton package"):
        build("muon", model, lr=0.02, kernels="triton")
    build("muon", model, lr=0.02, kernels="auto")  # auto falls back to the eager ops


def test_kernels_is_a_runtime_option_kept_by_copies():
    opt = build("muon", model_on("cpu"), lr=0.02, kernels="torch")
    assert copy.deepcopy(opt).kernels == "torch"
    assert "kernels" not in opt.state_dict()["param_groups"][0]


def test_a_kernel_that_fails_here_names_the_way_out(monkeypatch):
    class Broken:
        __name__ = "_momentum"

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise ValueError("no compiler for this device")

            return launch

    monkeypatch.setattr(triton_step, "MOMENTUM_INTERPRETED", Broken())
    model = model_on("cpu")
    opt = build("muon", model, lr=0.02, kernels="triton")
    with pytest.raises(RuntimeError, match=r"_momentum failed on this device \(no compiler.*kernels='torch'"):
        train(model, opt, 1)
