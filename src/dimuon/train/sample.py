"""``dimuon sample``: an image grid from a checkpoint's EMA (or raw) weights."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import tyro

from dimuon.dit import sample
from dimuon.dit.checkpoint import CheckpointError, find_checkpoint, load_model_for_eval
from dimuon.io import save_grid

__all__ = ["SampleConfig", "main"]


@dataclass
class SampleConfig:
    """Sample a grid of images from a checkpoint written by dimuon train."""

    ckpt: str
    """Checkpoint directory (.../checkpoints/step_NNNNNNN), or a run directory for its newest checkpoint."""
    out: str = "samples.png"
    """PNG file to write."""
    n: int = 64
    """Number of images; labels cycle through the classes unless --labels is given."""
    labels: tuple[int, ...] | None = None
    """Explicit class labels, repeated to fill --n."""
    cfg: float = 3.0
    """Classifier-free guidance scale (1 disables guidance)."""
    steps: int = 50
    """ODE steps."""
    method: Literal["euler", "heun"] = "heun"
    """ODE method."""
    seed: int = 0
    """Seed of the starting noise."""
    nrow: int | None = None
    """Images per grid row (default: the number of classes when it is at most 20, else square)."""
    raw: bool = False
    """Use the training weights instead of the EMA."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda if available."""
    scale: int = 2
    """Nearest-neighbour upscaling of the PNG."""


def run(cfg: SampleConfig) -> torch.Tensor:
    """Sample as configured, write the grid, return the images (N, C, H, W) in [-1, 1]."""
    for name in ("n", "steps", "scale"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    device = torch.device("cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    model, info = load_model_for_eval(find_checkpoint(cfg.ckpt), use_ema=not cfg.raw, map_location=device)
    num_classes = int(info["num_classes"])
    base = torch.tensor(cfg.labels if cfg.labels else range(num_classes), dtype=torch.long, device="cpu")
    if base.min() < 0 or base.max() >= num_classes:
        raise ValueError(f"--labels must lie in [0, {num_classes}), got {cfg.labels}")
    labels = base.repeat(-(-cfg.n // len(base)))[: cfg.n].to(device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    images = sample(model, labels, info["image_shape"], steps=cfg.steps, method=cfg.method,
                    cfg_scale=cfg.cfg, generator=gen)
    nrow = cfg.nrow or (len(base) if len(base) <= 20 else None)
    path = save_grid(images, cfg.out, nrow=nrow, scale=cfg.scale)
    print(f"dimuon sample: {cfg.n} images from {info['path']} (step {info['step']}, "
          f"{'raw' if cfg.raw else 'EMA'} weights, {cfg.method} x {cfg.steps}, cfg {cfg.cfg:g}) -> {path}")
    return images


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = tyro.cli(SampleConfig, args=args, prog="dimuon sample")
    try:
        run(cfg)
    except (CheckpointError, ValueError) as e:
        print(f"dimuon sample: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
