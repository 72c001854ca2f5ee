"""``dimuon sample``: an image grid from a checkpoint's EMA (or raw) weights."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro

from dimuon.dit import sample
from dimuon.dit.checkpoint import CheckpointError, find_checkpoint, load_model_for_eval
from dimuon.io import save_grid, unwritable_reason
from dimuon.log import run_command
from dimuon.metrics.series import check_device

__all__ = ["SampleConfig", "main", "parse"]


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
    """Images per grid row (default: one column per label, or per class without --labels, for 2 to 20 of them;
    else square)."""
    raw: bool = False
    """Use the training weights instead of the EMA."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda if available."""
    scale: int = 2
    """Nearest-neighbour upscaling of the PNG."""


def check_config(cfg: SampleConfig) -> None:
    """Refuse values that cannot work and an --out that cannot be written, before the model is loaded."""
    for name in ("n", "steps", "scale", "nrow"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if cfg.cfg < 0:
        raise ValueError(f"--cfg must be >= 0 (1 disables guidance), got {cfg.cfg}")
    check_device(cfg.device)
    out = Path(cfg.out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; name the PNG file to write")
    reason = unwritable_reason(out.parent)
    if reason is not None:
        raise ValueError(f"--out {out} cannot be written: {reason}")


def run(cfg: SampleConfig) -> torch.Tensor:
    """Sample as configured, write the grid, return the images (N, C, H, W) in [-1, 1]."""
    check_config(cfg)
    device = torch.device(
        "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    model, info = load_model_for_eval(find_checkpoint(cfg.ckpt), use_ema=not cfg.raw, map_location=device)
    num_classes = int(info["num_classes"])
    base = torch.tensor(cfg.labels if cfg.labels else range(num_classes), dtype=torch.long, device="cpu")
    if base.min() < 0 or base.max() >= num_classes:
        raise ValueError(f"--labels must lie in [0, {num_classes}), got {cfg.labels}")
    labels = base.repeat(-(-cfg.n // len(base)))[: cfg.n].to(device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    images = sample(
        model, labels, info["image_shape"], steps=cfg.steps, method=cfg.method, cfg_scale=cfg.cfg, generator=gen
    )
    nrow = cfg.nrow or (len(base) if 2 <= len(base) <= 20 else None)  # a label per column; one label: square
    path = save_grid(images, cfg.out, nrow=nrow, scale=cfg.scale)
    print(
        f"dimuon sample: {cfg.n} images from {info['path']} (step {info['step']}, "
        f"{'raw' if cfg.raw else 'EMA'} weights, {cfg.method} x {cfg.steps}, cfg {cfg.cfg:g}) -> {path}"
    )
    return images


def parse(argv: Sequence[str]) -> SampleConfig:
    """``dimuon sample``'s flags, nothing run: SystemExit(2) for a flag the parser refuses. :func:`check_config`
    is left to the run (it looks at --out on disk)."""
    return tyro.cli(SampleConfig, args=list(argv), prog="dimuon sample")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dimuon sample``: 0 done, 1 the grid could not be written, 2 bad flags or checkpoint."""
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = parse(args)

    def body() -> int:
        run(cfg)
        return 0

    return run_command("dimuon sample", body, usage=(CheckpointError, ValueError), interrupted="nothing was written")


if __name__ == "__main__":
    sys.exit(main())
