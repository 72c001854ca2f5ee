"""The optimizer on a CUDA GPU (one process): bf16 Newton-Schulz by default, state and kernels on the device,
fused AdamW, compiled paths. Skipped without CUDA; the sharded paths on a GPU are in
tests/multirank/test_sharded_devices.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dimuon.optim import build
from dimuon.optim.linalg import newton_schulz

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Relative Frobenius error of bf16 Newton-Schulz against fp64, twice what bf16 on a CPU gives on the same
# random matrices (standard 1.3-2.0e-2; Gram up to 7.5e-2 with Polar Express, whose first steps are steep).
BF16_TOLERANCE = {"standard": 4e-2, "gram": 1.5e-1}


def model_on(device: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), nn.Tanh(), nn.Linear(64, 8)).to(device)


def train(model: nn.Module, step, opt: torch.optim.Optimizer, steps: int) -> None:
    device = next(model.parameters()).device
    for t in range(steps):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(16, 64, generator=g).to(device)
        opt.zero_grad()
        model(x).square().mean().backward()
        step()


def max_relative_gap(a: nn.Module, b: nn.Module) -> float:
    return max(
        ((p.double() - q.double()).norm() / q.double().norm()).item() for p, q in zip(a.parameters(), b.parameters())
    )


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
@pytest.mark.parametrize("shape", [(4, 64, 256), (3, 256, 64)], ids=["wide", "tall"])
def test_newton_schulz_runs_in_bf16_on_cuda_and_tracks_fp64(shape, coefficients, algorithm):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).cuda()
    y = newton_schulz(x, coefficients=coefficients, algorithm=algorithm)  # ns_dtype None: bf16 on CUDA
    assert y.dtype is torch.bfloat16 and y.device == x.device and y.shape == x.shape
    ref = newton_schulz(x.double().cpu(), coefficients=coefficients, algorithm=algorithm, dtype=torch.float64)
    rel = ((y.double().cpu() - ref).norm() / ref.norm()).item()
    assert rel < BF16_TOLERANCE[algorithm], rel


@pytest.mark.parametrize("name", ["muon", "periodic_row_muon", "muon_bp", "adaptive_row_muon"])
def test_default_step_on_cuda_is_the_bf16_step_with_state_on_the_device(name):
    models = [model_on("cuda") for _ in range(3)]
    opts = [
        build(name, m, lr=0.02, weight_decay=0.1, **kw)
        for m, kw in zip(models, ({}, {"ns_dtype": torch.bfloat16}, {"ns_dtype": torch.float32}))
    ]
    for m, o in zip(models, opts):
        train(m, o.step, o, 4)
    default, bf16, fp32 = models
    assert max_relative_gap(default, bf16) == 0.0  # None means bf16 on CUDA
    if name != "adaptive_row_muon":  # (its decisions may differ between bf16 and fp32 directions)
        assert max_relative_gap(default, fp32) < 5e-2  # and bf16 stays close to fp32
    for p, state in opts[0].state.items():
        for key, value in state.items():
            # The AdamW groups run fused on CUDA by default, which keeps even the step counter on the device.
            if isinstance(value, torch.Tensor):
                assert value.device == p.device, (key, value.device)


def test_fused_adamw_on_cuda_matches_foreach():
    fused, foreach = model_on("cuda"), model_on("cuda")
    # fp32 Newton-Schulz: bf16 rounding would amplify the kernels' last-bit differences through the steps.
    opt_fused = build("muon", fused, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)  # fused: the default
    opt_foreach = build("muon", foreach, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, adamw_fused=False)
    train(fused, opt_fused.step, opt_fused, 4)
    train(foreach, opt_foreach.step, opt_foreach, 4)
    for p, q in zip(fused.parameters(), foreach.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    steps = {
        opt: {s["step"].device.type for s in opt.state.values() if "step" in s} for opt in (opt_fused, opt_foreach)
    }
    assert steps == {opt_fused: {"cuda"}, opt_foreach: {"cpu"}}  # torch's placement for each kernel


def test_checkpoint_moves_between_cpu_and_cuda():
    cpu_model = model_on("cpu")
    cpu_opt = build("periodic_row_muon", cpu_model, lr=0.02, ns_dtype=torch.float32)
    train(cpu_model, cpu_opt.step, cpu_opt, 2)
    cuda_model = model_on("cuda")
    cuda_model.load_state_dict(cpu_model.state_dict())
    cuda_opt = build("periodic_row_muon", cuda_model, lr=0.02, ns_dtype=torch.float32)
    cuda_opt.load_state_dict(copy.deepcopy(cpu_opt.state_dict()))  # AdamW steps arrive on the CPU; fused wants CUDA
    train(cuda_model, cuda_opt.step, cuda_opt, 2)
    train(cpu_model, cpu_opt.step, cpu_opt, 2)
    assert max_relative_gap(cuda_model.cpu(), cpu_model) < 1e-4


def test_compiled_newton_schulz_on_cuda_matches_eager():
    a, b = model_on("cuda"), model_on("cuda")
    opt_a = build("periodic_row_muon", a, lr=0.02, k=2, ns_compile=True, ns_dtype=torch.float32)
    opt_b = build("periodic_row_muon", b, lr=0.02, k=2, ns_dtype=torch.float32)
    train(a, opt_a.step, opt_a, 3)
    train(b, opt_b.step, opt_b, 3)
    assert max_relative_gap(a, b) < 1e-4


def test_compiled_step_on_cuda_matches_eager():
    a, b = model_on("cuda"), model_on("cuda")
    opt_a = build("periodic_row_muon", a, lr=torch.tensor(0.02), k=2, ns_dtype=torch.float32)
    opt_b = build("periodic_row_muon", b, lr=torch.tensor(0.02), k=2, ns_dtype=torch.float32)
    train(a, torch.compile(opt_a.step), opt_a, 4)
    train(b, opt_b.step, opt_b, 4)
    assert max_relative_gap(a, b) < 1e-4


def test_reduce_overhead_step_replays_as_cuda_graphs_with_the_eager_values():
    """``mode="reduce-overhead"``: inductor runs every graph of the step as a CUDA graph (it skips one that mutates an
    input that is not a static address, or that holds a CPU tensor), over both step kinds, with the eager step's
    values; a Tensor lr on the device, as docs/api.md shows it. One optimizer (compiling takes tens of seconds):
    the others' graphs are counted by ``dimuon bench host`` in the same check, and every optimizer's static state
    on a CPU by tests/unit/test_optim_compile.py."""
    name = "periodic_row_muon"
    from dimuon.bench.host_probe import cudagraph_skips

    torch._dynamo.reset()
    a, b = model_on("cuda"), model_on("cuda")
    options = {"ns_dtype": torch.float32, "nonfinite": "skip"}
    opt_a = build(name, a, lr=torch.tensor(0.02, device="cuda"), **options)
    opt_b = build(name, b, lr=torch.tensor(0.02, device="cuda"), **options)
    step = torch.compile(opt_a.step, mode="reduce-overhead", fullgraph=name != "adaptive_row_muon")
    with cudagraph_skips() as skips:
        train(a, step, opt_a, 8)
    train(b, opt_b.step, opt_b, 8)
    assert skips["count"] == 0, skips["reasons"]
    assert max_relative_gap(a, b) < 1e-4
    assert opt_a.skipped_steps == 0 and bool(opt_a.last_step_taken)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nonfinite_gradient_entry_on_cuda_is_caught_by_the_list_reduction(bad):
    model = model_on("cuda")
    opt = build("periodic_row_muon", model, lr=1e-2, nonfinite="skip")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    next(iter(model.parameters())).grad.view(-1)[7] = bad
    opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("name", ["muon", "periodic_row_muon", "muon_bp", "adaptive_row_muon"])
def test_skip_on_cuda_reads_nothing_and_leaves_every_state_tensor_as_it_was(name):
    # The fused AdamW kernel's found_inf on CUDA, the list reduction's vote, the masked Muon kernels: no host read
    # in the step (AdaptiveRowMuon's staleness signals apart), and a skipped step leaves every tensor bitwise.
    from dimuon.bench.census import tracing
    from dimuon.bench.peers import CallCounter, count_collectives

    model = model_on("cuda")
    opt = build(name, model, lr=1e-2, weight_decay=0.1, nonfinite="skip")
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    next(iter(model.parameters())).grad.view(-1)[3] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    before += [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    with count_collectives(CallCounter()) as counter, tracing(counter) as tally:
        opt.step()
    assert {k: n for k, n in tally.read_sites.items() if "core.py:read" not in k} == {}
    after = [p.detach() for p in model.parameters()]
    after += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert opt.skipped_steps == 1
