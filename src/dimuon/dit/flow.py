"""Rectified-flow objective (SiT convention), timestep distributions and a comparable validation loss.

Convention: ``x_t = t * x1 + (1 - t) * x0`` with data ``x1`` and noise ``x0 ~ N(0, I)``; the model
predicts the velocity ``v = x1 - x0`` and the loss is ``mean((v_hat - v)**2)``. Time runs from noise
(t = 0) to data (t = 1). A model is any callable ``model(x_t, t, y)`` whose first ``C`` output
channels are the velocity (``C`` = channels of ``x``), with ``t`` a float tensor (N,) in [0, 1].
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

__all__ = [
    "DEFAULT_T_GRID",
    "TimestepDist",
    "ValidationLoss",
    "eval_mode",
    "flow_loss",
    "interpolate",
    "predict_velocity",
    "validation_loss",
    "velocity_target",
]

ModelFn = Callable[[Tensor, Tensor, Tensor], Tensor]

# Midpoints of 10 equal bins of [0, 1]: their mean estimates the loss under t ~ U[0, 1].
DEFAULT_T_GRID: tuple[float, ...] = tuple((k + 0.5) / 10 for k in range(10))

# Validation noise is drawn in fixed blocks of rows, so it does not depend on the evaluation batch size.
_NOISE_BLOCK = 64


@dataclass(frozen=True)
class TimestepDist:
    """Training distribution of ``t``: ``"uniform"`` on [0, 1] or ``"logit_normal"`` (sigmoid of N(mean, std)).

    Logit-normal with mean 0, std 1 (as in SD3) puts more samples at mid times, where the velocity is
    hardest to predict.
    """

    kind: Literal["uniform", "logit_normal"] = "uniform"
    mean: float = 0.0
    std: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("uniform", "logit_normal"):
            raise ValueError(f"unknown timestep distribution {self.kind!r}; choose 'uniform' or 'logit_normal'")
        if not self.std > 0:
            raise ValueError(f"logit-normal std must be positive, got {self.std}")

    def sample(
        self, n: int, *, device: torch.device | str | None = None, generator: torch.Generator | None = None
    ) -> Tensor:
        """Draw ``n`` times as a float32 tensor (n,) on ``device`` (the generator's device if given)."""
        if self.kind == "uniform":
            return torch.rand(n, device=device, generator=generator)
        z = torch.randn(n, device=device, generator=generator)
        return torch.sigmoid(self.mean + self.std * z)


def interpolate(x0: Tensor, x1: Tensor, t: Tensor) -> Tensor:
    """Point on the straight path from noise ``x0`` to data ``x1`` at times ``t`` (N,): ``t*x1 + (1-t)*x0``."""
    tb = t.reshape(-1, *([1] * (x1.ndim - 1))).to(x1.dtype)
    return tb * x1 + (1 - tb) * x0


def velocity_target(x0: Tensor, x1: Tensor) -> Tensor:
    """Velocity of the straight path, constant in ``t``: ``x1 - x0``."""
    return x1 - x0


def predict_velocity(model: ModelFn, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
    """Call the model and keep its first ``C`` output channels (the velocity)."""
    return model(x, t, y)[:, : x.shape[1]]


def flow_loss(
    model: ModelFn,
    x1: Tensor,
    y: Tensor,
    *,
    t: Tensor | None = None,
    x0: Tensor | None = None,
    timesteps: TimestepDist | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Rectified-flow training loss ``mean((model(x_t, t, y) - (x1 - x0))**2)`` as a scalar tensor.

    ``t`` and ``x0`` are drawn (from ``timesteps`` and N(0, I), with ``generator`` if given; it must live
    on ``x1``'s device) unless passed. Label dropout is the model's business (training mode).
    """
    n = x1.shape[0]
    if t is None:
        t = (timesteps or TimestepDist()).sample(n, device=x1.device, generator=generator)
    if x0 is None:
        x0 = torch.randn(x1.shape, device=x1.device, dtype=x1.dtype, generator=generator)
    x_t = interpolate(x0, x1, t)
    v_hat = predict_velocity(model, x_t, t, y)
    return (v_hat.float() - velocity_target(x0, x1).float()).square().mean()


@contextlib.contextmanager
def eval_mode(model: nn.Module | ModelFn) -> Iterator[None]:
    """Put a module in eval mode (no label dropout) for the duration, then restore its previous mode."""
    if not isinstance(model, nn.Module):
        yield
        return
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class ValidationLoss(NamedTuple):
    """Mean validation loss over the t grid, and the loss at each grid time."""

    mean: float
    per_t: dict[float, float]


def _fixed_noise(start: int, stop: int, shape: Sequence[int], seed: int) -> Tensor:
    """Noise rows ``start:stop`` of a fixed sequence: row ``i`` depends only on ``(seed, i)``.

    Drawn on the CPU whatever the model's device, so a validation loss is comparable across devices.
    """
    blocks = []
    for b in range(start // _NOISE_BLOCK, (stop - 1) // _NOISE_BLOCK + 1):
        g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + b)
        blocks.append(torch.randn(_NOISE_BLOCK, *shape, generator=g, device="cpu"))
    noise = torch.cat(blocks)
    offset = (start // _NOISE_BLOCK) * _NOISE_BLOCK
    return noise[start - offset : stop - offset]


def _model_device(model: nn.Module | ModelFn, default: torch.device) -> torch.device:
    if isinstance(model, nn.Module):
        for p in model.parameters():
            return p.device
    return default


@torch.no_grad()
def validation_loss(
    model: nn.Module | ModelFn,
    images: Tensor,
    labels: Tensor,
    *,
    t_grid: Sequence[float] = DEFAULT_T_GRID,
    seed: int = 0,
    batch_size: int = 256,
) -> ValidationLoss:
    """Flow loss on held-out data at fixed times with fixed noise, so that two runs compare exactly.

    Every image is scored at every ``t`` in ``t_grid`` against the same noise sample (its noise depends
    only on ``seed`` and its row index, not on ``batch_size`` or the global RNG). The model runs in eval
    mode (no label dropout) and its previous mode is restored. Returns the mean over the grid and the
    per-t losses (each a mean over images and pixels).
    """
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {labels.shape[0]} labels")
    if images.shape[0] == 0:
        raise ValueError("validation set is empty")
    if not t_grid:
        raise ValueError("t_grid is empty")
    device = _model_device(model, images.device)
    n = images.shape[0]
    sums = torch.zeros(len(t_grid), dtype=torch.float64, device=device)  # summed on the device: one host read
    with eval_mode(model):
        for start in range(0, n, batch_size):
            stop = min(start + batch_size, n)
            x1 = images[start:stop].to(device=device, dtype=torch.float32)
            y = labels[start:stop].to(device)
            x0 = _fixed_noise(start, stop, images.shape[1:], seed).to(device)
            for k, tk in enumerate(t_grid):
                t = torch.full((stop - start,), float(tk), device=device)
                x_t = interpolate(x0, x1, t)
                err = (predict_velocity(model, x_t, t, y).float() - velocity_target(x0, x1)).square()
                sums[k] += err.sum(dtype=torch.float64)
    per_t = (sums / (n * math.prod(images.shape[1:]))).tolist()
    return ValidationLoss(mean=sum(per_t) / len(per_t), per_t=dict(zip((float(t) for t in t_grid), per_t, strict=True)))
