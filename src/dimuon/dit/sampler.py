"""Euler and Heun ODE samplers for the rectified flow, from noise (t = 0) to data (t = 1), with CFG.

The integrators take a velocity function ``v(x, t)`` (``t`` a float tensor (N,)) and are exact for a
constant velocity. ``sample`` wires a class-conditional model into them, with classifier-free guidance
through the model's null label, and draws the starting noise from a ``torch.Generator`` so that a
seeded call is reproducible.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from dimuon.dit.flow import ModelFn, eval_mode, predict_velocity

__all__ = ["euler", "guided_velocity", "heun", "integrate", "sample"]

VelocityFn = Callable[[Tensor, Tensor], Tensor]


def _time_grid(steps: int, t_start: float, t_end: float) -> list[float]:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return torch.linspace(t_start, t_end, steps + 1, dtype=torch.float64, device="cpu").tolist()


def euler(velocity: VelocityFn, x: Tensor, steps: int, t_start: float = 0.0, t_end: float = 1.0) -> Tensor:
    """Explicit Euler on a uniform grid: ``steps`` velocity evaluations."""
    ts = _time_grid(steps, t_start, t_end)
    for t0, t1 in itertools.pairwise(ts):
        t = torch.full((x.shape[0],), t0, device=x.device)
        x = x + (t1 - t0) * velocity(x, t)
    return x


def heun(velocity: VelocityFn, x: Tensor, steps: int, t_start: float = 0.0, t_end: float = 1.0) -> Tensor:
    """Heun's second-order method (trapezoidal predictor-corrector): ``2 * steps`` velocity evaluations.

    The flow's velocity is defined at t = 1, so the last step is corrected like the others.
    """
    ts = _time_grid(steps, t_start, t_end)
    for t0, t1 in itertools.pairwise(ts):
        h = t1 - t0
        v0 = velocity(x, torch.full((x.shape[0],), t0, device=x.device))
        x_pred = x + h * v0
        v1 = velocity(x_pred, torch.full((x.shape[0],), t1, device=x.device))
        x = x + 0.5 * h * (v0 + v1)
    return x


_INTEGRATORS: dict[str, Callable[..., Tensor]] = {"euler": euler, "heun": heun}


def integrate(
    velocity: VelocityFn,
    x: Tensor,
    steps: int,
    method: Literal["euler", "heun"] = "euler",
    t_start: float = 0.0,
    t_end: float = 1.0,
) -> Tensor:
    """Integrate ``dx/dt = velocity(x, t)`` from ``t_start`` to ``t_end`` with the named method."""
    if method not in _INTEGRATORS:
        raise ValueError(f"unknown ODE method {method!r}; choose one of: {', '.join(_INTEGRATORS)}")
    return _INTEGRATORS[method](velocity, x, steps, t_start, t_end)


def guided_velocity(
    model: ModelFn, x: Tensor, t: Tensor, y: Tensor, cfg_scale: float, null_label: int | None
) -> Tensor:
    """Classifier-free guidance: ``v(x, t, null) + cfg_scale * (v(x, t, y) - v(x, t, null))``.

    Scale 1 is the plain conditional velocity and costs one model call; other scales run the
    conditional and null branches as one doubled batch.
    """
    if cfg_scale == 1.0:
        return predict_velocity(model, x, t, y)
    if null_label is None:
        raise ValueError("classifier-free guidance needs null_label (the model has no num_classes)")
    null = torch.full_like(y, null_label)
    v = predict_velocity(model, torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]))
    v_cond, v_null = v.chunk(2, dim=0)
    return v_null + cfg_scale * (v_cond - v_null)


@torch.no_grad()
def sample(
    model: nn.Module | ModelFn,
    labels: Tensor,
    shape: Sequence[int],
    *,
    steps: int = 50,
    method: Literal["euler", "heun"] = "euler",
    cfg_scale: float = 1.0,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
    null_label: int | None = None,
) -> Tensor:
    """Generate images (N, *shape) for ``labels`` (N,) by integrating the model's velocity from noise.

    ``shape`` is (C, H, W). The noise comes from ``generator`` (on the generator's device, then moved to
    the labels' device) unless ``noise`` is given. ``null_label`` defaults to ``model.num_classes``. The
    model runs in eval mode and under ``no_grad``; its previous mode is restored.
    """
    n = labels.shape[0]
    if noise is None:
        gen_device = generator.device if generator is not None else labels.device
        noise = torch.randn(n, *shape, generator=generator, device=gen_device)
    x = noise.to(labels.device)
    if null_label is None:
        null_label = getattr(model, "num_classes", None)

    def velocity(x: Tensor, t: Tensor) -> Tensor:
        return guided_velocity(model, x, t, labels, cfg_scale, null_label)

    with eval_mode(model):
        return integrate(velocity, x, steps, method)
