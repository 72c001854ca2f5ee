"""A small CNN classifier trained on the data set itself; its penultimate layer is the feature space.

For small data sets (8x8 digits, 28x28 MNIST) no pretrained network fits, so FD and PRDC are measured in the
features of a classifier trained (seeded) on the training split. The trained weights are cached on disk by a
hash of the data and the training recipe, with the held-out accuracy in the file's metadata.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from dimuon.io import read_tensors, write_tensors_atomic
from dimuon.log import get_logger
from dimuon.metrics.features.base import FeatureExtractor
from dimuon.metrics.features.preprocess import check_images

CACHE_FORMAT = 1

log = get_logger(__name__)


@dataclass(frozen=True)
class ClassifierRecipe:
    """Architecture width and training schedule; part of the cache key."""

    channels: tuple[int, int] = (16, 32)
    feature_dim: int = 128
    epochs: int = 12
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 1e-4
    seed: int = 0
    holdout_fraction: float = 0.1


class SmallCNN(nn.Module):
    """Two conv-BN-ReLU-pool stages, a pooled grid, a ReLU feature layer, then the class logits."""

    def __init__(self, in_channels: int, size: int, num_classes: int, channels: tuple[int, int], feature_dim: int):
        super().__init__()
        c1, c2 = channels
        self.pool_side = max(1, min(4, size // 4))
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, c1, 3, padding=1, bias=False),
            nn.BatchNorm2d(c1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1, bias=False),
            nn.BatchNorm2d(c2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(self.pool_side),
        )
        self.fc = nn.Linear(c2 * self.pool_side**2, feature_dim)
        self.head = nn.Linear(feature_dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate activations `(B, feature_dim)`."""
        h = self.conv(x)  # (B, c2, s, s)
        return F.relu(self.fc(h.flatten(1)))  # (B, feature_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # (B, num_classes)


class ClassifierFeatures(FeatureExtractor):
    """Penultimate features of a trained `SmallCNN`; `meta` holds its provenance and test accuracy."""

    def __init__(self, net: SmallCNN, name: str, meta: dict) -> None:
        super().__init__(name=name, feature_dim=net.fc.out_features)
        self.net = net.eval().requires_grad_(False)
        self.meta = meta
        self.input_shape = (meta["in_channels"], meta["height"], meta["width"])

    @property
    def test_accuracy(self) -> float:
        """Accuracy on the held-out split, measured when the classifier was trained."""
        return float(self.meta["test_accuracy"])

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = check_images(images)
        if tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(
                f"images must be (B, {', '.join(map(str, self.input_shape))}) like the data this classifier "
                f"({self.name}) was trained on, got {tuple(x.shape)}"
            )
        return self.net.features(x.float().to(self.device))  # (B, feature_dim)


def _as_tensor(x: torch.Tensor | np.ndarray, dtype: torch.dtype, arg: str) -> torch.Tensor:
    t = x.detach().cpu() if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
    if dtype == torch.int64 and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise ValueError(f"{arg} must hold integer class indices, got dtype {t.dtype}")
    return t.to(dtype)


def _check_split(images: torch.Tensor, labels: torch.Tensor, img_arg: str, lab_arg: str) -> None:
    check_images(images, img_arg)
    if images.numel() and (images.min() < -1.001 or images.max() > 1.001):
        lo, hi = images.min().item(), images.max().item()
        raise ValueError(f"{img_arg} must be scaled to [-1, 1], got values in [{lo:g}, {hi:g}]")
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise ValueError(
            f"{lab_arg} must be a 1-D vector with one label per image ({images.shape[0]}), got {tuple(labels.shape)}"
        )
    if labels.numel() and labels.min() < 0:
        raise ValueError(f"{lab_arg} must be non-negative class indices")


def data_hash(*tensors: torch.Tensor, recipe: ClassifierRecipe) -> str:
    """SHA-256 over the data (shapes, dtypes, bytes) and the recipe: the classifier cache key."""
    h = hashlib.sha256(f"dimuon-classifier-v{CACHE_FORMAT}".encode())
    h.update(json.dumps(asdict(recipe), sort_keys=True).encode())
    for t in tensors:
        t = t.contiguous()
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def _accuracy(net: SmallCNN, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 512) -> float:
    net.eval()
    correct = 0
    for i in range(0, images.shape[0], batch_size):
        correct += (net(images[i : i + batch_size]).argmax(1) == labels[i : i + batch_size]).sum().item()
    return correct / max(images.shape[0], 1)


def train_classifier(
    images: torch.Tensor,
    labels: torch.Tensor,
    test_images: torch.Tensor,
    test_labels: torch.Tensor,
    num_classes: int,
    recipe: ClassifierRecipe,
    progress: bool = False,
) -> tuple[SmallCNN, float]:
    """Train a `SmallCNN` with AdamW and a one-cycle schedule from `recipe.seed`; returns it and its test accuracy.

    ``progress`` shows a bar over the training steps."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        gen = torch.Generator().manual_seed(recipe.seed)
        _, c, h, w = images.shape
        net = SmallCNN(c, min(h, w), num_classes, recipe.channels, recipe.feature_dim)
        steps_per_epoch = max(1, -(-images.shape[0] // recipe.batch_size))
        opt = torch.optim.AdamW(net.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.lr, total_steps=recipe.epochs * steps_per_epoch)
        bar = tqdm(
            total=recipe.epochs * steps_per_epoch,
            desc="feature classifier",
            unit="step",
            dynamic_ncols=True,
            disable=not progress,
        )
        for _ in range(recipe.epochs):
            net.train()
            order = torch.randperm(images.shape[0], generator=gen)
            for i in range(0, images.shape[0], recipe.batch_size):
                idx = order[i : i + recipe.batch_size]
                loss = F.cross_entropy(net(images[idx]), labels[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                bar.update(1)
        bar.close()
    return net.eval(), _accuracy(net, test_images, test_labels)


@contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """Temporarily run torch's CPU ops on `n` threads (None: leave the setting alone)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_or_train_classifier(
    images: torch.Tensor | np.ndarray,
    labels: torch.Tensor | np.ndarray,
    cache_dir: str | Path,
    dataset_name: str = "data",
    test_images: torch.Tensor | np.ndarray | None = None,
    test_labels: torch.Tensor | np.ndarray | None = None,
    recipe: ClassifierRecipe | None = None,
    num_threads: int | None = 1,
    progress: bool = False,
) -> ClassifierFeatures:
    """Classifier feature extractor for a data set: loaded from `cache_dir` if trained before, else trained.

    `images` are `(N, C, H, W)` in `[-1, 1]` with integer `labels`. Without a test split, a seeded
    `recipe.holdout_fraction` of the data is held out to measure the accuracy (and not trained on).
    The extractor is named `classifier-<dataset_name>-<hash8>`. `num_threads` sets torch's CPU threads while
    training (None: keep torch's setting); one is the robust default, as a second thread gains at most 2x on
    these small convolutions and spinning threads lose far more than that on a shared machine.
    Training (once per data set and recipe) is announced in the log, with a bar over its steps if ``progress``.
    """
    recipe = recipe or ClassifierRecipe()
    x, y = _as_tensor(images, torch.float32, "images"), _as_tensor(labels, torch.int64, "labels")
    _check_split(x, y, "images", "labels")
    if (test_images is None) != (test_labels is None):
        raise ValueError("test_images and test_labels must be given together")
    if test_images is not None:
        xt = _as_tensor(test_images, torch.float32, "test_images")
        yt = _as_tensor(test_labels, torch.int64, "test_labels")
        _check_split(xt, yt, "test_images", "test_labels")
        if xt.shape[1:] != x.shape[1:]:
            raise ValueError(f"test_images must be (N, {tuple(x.shape[1:])}), got {tuple(xt.shape)}")
        key = data_hash(x, y, xt, yt, recipe=recipe)
    else:
        if not 0.0 < recipe.holdout_fraction < 1.0:
            raise ValueError(f"recipe.holdout_fraction must be in (0, 1), got {recipe.holdout_fraction}")
        key = data_hash(x, y, recipe=recipe)
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(recipe.seed))
        n_test = max(1, round(recipe.holdout_fraction * x.shape[0]))
        xt, yt, x, y = x[perm[:n_test]], y[perm[:n_test]], x[perm[n_test:]], y[perm[n_test:]]
    if x.shape[0] < 2:
        raise ValueError(f"images needs at least 2 training samples, got {x.shape[0]}")

    name = f"classifier-{dataset_name}-{key[:8]}"
    path = Path(cache_dir) / f"{name}.safetensors"
    if path.is_file():
        tensors, meta = read_tensors(path)
        arch = meta["recipe"]
        size = min(meta["height"], meta["width"])
        net = SmallCNN(meta["in_channels"], size, meta["num_classes"], tuple(arch["channels"]), arch["feature_dim"])
        net.load_state_dict(tensors, strict=True)
        return ClassifierFeatures(net, name, meta)

    num_classes = int(max(y.max().item(), yt.max().item())) + 1
    log.info(
        "training the feature classifier of %s on %d images (%d epochs; once: it is cached as %s for every "
        "later evaluation of this data set)",
        dataset_name,
        x.shape[0],
        recipe.epochs,
        path,
    )
    start = time.perf_counter()
    with _torch_threads(num_threads):
        net, acc = train_classifier(x, y, xt, yt, num_classes, recipe, progress=progress)
    log.info(
        "feature classifier trained in %.0f s, %.1f%% accuracy on %d held-out images",
        time.perf_counter() - start,
        100 * acc,
        xt.shape[0],
    )
    meta = {
        "name": name,
        "dataset_name": dataset_name,
        "data_sha256": key,
        "test_accuracy": acc,
        "n_train": int(x.shape[0]),
        "n_test": int(xt.shape[0]),
        "train_seconds": round(time.perf_counter() - start, 2),
        "in_channels": int(x.shape[1]),
        "height": int(x.shape[2]),
        "width": int(x.shape[3]),
        "num_classes": num_classes,
        "recipe": asdict(recipe),
        "num_threads": torch.get_num_threads() if num_threads is None else num_threads,
        "torch_version": torch.__version__,
        "format": CACHE_FORMAT,
    }
    meta = json.loads(json.dumps(meta))  # the same plain-JSON form a cache hit returns
    write_tensors_atomic(path, net.state_dict(), meta)
    return ClassifierFeatures(net, name, meta)
