"""The interface every feature extractor follows: images in `[-1, 1]` to one feature vector per image."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class FeatureExtractor(nn.Module):
    """An `nn.Module` mapping images `(B, C, H, W)` in `[-1, 1]` to features `(B, feature_dim)`.

    `name` identifies the feature space (network, weights, preprocessing) and travels with every number
    computed from its features, so that two distances are only compared within one space. An extractor is
    frozen: it and every submodule stay in eval mode (see :meth:`train`), so features never depend on the batch.
    """

    def __init__(self, name: str, feature_dim: int) -> None:
        super().__init__()
        super().train(False)
        self.name = name
        self.feature_dim = feature_dim

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, nn.Module):
            value.train(False)  # a network assigned in a subclass's __init__ is frozen with the extractor
        super().__setattr__(name, value)

    def train(self, mode: bool = True) -> FeatureExtractor:
        """Keep the extractor and its submodules in eval mode whatever `mode` is: `.train()` must never switch
        BatchNorm or dropout to batch-dependent behaviour in a fixed feature space. Returns self."""
        return super().train(False)

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
