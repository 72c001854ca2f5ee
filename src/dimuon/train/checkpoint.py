"""Checkpoints of a training run: atomic on disk, verified on load, readable without the training code.

Layout of one checkpoint, ``<run>/checkpoints/step_{step:07d}/``:

- ``meta.json``: the step, the run's config, the timing, the data set, the model constructor and a
  manifest (byte size and SHA-256) of every other file; written last.
- one process: ``state.pt`` (model, optimizer, EMA, RNG and progress, one ``torch.save`` file);
- several processes: the files of ``torch.distributed.checkpoint`` (DCP), one per rank plus ``.metadata``.

The directory is assembled under a hidden temporary name and renamed once complete, so a checkpoint
under its final name is never half written; a killed run leaves at most a temporary directory, which
:func:`list_checkpoints` ignores and the next save removes. Loading checks the manifest first, so a
truncated or corrupted file raises :class:`CheckpointError` instead of loading damaged weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dimuon.dit import EMA, DiT
from dimuon.io import atomic_path, fsync_dir, write_json_atomic
from dimuon.train.distributed import DistEnv, all_gather_objects, barrier, on_main

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "checkpoint_path",
    "find_checkpoint",
    "list_checkpoints",
    "load_model_for_eval",
    "load_training_state",
    "prune_checkpoints",
    "read_meta",
    "remove_checkpoints_after",
    "save_checkpoint",
    "verify_checkpoint",
]

FORMAT_VERSION = 1
META_FILE = "meta.json"
STATE_FILE = "state.pt"
_STEP_DIR = re.compile(r"^step_(\d{7})$")
_TMP_PREFIX = ".tmp-"
_REQUIRED_META = ("format", "kind", "step", "config", "active_time_s", "dataset", "image_shape",
                  "num_classes", "model", "world_size", "files")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, truncated or corrupted; the message names the path."""


# --------------------------------------------------------------------------------------------------
# Finding checkpoints
# --------------------------------------------------------------------------------------------------


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """Final directory of the checkpoint taken after ``step`` optimizer steps."""
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of the complete checkpoints of a run, sorted by step.

    Complete means renamed to its final name with its ``meta.json`` in place; temporary directories of
    an interrupted save are skipped. File contents are checked on load, not here.
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and (child / META_FILE).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from ``--resume``: the directory itself, or the newest one of a run directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or run directory")
    if _STEP_DIR.match(path.name) or (path / META_FILE).exists():
        return path
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path}: no complete checkpoint under {path / 'checkpoints'}")
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
    missing = [k for k in _REQUIRED_META if not isinstance(meta, dict) or k not in meta]
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


def _describe(path: Path) -> dict[str, Any]:
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
# Saving
# --------------------------------------------------------------------------------------------------


def _rng_state(env: DistEnv) -> list[torch.Tensor]:
    """This process's global RNG states: CPU, then the current CUDA device if it is used."""
    states = [torch.get_rng_state()]
    if env.device.type == "cuda":
        states.append(torch.cuda.get_rng_state(env.device))
    return states


def _set_rng_state(states: list[torch.Tensor], env: DistEnv) -> None:
    torch.set_rng_state(states[0].cpu())
    if env.device.type == "cuda" and len(states) > 1:
        torch.cuda.set_rng_state(states[1].cpu(), env.device)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: EMA,
    progress: dict[str, float],
    meta: dict[str, Any],
    env: DistEnv,
) -> Path:
    """Write the checkpoint after ``step`` steps atomically (every rank calls this); return its directory.

    ``progress`` holds run counters restored on resume (e.g. ``active_time_s``); ``meta`` holds the
    run description stored in ``meta.json`` (config, data set, model, ...).
    """
    final = checkpoint_path(run_dir, step)
    tmp = final.with_name(_TMP_PREFIX + final.name)
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir(parents=True)
    barrier(env)
    rng = all_gather_objects(_rng_state(env), env)  # every rank's states, so each can get its own back
    if env.distributed:
        files = _save_dcp(tmp, model, optimizer, ema, progress, rng, env)
    else:
        files = _save_single(tmp, model, optimizer, ema, progress, rng)
    if env.is_main:
        record = {
            "format": FORMAT_VERSION,
            "kind": "dcp" if env.distributed else "single",
            "step": step,
            "world_size": env.world,
            **progress,
            "progress": dict(progress),
            **meta,
            "files": files,
        }
        write_json_atomic(tmp / META_FILE, record)
        if final.exists():  # a checkpoint of an abandoned trajectory (see remove_checkpoints_after)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    barrier(env)
    return final


def _save_single(
    tmp: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA,
    progress: dict[str, float], rng: list[list[torch.Tensor]],
) -> dict[str, Any]:
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "ema": ema.state_dict(),
        "progress": dict(progress),
        "rng": rng,
    }
    with atomic_path(tmp / STATE_FILE) as partial:
        torch.save(state, partial)
    return {STATE_FILE: _describe(tmp / STATE_FILE)}


def _dcp_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA,
    progress: dict[str, float], rng: list[list[torch.Tensor]],
) -> dict[str, Any]:
    """The nested dict DCP saves and loads in place (model and optimizer keyed by parameter names)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd, "ema": ema.state_dict(),
            "progress": dict(progress), "rng": rng}


def _save_dcp(
    tmp: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA,
    progress: dict[str, float], rng: list[list[torch.Tensor]], env: DistEnv,
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_state(model, optimizer, ema, progress, rng), checkpoint_id=str(tmp))
    barrier(env)
    # Each rank hashes the shard files it wrote; rank 0 also takes whatever no rank claimed (.metadata).
    mine = {p.name: _describe(p) for p in sorted(tmp.glob(f"__{env.rank}_*")) if p.is_file()}
    files: dict[str, Any] = {}
    for part in all_gather_objects(mine, env):
        files.update(part)
    if env.is_main:
        for p in sorted(tmp.iterdir()):
            if p.is_file() and p.name not in files and p.name != META_FILE:
                files[p.name] = _describe(p)
    return files


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (``keep == 0`` keeps all); return the deleted."""
    if keep <= 0:
        return []
    doomed = [path for _, path in list_checkpoints(run_dir)[:-keep]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def remove_checkpoints_after(run_dir: str | Path, step: int) -> list[Path]:
    """Delete checkpoints later than ``step`` and leftover temporary ones: a resumed run rewrites that future."""
    removed = [path for s, path in list_checkpoints(run_dir) if s > step]
    root = Path(run_dir) / "checkpoints"
    if root.is_dir():
        removed += [p for p in root.iterdir() if p.name.startswith(_TMP_PREFIX)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _torch_load(path: Path, map_location: Any) -> dict[str, Any]:
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises several types for damaged archives
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None


def load_training_state(
    ckpt_dir: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: EMA,
    env: DistEnv,
) -> dict[str, Any]:
    """Restore model, optimizer, EMA and RNG from a verified checkpoint (every rank calls this).

    Returns the metadata with the restored ``progress``. One-process checkpoints resume in one
    process; DCP checkpoints resume at any world size (bitwise continuation needs the same one).
    """
    ckpt_dir = Path(ckpt_dir)
    meta = on_main(lambda: verify_checkpoint(ckpt_dir), env)  # rank 0 reads every byte once
    if meta["kind"] == "single":
        if env.distributed:
            raise CheckpointError(
                f"{ckpt_dir}: a one-process checkpoint cannot resume on {env.world} ranks; "
                "resume it in one process"
            )
        state = _torch_load(ckpt_dir / STATE_FILE, env.device)
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            ema.load_state_dict(state["ema"])
        except (KeyError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{ckpt_dir}: does not match this model/optimizer ({e})") from None
        progress, rng = state["progress"], state["rng"]
    else:
        progress, rng = _load_dcp(ckpt_dir, meta, model, optimizer, ema, env)
    if len(rng) == env.world:
        _set_rng_state(rng[env.rank], env)
    return {**meta, "progress": progress}


def _load_dcp(
    ckpt_dir: Path, meta: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
    ema: EMA, env: DistEnv,
) -> tuple[dict[str, float], list[list[torch.Tensor]]]:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    saved_world = int(meta["world_size"])
    rng_shape = [s.clone() for s in _rng_state(env)]
    state = _dcp_state(model, optimizer, ema, {k: 0.0 for k in meta.get("progress", {})},
                       [[s.clone() for s in rng_shape] for _ in range(saved_world)])
    try:
        _dcp_load(state, ckpt_dir, no_dist=not env.distributed)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        ema.load_state_dict(state["ema"])
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{ckpt_dir}: cannot be loaded ({type(e).__name__}: {e})") from None
    return state["progress"], state["rng"]


def _dcp_load(state: dict[str, Any], ckpt_dir: Path, no_dist: bool) -> None:
    """``dcp.load`` in place; without a process group DCP warns that it loads in one process, as intended."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
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
    model = DiT(**meta["model"]["kwargs"])
    which = "ema" if use_ema else "model"
    if meta["kind"] == "single":
        state = _torch_load(ckpt_dir / STATE_FILE, "cpu")
        weights = state["ema"]["weights"] if use_ema else state["model"]
    else:
        target = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
        nested = {"ema": {"weights": target}} if use_ema else {"model": target}
        try:
            _dcp_load(nested, ckpt_dir, no_dist=True)
        except Exception as e:
            raise CheckpointError(f"{ckpt_dir}: cannot be loaded ({type(e).__name__}: {e})") from None
        weights = target
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise CheckpointError(f"{ckpt_dir}: {which} weights do not fit the model ({e})") from None
    model.to(map_location).eval()
    info = {k: meta[k] for k in _REQUIRED_META if k != "files"}
    info.update(path=str(ckpt_dir), use_ema=use_ema, wall_time_s=meta.get("wall_time_s"))
    info["image_shape"] = tuple(meta["image_shape"])
    return model, info
