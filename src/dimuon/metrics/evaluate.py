"""Function-level API for the harness: images to features, and features to one row of named metrics."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from dimuon.metrics.features.base import FeatureExtractor
from dimuon.metrics.frechet import ArrayLike, feature_matrix, frechet_distance
from dimuon.metrics.prdc import K_DC, K_PR, prdc


def _batches(images: torch.Tensor | np.ndarray | Iterable[torch.Tensor], batch_size: int) -> Iterable[torch.Tensor]:
    if isinstance(images, (torch.Tensor, np.ndarray)):
        for i in range(0, images.shape[0], batch_size):
            chunk = images[i : i + batch_size]
            yield chunk if isinstance(chunk, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(chunk))
    else:
        yield from images


@torch.no_grad()
def extract_features(
    extractor: FeatureExtractor,
    images: torch.Tensor | np.ndarray | Iterable[torch.Tensor],
    batch_size: int = 64,
    progress: bool = True,
    total: int | None = None,
) -> torch.Tensor:
    """Features `(N, F)` (float32, CPU) of images `(N, C, H, W)` in `[-1, 1]`, or of an iterable of such batches
    (consumed one at a time, so a large set is never held whole; `total`: its image count, for the progress bar)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    if isinstance(images, (torch.Tensor, np.ndarray)):
        total = images.shape[0]
        if images.ndim != 4 or total == 0:
            raise ValueError(f"images must be a non-empty (N, C, H, W) batch, got shape {tuple(images.shape)}")
    extractor.eval()  # a no-op for a FeatureExtractor; puts any other module in inference mode
    out: list[torch.Tensor] = []
    with tqdm(total=total, desc=f"features [{extractor.name}]", unit="img", disable=not progress) as bar:
        for batch in _batches(images, batch_size):
            feats = extractor(batch.float()).float().cpu()  # (B, F)
            out.append(feats)
            bar.update(batch.shape[0])
    if not out:
        raise ValueError("images yielded no batches")
    return torch.cat(out)


def evaluate_features(
    real_feats: ArrayLike,
    fake_feats: ArrayLike,
    feature_space: str,
    k_pr: int = K_PR,
    k_dc: int = K_DC,
) -> dict[str, Any]:
    """FD, precision, recall, density and coverage of `fake_feats` against `real_feats`, tagged with `feature_space`."""
    if not isinstance(feature_space, str) or not feature_space:
        raise ValueError(f"feature_space must name the features (e.g. extractor.name), got {feature_space!r}")
    real = feature_matrix(real_feats, "real_feats", min_rows=2)
    fake = feature_matrix(fake_feats, "fake_feats", min_rows=2)
    if real.shape[1] != fake.shape[1]:
        raise ValueError(
            f"real_feats and fake_feats must have the same feature dimension, got {real.shape[1]} and {fake.shape[1]}"
        )
    return {
        "feature_space": feature_space,
        "fd": frechet_distance(real, fake),
        **prdc(real, fake, k_pr=k_pr, k_dc=k_dc),
        "n_real": int(real.shape[0]),
        "n_fake": int(fake.shape[0]),
        "k_pr": k_pr,
        "k_dc": k_dc,
    }
