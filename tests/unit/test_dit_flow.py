"""Rectified-flow objective, timestep distributions, validation loss and the ODE samplers."""

from __future__ import annotations

import pytest
import torch

from dimuon.data import BatchSchedule, build_dataset, get_batch
from dimuon.dit.flow import (
    DEFAULT_T_GRID,
    TimestepDist,
    _fixed_noise,
    flow_loss,
    interpolate,
    validation_loss,
    velocity_target,
)
from dimuon.dit.model import build_dit
from dimuon.dit.sampler import euler, guided_velocity, heun, integrate, sample

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny_dit(seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


# --------------------------------------------------------------------------------------------------
# Objective
# --------------------------------------------------------------------------------------------------


def test_interpolation_endpoints_and_target():
    x0, x1 = torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4)
    assert torch.equal(interpolate(x0, x1, torch.zeros(3)), x0)
    assert torch.equal(interpolate(x0, x1, torch.ones(3)), x1)
    mid = interpolate(x0, x1, torch.tensor([0.25, 0.5, 0.75]))
    assert torch.allclose(mid[1], 0.5 * (x0[1] + x1[1]))
    assert torch.allclose(mid[2], 0.75 * x1[2] + 0.25 * x0[2])
    assert torch.equal(velocity_target(x0, x1), x1 - x0)


def test_flow_loss_matches_the_formula_and_is_zero_for_the_true_velocity():
    x1, x0, y = torch.randn(4, 2, 4, 4), torch.randn(4, 2, 4, 4), torch.zeros(4, dtype=torch.long)
    t = torch.tensor([0.1, 0.4, 0.6, 0.9])

    def oracle(x, t_, y_):
        return torch.cat([x1 - x0, torch.randn_like(x)], dim=1)  # extra channels must be ignored

    assert flow_loss(oracle, x1, y, t=t, x0=x0).item() == 0.0

    def zero(x, t_, y_):
        return torch.zeros_like(x)

    assert torch.allclose(flow_loss(zero, x1, y, t=t, x0=x0), (x1 - x0).square().mean())


def test_timestep_distributions():
    g = torch.Generator().manual_seed(0)
    u = TimestepDist("uniform").sample(20000, generator=g)
    assert u.min() >= 0 and u.max() <= 1 and abs(u.mean().item() - 0.5) < 0.01
    ln = TimestepDist("logit_normal", mean=1.0, std=0.5).sample(20000, generator=g)
    assert ln.min() > 0 and ln.max() < 1
    assert abs(ln.median().item() - torch.sigmoid(torch.tensor(1.0)).item()) < 0.01
    a = TimestepDist("logit_normal").sample(5, generator=torch.Generator().manual_seed(3))
    b = TimestepDist("logit_normal").sample(5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="unknown timestep distribution 'beta'"):
        TimestepDist("beta")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="std must be positive"):
        TimestepDist("logit_normal", std=0.0)


def test_loss_drops_on_a_tiny_adamw_run():
    train, val = build_dataset("digits", "train"), build_dataset("digits", "val")
    xv, yv = get_batch(val, range(len(val)))
    model = build_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    start = validation_loss(model, xv, yv).mean
    for idx in BatchSchedule(len(train), 64, seed=0).iter_from(0, 40):
        x, y = get_batch(train, idx)
        loss = flow_loss(model, x, y, generator=g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    end = validation_loss(model, xv, yv).mean
    # The zero-initialised model predicts v = 0, scoring E|x1 - x0|^2 (about 1.7 on these digits).
    assert start > 1.4
    assert end < 0.7 * start, (start, end)


# --------------------------------------------------------------------------------------------------
# Validation loss
# --------------------------------------------------------------------------------------------------


def test_validation_loss_is_deterministic_and_ignores_global_rng_and_batch_size():
    model = _tiny_dit(class_dropout_prob=0.5)
    images = torch.rand(20, 1, 8, 8) * 2 - 1
    labels = torch.arange(20) % 10
    torch.manual_seed(1)
    a = validation_loss(model, images, labels, batch_size=8)
    torch.manual_seed(2)
    torch.rand(100)
    b = validation_loss(model, images, labels, batch_size=8)
    assert a == b
    c = validation_loss(model, images, labels, batch_size=7)
    assert c.mean == pytest.approx(a.mean, rel=1e-6)
    assert list(a.per_t) == list(DEFAULT_T_GRID)
    assert a.mean == pytest.approx(sum(a.per_t.values()) / len(a.per_t))
    assert model.training  # mode restored; label dropout was off inside (else a != b)
    d = validation_loss(model, images, labels, seed=1, batch_size=8)
    assert d.mean != a.mean


def test_validation_loss_matches_a_direct_computation():
    model = _tiny_dit().eval()
    images, labels = torch.rand(5, 1, 8, 8), torch.arange(5)
    grid = (0.25, 0.75)
    res = validation_loss(model, images, labels, t_grid=grid, seed=3)
    x0 = _fixed_noise(0, 5, (1, 8, 8), seed=3)
    for tk in grid:
        t = torch.full((5,), tk)
        with torch.no_grad():
            expected = flow_loss(model, images, labels, t=t, x0=x0).item()
        assert res.per_t[tk] == pytest.approx(expected, rel=1e-5)


def test_fixed_noise_rows_do_not_depend_on_how_they_are_sliced():
    whole = _fixed_noise(0, 300, (2, 3), seed=5)
    assert whole.shape == (300, 2, 3)
    assert torch.equal(_fixed_noise(70, 200, (2, 3), seed=5), whole[70:200])
    assert torch.equal(_fixed_noise(299, 300, (2, 3), seed=5), whole[299:])
    assert not torch.equal(_fixed_noise(0, 300, (2, 3), seed=6), whole)
    assert abs(whole.mean().item()) < 0.1 and abs(whole.std().item() - 1) < 0.1


def test_validation_loss_errors():
    model = _tiny_dit()
    with pytest.raises(ValueError, match="3 images but 2 labels"):
        validation_loss(model, torch.zeros(3, 1, 8, 8), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        validation_loss(model, torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long))


# --------------------------------------------------------------------------------------------------
# Samplers
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["euler", "heun"])
@pytest.mark.parametrize("steps", [1, 3, 10])
def test_sampler_integrates_a_straight_flow_exactly(method, steps):
    x0 = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    x1 = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1))

    def straight(x, t, y):
        return (x1 - x0).expand_as(x)

    out = sample(straight, torch.zeros(4, dtype=torch.long), (1, 8, 8), steps=steps, method=method, noise=x0)
    assert torch.allclose(out, x1, atol=1e-5)


def test_heun_is_exact_for_a_linear_in_time_velocity_and_euler_is_first_order():
    x = torch.zeros(2, 3)

    def v(x_, t):
        return 2 * t[:, None].expand_as(x_)  # dx/dt = 2t, so x(1) = x(0) + 1

    for steps in (1, 2, 5):
        assert torch.allclose(heun(v, x, steps), x + 1, atol=1e-6)
        # Left Riemann sum of 2t: 1 - 1/steps.
        assert torch.allclose(euler(v, x, steps), x + 1 - 1 / steps, atol=1e-6)


def test_sampler_is_deterministic_given_a_generator():
    model = _tiny_dit()
    labels = torch.tensor([1, 2, 3])

    def draw(seed):
        return sample(model, labels, (1, 8, 8), steps=4, cfg_scale=2.0, generator=torch.Generator().manual_seed(seed))

    a = draw(0)
    torch.manual_seed(123)
    assert torch.equal(a, draw(0))
    assert not torch.allclose(a, draw(1))
    assert a.shape == (3, 1, 8, 8)


def test_cfg_scale_one_equals_the_conditional_sampler():
    model = _tiny_dit(class_dropout_prob=1.0).train()  # dropout on in train mode: sampling must turn it off
    labels = torch.tensor([0, 5, 9])
    noise = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    guided = sample(model, labels, (1, 8, 8), steps=3, cfg_scale=1.0, noise=noise)
    assert model.training

    def conditional(x, t):
        with torch.no_grad():
            return model.eval()(x, t, labels)

    plain = euler(conditional, noise, 3)
    assert torch.allclose(guided, plain, atol=1e-6)
    # The doubled-batch path at scale 1 gives the same numbers.
    x, t = noise, torch.full((3,), 0.3)
    with torch.no_grad():
        assert torch.allclose(guided_velocity(model, x, t, labels, 1.0, 10), model(x, t, labels), atol=1e-6)
        assert torch.allclose(model.forward_with_cfg(x, t, labels, 1.0), model(x, t, labels), atol=1e-5)


def test_cfg_combines_the_branches_through_the_null_label():
    def label_model(x, t, y):
        return y.float().reshape(-1, 1, 1, 1).expand_as(x).clone()

    x, t, y = torch.zeros(2, 1, 2, 2), torch.zeros(2), torch.tensor([3, 7])
    v = guided_velocity(label_model, x, t, y, cfg_scale=2.5, null_label=10)
    expected = 10 + 2.5 * (y.float() - 10)
    assert torch.allclose(v, expected.reshape(-1, 1, 1, 1).expand_as(x))
    with pytest.raises(ValueError, match="null_label"):
        sample(label_model, y, (1, 2, 2), steps=1, cfg_scale=2.0, noise=x)


def test_sampler_argument_errors():
    with pytest.raises(ValueError, match="unknown ODE method 'rk4'"):
        integrate(lambda x, t: x, torch.zeros(1), 2, method="rk4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="steps must be >= 1"):
        euler(lambda x, t: x, torch.zeros(1), 0)
