"""Image grids as PNG files, written atomically (Pillow; no torchvision)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from dimuon.train.logger import atomic_write_bytes

__all__ = ["make_grid", "save_grid"]


def make_grid(images: Tensor, nrow: int | None = None, pad: int = 2) -> np.ndarray:
    """Tile images (N, C, H, W) in [-1, 1] into a uint8 array (rows, cols) or (rows, cols, 3).

    ``nrow`` images per row (default: a square-ish grid). One channel gives grayscale, three RGB;
    other channel counts (latents) show the channel mean in grayscale.
    """
    if images.ndim != 4 or images.shape[0] == 0:
        raise ValueError(f"expected a non-empty (N, C, H, W) batch, got shape {tuple(images.shape)}")
    x = images.detach().float().cpu()
    if x.shape[1] not in (1, 3):
        x = x.mean(dim=1, keepdim=True)
    n, c, h, w = x.shape
    nrow = nrow or math.ceil(math.sqrt(n))
    ncol_rows = math.ceil(n / nrow)
    grid = torch.full((c, ncol_rows * (h + pad) + pad, nrow * (w + pad) + pad), -1.0)
    for i in range(n):
        r, col = divmod(i, nrow)
        top, left = pad + r * (h + pad), pad + col * (w + pad)
        grid[:, top : top + h, left : left + w] = x[i]
    pixels = ((grid.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # (C, rows, cols)
    return pixels[0].numpy() if c == 1 else pixels.permute(1, 2, 0).numpy()


def save_grid(images: Tensor, path: str | Path, nrow: int | None = None, scale: int = 1) -> Path:
    """Write ``make_grid(images, nrow)`` as a PNG (``scale``: nearest-neighbour upscaling factor)."""
    from PIL import Image

    img = Image.fromarray(make_grid(images, nrow))
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), resample=Image.Resampling.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())
    return path
