"""The training loop of ``dimuon train``: rectified-flow DiT training, one process or FSDP2 over N ranks.

Everything a step consumes is a function of ``(seed, step, rank)``: the batch comes from
``BatchSchedule``, the label dropout, flow times and noise from a generator reseeded at every step,
the learning rate from the schedule. A resumed run therefore needs only the model, optimizer and
EMA state (plus the global RNG, restored for anything else that draws from it) to continue exactly.

:func:`train` resolves the flags into a plan, joins the process group and hands both to a
:class:`Trainer`: set-up in ``__init__``, then :meth:`Trainer.fit` runs :meth:`Trainer.train_step`
and, after each step, the hooks that are due (log, validate, sample, evaluate, checkpoint).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from dimuon.data import BatchSchedule, get_batch
from dimuon.dit import EMA, TimestepDist, flow_loss, sample
from dimuon.dit.checkpoint import find_checkpoint
from dimuon.io import read_jsonl, save_grid
from dimuon.train import checkpoint as ckpt
from dimuon.train.config import ConfigError, TrainConfig, check_patch_size
from dimuon.train.distributed import DistEnv, barrier, on_main, setup, shard_model
from dimuon.train.gen_eval import TrainingEvaluator
from dimuon.train.logger import tensorboard_available
from dimuon.train.plan import TrainPlan, resolve
from dimuon.train.plots import plot_losses
from dimuon.train.records import RunClock, RunLog, StepTimes, Window, train_record, validation_record
from dimuon.train.rundir import check_run_dir, prepare_run_dir

__all__ = ["Trainer", "train"]

GEN_EVAL_KEYS = ("fd", "precision", "recall", "density", "coverage", "feature_space", "num_samples", "eval_s")


def train(cfg: TrainConfig, *, stop_after: int | None = None) -> dict[str, Any]:
    """Run (or resume) training as configured; return a summary (final step, losses, run directory).

    ``stop_after`` ends the run after that many total steps, as if it were killed right after the
    step's checkpoint (tests use it to check that resuming continues exactly).
    """
    plan = resolve(cfg)
    owns_group = not dist.is_initialized()
    env = setup(cfg.device, cfg.threads)
    try:
        return Trainer(plan, env).fit(stop_after)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class TrainData:
    """The opened data: the training split, the batch of every step, the fixed validation images."""

    train_set: Any
    batches: BatchSchedule
    val_x: torch.Tensor
    val_y: torch.Tensor

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.train_set.channels, self.train_set.image_size, self.train_set.image_size)

    @property
    def num_classes(self) -> int:
        return self.train_set.num_classes


def open_data(plan: TrainPlan, env: DistEnv) -> TrainData:
    """Both splits (errors become start-up errors naming the flags), checked against the model's patch size."""
    cfg, spec = plan.cfg, plan.data
    try:
        train_set, val_set = spec.build("train"), spec.build("val")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--dataset {spec.name} {spec.kwargs or ''}: {e}") from None
    check_patch_size(plan.model.name, train_set.image_size)
    n_val = len(val_set) if cfg.val_samples == 0 else min(cfg.val_samples, len(val_set))
    if n_val == 0:
        raise ConfigError(f"--dataset {spec.name} has an empty validation split")
    batches = BatchSchedule(len(train_set), cfg.batch_size, cfg.seed, env.rank, env.world)
    val_x, val_y = get_batch(val_set, np.arange(n_val))
    return TrainData(train_set, batches, val_x, val_y)


def due(done: int, interval: int, steps: int) -> bool:
    """Whether a hook with this interval runs after ``done`` steps (always after the last one)."""
    return done == steps or (interval > 0 and done % interval == 0)


class Trainer:
    """One training run: set up from its plan, then :meth:`fit` trains and calls the hooks that are due."""

    def __init__(self, plan: TrainPlan, env: DistEnv) -> None:
        cfg, layout = plan.cfg, plan.layout
        self.plan, self.cfg, self.layout, self.env = plan, cfg, layout, env
        self.resume_from = on_main(lambda: find_checkpoint(plan.resume) if plan.resume else None, env)
        on_main(lambda: check_run_dir(layout, self.resume_from, cfg.overwrite), env)
        if cfg.tensorboard and not tensorboard_available():
            raise ConfigError("--tensorboard needs the tensorboard package (pip install tensorboard)")
        if cfg.batch_size % env.world:
            raise ConfigError(f"--batch-size {cfg.batch_size} is not divisible by the {env.world} ranks")
        self.data = open_data(plan, env)

        # Model, optimizer, EMA: the same init on every rank (seeded), sharded afterwards.
        torch.manual_seed(cfg.seed)
        self.model = plan.model.build(self.data.image_shape, self.data.num_classes)
        self.meta = {
            "config": plan.record,
            "dataset": plan.data.as_record(),
            "image_shape": list(self.data.image_shape),
            "num_classes": self.data.num_classes,
            "model": {"name": plan.model.name, "kwargs": dict(self.model.config)},
            "torch_version": torch.__version__,
        }
        self.model.to(env.device)
        if env.distributed:
            shard_model(self.model, env)
        self.opt = plan.optimizer.build(self.model)
        self.ema = EMA(self.model, cfg.ema_decay, warmup=cfg.ema_warmup)

        self.clock, self.start = RunClock(), 0
        if self.resume_from is not None:
            restored = ckpt.load_training_state(self.resume_from, model=self.model, optimizer=self.opt,
                                                ema=self.ema, env=env)
            self.start, self.clock = int(restored["step"]), RunClock.resumed(restored["progress"])
            if self.start > cfg.steps:
                raise ConfigError(f"--steps {cfg.steps} is behind the checkpoint's step {self.start}; "
                                  f"pass --steps >= {self.start}")
        if env.is_main:
            prepare_run_dir(layout, plan.record, self.resume_from, self.start)
        barrier(env)

        self.generation = None
        if plan.evaluation is not None:
            if env.is_main:
                print(f"dimuon train: preparing generation-quality evaluation ({plan.evaluation.features} features, "
                      f"{plan.evaluation.num_samples} samples every {plan.evaluation.interval} steps)")
            self.generation = TrainingEvaluator(plan.evaluation, layout.root, self.meta, env, progress=cfg.progress)
        self.log = RunLog(layout.metrics, layout.tensorboard if cfg.tensorboard else None, enabled=env.is_main)
        self.timesteps = TimestepDist(cfg.timesteps)
        self.autocast = torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")
        self.summary: dict[str, Any] = {"run_dir": str(layout.root), "step": self.start}
        self.window = Window()

    # ----------------------------------------------------------------------------------------------
    # The loop
    # ----------------------------------------------------------------------------------------------

    def fit(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train from the starting step to ``--steps`` (or ``stop_after``); return the run's summary."""
        cfg = self.cfg
        self.announce()
        self.reset_comm_stats()
        self.clock.restart()
        self.bar = tqdm(total=cfg.steps, initial=self.start, unit="step", dynamic_ncols=True, mininterval=1.0,
                        disable=not (self.env.is_main and cfg.progress))
        self.model.train()
        try:
            for step in range(self.start, cfg.steps):
                self.train_step(step)
                done = step + 1
                self.bar.update(1)
                if due(done, cfg.log_interval, cfg.steps):
                    self.log_train(done)
                if due(done, cfg.val_interval, cfg.steps):
                    self.validate(done)
                if due(done, cfg.sample_interval, cfg.steps):
                    self.sample(done)
                if self.plan.evaluation is not None and due(done, self.plan.evaluation.interval, cfg.steps):
                    self.evaluate(done)
                if due(done, cfg.ckpt_interval, cfg.steps):
                    self.checkpoint(done)
                self.summary["step"] = done
                if stop_after is not None and done >= stop_after:
                    break
        finally:
            self.bar.close()
            self.log.close()
        if self.summary["step"] == cfg.steps:
            self.finish()
        self.summary.update(active_time_s=self.clock.active_s, wall_s=self.clock.wall())
        return self.summary

    def train_step(self, step: int) -> None:
        """One optimizer step on the batch of ``step``, timed part by part, then the EMA update."""
        env, cfg = self.env, self.cfg
        t0 = time.perf_counter()
        x1, y = get_batch(self.data.train_set, self.data.batches.indices(step))
        x1, y = x1.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        t_data = time.perf_counter()

        # One lr for every group: the Muon family scales its matrix updates to AdamW's RMS itself.
        self.lr = self.plan.schedule.lr(step)
        for group in self.opt.param_groups:
            group["lr"] = self.lr

        # Dropout, times and noise from (seed, step, rank) alone: nothing to carry across a restart.
        gen = step_generator(cfg.seed, step, env.rank, env.device)
        drop = torch.rand(x1.shape[0], generator=gen, device=env.device) < cfg.class_dropout
        with self.autocast:
            loss = flow_loss(functools.partial(self.model, drop_labels=drop), x1, y,
                             timesteps=self.timesteps, generator=gen)
        loss.backward()
        grad_norm = clip_grad_norm(self.model, cfg.grad_clip)
        sync(env)
        t_fb = time.perf_counter()
        self.opt.step()
        sync(env)
        t_opt = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.ema.update(self.model)

        step_s = time.perf_counter() - t0
        self.clock.active_s += step_s
        self.window.add(loss, grad_norm, StepTimes(t_data - t0, t_fb - t_data, t_opt - t_fb, step_s))

    # ----------------------------------------------------------------------------------------------
    # Hooks
    # ----------------------------------------------------------------------------------------------

    def record(self, rec: dict[str, Any]) -> None:
        """Append a record stamped with the run's active and wall time."""
        self.log.write(self.clock.stamp(rec))

    def log_train(self, done: int) -> None:
        """The ``train`` record of the steps since the last one (and the optimizer's communication)."""
        rec = train_record(self.window, done, self.lr, self.data.batches, self.env, self.comm_stats())
        self.reset_comm_stats()
        self.record(rec)
        self.bar.set_postfix(loss=f"{rec['loss']:.4f}", step_ms=f"{rec['step_ms']:.0f}",
                             opt_ms=f"{rec['opt_ms']:.1f}", refresh=False)
        self.window = Window()
        self.summary["train_loss"] = rec["loss"]

    def validate(self, done: int) -> None:
        """Validation loss of the raw and the EMA weights on the fixed held-out images."""
        t = time.perf_counter()
        rec = validation_record(self.model, self.ema, self.data.val_x, self.data.val_y, self.cfg.val_seed)
        rec.update(step=done, eval_s=round(time.perf_counter() - t, 3))
        self.record(rec)
        self.summary.update(val_loss=rec["val_loss"], val_loss_ema=rec["val_loss_ema"])
        if self.env.is_main:
            self.bar.write(f"step {done}: val loss {rec['val_loss']:.4f}, EMA {rec['val_loss_ema']:.4f}")

    def sample(self, done: int) -> None:
        """A grid of EMA samples from fixed noise: labels cycle through the classes (a class per column)."""
        cfg, env = self.cfg, self.env
        t = time.perf_counter()
        labels = torch.arange(cfg.sample_count, device=env.device) % self.data.num_classes
        gen = torch.Generator(device=env.device).manual_seed(cfg.seed)
        with self.ema.swapped_into(self.model):
            images = sample(self.model, labels, self.data.image_shape, steps=cfg.sample_steps,
                            method=cfg.sample_method, cfg_scale=cfg.cfg_scale, generator=gen)
        path = self.layout.sample_grid(done)
        if env.is_main:
            nrow = self.data.num_classes if self.data.num_classes <= 20 else None
            save_grid(images, path, nrow=nrow, scale=2 if self.data.image_shape[1] < 64 else 1)
        self.record({"kind": "sample", "step": done, "path": str(path),
                     "sample_s": round(time.perf_counter() - t, 3)})
        self.summary["samples"] = str(path)

    def evaluate(self, done: int) -> None:
        """Generation quality of the current weights, into the run's evaluation series and the log."""
        assert self.generation is not None
        entry = self.generation(self.model, self.ema, done, self.clock.active_s)
        self.record({"kind": "gen_eval", "step": done, **{k: entry[k] for k in GEN_EVAL_KEYS}})
        self.summary.update(fd=entry["fd"], feature_space=entry["feature_space"])
        if self.env.is_main:
            self.bar.write(f"step {done}: FD {entry['fd']:.3f} ({entry['feature_space']}), precision "
                           f"{entry['precision']:.3f}, recall {entry['recall']:.3f} in {entry['eval_s']:.1f} s")

    def checkpoint(self, done: int) -> None:
        """Save the training state (every rank), keep the newest checkpoints, redraw the loss plots."""
        t = time.perf_counter()
        path = ckpt.save_checkpoint(self.layout.root, done, model=self.model, optimizer=self.opt, ema=self.ema,
                                    progress=self.clock.progress(), meta=self.meta, env=self.env)
        if self.env.is_main:
            ckpt.prune_checkpoints(self.layout.root, self.cfg.keep_checkpoints)
            self.plot()
        self.record({"kind": "checkpoint", "step": done, "path": str(path),
                     "ckpt_s": round(time.perf_counter() - t, 3)})
        self.summary["checkpoint"] = str(path)

    # ----------------------------------------------------------------------------------------------
    # Start and end of a run
    # ----------------------------------------------------------------------------------------------

    def announce(self) -> None:
        """The start line and the ``start`` record (rank 0)."""
        cfg, env, data = self.cfg, self.env, self.data
        if not env.is_main:
            return
        n_params = sum(p.numel() for p in self.model.parameters())
        print(
            f"dimuon train: {cfg.model} ({n_params / 1e6:.2f} M params) on {cfg.dataset} "
            f"({len(data.train_set)} train / {len(data.val_x)} val images {data.image_shape}); {cfg.optimizer}, "
            f"lr {cfg.lr:g} ({cfg.schedule}, warmup {cfg.warmup_steps}); global batch {cfg.batch_size} x "
            f"{cfg.steps} steps ({data.batches.num_epochs(cfg.steps):.1f} epochs); {env.world} process(es) on "
            f"{env.device}; out {self.layout.root}"
        )
        if self.resume_from is not None:
            print(f"dimuon train: resumed from {self.resume_from} at step {self.start}")
        self.log.write({"kind": "start", "step": self.start, "world_size": env.world, "device": str(env.device),
                        "params": n_params, "torch_version": torch.__version__,
                        "resumed_from": str(self.resume_from or "")})

    def finish(self) -> None:
        """The final loss plots and the closing line (rank 0)."""
        if not self.env.is_main:
            return
        s = self.summary
        self.plot()
        print(
            f"dimuon train: done, step {self.cfg.steps}; val loss {s.get('val_loss', math.nan):.4f} "
            f"(EMA {s.get('val_loss_ema', math.nan):.4f}); training time "
            f"{self.clock.active_s:.1f} s of {self.clock.wall():.1f} s; samples {s.get('samples', '-')}"
            + (f"; FD {s['fd']:.3f} ({s['feature_space']})" if "fd" in s else "")
        )

    def plot(self) -> list[Path]:
        cfg = self.cfg
        title = f"{cfg.model} on {cfg.dataset}, {cfg.optimizer} lr {cfg.lr:g}, batch {cfg.batch_size}"
        return plot_losses(read_jsonl(self.layout.metrics), self.layout.plots, title=title)

    def comm_stats(self) -> dict[str, dict[str, float]]:
        """The optimizer's collectives since the last reset (none for optimizers that do not count them)."""
        stats = getattr(self.opt, "comm_stats", None)
        return stats() if stats is not None else {}

    def reset_comm_stats(self) -> None:
        reset = getattr(self.opt, "reset_comm_stats", None)
        if reset is not None:
            reset()


# --------------------------------------------------------------------------------------------------
# Pieces of a step
# --------------------------------------------------------------------------------------------------


def step_generator(seed: int, step: int, rank: int, device: torch.device) -> torch.Generator:
    """A generator seeded from (seed, rank, step) through NumPy's SeedSequence, so streams never overlap."""
    state = np.random.SeedSequence([seed, rank, step]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(state) & ((1 << 63) - 1))


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor | float:
    """Clip the global gradient norm (sharded gradients included) and return it before clipping."""
    if max_norm <= 0:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm.detach()


def sync(env: DistEnv) -> None:
    """Wait for queued GPU work so that host timers measure it."""
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
