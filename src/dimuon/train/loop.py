"""The training loop of ``dimuon train``: rectified-flow DiT training, one process or FSDP2 over N ranks.

Everything a step consumes is a function of ``(seed, step, rank)``: the batch comes from
``BatchSchedule``, the label dropout, flow times and noise from a generator reseeded at every step,
the learning rate from ``lr_factor``. A resumed run therefore needs only the model, optimizer and
EMA state (plus the global RNG, restored for anything else that draws from it) to continue exactly.
"""

from __future__ import annotations

import functools
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from dimuon.data import BatchSchedule, build_dataset, get_batch
from dimuon.dit import EMA, TimestepDist, build_dit, flow_loss, sample
from dimuon.dit import validation_loss as flow_validation_loss
from dimuon.dit.checkpoint import find_checkpoint
from dimuon.io import JsonlLog, read_jsonl, save_grid, truncate_jsonl, write_json_atomic
from dimuon.metrics.results import truncate_results
from dimuon.optim import build
from dimuon.train import checkpoint as ckpt
from dimuon.train.config import (
    ConfigError,
    TrainConfig,
    check_patch_size,
    config_to_dict,
    dataset_kwargs,
    optimizer_kwargs,
    validate,
)
from dimuon.train.distributed import DistEnv, barrier, mean_over_ranks, on_main, setup, shard_model
from dimuon.train.gen_eval import TrainingEvaluator
from dimuon.train.logger import TensorBoardLog, tensorboard_available
from dimuon.train.plots import plot_losses
from dimuon.train.schedule import lr_factor

__all__ = ["train"]

RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints", "samples", "plots", "tensorboard", "eval")
GEN_EVAL_KEYS = ("fd", "precision", "recall", "density", "coverage", "feature_space", "num_samples", "eval_s")


@dataclass
class _Window:
    """Sums over the steps since the last training record."""

    steps: int = 0
    loss: torch.Tensor | float = 0.0
    grad_norm: torch.Tensor | float = 0.0
    data_s: float = 0.0
    fwd_bwd_s: float = 0.0
    opt_s: float = 0.0
    step_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def train(cfg: TrainConfig, *, stop_after: int | None = None) -> dict[str, Any]:
    """Run (or resume) training as configured; return a summary (final step, losses, run directory).

    ``stop_after`` ends the run after that many total steps, as if it were killed right after the
    step's checkpoint (tests use it to check that resuming continues exactly).
    """
    validate(cfg)
    owns_group = not dist.is_initialized()
    env = setup(cfg.device, cfg.threads)
    try:
        return _train(cfg, env, stop_after)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, env: DistEnv, stop_after: int | None) -> dict[str, Any]:
    run_dir = Path(cfg.out)
    resume_from = on_main(lambda: find_checkpoint(cfg.resume) if cfg.resume else None, env)
    on_main(lambda: _check_run_dir(run_dir, cfg, resume_from), env)
    if cfg.tensorboard and not tensorboard_available():
        raise ConfigError("--tensorboard needs the tensorboard package (pip install tensorboard)")
    if cfg.batch_size % env.world:
        raise ConfigError(f"--batch-size {cfg.batch_size} is not divisible by the {env.world} ranks")

    # Data: the training order and every rank's slice of it are fixed by (seed, step).
    train_set, val_set = _datasets(cfg)
    check_patch_size(cfg.model, train_set.image_size)
    shape = (train_set.channels, train_set.image_size, train_set.image_size)
    batches = BatchSchedule(len(train_set), cfg.batch_size, cfg.seed, env.rank, env.world)
    n_val = len(val_set) if cfg.val_samples == 0 else min(cfg.val_samples, len(val_set))
    if n_val == 0:
        raise ConfigError(f"--dataset {cfg.dataset} has an empty validation split")
    val_x, val_y = get_batch(val_set, np.arange(n_val))

    # Model, optimizer, EMA: the same init on every rank (seeded), sharded afterwards.
    torch.manual_seed(cfg.seed)
    model = build_dit(cfg.model, input_size=shape[1], in_channels=shape[0],
                      num_classes=train_set.num_classes, class_dropout_prob=cfg.class_dropout)
    model_kwargs = dict(model.config)
    model.to(env.device)
    if env.distributed:
        shard_model(model, env)
    try:
        opt = build(cfg.optimizer, model, **optimizer_kwargs(cfg))
    except NotImplementedError as e:  # e.g. a one-process baseline asked to run on sharded parameters
        raise ConfigError(f"--optimizer {cfg.optimizer}: {e}") from None
    ema = EMA(model, cfg.ema_decay, warmup=cfg.ema_warmup)

    meta = {
        "config": config_to_dict(cfg),
        "dataset": {"name": cfg.dataset, "kwargs": dataset_kwargs(cfg)},
        "image_shape": list(shape),
        "num_classes": train_set.num_classes,
        "model": {"name": cfg.model, "kwargs": model_kwargs},
        "torch_version": torch.__version__,
    }
    progress = {"active_time_s": 0.0, "wall_time_s": 0.0}
    start = 0
    if resume_from is not None:
        restored = ckpt.load_training_state(resume_from, model=model, optimizer=opt, ema=ema, env=env)
        start, progress = int(restored["step"]), {k: float(v) for k, v in restored["progress"].items()}
        if start > cfg.steps:
            raise ConfigError(f"--steps {cfg.steps} is behind the checkpoint's step {start}; pass --steps >= {start}")
    if env.is_main:
        _prepare_run_dir(run_dir, cfg, resume_from, start)
    barrier(env)

    main = env.is_main
    generation = None
    if cfg.eval.interval > 0:
        if main:
            print(f"dimuon train: preparing generation-quality evaluation ({cfg.eval.features} features, "
                  f"{cfg.eval.num_samples} samples every {cfg.eval.interval} steps)")
        generation = TrainingEvaluator(cfg.eval, run_dir, meta, env, progress=cfg.progress)
    log = JsonlLog(run_dir / "metrics.jsonl") if main else None
    tb = TensorBoardLog(run_dir / "tensorboard") if main and cfg.tensorboard else None

    def record(rec: dict[str, Any]) -> None:
        if log is not None:
            log.write(rec)
        if tb is not None:
            tb.write(rec)

    n_params = sum(p.numel() for p in model.parameters())
    if main:
        print(
            f"dimuon train: {cfg.model} ({n_params / 1e6:.2f} M params) on {cfg.dataset} "
            f"({len(train_set)} train / {n_val} val images {shape}); {cfg.optimizer}, lr {cfg.lr:g} "
            f"({cfg.schedule}, warmup {cfg.warmup_steps}); global batch {cfg.batch_size} x {cfg.steps} steps "
            f"({batches.num_epochs(cfg.steps):.1f} epochs); {env.world} process(es) on {env.device}; out {run_dir}"
        )
        if resume_from is not None:
            print(f"dimuon train: resumed from {resume_from} at step {start}")
        record({"kind": "start", "step": start, "world_size": env.world, "device": str(env.device),
                "params": n_params, "torch_version": torch.__version__, "resumed_from": str(resume_from or "")})

    timesteps = TimestepDist(cfg.timesteps)
    autocast = torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")
    comm_stats = getattr(opt, "comm_stats", None)
    reset_comm = getattr(opt, "reset_comm_stats", None)
    if reset_comm is not None:
        reset_comm()
    session_start = time.perf_counter()
    wall_before = progress["wall_time_s"]

    def wall() -> float:
        return wall_before + time.perf_counter() - session_start

    def stamp(rec: dict[str, Any]) -> dict[str, Any]:
        return {**rec, "active_time_s": round(progress["active_time_s"], 4), "wall_s": round(wall(), 4)}

    summary: dict[str, Any] = {"run_dir": str(run_dir), "step": start}
    bar = tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True, mininterval=1.0,
               disable=not (main and cfg.progress))
    window = _Window()
    model.train()
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            x1, y = get_batch(train_set, batches.indices(step))
            x1, y = x1.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
            t_data = time.perf_counter()

            # One lr for every group: the Muon family scales its matrix updates to AdamW's RMS itself.
            lr = cfg.lr * lr_factor(step, cfg.steps, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio)
            for group in opt.param_groups:
                group["lr"] = lr

            # Dropout, times and noise from (seed, step, rank) alone: nothing to carry across a restart.
            gen = _step_generator(cfg.seed, step, env.rank, env.device)
            drop = torch.rand(x1.shape[0], generator=gen, device=env.device) < cfg.class_dropout
            with autocast:
                loss = flow_loss(functools.partial(model, drop_labels=drop), x1, y,
                                 timesteps=timesteps, generator=gen)
            loss.backward()
            grad_norm = _clip(model, cfg.grad_clip)
            _sync(env)
            t_fb = time.perf_counter()
            opt.step()
            _sync(env)
            t_opt = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            ema.update(model)

            step_s = time.perf_counter() - t0
            progress["active_time_s"] += step_s
            window.steps += 1
            window.loss = window.loss + loss.detach().float()
            window.grad_norm = window.grad_norm + grad_norm
            window.data_s += t_data - t0
            window.fwd_bwd_s += t_fb - t_data
            window.opt_s += t_opt - t_fb
            window.step_s += step_s
            done = step + 1
            bar.update(1)

            if done % cfg.log_interval == 0 or done == cfg.steps:
                rec = _train_record(window, done, lr, batches, env, comm_stats)
                if reset_comm is not None:
                    reset_comm()
                record(stamp(rec))
                bar.set_postfix(loss=f"{rec['loss']:.4f}", step_ms=f"{rec['step_ms']:.0f}",
                                opt_ms=f"{rec['opt_ms']:.1f}", refresh=False)
                window = _Window()
                summary["train_loss"] = rec["loss"]

            if _due(done, cfg.val_interval, cfg.steps):
                t = time.perf_counter()
                rec = _validation_record(model, ema, val_x, val_y, cfg.val_seed)
                rec.update(step=done, eval_s=round(time.perf_counter() - t, 3))
                record(stamp(rec))
                summary.update(val_loss=rec["val_loss"], val_loss_ema=rec["val_loss_ema"])
                if main:
                    bar.write(f"step {done}: val loss {rec['val_loss']:.4f}, EMA {rec['val_loss_ema']:.4f}")

            if _due(done, cfg.sample_interval, cfg.steps):
                t = time.perf_counter()
                images = _sample_grid(model, ema, cfg, shape, train_set.num_classes, env.device)
                path = run_dir / "samples" / f"step_{done:07d}.png"
                if main:
                    nrow = train_set.num_classes if train_set.num_classes <= 20 else None
                    save_grid(images, path, nrow=nrow, scale=2 if shape[1] < 64 else 1)
                record(stamp({"kind": "sample", "step": done, "path": str(path),
                              "sample_s": round(time.perf_counter() - t, 3)}))
                summary["samples"] = str(path)

            if generation is not None and _due(done, cfg.eval.interval, cfg.steps):
                entry = generation(model, ema, done, progress["active_time_s"])
                record(stamp({"kind": "gen_eval", "step": done, **{k: entry[k] for k in GEN_EVAL_KEYS}}))
                summary.update(fd=entry["fd"], feature_space=entry["feature_space"])
                if main:
                    bar.write(f"step {done}: FD {entry['fd']:.3f} ({entry['feature_space']}), precision "
                              f"{entry['precision']:.3f}, recall {entry['recall']:.3f} in {entry['eval_s']:.1f} s")

            if (cfg.ckpt_interval and done % cfg.ckpt_interval == 0) or done == cfg.steps:
                t = time.perf_counter()
                progress["wall_time_s"] = wall()
                path = ckpt.save_checkpoint(run_dir, done, model=model, optimizer=opt, ema=ema,
                                            progress=progress, meta=meta, env=env)
                if main:
                    ckpt.prune_checkpoints(run_dir, cfg.keep_checkpoints)
                    plot_losses(read_jsonl(run_dir / "metrics.jsonl"), run_dir / "plots", title=_title(cfg))
                record(stamp({"kind": "checkpoint", "step": done, "path": str(path),
                              "ckpt_s": round(time.perf_counter() - t, 3)}))
                summary["checkpoint"] = str(path)

            summary["step"] = done
            if stop_after is not None and done >= stop_after:
                break
    finally:
        bar.close()
        if log is not None:
            log.close()
        if tb is not None:
            tb.close()
    if main and summary["step"] == cfg.steps:
        plot_losses(read_jsonl(run_dir / "metrics.jsonl"), run_dir / "plots", title=_title(cfg))
        print(
            f"dimuon train: done, step {cfg.steps}; val loss {summary.get('val_loss', math.nan):.4f} "
            f"(EMA {summary.get('val_loss_ema', math.nan):.4f}); training time "
            f"{progress['active_time_s']:.1f} s of {wall():.1f} s; samples {summary.get('samples', '-')}"
            + (f"; FD {summary['fd']:.3f} ({summary['feature_space']})" if "fd" in summary else "")
        )
    summary.update(active_time_s=progress["active_time_s"], wall_s=wall())
    return summary


# --------------------------------------------------------------------------------------------------
# Pieces of the loop
# --------------------------------------------------------------------------------------------------


def _datasets(cfg: TrainConfig) -> tuple[Any, Any]:
    """Train and validation splits; data-set errors become start-up errors that name the flags."""
    kwargs = dataset_kwargs(cfg)
    try:
        return build_dataset(cfg.dataset, "train", **kwargs), build_dataset(cfg.dataset, "val", **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--dataset {cfg.dataset} {kwargs or ''}: {e}") from None


def _step_generator(seed: int, step: int, rank: int, device: torch.device) -> torch.Generator:
    """A generator seeded from (seed, rank, step) through NumPy's SeedSequence, so streams never overlap."""
    state = np.random.SeedSequence([seed, rank, step]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(state) & ((1 << 63) - 1))


def _clip(model: torch.nn.Module, max_norm: float) -> torch.Tensor | float:
    """Clip the global gradient norm (sharded gradients included) and return it before clipping."""
    if max_norm <= 0:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm.detach()


def _sync(env: DistEnv) -> None:
    """Wait for queued GPU work so that host timers measure it."""
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)


def _due(done: int, interval: int, steps: int) -> bool:
    return done == steps or (interval > 0 and done % interval == 0)


def _train_record(window: _Window, done: int, lr: float, batches: BatchSchedule, env: DistEnv,
                  comm_stats: Any) -> dict[str, Any]:
    n = window.steps
    rec: dict[str, Any] = {
        "kind": "train",
        "step": done,
        "epoch": round(batches.num_epochs(done), 4),
        "lr": lr,
        "loss": mean_over_ranks(torch.as_tensor(window.loss, dtype=torch.float32) / n, env),
        "grad_norm": float(window.grad_norm) / n if isinstance(window.grad_norm, torch.Tensor) else None,
        "step_ms": 1e3 * window.step_s / n,
        "data_ms": 1e3 * window.data_s / n,
        "fwd_bwd_ms": 1e3 * window.fwd_bwd_s / n,
        "opt_ms": 1e3 * window.opt_s / n,
        "samples_per_s": batches.global_batch_size * n / window.step_s,
    }
    stats = comm_stats() if comm_stats is not None else {}
    rec["comm_bytes_per_step"] = sum(v["bytes"] for v in stats.values()) / n
    rec["comm"] = {kind: {"calls": v["calls"] / n, "bytes": v["bytes"] / n} for kind, v in stats.items()}
    return rec


def _validation_record(model: torch.nn.Module, ema: EMA, val_x: torch.Tensor, val_y: torch.Tensor,
                       seed: int) -> dict[str, Any]:
    """Validation loss of the training weights and of the EMA weights (same images, times and noise)."""
    raw = flow_validation_loss(model, val_x, val_y, seed=seed)
    with ema.swapped_into(model):
        avg = flow_validation_loss(model, val_x, val_y, seed=seed)
    return {
        "kind": "val",
        "val_loss": raw.mean,
        "val_loss_ema": avg.mean,
        "val_per_t": {f"{t:g}": v for t, v in raw.per_t.items()},
        "val_per_t_ema": {f"{t:g}": v for t, v in avg.per_t.items()},
    }


def _sample_grid(model: torch.nn.Module, ema: EMA, cfg: TrainConfig, shape: tuple[int, int, int],
                 num_classes: int, device: torch.device) -> torch.Tensor:
    """Samples of the EMA weights from fixed noise: labels cycle through the classes (a class per column)."""
    labels = torch.arange(cfg.sample_count, device=device) % num_classes
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    with ema.swapped_into(model):
        return sample(model, labels, shape, steps=cfg.sample_steps, method=cfg.sample_method,
                      cfg_scale=cfg.cfg_scale, generator=gen)


def _title(cfg: TrainConfig) -> str:
    return f"{cfg.model} on {cfg.dataset}, {cfg.optimizer} lr {cfg.lr:g}, batch {cfg.batch_size}"


# --------------------------------------------------------------------------------------------------
# Run directory
# --------------------------------------------------------------------------------------------------


def _holds_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RUN_FILES)


def _check_run_dir(run_dir: Path, cfg: TrainConfig, resume_from: Path | None) -> None:
    """Refuse to mix two runs in one directory unless asked to (before any expensive work)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--out {run_dir} exists and is not a directory")
    continuing = resume_from is not None and _same_path(resume_from.parent.parent, run_dir)
    if _holds_run(run_dir) and not continuing and not cfg.overwrite:
        raise ConfigError(
            f"--out {run_dir} already holds a run; pass --resume {run_dir} to continue it, "
            "--overwrite to replace it, or another --out"
        )


def _same_path(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def _prepare_run_dir(run_dir: Path, cfg: TrainConfig, resume_from: Path | None, start: int) -> None:
    """Make the run directory consistent with step ``start`` and write the config (rank 0 only)."""
    source = resume_from.parent.parent if resume_from is not None else None
    if source is not None and _same_path(source, run_dir):
        # Continuing in place: what was logged or saved after the checkpoint is rewritten by this run.
        dropped = truncate_jsonl(run_dir / "metrics.jsonl", start) + truncate_results(run_dir, start)
        removed = ckpt.remove_checkpoints_after(run_dir, start)
        for png in (run_dir / "samples").glob("step_*.png"):
            if int(png.stem.split("_")[1]) > start:
                png.unlink()
        if dropped or removed:
            print(f"dimuon train: resuming at step {start}: dropped {dropped} log records and "
                  f"{len(removed)} checkpoint(s) written after it")
    else:
        for name in RUN_FILES:
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        run_dir.mkdir(parents=True, exist_ok=True)
        if source is not None:
            # A run forked from another run's checkpoint starts with that run's history up to it.
            history = [r for r in read_jsonl(source / "metrics.jsonl") if int(r.get("step", 0)) <= start]
            log = JsonlLog(run_dir / "metrics.jsonl")
            for rec in history:
                log.write(rec)
            log.close()
    (run_dir / "samples").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / "config.json", config_to_dict(cfg))
