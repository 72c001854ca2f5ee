"""Writing a training run's checkpoints and restoring its full state (model, optimizer, EMA, RNG, progress).

The format (``meta.json`` with a manifest, ``state.pt`` or DCP files) is defined by
``dimuon.dit.checkpoint``, which reads checkpoints back for every command. A checkpoint is assembled
under a hidden temporary name (``checkpoints/.tmp-step_NNNNNNN/``) and renamed once complete, so a
checkpoint under its final name is never half written; a killed run leaves at most a temporary
directory, which ``list_checkpoints`` ignores and the next save removes.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dimuon.dit import EMA
from dimuon.dit.checkpoint import (
    FORMAT_VERSION,
    META_FILE,
    STATE_FILE,
    TMP_PREFIX,
    CheckpointError,
    dcp_errors,
    dcp_load,
    file_record,
    list_checkpoints,
    torch_load,
    verify_checkpoint,
)
from dimuon.dit.parallel import checkpointable
from dimuon.io import (
    SUPERSEDED_SUFFIX,
    RunLayout,
    atomic_path,
    free_bytes,
    fsync_dir,
    move_checkpoint,
    remove_checkpoint,
    step_of,
    write_json_atomic,
)
from dimuon.train.distributed import DistEnv, all_gather_objects, barrier, on_main

__all__ = [
    "LOG_WINDOW",
    "CheckpointWriteError",
    "checkpoint_bytes",
    "drop_superseded",
    "load_training_state",
    "prune_checkpoints",
    "save_checkpoint",
    "set_aside_checkpoints_after",
]


# The key of ``progress`` that holds the running log window (the sums since the last train record); a checkpoint
# written before it was kept has none, and its run resumes with an empty window.
LOG_WINDOW = "log_window"


# --------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------


def _rng_state(env: DistEnv) -> list[torch.Tensor]:
    """This process's global RNG states: CPU, then the current CUDA device if it is used."""
    states = [torch.get_rng_state()]
    if env.device.type == "cuda":
        states.append(torch.cuda.get_rng_state(env.device))
    return states


def saved_rng_template(ckpt_dir: Path, saved_world: int) -> list[list[torch.Tensor]]:
    """Tensors of the shapes of every saved rank's RNG states, read from a DCP checkpoint's metadata: a run on
    the CPU saved one state per rank, a CUDA run two, so the template cannot be this process's own states."""
    from torch.distributed.checkpoint import FileSystemReader

    with dcp_errors():
        saved = FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata
    template = []
    for rank in range(saved_world):
        states, i = [], 0
        while f"rng.{rank}.{i}" in saved:
            entry = saved[f"rng.{rank}.{i}"]
            states.append(torch.empty(tuple(entry.size), dtype=entry.properties.dtype))
            i += 1
        template.append(states)
    return template


def _set_rng_state(states: list[torch.Tensor], env: DistEnv) -> None:
    torch.set_rng_state(states[0].cpu())
    if env.device.type == "cuda" and len(states) > 1:
        torch.cuda.set_rng_state(states[1].cpu(), env.device)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a vanished directory); nothing of it was left behind."""


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: EMA,
    progress: dict[str, Any],
    meta: dict[str, Any],
    env: DistEnv,
) -> Path:
    """Write the checkpoint after ``step`` steps atomically (every rank calls this); return its directory.

    ``progress`` holds run counters restored on resume (e.g. ``active_time_s``; the log window under
    :data:`LOG_WINDOW`, the same on every rank); ``meta`` holds the
    run description stored in ``meta.json`` (config, data set, model, ...). A failed write raises
    :class:`CheckpointWriteError` on every rank and leaves no partial checkpoint behind.
    """
    final = RunLayout(run_dir).checkpoint(step)
    tmp = final.with_name(TMP_PREFIX + final.name)

    def begin() -> None:
        remove_checkpoint(tmp)  # left by a save that was killed
        tmp.mkdir(parents=True, exist_ok=True)

    def complete(files: dict[str, Any]) -> None:
        record = {
            "format": FORMAT_VERSION,
            "kind": "dcp" if env.distributed else "single",
            "step": step,
            "world_size": env.world,
            **{k: v for k, v in progress.items() if k != LOG_WINDOW},  # the counters, at the top level too
            "progress": dict(progress),
            **meta,
            "files": files,
        }
        write_json_atomic(tmp / META_FILE, record)
        move_checkpoint(tmp, final)  # replacing one an earlier trajectory left, if it was not set aside
        fsync_dir(final.parent)

    try:
        on_main(begin, env)
        rng = all_gather_objects(_rng_state(env), env)  # every rank's states, so each can get its own back
        if env.distributed:
            files = _save_dcp(tmp, model, optimizer, ema, progress, rng, env)
        else:
            files = _save_single(tmp, model, optimizer, ema, progress, rng)
        on_main(lambda: complete(files), env)
    except Exception as e:
        if env.is_main:
            remove_checkpoint(tmp)
        free = f"; {free_bytes(final.parent) / (1 << 20):.0f} MiB free there" if final.parent.exists() else ""
        raise CheckpointWriteError(
            f"could not write the checkpoint of step {step} to {final} ({type(e).__name__}: {e}){free}; "
            "nothing of it was left behind"
        ) from e
    return final


def checkpoint_bytes(model: nn.Module, ema: EMA) -> int:
    """About how many bytes one checkpoint of this run takes: the model, its EMA and an optimizer state of
    at most two buffers per parameter (AdamW's; the Muon family keeps one per matrix)."""
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    ema_bytes = sum(t.numel() * t.element_size() for t in ema.weights().values())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return model_bytes + ema_bytes + 2 * param_bytes


def _save_single(
    tmp: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: EMA,
    progress: dict[str, Any],
    rng: list[list[torch.Tensor]],
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
    return {STATE_FILE: file_record(tmp / STATE_FILE)}


def _dcp_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: EMA,
    progress: dict[str, Any],
    rng: list[list[torch.Tensor]],
) -> dict[str, Any]:
    """The nested dict DCP saves and loads in place (model and optimizer keyed by parameter names)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    # Head-wise tensor-parallel pieces are gathered along tp: DCP stores contiguous blocks only.
    model_sd, optim_sd, ema_sd = checkpointable((model_sd, optim_sd, ema.state_dict()))
    return {"model": model_sd, "optimizer": optim_sd, "ema": ema_sd, "progress": dict(progress), "rng": rng}


def _save_dcp(
    tmp: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: EMA,
    progress: dict[str, Any],
    rng: list[list[torch.Tensor]],
    env: DistEnv,
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    with dcp_errors():
        dcp.save(_dcp_state(model, optimizer, ema, progress, rng), checkpoint_id=str(tmp))
    barrier(env)
    # Each rank hashes the shard files it wrote; rank 0 also takes whatever no rank claimed (.metadata).
    mine = {p.name: file_record(p) for p in sorted(tmp.glob(f"__{env.rank}_*")) if p.is_file()}
    files: dict[str, Any] = {}
    for part in all_gather_objects(mine, env):
        files.update(part)
    if env.is_main:
        for p in sorted(tmp.iterdir()):
            if p.is_file() and p.name not in files and p.name != META_FILE:
                files[p.name] = file_record(p)
    return files


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (``keep == 0`` keeps all); return the deleted."""
    if keep <= 0:
        return []
    doomed = [path for _, path in list_checkpoints(run_dir)[:-keep]]
    for path in doomed:
        remove_checkpoint(path)  # dimuon's files: a user's note in it stays
    return doomed


def set_aside_checkpoints_after(run_dir: str | Path, step: int) -> list[Path]:
    """Rename the checkpoints later than ``step`` to ``step_N.superseded`` (and delete leftover temporary ones).

    A run resumed in place from an earlier checkpoint rewrites that future. Its old checkpoints stay on
    disk until the run replaces them (:func:`drop_superseded`), but under a name that nothing lists, so
    that after a crash ``--resume <run>`` and ``dimuon eval`` never pick a checkpoint of the abandoned
    trajectory. Returns their new paths.
    """
    layout = RunLayout(run_dir)
    moved = []
    for s, path in list_checkpoints(run_dir):
        if s > step:
            target = layout.superseded(s)
            move_checkpoint(path, target)
            moved.append(target)
    if layout.checkpoints.is_dir():
        for leftover in layout.checkpoints.glob(TMP_PREFIX + "*"):
            remove_checkpoint(leftover)
    if moved:
        fsync_dir(layout.checkpoints)
    return moved


def drop_superseded(run_dir: str | Path, up_to: int | None = None) -> list[Path]:
    """Delete the set-aside checkpoints of steps ``<= up_to`` (all of them with None): the run has replaced them."""
    layout = RunLayout(run_dir)
    if not layout.checkpoints.is_dir():
        return []
    doomed = [
        p
        for p in sorted(layout.checkpoints.iterdir())
        if (s := step_of(p, SUPERSEDED_SUFFIX)) is not None and (up_to is None or s <= up_to)
    ]
    for path in doomed:
        remove_checkpoint(path)
    return doomed


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


# What a parameter group carries besides its options: its parameters and the counters a resume continues.
_GROUP_COUNTERS = frozenset({"params", "param_names", "step", "skipped_steps", "initial_lr"})


def load_training_state(
    ckpt_dir: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: EMA,
    env: DistEnv,
) -> dict[str, Any]:
    """Restore model, optimizer, EMA and RNG from a verified checkpoint (every rank calls this).

    The saved state brings what evolves (weights, buffers, step counters); the hyperparameters stay
    this run's, as the optimizer and the EMA were built from its flags: every option in the optimizer's
    parameter groups and the EMA's decay and warmup are put back after loading, so that the run does
    what its recorded config says. Returns the metadata with the restored ``progress``. One-process
    checkpoints resume in one process; DCP checkpoints resume at any world size (bitwise continuation
    needs the same one).
    """
    ckpt_dir = Path(ckpt_dir)
    options = [{k: v for k, v in g.items() if k not in _GROUP_COUNTERS} for g in optimizer.param_groups]
    ema_settings = (ema.decay, ema.warmup)
    meta = on_main(lambda: verify_checkpoint(ckpt_dir), env)  # rank 0 reads every byte once
    if meta["kind"] == "single":
        if env.distributed:
            raise CheckpointError(
                f"{ckpt_dir}: a one-process checkpoint cannot resume on {env.world} ranks; resume it in one process"
            )
        state = torch_load(ckpt_dir / STATE_FILE, env.device)
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
    for group, own in zip(optimizer.param_groups, options, strict=True):
        group.update(own)
    ema.decay, ema.warmup = ema_settings
    return {**meta, "progress": progress}


def _load_dcp(
    ckpt_dir: Path,
    meta: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: EMA,
    env: DistEnv,
) -> tuple[dict[str, Any], list[list[torch.Tensor]]]:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    try:
        state = _dcp_state(
            model,
            optimizer,
            ema,
            copy.deepcopy(meta.get("progress", {})),  # the saved structure (the log window nests), loaded over
            saved_rng_template(ckpt_dir, int(meta["world_size"])),
        )
        dcp_load(state, ckpt_dir, no_dist=not env.distributed)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        ema.load_state_dict(state["ema"])
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{ckpt_dir}: cannot be loaded ({type(e).__name__}: {e})") from None
    return state["progress"], state["rng"]
