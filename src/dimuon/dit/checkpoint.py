"""Reading a training checkpoint back: find it, verify it against its manifest, load its DiT for evaluation.

The checkpoint format is defined here, where every command can read it (``dimuon train --resume``,
``dimuon eval``, ``dimuon sample``, the benchmarks); ``dimuon.train.checkpoint`` writes it and
restores the full training state. One checkpoint, ``<run>/checkpoints/step_{step:07d}/``:

- ``meta.json``: the step, the run's config, the timing, the data set, the model constructor and a
  manifest (byte size and SHA-256) of every other file; written last.
- one process: ``state.pt`` (model, optimizer, EMA, RNG and progress, one ``torch.save`` file);
- several processes: the files of ``torch.distributed.checkpoint`` (DCP), one per rank plus ``.metadata``.

A checkpoint under its final name is complete (it is assembled under a hidden temporary name and
renamed); loading checks the manifest first, so a truncated or corrupted file raises
:class:`CheckpointError` instead of loading damaged weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dimuon.dit.model import DiT
from dimuon.io import RunLayout, step_of

__all__ = [
    "FORMAT_VERSION",
    "META_FILE",
    "STATE_FILE",
    "TMP_PREFIX",
    "CheckpointError",
    "dcp_load",
    "file_record",
    "find_checkpoint",
    "list_checkpoints",
    "load_model_for_eval",
    "read_meta",
    "torch_load",
    "verify_checkpoint",
]

FORMAT_VERSION = 1
META_FILE = "meta.json"
STATE_FILE = "state.pt"
TMP_PREFIX = ".tmp-"  # a checkpoint being assembled: checkpoints/.tmp-step_NNNNNNN/
REQUIRED_META = (
    "format",
    "kind",
    "step",
    "config",
    "active_time_s",
    "dataset",
    "image_shape",
    "num_classes",
    "model",
    "world_size",
    "files",
)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, truncated or corrupted; the message names the path."""


# --------------------------------------------------------------------------------------------------
# Finding and verifying
# --------------------------------------------------------------------------------------------------


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of the complete checkpoints of a run, sorted by step.

    Complete means renamed to its final name with its ``meta.json`` in place; temporary directories of
    an interrupted save are skipped. File contents are checked on load, not here.
    """
    root = RunLayout(run_dir).checkpoints
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = step_of(child)
        if step is not None and child.is_dir() and (child / META_FILE).is_file():
            found.append((step, child))
    return sorted(found)


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from ``--resume``: the directory itself, or the newest one of a run directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or run directory")
    if step_of(path) is not None or (path / META_FILE).exists():
        return path
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path}: no complete checkpoint under {RunLayout(path).checkpoints}")
    return found[-1][1]


def read_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    """The parsed ``meta.json`` of a checkpoint; :class:`CheckpointError` if it is missing or malformed."""
    ckpt_dir = Path(ckpt_dir)
    meta_path = ckpt_dir / META_FILE
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: checkpoint directory does not exist")
    if not meta_path.is_file():
        raise CheckpointError(f"{ckpt_dir}: incomplete checkpoint, {META_FILE} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: unreadable checkpoint metadata ({e})") from None
    missing = [k for k in REQUIRED_META if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise CheckpointError(f"{meta_path}: checkpoint metadata lacks {missing}")
    if meta["format"] != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: checkpoint format {meta['format']}, expected {FORMAT_VERSION}")
    return meta


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    """A file's manifest entry: its byte size and SHA-256."""
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def verify_checkpoint(ckpt_dir: str | Path) -> dict[str, Any]:
    """Check every file of the manifest (present, size, SHA-256); return the metadata."""
    ckpt_dir = Path(ckpt_dir)
    meta = read_meta(ckpt_dir)
    if not meta["files"]:
        raise CheckpointError(f"{ckpt_dir}: the checkpoint manifest lists no files")
    for name, expected in sorted(meta["files"].items()):
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointError(f"{ckpt_dir}: missing piece {name!r} (listed in {META_FILE})")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"{path}: truncated or overwritten, {size} bytes where the manifest says {expected['bytes']}"
            )
        if _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"{path}: corrupted, its SHA-256 does not match the manifest")
    return meta


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def torch_load(path: Path, map_location: Any) -> dict[str, Any]:
    """``torch.load`` of a ``state.pt`` (weights only); a damaged archive raises :class:`CheckpointError`."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises several types for damaged archives
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None


class DcpFailed(RuntimeError):
    """torch's ``CheckpointException`` as an ordinary error: torch derives it from ``BaseException``, which the
    ``except Exception`` of the checkpoint code (cleanup, one-line messages) would let pass."""


@contextlib.contextmanager
def dcp_errors() -> Iterator[None]:
    """Raise a failed DCP save or load (on any rank) as :class:`DcpFailed`."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:  # one line per failed rank: its error, not torch's whole traceback
        lines = []
        for rank, failure in sorted(getattr(e, "failures", {}).items()):
            error = failure[0] if isinstance(failure, tuple) else failure
            text = str(error).strip().splitlines()
            lines.append(f"rank {rank}: {type(error).__name__}" + (f": {text[0]}" if text else ""))
        raise DcpFailed("; ".join(lines) or str(e).splitlines()[0]) from e


def dcp_load(state: dict[str, Any], ckpt_dir: Path, no_dist: bool) -> None:
    """``dcp.load`` in place; without a process group DCP warns that it loads in one process, as intended."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings(), dcp_errors():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt_dir), no_dist=no_dist)


def load_model_for_eval(
    ckpt_dir: str | Path, use_ema: bool = True, map_location: Any = "cpu"
) -> tuple[nn.Module, dict[str, Any]]:
    """An unsharded DiT in eval mode with the checkpoint's EMA (or raw) weights, and an info dict.

    ``info`` holds ``step``, ``config`` (the run's config dict), ``active_time_s`` (training time up to
    this checkpoint, without evaluation, sampling and checkpoint time), ``dataset`` (``name`` and
    ``kwargs`` for ``build_dataset(name, split="val", **kwargs)``), ``image_shape`` (C, H, W),
    ``num_classes``, ``model`` (registry ``name`` and constructor ``kwargs``), ``wall_time_s``, ``kind``,
    ``world_size`` and ``path``.
    Works on one-process and DCP checkpoints, without a process group.
    """
    ckpt_dir = Path(ckpt_dir)
    meta = verify_checkpoint(ckpt_dir)
    with torch.device("cpu"):  # built where the weights are read, then moved once
        model = DiT(**meta["model"]["kwargs"])
    which = "ema" if use_ema else "model"
    if meta["kind"] == "single":
        state = torch_load(ckpt_dir / STATE_FILE, "cpu")
        weights = state["ema"]["weights"] if use_ema else state["model"]
    else:
        target = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
        nested = {"ema": {"weights": target}} if use_ema else {"model": target}
        try:
            dcp_load(nested, ckpt_dir, no_dist=True)
        except Exception as e:
            raise CheckpointError(f"{ckpt_dir}: cannot be loaded ({type(e).__name__}: {e})") from None
        weights = target
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise CheckpointError(f"{ckpt_dir}: {which} weights do not fit the model ({e})") from None
    model.to(map_location).eval()
    info = {k: meta[k] for k in REQUIRED_META if k != "files"}
    info.update(path=str(ckpt_dir), use_ema=use_ema, wall_time_s=meta.get("wall_time_s"))
    info["image_shape"] = tuple(meta["image_shape"])
    return model, info
