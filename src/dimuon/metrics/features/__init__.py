"""Feature extractors for generation metrics, built by name: `classifier`, `inception`, `dinov2`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dimuon.metrics.features.base import FeatureExtractor
from dimuon.metrics.features.classifier import ClassifierFeatures, ClassifierRecipe, load_or_train_classifier
from dimuon.metrics.features.dinov2 import CONFIGS as DINOV2_CONFIGS
from dimuon.metrics.features.dinov2 import DinoV2Features, DinoV2ViT, ViTConfig
from dimuon.metrics.features.inception import InceptionFeatures, inception_weights_path

EXTRACTORS: dict[str, Callable[..., FeatureExtractor]] = {
    "classifier": load_or_train_classifier,
    "inception": InceptionFeatures,
    "dinov2": DinoV2Features,
}


def build_extractor(name: str, **kwargs: Any) -> FeatureExtractor:
    """Build a feature extractor by registry name; `kwargs` go to its constructor (see each extractor)."""
    if name not in EXTRACTORS:
        raise ValueError(f"unknown feature extractor {name!r}; allowed values: {', '.join(sorted(EXTRACTORS))}")
    return EXTRACTORS[name](**kwargs)


__all__ = [
    "DINOV2_CONFIGS",
    "EXTRACTORS",
    "ClassifierFeatures",
    "ClassifierRecipe",
    "DinoV2Features",
    "DinoV2ViT",
    "FeatureExtractor",
    "InceptionFeatures",
    "ViTConfig",
    "build_extractor",
    "inception_weights_path",
    "load_or_train_classifier",
]
