"""Image preprocessing shared by the extractors: checks, range mapping, channel replication, resizing."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_images(images: torch.Tensor, arg: str = "images") -> torch.Tensor:
    """Validate a `(B, C, H, W)` floating batch with 1 or 3 channels; returns it unchanged."""
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"{arg} must be a torch.Tensor, got {type(images).__name__}")
    if images.ndim != 4:
        raise ValueError(f"{arg} must be (B, C, H, W), got shape {tuple(images.shape)}")
    if not images.is_floating_point():
        raise ValueError(f"{arg} must be floating point in [-1, 1], got dtype {images.dtype}")
    if images.shape[1] not in (1, 3):
        raise ValueError(f"{arg} must have 1 (grayscale) or 3 (RGB) channels, got {images.shape[1]}")
    return images


def to_unit_range(images: torch.Tensor) -> torch.Tensor:
    """Map `[-1, 1]` images to `[0, 1]` (clamped), in float32."""
    return ((images.float() + 1.0) * 0.5).clamp_(0.0, 1.0)


def to_rgb(images: torch.Tensor) -> torch.Tensor:
    """Replicate a grayscale channel to three; RGB passes through."""
    return images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images


def quantize_8bit(images01: torch.Tensor) -> torch.Tensor:
    """Round `[0, 1]` images to the 256 levels of an 8-bit image file, as reference sets are stored."""
    return torch.round(images01 * 255.0) / 255.0


def _legacy_bilinear_axis(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Resample one axis: output index `j` reads source coordinate `j * n_in / n_out` (edge clamped)."""
    n_in = x.shape[dim]
    src = torch.arange(size, dtype=torch.float64, device=x.device) * (n_in / size)
    i0 = src.floor().long().clamp_(0, n_in - 1)
    i1 = (i0 + 1).clamp_(max=n_in - 1)
    w = (src - i0).to(x.dtype)
    shape = [1] * x.ndim
    shape[dim] = size
    w = w.view(shape)
    return x.index_select(dim, i0) * (1.0 - w) + x.index_select(dim, i1) * w


def resize_legacy_bilinear(images: torch.Tensor, size: int) -> torch.Tensor:
    """Bilinear resize as TF1's `resize_bilinear` inside FID's graph: `src = dst * in / out`, no half-pixel shift."""
    if images.shape[-2:] == (size, size):
        return images
    return _legacy_bilinear_axis(_legacy_bilinear_axis(images, 2, size), 3, size)


def resize_bicubic(images: torch.Tensor, size: int) -> torch.Tensor:
    """Antialiased bicubic resize to `size x size`, clamped back to `[0, 1]` like an 8-bit image library."""
    if images.shape[-2:] == (size, size):
        return images
    out = F.interpolate(images, size=(size, size), mode="bicubic", align_corners=False, antialias=True)
    return out.clamp_(0.0, 1.0)
