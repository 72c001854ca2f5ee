"""The torch.optim contract a training script relies on, checked for every optimizer ``build`` makes.

The list follows torch's own generic optimizer tests (``TestOptimRenewed`` with the ``OptimizerInfo``
database of ``torch.testing._internal.common_optimizers``): state_dict round trips and resume,
deepcopy and pickle, older state dicts, named parameters, param_groups mutation, add_param_group,
zero_grad, closures, LR schedulers, step and state_dict hooks, parameters without gradients, empty
groups, Tensor lr, printing. ``adamw`` (torch's own AdamW) is the yardstick; ``torch_muon`` takes
part where its nested state_dict allows.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from dimuon.optim import MuonFamily, build, param_groups

pytestmark = pytest.mark.usefixtures("one_thread")

# Schedule options chosen so that a few steps take every step kind.
OPTIONS = {
    "muon": {},
    "periodic_row_muon": {"k": 2},
    "muon_bp": {"period": 2, "blocks": 2},
    "adaptive_row_muon": {"threshold": 0.5, "k_min": 2, "k_max": 3},
    "adamw": {},
    "torch_muon": {},
}
NAMES = list(OPTIONS)
FAMILY = ["muon", "periodic_row_muon", "muon_bp", "adaptive_row_muon"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def make(name: str, params, lr: float | torch.Tensor = 0.02, **kw) -> torch.optim.Optimizer:
    """``build(name, ...)`` over a model, or over {"muon": [...], "adamw": [...]} parameter lists."""
    if isinstance(params, dict):
        groups = [{"params": ps, "algorithm": algo} for algo, ps in params.items()]
        params = [p for ps in params.values() for p in ps] if name == "adamw" else groups
    return build(name, params, lr=lr, **{**OPTIONS[name], **kw})


def split(model: Net) -> dict[str, list[nn.Parameter]]:
    return {"muon": [model.fc1.weight, model.fc2.weight], "adamw": [model.fc1.bias, model.fc2.bias]}


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)


def loss_of(model: nn.Module, t: int) -> torch.Tensor:
    x, y = batch(t)
    return nn.functional.mse_loss(model(x), y)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, after: Callable[[], None] = lambda: None):
    for t in steps:
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
        after()


def trained(name: str, steps: int, **kw) -> tuple[Net, torch.optim.Optimizer]:
    """A fresh model and its optimizer after ``steps`` steps."""
    model = net()
    opt = make(name, model, **kw)
    train(model, opt, range(steps))
    return model, opt


def assert_same(a, b, path: str = "") -> None:
    """Exact equality of nested state (tensors by value, dtype and device; everything else by ==)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def params_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# --------------------------------------------------------------------------- state_dict and copies
@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_is_exact(name):
    _, opt = trained(name, 3)
    saved = copy.deepcopy(opt.state_dict())
    other = make(name, net(1), lr=0.5)  # the saved hyperparameters come back with the state
    given = copy.deepcopy(saved)
    other.load_state_dict(given)
    assert_same(other.state_dict(), saved)
    assert_same(given, saved)  # loading does not change the dict it was given
    if name in FAMILY:
        assert all("differentiable" not in g for g in other.state_dict()["param_groups"])


@pytest.mark.parametrize("name", NAMES)
def test_resume_from_a_saved_file_continues_bitwise(name):
    straight, resumed = net(), net()
    opt = make(name, straight)
    train(straight, opt, range(6))
    first = make(name, resumed)
    train(resumed, first, range(3))
    buf = io.BytesIO()
    torch.save({"model": resumed.state_dict(), "opt": first.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # plain tensors, numbers, strings and dtypes only
    restarted = net(5)
    restarted.load_state_dict(ckpt["model"])
    second = make(name, restarted)
    second.load_state_dict(ckpt["opt"])
    train(restarted, second, range(3, 6))
    assert params_equal(restarted, straight)


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))], ids=["deepcopy", "pickle"])
@pytest.mark.parametrize("name", NAMES)
def test_copies_keep_every_attribute_and_step_alike(name, copier):
    extra = {"nonfinite": "skip", "adamw_fused": False, "refresh": "gather"} if name in FAMILY else {}
    _, opt = trained(name, 2, **extra)
    twin = copier(opt)
    public = {k: v for k, v in vars(opt).items() if not k.startswith("_") and k not in ("state", "param_groups")}
    assert {k: v for k, v in vars(twin).items() if k in public} == public
    assert_same(twin.state_dict(), opt.state_dict())
    # The copy holds copies of the parameters and, given the same gradients, steps exactly like the original.
    pairs = [(p, q) for g, h in zip(opt.param_groups, twin.param_groups) for p, q in zip(g["params"], h["params"])]
    for p, q in pairs:
        q.grad = p.grad.clone()
    opt.step()
    twin.step()
    assert all(p is not q and torch.equal(p, q) for p, q in pairs)


@pytest.mark.parametrize("name", FAMILY)
def test_state_dict_of_an_older_version_loads(name):
    model, opt = trained(name, 2)
    old = copy.deepcopy(opt.state_dict())
    for group in old["param_groups"]:  # options added after the first release
        del group["ns_algorithm"], group["skipped_steps"]
    for state in old["state"].values():
        if "step" in state:
            state["step"] = state["step"].item()  # a number, as some torch versions saved it
    del old["state"][0]  # state was made at a parameter's first step: one that never had a gradient has none
    fresh = make(name, model)
    fresh.load_state_dict(old)
    assert all(g["ns_algorithm"] == "standard" and g["skipped_steps"] == 0 for g in fresh.param_groups)
    first = fresh.param_groups[0]["params"][0]
    assert torch.equal(fresh.state[first]["momentum_buffer"], torch.zeros_like(first))  # made as at its first step
    train(model, fresh, range(2, 4))
    assert [set(g) for g in fresh.state_dict()["param_groups"]] == [set(g) for g in opt.state_dict()["param_groups"]]


@pytest.mark.parametrize("named_from", [True, False])
@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_named_and_unnamed_parameters_load_into_each_other(name, named_from):
    def groups(model: Net, named: bool):
        if name == "adamw":
            return model.named_parameters() if named else model.parameters()
        parts = split(model)
        names = {id(p): n for n, p in model.named_parameters()}
        return {algo: [(names[id(p)], p) if named else p for p in ps] for algo, ps in parts.items()}

    a, b = net(), net()
    opt_a = make(name, groups(a, named_from))
    train(a, opt_a, range(2))
    opt_b = make(name, groups(b, not named_from))
    train(b, opt_b, range(2))
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    b.load_state_dict(a.state_dict())
    train(a, opt_a, range(2, 4))
    train(b, opt_b, range(2, 4))
    assert params_equal(a, b)
    assert "param_names" in opt_b.state_dict()["param_groups"][0]  # names survive when either side had them


# --------------------------------------------------------------------------- param_groups
@pytest.mark.parametrize("name", NAMES)
def test_lr_set_on_a_group_takes_effect(name):
    model = net()
    opt = make(name, split(model), weight_decay=0.1)
    frozen = opt.param_groups[1]["params"] if name != "adamw" else [model.fc2.weight, model.fc2.bias]
    if name == "adamw":  # one group: give fc2 a group of its own
        opt = torch.optim.AdamW(
            [{"params": [model.fc1.weight, model.fc1.bias]}, {"params": [model.fc2.weight, model.fc2.bias]}],
            lr=0.02,
            weight_decay=0.1,
        )
    opt.param_groups[1]["lr"] = 0.0
    before = [p.detach().clone() for p in frozen]
    moving = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    train(model, opt, range(2))
    assert all(torch.equal(p, q) for p, q in zip(frozen, before))  # lr 0 (weight decay too uses lr)
    assert all(not torch.equal(p, q) for p, q in zip(opt.param_groups[0]["params"], moving))


@pytest.mark.parametrize("name", NAMES)
def test_zero_gradient_only_decays_the_weights(name):
    model = net()
    opt = make(name, model, lr=0.1, weight_decay=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for p, q in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), q * (1 - 0.1 * 0.5), rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", NAMES)
def test_add_param_group_steps_the_new_group(name):
    model, extra = net(), nn.Linear(4, 3)
    opt = make(name, {"muon": [model.fc1.weight, model.fc2.weight]} if name != "adamw" else model)
    if name == "adamw":
        opt.add_param_group({"params": list(extra.parameters())})
    else:
        opt.add_param_group({"params": [extra.weight], "algorithm": "muon", "lr": 0.05})
        opt.add_param_group({"params": [extra.bias], "algorithm": "adamw"})
    before = [p.detach().clone() for p in extra.parameters()]
    for t in range(2):
        opt.zero_grad()
        (loss_of(model, t) + extra(model(batch(t)[0])).square().mean()).backward()
        opt.step()
    assert all(not torch.equal(p, q) for p, q in zip(extra.parameters(), before))
    if name != "adamw":
        assert opt.param_groups[-2]["lr"] == 0.05
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": [extra.weight], "algorithm": "muon"})


@pytest.mark.parametrize("name", FAMILY)
def test_a_refused_group_leaves_the_optimizer_as_it_was(name):
    model = net()
    opt = make(name, split(model))
    with pytest.raises(ValueError, match=r"lr \(parameter group 2\) must be in"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3, 3))], "lr": -1.0})
    assert len(opt.param_groups) == 2
    train(model, opt, range(1))


@pytest.mark.parametrize("name", NAMES)
def test_empty_groups_are_allowed(name):
    model = net()
    groups = split(model)
    opt = make(name, {**groups, "adamw": []} if name != "adamw" else groups)
    opt.add_param_group({"params": [], "algorithm": "adamw"} if name != "adamw" else {"params": []})
    train(model, opt, range(2))
    assert_same(copy.deepcopy(opt).state_dict(), opt.state_dict())


# --------------------------------------------------------------------------- step
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_zero_grad(name, set_to_none):
    model = net()
    opt = make(name, model)
    loss_of(model, 0).backward()
    opt.zero_grad(set_to_none=set_to_none)
    for p in model.parameters():
        assert p.grad is None if set_to_none else torch.equal(p.grad, torch.zeros_like(p))


@pytest.mark.parametrize("name", NAMES)
def test_closure_is_evaluated_once_with_grad_and_its_loss_returned(name):
    model = net()
    opt = make(name, model)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = loss_of(model, 0)
        loss.backward()
        return loss

    first = opt.step(closure)
    for _ in range(10):
        opt.step(closure)
    assert calls == [True] * 11
    assert isinstance(first, torch.Tensor) and closure().item() < first.item()


@pytest.mark.parametrize("name", NAMES)
def test_parameters_without_gradients_stay_put(name):
    params = [torch.randn(3, 4), torch.randn(4, 3)]  # requires_grad=False: never get a gradient
    before = [p.clone() for p in params]
    opt = make(name, {"muon": params, "adamw": []} if name != "adamw" else {"adamw": params}, weight_decay=0.1)
    assert opt.step(lambda: torch.tensor(1.0)).item() == 1.0
    assert all(torch.equal(p, q) for p, q in zip(params, before))


@pytest.mark.parametrize("name", NAMES)
def test_non_contiguous_parameters_train(name):
    weight = nn.Parameter(torch.randn(10, 5, 2)[..., 0])
    bias = nn.Parameter(torch.randn(10, 2)[..., 0])
    assert not weight.is_contiguous()
    opt = make(name, {"muon": [weight], "adamw": [bias]})
    x = torch.randn(5)

    def closure():
        opt.zero_grad()
        loss = (weight.mv(x) + bias).pow(2).sum()
        loss.backward()
        return loss

    first = closure().item()
    for _ in range(20):
        opt.step(closure)
    assert closure().item() < first


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0-d", "1-d", "2-d"])
@pytest.mark.parametrize("name", NAMES)
def test_tensor_lr_trains_like_a_number(name, shape):
    a, b = net(), net()
    opt_a = make(name, a, lr=0.02)
    opt_b = make(name, b, lr=torch.full(shape, 0.02))
    train(a, opt_a, range(4))
    train(b, opt_b, range(4))
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        make(name, net(), lr=torch.tensor([0.01, 0.02]))


@pytest.mark.parametrize("name", FAMILY)
def test_tensor_lr_set_on_a_group_later(name):
    a, b = net(), net()
    opt_a, opt_b = make(name, a, lr=0.02), make(name, b, lr=0.05)
    for group in opt_b.param_groups:
        group["lr"] = torch.tensor(0.02)
    train(a, opt_a, range(3))
    train(b, opt_b, range(3))
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_can_be_printed(name):
    text = repr(make(name, net()))
    assert "lr: 0.02" in text


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_has_state_after_a_step(name):
    _, opt = trained(name, 1)
    assert all(len(opt_state) > 0 for opt_state in _states(opt))


@pytest.mark.parametrize("name", FAMILY)
def test_state_exists_before_the_first_step(name):
    # As dion does: a checkpoint's keys never depend on which parameters have stepped.
    model = net()
    opt = make(name, model)
    adaptive = (
        {"refresh_direction", "refresh_row_sums", "refresh_age", "refresh_signal"}
        if name == "adaptive_row_muon"
        else set()
    )
    matrix = {"momentum_buffer"} | adaptive
    expect = matrix, {"step", "exp_avg", "exp_avg_sq"}
    for group in opt.param_groups:
        for p in group["params"]:
            assert set(opt.state[p]) == expect[group["algorithm"] == "adamw"]
    assert len(opt.state_dict()["state"]) == len(list(model.parameters()))


def _states(opt: torch.optim.Optimizer) -> list[dict]:
    inner = getattr(opt, "_inner", None)
    if inner is not None:
        return [s for o in inner() for s in o.state.values()]
    return list(opt.state.values())


# --------------------------------------------------------------------------- LR schedulers
SCHEDULERS = {
    "step": lambda o: [lr_scheduler.StepLR(o, step_size=5, gamma=0.5)],
    "lambda": lambda o: [lr_scheduler.LambdaLR(o, lambda s: 0.9**s)],
    "cosine": lambda o: [lr_scheduler.CosineAnnealingLR(o, T_max=12)],
    "warmup_then_cosine": lambda o: [
        lr_scheduler.SequentialLR(
            o,
            [lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3), lr_scheduler.CosineAnnealingLR(o, T_max=9)],
            milestones=[3],
        )
    ],
    "one_cycle": lambda o: [lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=12)],
    "cyclic": lambda o: [lr_scheduler.CyclicLR(o, base_lr=0.005, max_lr=0.05, step_size_up=3)],
    "plateau": lambda o: [lr_scheduler.ReduceLROnPlateau(o, patience=1)],
    "chained": lambda o: [
        lr_scheduler.ChainedScheduler(
            [lr_scheduler.ExponentialLR(o, gamma=0.95), lr_scheduler.ConstantLR(o, factor=0.5, total_iters=4)]
        )
    ],
}


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
@pytest.mark.parametrize("name", NAMES)
def test_lr_schedulers_drive_every_group(name, scheduler):
    model = net()
    opt = make(name, model)
    schedulers = SCHEDULERS[scheduler](opt)
    first = loss_of(model, 0).item()
    for _ in range(12):
        opt.zero_grad()
        loss = loss_of(model, 0)
        loss.backward()
        opt.step()
        for s in schedulers:
            s.step(loss.item()) if isinstance(s, lr_scheduler.ReduceLROnPlateau) else s.step()
        lrs = {g["lr"] for g in opt.param_groups}
        assert len(lrs) == 1  # every group, the Muon and the AdamW ones, follows the schedule
    assert loss_of(model, 0).item() < first
    if scheduler not in ("plateau",):
        assert lrs != {0.02}


@pytest.mark.parametrize("name", FAMILY)
def test_a_scheduled_one_element_tensor_lr_trains_like_a_number(name):
    # A (1,)-shaped lr is stepped through a 0-d view: the scheduler's in-place fill_ reaches every step.
    a, b = net(), net()
    opt_a, opt_b = make(name, a, lr=0.02), make(name, b, lr=torch.tensor([0.02]))
    scheds = [lr_scheduler.LambdaLR(o, lambda s: 0.5**s) for o in (opt_a, opt_b)]
    for opt, model, sched in ((opt_a, a, scheds[0]), (opt_b, b, scheds[1])):
        for i in range(4):
            opt.zero_grad()
            loss_of(model, i).backward()
            opt.step()
            sched.step()
    assert opt_b.param_groups[0]["lr"].shape == (1,)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", FAMILY)
def test_one_cycle_cycles_muon_momentum_by_default(name):
    # OneCycleLR (and CyclicLR) cycle the group key "momentum" when an optimizer has one: for the
    # Muon family that is the Muon momentum beta. cycle_momentum=False leaves it alone.
    for cycle, expect_moves in ((True, True), (False, False)):
        opt = make(name, net())
        sched = lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10, cycle_momentum=cycle)
        seen = set()
        for _ in range(9):
            opt.step()
            sched.step()
            seen.add(opt.param_groups[0]["momentum"])
        assert (len(seen) > 1) == expect_moves
        assert all(0.85 - 1e-9 <= m <= 0.95 + 1e-9 for m in seen)


# --------------------------------------------------------------------------- hooks
@pytest.mark.parametrize("name", NAMES)
def test_step_hooks_run_in_order_and_come_off(name):
    model = net()
    opt = make(name, model)
    calls = []
    handles = [
        register_optimizer_step_pre_hook(lambda *_: calls.append("global pre")),
        register_optimizer_step_post_hook(lambda *_: calls.append("global post")),
        opt.register_step_pre_hook(lambda *_: calls.append("pre")),
        opt.register_step_post_hook(lambda *_: calls.append("post")),
    ]
    try:
        train(model, opt, range(1))
        assert calls == ["global pre", "pre", "post", "global post"]
    finally:
        for h in handles:
            h.remove()
    train(model, opt, range(1, 2))
    assert len(calls) == 4


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_hooks(name):
    opt = make(name, net())
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": 7})
    state = opt.state_dict()
    assert calls == ["pre"] and state["tag"] == 7
    del state["tag"]

    def set_lr(o, sd):
        sd = copy.deepcopy(sd)
        for group in (
            sd["param_groups"]
            if "param_groups" in sd
            else [g for k in ("muon", "adamw") for g in sd[k]["param_groups"]]
        ):
            group["lr"] = 0.003
        return sd

    opt.register_load_state_dict_pre_hook(set_lr)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("post-load"))
    opt.load_state_dict(state)
    assert {g["lr"] for g in opt.param_groups} == {0.003} and calls[-1] == "post-load"


# --------------------------------------------------------------------------- refusals torch makes too
@pytest.mark.parametrize("name", FAMILY)
def test_refusals_of_torch_optim(name):
    w, w2 = nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.randn(2, 3))
    with pytest.raises(TypeError, match="params argument given to the optimizer should be an iterable"):
        make(name, w)
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        build(name, [{"params": [w]}, {"params": [w]}])
    with pytest.raises(ValueError, match="all optimizer params should be with/without names"):
        build(name, [("w", w), w2])
    assert issubclass(type(make(name, net())), MuonFamily)


def test_param_groups_of_a_model_cover_each_parameter_once():
    model = net()
    ids = [id(p) for g in param_groups(model) for _, p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
