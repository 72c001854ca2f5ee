"""What a training script written for AdamW meets when it swaps in a dimuon optimizer: a DDP checkpoint resumed in
one process and back, options read from a config file, a model passed where parameters go, and an optimizer built
before the model's parameters were replaced."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dimuon.optim import (
    OPTIMIZERS,
    AdaptiveRowMuon,
    Muon,
    MuonBP,
    NoGradientWarning,
    PeriodicRowMuon,
    build,
    param_groups,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x_embedder = nn.Linear(6, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.final_layer = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.final_layer(self.blocks(self.x_embedder(x)))


class Holder(nn.Module):
    """A wrapper that holds the model as ``module``, as DDP does (its parameters named ``module.*``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for t in range(steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(t))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _momenta(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {
        name: opt.state[p]["momentum_buffer"]
        for g in opt.param_groups
        if g["algorithm"] == "muon"
        for name, p in zip(g["param_names"], g["params"])
    }


@pytest.fixture
def one_rank_group():
    """A one-process gloo group, all DDP needs to wrap a model."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_a_ddp_state_dict_loads_in_one_process_and_back(one_rank_group) -> None:
    torch.manual_seed(0)
    net = Net()
    ddp = DistributedDataParallel(net)
    opt = PeriodicRowMuon(param_groups(ddp), lr=0.02, k=3)
    _train(ddp, opt)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["param_names"][0] == "module.x_embedder.weight"
    bare = copy.deepcopy(net)
    single = PeriodicRowMuon(param_groups(bare), lr=0.02, k=3)
    single.load_state_dict(copy.deepcopy(saved))  # DDP training resumed on one GPU
    momenta = {name.removeprefix("module."): m for name, m in _momenta(opt).items()}
    assert {n: m for n, m in _momenta(single).items()}.keys() == momenta.keys()
    for name, m in _momenta(single).items():
        assert torch.equal(m, momenta[name]), name
    assert single.param_groups[0]["param_names"][0] == "x_embedder.weight"  # the names of the parameters held
    again = PeriodicRowMuon(param_groups(DistributedDataParallel(copy.deepcopy(net))), lr=0.02, k=3)
    again.load_state_dict(copy.deepcopy(single.state_dict()))  # and a one-process state_dict into a DDP run
    for (name, m), (_, expect) in zip(_momenta(again).items(), _momenta(single).items()):
        assert name.startswith("module.") and torch.equal(m, expect), name


@pytest.mark.parametrize(
    ("saved_under", "loaded_under"),
    [
        (lambda m: Holder(m), lambda m: m),
        (lambda m: m, lambda m: Holder(m)),
        (lambda m: Holder(torch.compile(m)), lambda m: m),  # module._orig_mod.*
        (lambda m: torch.compile(Holder(m)), lambda m: Holder(m)),  # _orig_mod.module.*
        (lambda m: Holder(Holder(m)), lambda m: Holder(m)),  # a model whose own child is called module
    ],
)
def test_names_that_differ_by_wrappers_match_in_both_directions(saved_under, loaded_under) -> None:
    torch.manual_seed(0)
    net = Net()
    model = saved_under(net)
    opt = Muon(param_groups(model), lr=0.02)
    _train(net, opt)  # the same parameters (a compiled forward would only cost time)
    target_net = copy.deepcopy(net)
    target = Muon(param_groups(loaded_under(target_net)), lr=0.02)
    target.load_state_dict(copy.deepcopy(opt.state_dict()))
    for (name, mine), theirs in zip(target_net.named_parameters(), net.parameters()):
        state, expect = target.state[mine], opt.state[theirs]
        assert state.keys() == expect.keys() and all(torch.equal(state[k], expect[k]) for k in state), name


def test_names_that_only_a_wrapper_part_tells_apart_are_refused_by_name() -> None:
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    opt = Muon([{"params": [a, b], "param_names": ["blk._orig_mod.w", "blk.w"]}], lr=0.02)
    other = Muon([{"params": [a, b], "param_names": ["x.w", "y.w"]}], lr=0.02)
    with pytest.raises(ValueError, match=r"'blk._orig_mod.w' and 'blk.w' are both 'blk.w' without wrappers"):
        opt.load_state_dict(other.state_dict())


@pytest.mark.parametrize(
    ("cls", "options", "key", "value"),
    [
        (PeriodicRowMuon, {"k": 3.0}, "k", 3),
        (MuonBP, {"period": 4.0, "blocks": (2.0, 1.0)}, "blocks", (2, 1)),
        (AdaptiveRowMuon, {"k_min": 2.0, "k_max": 6.0}, "k_max", 6),
        (Muon, {"ns_steps": 4.0}, "ns_steps", 5 - 1),
    ],
)
def test_integral_floats_from_a_config_are_taken_as_ints(cls, options, key, value) -> None:
    opt = cls(param_groups(Net()), lr=0.02, **options)
    for recorded in (opt.defaults[key], opt.param_groups[0][key]):
        assert recorded == value and type(recorded) is type(value)
        if isinstance(value, tuple):
            assert all(type(v) is int for v in recorded)
    group = cls([{"params": [nn.Parameter(torch.randn(4, 4))], **options}], lr=0.02).param_groups[0]
    assert type(group[key]) is type(value)  # a group's own option too
    with pytest.raises(TypeError, match=rf"^{key} must be an int, got 3.5 \(float\)"):
        cls(param_groups(Net()), lr=0.02, **{key: 3.5})


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n != "adamw"])
def test_a_model_passed_where_parameters_go_is_refused_pointing_at_param_groups(name) -> None:
    model = Net()
    with pytest.raises(
        TypeError,
        match=r"takes parameters or parameter groups, not a model \(Net\): pass "
        r"dimuon.optim.param_groups\(model\)",
    ):
        OPTIMIZERS[name](model, lr=0.02)
    assert type(build(name, model, lr=0.02)) is OPTIMIZERS[name]  # build takes the model and groups it


def test_a_step_with_no_gradient_anywhere_warns_once_naming_the_cause() -> None:
    model = Net()
    opt = PeriodicRowMuon(param_groups(model), lr=0.02)
    for module in model.modules():  # what fully_shard or a move to another device does: new parameters
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(p.detach().clone()))
    with pytest.warns(NoGradientWarning, match=r"found no gradient on any of its 8 parameters.*fully_shard") as seen:
        _train(model, opt, steps=3)
    assert len([w for w in seen if issubclass(w.category, NoGradientWarning)]) == 1
    assert seen[0].filename == __file__  # it points at the script's step
    fresh = PeriodicRowMuon(param_groups(model), lr=0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoGradientWarning)
        _train(model, fresh)  # built after: steps as usual, no warning
        fresh.zero_grad()
        model.final_layer.weight.grad = torch.ones_like(model.final_layer.weight)
        fresh.step()  # one gradient of many: a step (frozen parts and unused layers are common)
