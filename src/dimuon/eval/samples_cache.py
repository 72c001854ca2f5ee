"""Generated samples kept per checkpoint and sampling settings, so that scoring one checkpoint again (another
feature space, a rescore) reuses the very images instead of sampling them again, which is most of an evaluation's
time. A file is keyed by the checkpoint's bytes and everything that changes the images; it is used only where
every part of its key matches."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dimuon.io import read_tensors, write_tensors_atomic
from dimuon.metrics.eval_settings import EvalSettings, sampling_settings

SUFFIX = ".samples.safetensors"


def checkpoint_digest(checkpoint: Path) -> str:
    """SHA-256 over the names and bytes of a checkpoint directory's files (a file checkpoint: its bytes)."""
    digest = hashlib.sha256()
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file()) if checkpoint.is_dir() else [checkpoint]
    for path in files:
        digest.update(str(path.relative_to(checkpoint) if checkpoint.is_dir() else path.name).encode())
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def samples_key(checkpoint: Path, settings: EvalSettings, device: torch.device | str) -> dict[str, Any]:
    """What the generated images depend on: the checkpoint's bytes, the sampling settings (count, seed, sampler,
    steps, guidance, EMA weights), the device type and the torch version (kernels differ in the last bits)."""
    return {
        "checkpoint_sha256": checkpoint_digest(checkpoint),
        **sampling_settings(settings),
        "device": torch.device(device).type,
        "torch": torch.__version__,
    }


def _path(cache: Path, key: dict[str, Any]) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache / f"{name}{SUFFIX}"


def load_samples(cache: Path, key: dict[str, Any]) -> Tensor | None:
    """The samples stored under ``key``, None where there are none (or the file's own key differs)."""
    path = _path(cache, key)
    if not path.is_file():
        return None
    tensors, meta = read_tensors(path)
    if meta.get("key") != key or "samples" not in tensors:
        return None
    return tensors["samples"]


def save_samples(cache: Path, key: dict[str, Any], samples: Tensor) -> Path:
    """Store ``samples`` ``(n, C, H, W)`` under ``key`` (atomically: a reader never sees a torn file)."""
    cache.mkdir(parents=True, exist_ok=True)
    return write_tensors_atomic(_path(cache, key), {"samples": samples.cpu()}, {"key": key})
