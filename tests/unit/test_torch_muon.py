"""`torch_muon`: PyTorch's Muon + AdamW behind dimuon's groups, agreeing with dimuon's Muon and resuming exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dimuon.dit import build_dit
from dimuon.optim import build, param_groups
from dimuon.optim.torch_muon import TorchMuonAdamW

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10)
    with torch.no_grad():  # leave the zero init, so that every matrix gets a gradient
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        torch.manual_seed(step)  # the model's own label dropout draws from the global generator
        g = torch.Generator().manual_seed(step)
        x, t = torch.randn(8, 1, 8, 8, generator=g), torch.rand(8, generator=g)
        y = torch.randint(0, 10, (8,), generator=g)
        model(x, t, y).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_matches_dimuon_muon_with_bf16_newton_schulz() -> None:
    """Both orthogonalize in bf16: a first step agrees to bf16 rounding on the matrices and to float rounding on the
    AdamW groups. After three steps the rounding is in the gradients too, and how much depends on the CPU's bf16
    matmul (AMX units or an fp32 fallback), so the matrices' bound is measured here: the two bf16 optimizers must
    agree with each other much better than dimuon's bf16 Muon agrees with its fp32 Muon."""
    start = tiny_model()
    ours, theirs, exact = copy.deepcopy(start), copy.deepcopy(start), copy.deepcopy(start)
    opt_ours = build("muon", ours, lr=1e-2, ns_dtype=torch.bfloat16)
    opt_theirs = build("torch_muon", theirs, lr=1e-2)
    opt_exact = build("muon", exact, lr=1e-2, ns_dtype=torch.float32)
    algorithm = {name: g["algorithm"] for g in param_groups(start) for name, _ in g["params"]}
    assert set(algorithm.values()) == {"muon", "adamw"}

    def rel(a: torch.Tensor, b: torch.Tensor, p0: torch.Tensor) -> float:
        """Relative difference of the two runs' total updates of one parameter."""
        step_a, step_b = a.detach() - p0.detach(), b.detach() - p0.detach()
        return ((step_a - step_b).norm() / step_b.norm()).item()

    for steps, bound in ((range(1), {"muon": 3e-2, "adamw": 1e-5}), (range(1, 3), {"muon": None, "adamw": 5e-2})):
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs), (exact, opt_exact)):
            train_steps(model, opt, steps)
        for (name, p0), a, b, c in zip(
            start.named_parameters(), ours.parameters(), theirs.parameters(), exact.parameters()
        ):
            limit = bound[algorithm[name]]
            if limit is None:  # a bf16 rounding's worth, as this CPU rounds: 0.45 of it on an AVX2-only CPU
                limit = 0.6 * rel(a, c, p0)
                assert limit > 1e-3, (name, "bf16 and fp32 Newton-Schulz agree too well to tell anything apart")
            assert rel(a, b, p0) < limit, (steps, name, rel(a, b, p0), limit)


def test_inner_optimizers_share_the_listed_groups() -> None:
    opt = build("torch_muon", tiny_model(), lr=1e-2)
    inner = [*opt._muon.param_groups, *opt._adamw.param_groups]
    assert sorted(map(id, opt.param_groups)) == sorted(map(id, inner))
    # So an lr set on the listed groups (as the training loop and LR schedulers do) is the one used.
    model = tiny_model()
    opt = build("torch_muon", model, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    for group in opt.param_groups:
        group["lr"] = 0.0
    train_steps(model, opt, range(1))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_state_dict_round_trip_continues_exactly() -> None:
    straight, resumed = tiny_model(), tiny_model()
    opt = build("torch_muon", straight, lr=1e-2)
    train_steps(straight, opt, range(4))

    opt_a = build("torch_muon", resumed, lr=1e-2)
    train_steps(resumed, opt_a, range(2))
    state = copy.deepcopy(opt_a.state_dict())
    opt_b = build("torch_muon", resumed, lr=5.0)  # the saved lr comes back with the state
    opt_b.load_state_dict(state)
    assert [g["lr"] for g in opt_b.param_groups] == [1e-2, 1e-2]
    assert sorted(map(id, opt_b.param_groups)) == sorted(
        map(id, [*opt_b._muon.param_groups, *opt_b._adamw.param_groups])
    )
    train_steps(resumed, opt_b, range(2, 4))
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_state_dict_of_another_grouping_is_refused() -> None:
    model = tiny_model()
    state = build("torch_muon", model).state_dict()
    matrices_only = TorchMuonAdamW([g for g in param_groups(model) if g["algorithm"] == "muon"])
    with pytest.raises(ValueError, match="its 'adamw' part is present, but this optimizer has no adamw groups"):
        matrices_only.load_state_dict(state)
    with pytest.raises(ValueError, match="its 'adamw' part is missing, but this optimizer has adamw groups"):
        build("torch_muon", model).load_state_dict({**state, "adamw": None})


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="'algorithm' key"):
        TorchMuonAdamW([nn.Parameter(torch.randn(4, 4))])
    with pytest.raises(ValueError, match="'muon' or 'adamw'"):
        TorchMuonAdamW([{"params": [nn.Parameter(torch.randn(4, 4))], "algorithm": "sgd"}])
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['k'\]"):
        build("torch_muon", tiny_model(), k=3)
    sharded = nn.Parameter(torch.randn(4, 4))
    sharded.device_mesh = object()  # what a DTensor parameter carries
    with pytest.raises(NotImplementedError, match="one process only"):
        TorchMuonAdamW([{"params": [sharded], "algorithm": "muon"}])


def test_trains_in_the_harness(tmp_path) -> None:
    from dimuon.train import TrainConfig, train

    cfg = TrainConfig(
        model="DiT-T/2",
        dataset="digits",
        optimizer="torch_muon",
        batch_size=16,
        steps=20,
        warmup_steps=2,
        log_interval=10,
        val_interval=0,
        val_samples=32,
        sample_count=10,
        sample_steps=2,
        ckpt_interval=10,
        progress=False,
        out=str(tmp_path / "run"),
    )
    summary = train(cfg)
    assert summary["step"] == 20 and summary["val_loss"] < 1.6  # a zero-output model scores about 1.7
    resumed = train(TrainConfig(**{**cfg.__dict__, "resume": str(tmp_path / "run"), "steps": 20}))
    assert resumed["step"] == 20
