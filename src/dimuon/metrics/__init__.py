"""Generation-quality metrics: Frechet distance and precision/recall/density/coverage in a named feature space.

What scores samples (``frechet``, ``prdc``, ``features``, ``evaluate``, ``generation``: the
:class:`GenerationEvaluator`, ``eval_settings``) and the results store of a run's evaluations
(``results``, ``series``, ``plots``), shared by ``dimuon eval`` and the training loop, and the table of every
metric's key, label and better direction (``registry``).

Layering: a building block. It may import ``dimuon.data``, ``dimuon.dit``, ``dimuon.io`` and
``dimuon.log``; it must not import ``dimuon.optim`` or the commands (``train``, ``eval``, ``bench``).
"""

from dimuon.metrics.evaluate import evaluate_features, extract_features
from dimuon.metrics.features import (
    EXTRACTORS,
    ClassifierFeatures,
    ClassifierRecipe,
    DinoV2Features,
    FeatureExtractor,
    InceptionFeatures,
    build_extractor,
    load_or_train_classifier,
)
from dimuon.metrics.frechet import frechet_distance, frechet_distance_from_stats, gaussian_stats
from dimuon.metrics.generation import GenerationEvaluator, SampleSettings, generate_samples, iter_samples
from dimuon.metrics.prdc import prdc

__all__ = [
    "EXTRACTORS",
    "ClassifierFeatures",
    "ClassifierRecipe",
    "DinoV2Features",
    "FeatureExtractor",
    "GenerationEvaluator",
    "InceptionFeatures",
    "SampleSettings",
    "build_extractor",
    "evaluate_features",
    "extract_features",
    "frechet_distance",
    "frechet_distance_from_stats",
    "gaussian_stats",
    "generate_samples",
    "iter_samples",
    "load_or_train_classifier",
    "prdc",
]
