"""The interface every feature extractor follows: images in `[-1, 1]` to one feature vector per image."""

from __future__ import annotations

import torch
from torch import nn


class FeatureExtractor(nn.Module):
    """An `nn.Module` mapping images `(B, C, H, W)` in `[-1, 1]` to features `(B, feature_dim)`.

    `name` identifies the feature space (network, weights, preprocessing) and travels with every number
    computed from its features, so that two distances are only compared within one space.
    """

    def __init__(self, name: str, feature_dim: int) -> None:
        super().__init__()
        self.name = name
        self.feature_dim = feature_dim

    @property
    def device(self) -> torch.device:
        """Device of the extractor's weights (where input batches are sent)."""
        for t in self.parameters():
            return t.device
        for t in self.buffers():
            return t.device
        return torch.device("cpu")

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError
