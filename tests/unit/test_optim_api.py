"""torch.optim behaviour: validation, state_dict/resume, non-finite gradients, closures, schedulers, AdamW."""

import copy
import inspect
import io
import typing
import warnings

import pytest
import torch
from torch import nn

from dimuon.optim import (
    DEFAULT_BUCKET_MB,
    AdaptiveRowMuon,
    FlattenedParameterWarning,
    ForeignGroupKeyWarning,
    Muon,
    MuonBP,
    MuonFamily,
    PeriodicRowMuon,
    build,
    param_groups,
)
from dimuon.optim.build import option_parameters
from dimuon.optim.core import MuonOptions
from dimuon.optim.docs import CORE_OPTIONS


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 20)
        self.fc2 = nn.Linear(20, 40)
        self.fc3 = nn.Linear(40, 9)
        self.norm = nn.LayerNorm(9)

    def forward(self, x):
        return self.norm(self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))))


def _groups(model):
    return [
        {"params": [model.fc1.weight, model.fc2.weight, model.fc3.weight]},
        {"params": [model.fc1.bias, model.fc2.bias, model.fc3.bias, *model.norm.parameters()], "algorithm": "adamw"},
    ]


def _batch(t):
    g = torch.Generator().manual_seed(t)
    return torch.randn(16, 12, generator=g), torch.randn(16, 9, generator=g)


def _train(model, opt, start, stop):
    for t in range(start, stop):
        x, y = _batch(t)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (PeriodicRowMuon, dict(k=3, gamma=0.15)),
        (MuonBP, dict(period=5, blocks=2)),
        (Muon, {}),
        (AdaptiveRowMuon, dict(threshold=0.3, k_min=2, k_max=5)),
    ],
)
def test_resume_mid_period_is_bitwise_identical(cls, kw):
    torch.manual_seed(0)
    model = Net()
    straight = copy.deepcopy(model)
    opt_straight = cls(_groups(straight), lr=0.01, weight_decay=0.1, **kw)
    _train(straight, opt_straight, 0, 10)

    opt = cls(_groups(model), lr=0.01, weight_decay=0.1, **kw)
    _train(model, opt, 0, 4)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)

    resumed = Net()
    resumed.load_state_dict(ckpt["model"])
    opt2 = cls(_groups(resumed), lr=0.01, weight_decay=0.1, **kw)
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.param_groups[0]["step"] == 4
    assert opt2.step_kinds() == opt.step_kinds()
    _train(resumed, opt2, 4, 10)
    for a, b in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(a, b)


def test_adamw_group_matches_torch_adamw():
    torch.manual_seed(0)
    a = nn.Linear(5, 7)
    b = copy.deepcopy(a)
    ours = Muon([{"params": a.parameters(), "algorithm": "adamw"}], lr=0.01, weight_decay=0.1)
    theirs = torch.optim.AdamW(b.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for t in range(5):
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(t))
        for m, opt in ((a, ours), (b, theirs)):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(lr=-1.0), ValueError, r"lr must be in \[0.0, inf\), got -1.0"),
        (dict(momentum=1.0), ValueError, r"momentum must be in \[0.0, 1.0\)"),
        (dict(momentum=-0.1), ValueError, r"momentum must be in"),
        (dict(weight_decay=-1e-3), ValueError, "weight_decay must be in"),
        (dict(lr_scale="adam"), ValueError, r"lr_scale must be one of \('match_rms_adamw', 'original', 'none'\)"),
        (dict(ns_coefficients="cubic"), ValueError, r"ns_coefficients must be one of \('quintic', 'polar_express'\)"),
        (dict(ns_algorithm="svd"), ValueError, r"ns_algorithm must be one of \('standard', 'gram'\)"),
        (dict(ns_steps=0), ValueError, r"ns_steps must be in"),
        (dict(ns_dtype="bf16"), TypeError, "ns_dtype must be None or a floating torch.dtype"),
        (dict(nonfinite="ignore"), ValueError, r"nonfinite must be one of \('raise', 'skip'\)"),
        (dict(adamw_betas=(0.9, 1.0)), ValueError, r"adamw_betas\[1\] must be in"),
        (dict(lr="fast"), TypeError, "lr must be a number"),
    ],
)
def test_bad_hyperparameters_name_themselves(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Muon([nn.Parameter(torch.randn(3, 4))], **kwargs)


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (PeriodicRowMuon, dict(k=0), r"k must be in \[1, inf\), got 0"),
        (PeriodicRowMuon, dict(k=2.5), "k must be an int"),
        (PeriodicRowMuon, dict(gamma=0.0), r"gamma must be in \(0.0, inf\), got 0.0"),
        (MuonBP, dict(period=0), r"period must be in \[1, inf\)"),
        (MuonBP, dict(blocks=0), r"blocks must be in \[1, inf\)"),
        (MuonBP, dict(blocks=(0,)), r"blocks\[0\] \(row_blocks\) must be in \[1, inf\), got 0"),
        (MuonBP, dict(blocks=(2, 0)), r"blocks\[1\] \(col_blocks\) must be in \[1, inf\), got 0"),
        (MuonBP, dict(blocks=(1, 2, 3)), r"blocks must be an int or a pair \(row_blocks, col_blocks\)"),
        (MuonBP, dict(block_lr_ratio=-1.0), "block_lr_ratio must be in"),
        (AdaptiveRowMuon, dict(threshold=-0.1), r"threshold must be in \[0.0, inf\), got -0.1"),
        (AdaptiveRowMuon, dict(threshold=float("inf")), "threshold must be finite"),
        (AdaptiveRowMuon, dict(k_min=0), r"k_min must be in \[1, inf\), got 0"),
        (AdaptiveRowMuon, dict(k_max=2.5), "k_max must be an int"),
        (AdaptiveRowMuon, dict(k_min=4, k_max=3), r"k_max must be >= k_min \(4\), got 3"),
        (AdaptiveRowMuon, dict(gamma=0.0), r"gamma must be in \(0.0, inf\), got 0.0"),
    ],
)
def test_bad_schedule_options(cls, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        cls([nn.Parameter(torch.randn(3, 4))], **kwargs)


def test_unknown_options_and_group_keys():
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['k'\]"):
        Muon([nn.Parameter(torch.randn(3, 4))], k=3)
    with pytest.raises(ValueError, match=r"option\(s\) 'weight_decy' \(did you mean 'weight_decay'\?\)"):
        Muon([{"params": [nn.Parameter(torch.randn(3, 4))], "weight_decy": 0.1}])
    with pytest.raises(ValueError, match=r"'ns_step' \(did you mean 'ns_steps'\?\)"):
        Muon([{"params": [nn.Parameter(torch.randn(3, 4))], "ns_step": 4, "foreach": True}])
    with pytest.raises(ValueError, match=r"'K' \(did you mean 'k'\?\)"):
        PeriodicRowMuon([{"params": [nn.Parameter(torch.randn(3, 4))], "K": 4}])
    with pytest.raises(ValueError, match=r"'betas' \(did you mean 'adamw_betas'\?\)"):  # torch AdamW's name
        Muon([{"params": [nn.Parameter(torch.randn(4))], "algorithm": "adamw", "betas": (0.9, 0.99)}])
    with pytest.raises(
        ValueError, match=r"'gamma' \(AdaptiveRowMuon's, PeriodicRowMuon's\), 'k' \(PeriodicRowMuon's\), not Muon's"
    ):
        Muon([{"params": [nn.Parameter(torch.randn(3, 4))], "k": 4, "gamma": 0.5}])
    reused = [{"params": [nn.Parameter(torch.randn(3, 4))]}]
    PeriodicRowMuon(reused)  # torch fills the dict in place with k=3, gamma=0.15: reused, they are ignored
    with pytest.warns(ForeignGroupKeyWarning, match=r"\['gamma', 'k'\]"):
        Muon(reused)
    with pytest.raises(
        ValueError, match=r"\['split_sizes'\] shape a 'muon' group's matrices; this group's algorithm is"
    ):
        Muon([{"params": [nn.Parameter(torch.randn(3, 4))], "algorithm": "adamw", "split_sizes": 3}])
    with pytest.raises(ValueError, match=r"'period' \(MuonBP's\), not PeriodicRowMuon's"):
        PeriodicRowMuon([{"params": [nn.Parameter(torch.randn(3, 4))], "period": 3, "threshold": 0.35}])
    with pytest.raises(ValueError, match=r"algorithm \(parameter group 0\) must be one of \('muon', 'adamw'\)"):
        Muon([{"params": [nn.Parameter(torch.randn(3, 4))], "algorithm": "sgd"}])
    with pytest.raises(ValueError, match="lr \\(parameter group 1\\) must be in"):
        Muon(
            [
                {"params": [nn.Parameter(torch.randn(3, 4))]},
                {"params": [nn.Parameter(torch.randn(3))], "algorithm": "adamw", "lr": -1.0},
            ]
        )


def test_non_matrix_in_muon_group_names_parameter_and_shape():
    model = Net()
    with pytest.raises(ValueError, match=r"parameter 'fc1.bias' with shape \(20,\) is in a 'muon' group"):
        Muon(model.named_parameters())
    with pytest.raises(ValueError, match=r"params\[0\] of group 0' with shape \(\)"):
        Muon([nn.Parameter(torch.tensor(1.0))])


def test_bad_split_sizes():
    with pytest.raises(
        ValueError, match="split_sizes=5 for parameter 'params\\[0\\] of group 0' must divide its 12 rows"
    ):
        Muon([{"params": [nn.Parameter(torch.randn(12, 4))], "split_sizes": 5}])
    with pytest.raises(ValueError, match="must be positive and sum to its 12 rows"):
        Muon([{"params": [nn.Parameter(torch.randn(12, 4))], "split_sizes": (4, 4)}])


def test_sparse_gradient_rejected():
    p = nn.Parameter(torch.randn(4, 5))
    opt = Muon([p])
    p.grad = torch.randn(4, 5).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()


@pytest.mark.parametrize("where", ["muon", "adamw"])
def test_nonfinite_gradient_raises_and_leaves_state_untouched(where):
    torch.manual_seed(0)
    model = Net()
    opt = PeriodicRowMuon(_groups(model), lr=0.01)
    _train(model, opt, 0, 2)
    snapshot = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(model.state_dict())
    x, y = _batch(7)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    target = model.fc2.weight if where == "muon" else model.fc2.bias
    target.grad[0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite gradient in params"):
        opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k])
    after = opt.state_dict()
    assert after["param_groups"] == snapshot["param_groups"]
    for k, st in snapshot["state"].items():
        for name, v in st.items():
            assert torch.equal(after["state"][k][name], v)


def test_nonfinite_named_parameter_in_message():
    model = Net()
    opt = Muon([{"params": [("fc1.weight", model.fc1.weight)]}])
    model.fc1.weight.grad = torch.full_like(model.fc1.weight, float("inf"))
    with pytest.raises(FloatingPointError, match=r"non-finite gradient in fc1\.weight"):
        opt.step()


def test_nonfinite_skip_keeps_everything_and_counts():
    torch.manual_seed(0)
    model = Net()
    opt = PeriodicRowMuon(_groups(model), lr=0.01, nonfinite="skip")
    _train(model, opt, 0, 2)
    weights = copy.deepcopy(model.state_dict())
    bufs = {id(p): s["momentum_buffer"].clone() for p, s in opt.state.items() if "momentum_buffer" in s}
    x, y = _batch(9)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    model.fc1.weight.grad[1, 1] = float("inf")
    opt.step()
    assert opt.skipped_steps == 1
    # Skipped on the device: the host cannot know, so the step takes its slot in the schedule (docs/algorithms.md).
    assert opt.param_groups[0]["step"] == 3
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k])
    for p, s in opt.state.items():
        if "momentum_buffer" in s:
            assert torch.equal(s["momentum_buffer"], bufs[id(p)])
    _train(model, opt, 10, 11)  # a finite step afterwards goes through
    assert opt.param_groups[0]["step"] == 4


@pytest.mark.parametrize("adamw_fused", [None, False], ids=["fused", "masked"])
def test_a_skipped_first_step_keeps_adamw_weights_with_zero_eps(adamw_fused):
    # The first step's moments are zero: with adamw_eps=0 the masked kernel's m / denom is 0 / 0 there.
    weight, bias = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.ones(4))
    opt = Muon(
        [{"params": [weight]}, {"params": [bias], "algorithm": "adamw"}],
        lr=0.01,
        adamw_eps=0.0,
        adamw_fused=adamw_fused,
        nonfinite="skip",
    )
    weight.grad, bias.grad = torch.full((4, 4), float("nan")), torch.ones(4)
    opt.step()
    assert opt.skipped_steps == 1
    assert torch.equal(bias, torch.ones(4))


def test_params_without_grad_are_skipped():
    a, b = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(6, 4))
    before = b.detach().clone()
    opt = Muon([a, b], lr=0.1)
    a.grad = torch.randn(4, 6)
    opt.step()
    assert torch.equal(b, before)
    # State exists from construction on (so checkpoints have the same keys whatever has stepped); b's is untouched.
    assert torch.equal(opt.state[b]["momentum_buffer"], torch.zeros(6, 4))
    assert opt.state[a]["momentum_buffer"].abs().sum() > 0


def test_closure_scheduler_zero_grad():
    torch.manual_seed(0)
    model = Net()
    opt = PeriodicRowMuon(_groups(model), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    x, y = _batch(0)

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    first = opt.step(closure)
    for _ in range(5):
        opt.step(closure)
        sched.step()
    assert isinstance(first, torch.Tensor) and closure().item() < first.item()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**5)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_build_names_and_options():
    model = Net()
    for name, cls in [
        ("muon", Muon),
        ("periodic_row_muon", PeriodicRowMuon),
        ("muon_bp", MuonBP),
        ("adaptive_row_muon", AdaptiveRowMuon),
    ]:
        assert type(build(name, model, lr=1e-3)) is cls
    adamw = build("adamw", model, lr=1e-3)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["betas"] == (0.9, 0.95)
    assert build("periodic_row_muon", model, k=4).param_groups[0]["k"] == 4
    with pytest.raises(
        ValueError,
        match=r"optimizer must be one of \('adamw', 'muon', 'periodic_row_muon', 'muon_bp', "
        r"'adaptive_row_muon', 'torch_muon'\)",
    ):
        build("sgd", model)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['period'\]"):
        build("periodic_row_muon", model, period=3)
    with pytest.raises(TypeError, match=r"\['weight_decy'\] \('weight_decy': did you mean 'weight_decay'\?\)"):
        build("muon", model, weight_decy=0.1)


def test_old_state_dict_without_new_keys_loads():
    model = Net()
    opt = Muon(_groups(model), lr=0.01)
    _train(model, opt, 0, 1)
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        g.pop("ns_algorithm")
    opt2 = Muon(_groups(model), lr=0.01)
    opt2.load_state_dict(sd)
    state = opt2.__getstate__()
    opt2.__setstate__(state)
    assert all("ns_algorithm" in g for g in opt2.param_groups)
    _train(model, opt2, 1, 2)


def test_complex_parameters_are_refused_by_name():
    real, cplx = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"parameter 'z' is complex \(torch.complex64\)"):
        Muon([{"params": [("w", real)]}, {"params": [("z", cplx)], "algorithm": "adamw"}])
    with pytest.raises(ValueError, match=r"parameter 'params\[0\] of group 0' is complex"):
        PeriodicRowMuon([cplx])


def test_parameters_of_three_or_more_dims_are_flattened_with_one_warning():
    conv, stacked = nn.Conv2d(4, 8, 3), nn.Parameter(torch.randn(3, 8, 8))
    with pytest.warns(FlattenedParameterWarning) as record:
        opt = Muon([{"params": [("conv.weight", conv.weight), ("experts", stacked)]}])
    assert len(record) == 1
    assert "conv.weight (8, 4, 3, 3), experts (3, 8, 8)" in str(record[0].message)
    assert "split the parameter or put it in an 'adamw' group" in str(record[0].message)
    with pytest.warns(FlattenedParameterWarning, match=r"heads \(2, 3, 4\)"):
        opt.add_param_group({"params": [("heads", nn.Parameter(torch.randn(2, 3, 4)))]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon([nn.Parameter(torch.randn(3, 4))])  # matrices: no warning


@pytest.mark.parametrize(
    ("saved_by", "loaded_by", "match"),
    [
        (
            PeriodicRowMuon,
            MuonBP,
            r"not saved by MuonBP: its parameter groups carry \['gamma', 'k'\] \(options of "
            r"PeriodicRowMuon\) and lack \['block_lr_ratio', 'blocks', 'period'\]",
        ),
        (Muon, MuonBP, r"not saved by MuonBP: its parameter groups lack \['block_lr_ratio', 'blocks', 'period'\]"),
        (
            MuonBP,
            Muon,
            r"not saved by Muon: its parameter groups carry \['block_lr_ratio', 'blocks', 'period'\] "
            r"\(options of MuonBP\) \(Muon's schedule options: none\)",
        ),
    ],
)
def test_state_of_another_optimizer_is_refused_at_load(saved_by, loaded_by, match):
    model = Net()
    source = saved_by(_groups(model), lr=0.01)
    _train(model, source, 0, 1)
    target = loaded_by(_groups(model), lr=0.01)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(source.state_dict())
    assert after_equal(target.state_dict(), before)
    with pytest.raises(ValueError, match="parameter group 0 has no 'algorithm': it was not saved by a Muon-family"):
        target.load_state_dict(
            torch.optim.AdamW(model.parameters()).state_dict()
            | {"param_groups": [{"params": [0, 1, 2], "lr": 0.1}, {"params": [3, 4, 5, 6, 7], "lr": 0.1}]}
        )


def after_equal(a, b) -> bool:
    return a["param_groups"] == b["param_groups"] and all(
        torch.equal(a["state"][k][n], v) for k, st in b["state"].items() for n, v in st.items()
    )


def test_state_of_other_shapes_or_groups_is_refused_at_load():
    model = Net()
    opt = Muon(_groups(model), lr=0.01)
    _train(model, opt, 0, 1)
    saved = opt.state_dict()
    other = Net()
    other.fc2 = nn.Linear(20, 41)
    named = [
        {"params": [(n, p) for n, p in other.named_parameters() if n.endswith("weight") and "norm" not in n]},
        {
            "params": [(n, p) for n, p in other.named_parameters() if n.endswith("bias") or "norm" in n],
            "algorithm": "adamw",
        },
    ]
    with pytest.raises(
        ValueError,
        match=r"does not fit parameter 'fc2.weight': its 'momentum_buffer' has shape "
        r"\(40, 20\), the parameter \(41, 20\)",
    ):
        Muon(named, lr=0.01).load_state_dict(saved)
    with pytest.raises(ValueError, match="state_dict has 2 parameter groups, this optimizer 1"):
        Muon([model.fc1.weight], lr=0.01).load_state_dict(saved)
    with pytest.raises(ValueError, match="parameter group 0 holds 2 parameters here but 3 in the state_dict"):
        Muon([{"params": [model.fc1.weight, model.fc2.weight]}, _groups(model)[1]]).load_state_dict(saved)
    swapped = [dict(_groups(model)[0], algorithm="adamw"), _groups(model)[1]]
    with pytest.raises(ValueError, match="parameter group 0 is 'adamw' here but 'muon' in the state_dict"):
        Muon(swapped).load_state_dict(saved)


def test_bf16_parameters_keep_fp32_momentum_through_a_load():
    w = nn.Parameter(torch.randn(6, 8, dtype=torch.bfloat16))
    opt = Muon([w], lr=0.01)
    w.grad = torch.randn(6, 8, dtype=torch.bfloat16)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    opt2 = Muon([w], lr=0.01)
    opt2.load_state_dict(saved)  # torch casts state to the parameter dtype; the buffer keeps its fp32
    assert opt2.state[w]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(opt2.state[w]["momentum_buffer"], saved["state"][0]["momentum_buffer"])


def test_state_follows_a_model_cast_before_its_first_step():
    model = Net()
    opt = Muon(_groups(model), lr=0.01)
    model.double()  # parameters swap their data in place; the optimizer still holds them
    _train_double = [(x.double(), y.double()) for x, y in (_batch(0), _batch(1))]
    for x, y in _train_double:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert {s["momentum_buffer"].dtype for s in opt.state.values() if "momentum_buffer" in s} == {torch.float64}
    assert {s["exp_avg"].dtype for s in opt.state.values() if "exp_avg" in s} == {torch.float64}


def test_skipped_steps_are_saved_with_the_state():
    model = Net()
    opt = Muon(_groups(model), lr=0.01, nonfinite="skip")
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    model.fc1.weight.grad[0, 0] = float("nan")
    opt.step()
    opt.step()
    assert opt.skipped_steps == 2
    fresh = Muon(_groups(model), lr=0.01, nonfinite="skip")
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert fresh.skipped_steps == 2 and fresh.param_groups[0]["step"] == 2  # skipped steps take their slots


@pytest.mark.parametrize("cls", [Muon, PeriodicRowMuon, MuonBP, AdaptiveRowMuon])
def test_constructor_is_the_single_source_of_every_option(cls):
    """The subclass declares its schedule's options and forwards the core's (typed by MuonOptions): together
    every option once, each with its type hint and default, and its declared text."""
    parameters = option_parameters(cls)
    options = {n: p for n, (p, _) in parameters.items()}
    hints = {n: hint for n, (_, hint) in parameters.items()}
    assert all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in options.values())
    assert all(
        (p.default is not inspect.Parameter.empty and hints[n] is not typing.Any) or n == "process_group"
        for n, p in options.items()
    )
    for key, default in cls._schedule_defaults().items():
        assert options[key].default == default
    # The defaults in the signature are the ones an optimizer built without options carries.
    opt = cls([nn.Parameter(torch.randn(3, 4))])
    for name, value in opt.defaults.items():
        if name in options:
            assert (tuple(options[name].default) if name == "adamw_betas" else options[name].default) == value
    assert options["bucket_mb"].default == DEFAULT_BUCKET_MB == opt.engine_options["bucket_mb"]
    assert typing.get_args(hints["lr_scale"]) == ("match_rms_adamw", "original", "none")
    # The core's options as MuonOptions types them, and each with its text.
    core = {n for n in inspect.signature(MuonFamily.__init__).parameters if n not in ("self", "params", "lr")}
    core -= {"schedule_options"}
    typed = typing.get_type_hints(MuonOptions)
    assert set(typed) == core
    family = typing.get_type_hints(MuonFamily.__init__)
    assert all(typed[n] == family[n] for n in core)
    assert set(CORE_OPTIONS) == core | {"params", "lr"}
    assert all(option.doc for option in cls.schedule.options.values())
    names = {
        Muon: "muon",
        PeriodicRowMuon: "periodic_row_muon",
        MuonBP: "muon_bp",
        AdaptiveRowMuon: "adaptive_row_muon",
    }
    built = build(names[cls], Net(), ns_compile=False, adamw_fused=True, **cls._schedule_defaults())
    assert built.adamw_fused is True


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(ns_compile=1), TypeError, "ns_compile must be a bool"),
        (dict(adamw_fused="yes"), TypeError, "adamw_fused must be None, True or False"),
        (dict(lr=torch.tensor(1)), TypeError, "Tensor lr must be floating point"),
        (dict(lr=torch.tensor(-0.1)), ValueError, r"lr must be in \[0.0, inf\)"),
    ],
)
def test_bad_runtime_options_name_themselves(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Muon([nn.Parameter(torch.randn(3, 4))], **kwargs)


def test_non_contiguous_adamw_parameters_take_the_foreach_kernel():
    # torch's fused AdamW gives wrong updates for a non-contiguous parameter; the default kernel choice avoids it.
    ours, theirs = (
        nn.Parameter(torch.randn(10, 2, generator=torch.Generator().manual_seed(0))[:, 0]) for _ in range(2)
    )
    assert not ours.is_contiguous()
    opt = Muon([{"params": [ours], "algorithm": "adamw"}], lr=0.02)
    ref = torch.optim.AdamW([theirs], lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=True)
    for _ in range(5):
        for p, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            (p - 1).square().sum().backward()
            o.step()
    torch.testing.assert_close(ours, theirs)
    with pytest.raises(ValueError, match=r"no fused AdamW for parameter 'b' \(torch.float32 on cpu, not contiguous\)"):
        Muon([{"params": [("b", nn.Parameter(torch.randn(4, 2)[:, 0]))], "algorithm": "adamw"}], adamw_fused=True)


def test_fused_adamw_refused_where_torch_has_none():
    p = nn.Parameter(torch.randn(3, 4, device="meta"))
    with pytest.raises(ValueError, match=r"adamw_fused=True, but torch has no fused AdamW for parameter 'b'"):
        Muon([{"params": [("b", p)], "algorithm": "adamw"}], adamw_fused=True)


def test_keys_other_libraries_add_to_groups_are_kept_and_ignored_with_one_warning():
    """torchtitan's containers put ``fused``/``foreach`` in every group, schedulers ``initial_lr``: accepted as
    torch's optimizers accept them, one warning naming what dimuon ignores, the update unchanged."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(4))
    a2, b2 = (nn.Parameter(p.detach().clone()) for p in (a, b))
    foreign = {"fused": False, "foreach": True, "capturable": False}
    with pytest.warns(ForeignGroupKeyWarning, match=r"\['capturable', 'foreach', 'fused'\]") as caught:
        opt = PeriodicRowMuon([{"params": [a], **foreign}, {"params": [b], "algorithm": "adamw", **foreign}], lr=0.02)
    assert len([w for w in caught if w.category is ForeignGroupKeyWarning]) == 1
    plain = PeriodicRowMuon([{"params": [a2]}, {"params": [b2], "algorithm": "adamw"}], lr=0.02)
    for _ in range(3):
        for p in (a, b, a2, b2):
            p.grad = torch.ones_like(p) + p.detach()
        opt.step()
        plain.step()
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert opt.param_groups[0]["foreach"] is True  # kept, as torch keeps them
    restored = PeriodicRowMuon([{"params": [a], **foreign}, {"params": [b], "algorithm": "adamw", **foreign}], lr=0.02)
    restored.load_state_dict(opt.state_dict())
    assert restored.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    with pytest.warns(ForeignGroupKeyWarning, match=r"\['maximize'\]"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3, 3))], "maximize": False})


def test_the_fused_adamw_group_takes_gradients_and_moments_laid_out_unlike_the_parameter():
    # torch's fused AdamW pairs elements by memory offset: a strided gradient (autograd.grad through an einsum) or
    # moments a checkpoint brought in another layout gave wrong steps, silently.
    torch.manual_seed(0)
    x, start = torch.randn(16, 5), torch.randn(3, 5)

    def grad_of(p: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(torch.einsum("ij,kj->ik", x, p).square().mean(), [p])
        assert not g.is_contiguous()
        return g

    def train(make, steps: int = 4, state=None):
        p = nn.Parameter(start.clone())
        opt = make(p)
        if state is not None:
            opt.load_state_dict(copy.deepcopy(state))  # the moments and counters are stepped in place
        for _ in range(steps):
            p.grad = grad_of(p)
            opt.step()
        return p.detach(), opt

    reference, _ = train(lambda p: torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.95), weight_decay=0.0))
    fused, opt = train(lambda p: Muon([{"params": [p], "algorithm": "adamw"}], lr=0.01, adamw_fused=True))
    torch.testing.assert_close(fused, reference, rtol=0, atol=1e-6)
    # Moments saved in a transposed layout (as a channels_last model's would be) and resumed into this one.
    state = opt.state_dict()
    for s in state["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            s[key] = s[key].t().contiguous().t()
            assert not s[key].is_contiguous()
    resumed, _ = train(lambda p: Muon([{"params": [p], "algorithm": "adamw"}], lr=0.01, adamw_fused=True), 2, state)
    again, _ = train(lambda p: Muon([{"params": [p], "algorithm": "adamw"}], lr=0.01, adamw_fused=False), 2, state)
    torch.testing.assert_close(resumed, again, rtol=0, atol=1e-6)


def test_the_keys_torch_s_schedulers_write_into_groups_are_taken_quietly():
    # OneCycleLR writes max_momentum, which reads like a misspelt 'momentum' but is the scheduler's own key.
    model = nn.Linear(4, 4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=0.1, total_steps=10)
    written = {k: v for k, v in sgd.param_groups[0].items() if k not in sgd.defaults and k != "params"}
    assert {"max_momentum", "base_momentum", "max_lr", "min_lr", "initial_lr"} <= set(written)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = PeriodicRowMuon([{"params": [model.weight], **written}], lr=0.02)
        opt.add_param_group({"params": [model.bias], "algorithm": "adamw", **written})


class _TwoLayers(nn.Module):
    """Two same-shape layers, declared in the order given (a refactor that swaps them keeps every shape)."""

    def __init__(self, order=("fc1", "fc2")):
        super().__init__()
        for name in order:
            setattr(self, name, nn.Linear(8, 8))


def _stepped(cls, order=("fc1", "fc2"), **kw):
    """A model of ``order`` and its optimizer after one step with gradient +1 on fc1 and -1 on fc2."""
    model = _TwoLayers(order)
    opt = cls(param_groups(model), lr=0.02, **kw)
    for layer, sign in (("fc1", 1.0), ("fc2", -1.0)):
        for p in getattr(model, layer).parameters():
            p.grad = torch.full_like(p, sign)
    opt.step()
    return model, opt


def _momentum(opt, p):
    state = opt.state[p]
    return state["momentum_buffer"] if "momentum_buffer" in state else state["exp_avg"]


@pytest.mark.parametrize("cls", [Muon, PeriodicRowMuon, AdaptiveRowMuon])
def test_a_load_matches_state_to_parameters_by_name(cls):
    source, opt = _stepped(cls)
    saved = copy.deepcopy(opt.state_dict())
    model = _TwoLayers(("fc2", "fc1"))  # the same layers, declared in the other order
    target = cls(param_groups(model), lr=0.02)
    names = [list(g["param_names"]) for g in target.param_groups]
    assert names != [g["param_names"] for g in saved["param_groups"]]
    target.load_state_dict(saved)
    for layer in ("fc1", "fc2"):
        for mine, theirs in zip(getattr(model, layer).parameters(), getattr(source, layer).parameters()):
            assert torch.equal(_momentum(target, mine), _momentum(opt, theirs)), layer
    assert [g["param_names"] for g in target.param_groups] == names  # still those of the parameters held
    model.fc2.weight.grad = torch.full((8, 8), float("nan"))
    with pytest.raises(FloatingPointError, match=r"non-finite gradient in fc2\.weight;"):
        target.step()


def test_a_model_saved_compiled_resumes_without_compile_by_name():
    source, opt = _stepped(Muon)
    compiled = torch.compile(source)  # its parameters named "_orig_mod.fc1.weight", ...
    saved = Muon(param_groups(compiled), lr=0.02)
    saved.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert saved.param_groups[0]["param_names"] == ["_orig_mod.fc1.weight", "_orig_mod.fc2.weight"]
    model = _TwoLayers(("fc2", "fc1"))
    target = Muon(param_groups(model), lr=0.02)
    target.load_state_dict(copy.deepcopy(saved.state_dict()))
    assert torch.equal(_momentum(target, model.fc1.weight), _momentum(opt, source.fc1.weight))
    assert target.param_groups[0]["param_names"] == ["fc2.weight", "fc1.weight"]


def test_a_torch_muon_load_matches_state_to_parameters_by_name():
    source, opt = _stepped(lambda groups, lr: build("torch_muon", groups, lr=lr))
    model = _TwoLayers(("fc2", "fc1"))
    target = build("torch_muon", param_groups(model), lr=0.02)
    target.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert torch.equal(
        target._muon.state[model.fc1.weight]["momentum_buffer"], opt._muon.state[source.fc1.weight]["momentum_buffer"]
    )
    assert [g["param_names"] for g in target.param_groups] == [
        ["fc2.weight", "fc1.weight"],
        ["fc2.bias", "fc1.bias"],
    ]


def test_a_load_of_other_parameter_names_is_refused_naming_them():
    _, opt = _stepped(Muon)
    saved = copy.deepcopy(opt.state_dict())
    model = _TwoLayers(("fc1", "fc3"))  # fc2 renamed: the same shapes, other names
    target = Muon(param_groups(model), lr=0.02)
    with pytest.raises(
        ValueError,
        match=r"^parameter group 0 of the state_dict holds other parameters than this optimizer's: missing "
        r"'fc3.weight'; unexpected 'fc2.weight' \(state is matched to parameters by their names",
    ):
        target.load_state_dict(saved)
    assert all(not _momentum(target, p).any() for p in model.parameters())  # nothing was loaded
    # Without names on one side the state loads by position, as torch loads it.
    unnamed = Muon([{**g, "params": [p for _, p in g["params"]]} for g in param_groups(model)], lr=0.02)
    unnamed.load_state_dict(copy.deepcopy(saved))
    assert torch.equal(_momentum(unnamed, model.fc3.weight), _momentum(opt, opt.param_groups[0]["params"][1]))


def test_a_checkpoint_keyed_by_name_keeps_the_optimizer_s_parameter_names():
    """torch.distributed.checkpoint's set_state_dict matches state by name itself and lists it in this optimizer's
    order; the groups keep the names of the parameters they hold (not the checkpoint's order of them)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    source, opt = _stepped(Muon)
    model_sd, optim_sd = get_state_dict(source, opt)
    model = _TwoLayers(("fc2", "fc1"))
    target = Muon(param_groups(model), lr=0.02)
    set_state_dict(model, target, model_state_dict=model_sd, optim_state_dict=copy.deepcopy(optim_sd))
    assert target.param_groups[0]["param_names"] == ["fc2.weight", "fc1.weight"]
    assert torch.equal(_momentum(target, model.fc2.weight), _momentum(opt, source.fc2.weight))


def test_a_state_dict_that_is_not_an_optimizer_s_is_refused_naming_its_keys():
    opt = Muon([nn.Parameter(torch.randn(3, 3))])
    with pytest.raises(ValueError, match=r"not an optimizer's state dict \(it has \['optimizers'\]"):
        opt.load_state_dict({"optimizers": {}})


def test_a_misspelt_constructor_argument_is_named_with_the_one_meant():
    with pytest.raises(TypeError, match=r"\['betas'\] \('betas': did you mean 'adamw_betas'\?\); it takes \["):
        Muon([nn.Parameter(torch.randn(3, 3))], betas=(0.9, 0.99))
    with pytest.raises(TypeError, match=r"\('kk': did you mean 'k'\?\)|it takes \[.*'gamma', 'k'"):
        PeriodicRowMuon([nn.Parameter(torch.randn(3, 3))], kk=3)


def test_a_refused_group_or_load_leaves_no_trace():
    opt = Muon([nn.Parameter(torch.randn(4, 4))], nonfinite="skip")
    conv = nn.Parameter(torch.randn(8, 3, 3, 3))
    with pytest.raises(ValueError, match="is in a 'muon' group, but Muon updates matrices"):
        opt.add_param_group({"params": [conv, nn.Parameter(torch.randn(8))]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about the refused group's conv weight
        opt.add_param_group({"params": [nn.Parameter(torch.randn(5, 5))]})
    # A skipped step, then a load that is refused: the skip is still counted.
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.full_like(p, float("nan"))
    opt.step()
    with pytest.raises(ValueError):
        opt.load_state_dict(PeriodicRowMuon([nn.Parameter(torch.randn(4, 4))]).state_dict())
    assert opt.skipped_steps == 1


def test_load_post_hooks_see_and_keep_the_state_as_loaded():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))
    opt = PeriodicRowMuon([w], lr=0.02)
    for _ in range(2):
        w.grad = torch.randn_like(w)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    w2 = nn.Parameter(w.detach().clone())
    opt2 = PeriodicRowMuon([w2], lr=0.02)
    seen = {}

    def restart_momentum(o: torch.optim.Optimizer) -> None:
        seen["dtype"] = o.state[w2]["momentum_buffer"].dtype
        o.state[w2]["momentum_buffer"] = torch.zeros_like(o.state[w2]["momentum_buffer"])

    opt2.register_load_state_dict_post_hook(restart_momentum)
    opt2.load_state_dict(saved)
    assert seen["dtype"] == torch.float32  # the saved (wide) momentum, not torch's cast to the parameter's bf16
    assert (opt2.state[w2]["momentum_buffer"] == 0).all()  # and what the hook wrote stays
