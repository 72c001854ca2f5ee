"""The training loop of ``dimuon train``: rectified-flow DiT training, one process or FSDP2 over N ranks.

Everything a step consumes is a function of ``(seed, step, rank)``: the batch comes from
``BatchSchedule``, the label dropout, flow times and noise from a generator reseeded at every step,
the learning rate from the schedule. A resumed run therefore needs only the model, optimizer and
EMA state (plus the global RNG, restored for anything else that draws from it) to continue exactly.

:func:`train` resolves the flags into a plan, joins the process group and hands both to a
:class:`Trainer`: set-up in ``__init__`` (data checked, output checked, state restored), then
:meth:`Trainer.fit` runs :meth:`Trainer.train_step` and, after each step, the hooks that are due (log,
validate, sample, evaluate, checkpoint). A step whose loss or gradient norm is not finite is never
applied (``--nonfinite``, :mod:`dimuon.train.failures`: with the Muon family and ``skip`` it is decided on the device
and the host waits for the device only at logging steps); a run that stops early raises
:class:`~dimuon.train.failures.RunFailed` saying how to continue it. A stop signal (SIGTERM, SIGUSR1, Ctrl-C)
saves a checkpoint at the next logging step and raises :class:`~dimuon.train.stop.RunStopped`
(:mod:`dimuon.train.stop`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from dimuon.data import (
    BatchSchedule,
    DataSpec,
    balanced_subset,
    describe_item,
    find_problems,
    get_batch,
    problems_message,
)
from dimuon.dit import EMA, TimestepDist, flow_loss, sample
from dimuon.dit.checkpoint import list_checkpoints
from dimuon.dit.parallel import clip_grad_norm as clip_grad_norm_over_meshes
from dimuon.io import read_jsonl, save_grid
from dimuon.metrics.registry import GENERATION
from dimuon.optim.core import local_tensor
from dimuon.train import checkpoint as ckpt
from dimuon.train.config import ConfigError, TrainConfig, check_patch_size, check_token_split
from dimuon.train.distributed import (
    DataParallel,
    DistEnv,
    all_gather_objects,
    data_parallel,
    mean_over_ranks,
    on_main,
    setup,
    shard_model,
)
from dimuon.train.failures import NonFiniteGuard, RunFailed, all_finite
from dimuon.train.gen_eval import TrainingEvaluator
from dimuon.train.logger import tensorboard_available
from dimuon.train.plan import TrainPlan, resolve
from dimuon.train.plots import plot_losses, plot_refreshes
from dimuon.train.records import (
    RunClock,
    RunLog,
    StepTimes,
    Window,
    add_counts,
    add_refresh_counts,
    phase_seconds,
    refresh_counts,
    train_record,
    validation_record,
)
from dimuon.train.rundir import (
    RunLock,
    check_free_space,
    check_run_dir,
    check_same_start,
    prepare_run_dir,
    start_of,
)
from dimuon.train.stop import RunStopped, SignalStop

__all__ = ["Trainer", "train"]

GEN_EVAL_KEYS = (*GENERATION, "feature_space", "num_samples", "eval_s")


def train(cfg: TrainConfig, *, stop_after: int | None = None) -> dict[str, Any]:
    """Run (or resume) training as configured; return a summary (final step, losses, run directory).

    ``stop_after`` ends the run after that many total steps, as if it were killed right after the
    step's checkpoint (tests use it to check that resuming continues exactly).
    """
    plan = resolve(cfg)
    owns_group = not dist.is_initialized()
    env = setup(cfg.device, cfg.threads)
    try:
        with RunLock(plan.layout) as lock:
            return Trainer(plan, env, lock).fit(stop_after)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def bar_paused(bar: Any) -> Iterator[None]:
    """Stop a tqdm bar's clock while the body runs, so its rate and elapsed time count only the work it tracks.

    The training bar would otherwise fold validation, sampling and checkpoints into its steps/s (the last step of
    a demo run, followed by a final validation and sample grid, read "2.9 s/step" for a 0.45 s step).
    """
    start = time.time()
    try:
        yield
    finally:
        paused = time.time() - start
        if not bar.disable:  # a disabled bar keeps no clock
            bar.start_t += paused  # tqdm's own clock (time.time), as its unpause() shifts it
            bar.last_print_t += paused


@dataclass
class TrainData:
    """The opened data: the training split, the batch of every step, the fixed validation images, and the
    data set as recorded in checkpoints (with the number of classes once inferred)."""

    train_set: Any
    batches: BatchSchedule
    val_x: torch.Tensor
    val_y: torch.Tensor
    spec: DataSpec

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.train_set.channels, self.train_set.image_size, self.train_set.image_size)

    @property
    def num_classes(self) -> int:
        return self.train_set.num_classes


def open_data(plan: TrainPlan, env: DistEnv, dp: DataParallel) -> TrainData:
    """Both splits, checked before anything is built: every item usable (all ranks share the reading), the
    splits' classes alike, the model's patch size and one batch fitting; errors name the flags."""
    cfg, spec = plan.cfg, plan.data
    where = f"--dataset {spec.name}" + (f" --data-path {cfg.data_path}" if cfg.data_path else "")
    try:
        train_set = spec.build("train")
        if spec.name == "arrays" and "num_classes" not in spec.kwargs:
            # Classes inferred from the training split hold for the held-out one, and for every later reader.
            spec = DataSpec(spec.name, {**spec.kwargs, "num_classes": train_set.num_classes})
        val_set = spec.build("val")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None
    check_patch_size(plan.model.name, train_set.image_size)
    check_token_split(plan.model.name, train_set.image_size, plan.parallel.cp)
    if getattr(train_set, "classes", None) != getattr(val_set, "classes", None) or (
        train_set.num_classes != val_set.num_classes
    ):
        raise ConfigError(
            f"{where}: the train and val splits have different classes "
            f"({train_set.num_classes} and {val_set.num_classes})"
        )
    if len(train_set) < cfg.batch_size:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} is larger than the {len(train_set)} training items of "
            f"{where}; pass --batch-size {len(train_set)} or less"
        )
    problems = []
    for split, dataset in (("train", train_set), ("val", val_set)):
        found = find_problems(
            dataset, env.rank, env.world, progress=env.is_main and cfg.progress, what=f"the {split} split"
        )
        problems += [p for part in all_gather_objects(found, env) for p in part]
    if problems:
        raise ConfigError(f"{where}: {problems_message(problems, 'the data set')}")
    n_val = len(val_set) if cfg.val_samples == 0 else min(cfg.val_samples, len(val_set))
    if n_val == 0:
        raise ConfigError(f"{where} has an empty validation split")
    batches = BatchSchedule(len(train_set), cfg.batch_size, cfg.seed, dp.rank, dp.world)
    # The classes in turn: a split's first items are often its first classes only (MNIST's are in class order).
    val_idx = balanced_subset(val_set.labels, n_val) if cfg.val_subset == "balanced" else np.arange(n_val)
    val_x, val_y = get_batch(val_set, val_idx)
    return TrainData(train_set, batches, val_x, val_y, spec)


def due(done: int, interval: int, steps: int) -> bool:
    """Whether a hook with this interval runs after ``done`` steps (always after the last one)."""
    return done == steps or (interval > 0 and done % interval == 0)


class Trainer:
    """One training run: set up from its plan, then :meth:`fit` trains and calls the hooks that are due."""

    def __init__(self, plan: TrainPlan, env: DistEnv, lock: RunLock | None = None) -> None:
        """``lock``: taken (on rank 0) as soon as the run directory exists; without one nothing is locked."""
        cfg, layout = plan.cfg, plan.layout
        self.plan, self.cfg, self.layout, self.env = plan, cfg, layout, env
        self.resume_from = plan.resume.checkpoint if plan.resume is not None else None
        check_same_start(all_gather_objects(start_of(plan.resume), env))  # every rank found what --resume found
        on_main(lambda: check_run_dir(layout, plan.resume, cfg.overwrite), env)
        self.lock = lock
        on_main(lambda: self.take_lock(create=False), env)  # an existing run: before the expensive set-up
        if cfg.tensorboard and not tensorboard_available():
            raise ConfigError("--tensorboard needs the tensorboard package (pip install tensorboard)")
        try:
            self.par = plan.parallel.resolve(env.world)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.dp = data_parallel(env, self.par)
        if cfg.batch_size % self.dp.world:
            raise ConfigError(
                f"--batch-size {cfg.batch_size} is not divisible by the {self.dp.world} data-parallel ranks"
            )
        self.data = open_data(plan, env, self.dp)

        # Model, optimizer, EMA: the same init on every rank (seeded), sharded afterwards.
        torch.manual_seed(cfg.seed)
        self.model = plan.model.build(self.data.image_shape, self.data.num_classes)
        self.meta = {
            "config": plan.record,
            "dataset": self.data.spec.as_record(),
            "image_shape": list(self.data.image_shape),
            "num_classes": self.data.num_classes,
            "model": {"name": plan.model.name, "kwargs": dict(self.model.config)},
            "torch_version": torch.__version__,
        }
        self.model.to(env.device)
        all_gather_dtype = torch.bfloat16 if cfg.precision == "bf16" else None  # FSDP2's MixedPrecisionPolicy
        shared = shard_model(self.model, env, self.par, param_dtype=all_gather_dtype) if env.distributed else None
        self.opt = plan.optimizer.build(self.model, process_group=shared, nonfinite=cfg.nonfinite)
        # The Muon family votes on the device: the harness's check rides on its vote (train_step).
        self.device_vote = hasattr(type(self.opt), "last_step_taken")
        self.ema = EMA(self.model, cfg.ema_decay, warmup=cfg.ema_warmup)
        self.checkpoint_bytes = ckpt.checkpoint_bytes(self.model, self.ema)
        on_main(lambda: check_free_space(layout, self.checkpoint_bytes), env)

        self.clock, self.start = RunClock(), 0
        self.guard = NonFiniteGuard(cfg.nonfinite, cfg.skip_limit)
        self.window = Window()  # sums over the steps since the last train record
        if self.resume_from is not None:
            restored = ckpt.load_training_state(
                self.resume_from, model=self.model, optimizer=self.opt, ema=self.ema, env=env
            )
            self.start, self.clock = int(restored["step"]), RunClock.resumed(restored["progress"])
            self.guard.skipped = int(restored["progress"].get("skipped_steps", 0))
            # The streak too: --skip-limit counts the skips in a row across a resume, as an unbroken run does.
            self.guard.in_a_row = int(restored["progress"].get("skipped_in_a_row", 0))
            # And the steps since the last train record before the checkpoint: the next record averages them too.
            self.window = Window.restored(restored["progress"].get(ckpt.LOG_WINDOW), env)
        on_main(lambda: self.take_lock(create=True), env)  # a new run: before anything is written
        on_main(lambda: prepare_run_dir(layout, plan.record, plan.resume, self.start, cfg.overwrite), env)

        self.generation = None
        if plan.evaluation is not None:
            if env.is_main:
                print(
                    f"dimuon train: preparing generation-quality evaluation ({plan.evaluation.features} features, "
                    f"{plan.evaluation.num_samples} samples every {plan.evaluation.interval} steps)"
                )
            self.generation = TrainingEvaluator(plan.evaluation, layout.root, self.meta, env, progress=cfg.progress)
        self.log = RunLog(layout.metrics, layout.tensorboard if cfg.tensorboard else None, enabled=env.is_main)
        self.timesteps = TimestepDist(cfg.timesteps)
        self.autocast = torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")
        self.summary: dict[str, Any] = {"run_dir": str(layout.root), "step": self.start, "skipped_steps": 0}
        self.saved_at = self.start  # the step of the newest checkpoint (the resumed one to begin with)

    # ----------------------------------------------------------------------------------------------
    # The loop
    # ----------------------------------------------------------------------------------------------

    def fit(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train from the starting step to ``--steps`` (or ``stop_after``); return the run's summary."""
        cfg = self.cfg
        self.announce()
        self.optimizer_stats("comm_stats")
        self.optimizer_stats("refresh_stats")
        self.clock.restart()
        self.bar = tqdm(
            total=cfg.steps,
            initial=self.start,
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,
            disable=not (self.env.is_main and cfg.progress),
        )
        self.model.train()
        try:
            with SignalStop(announce=self.env.is_main) as stop:
                for step in range(self.start, cfg.steps):
                    self.train_step(step)
                    done = step + 1
                    self.summary["step"] = done  # where the run stops if a hook fails
                    self.bar.update(1)
                    log_step = due(done, cfg.log_interval, cfg.steps)
                    with bar_paused(self.bar):  # the bar's steps/s counts training steps, not the hooks
                        if log_step:
                            self.log_train(done)
                        if due(done, cfg.val_interval, cfg.steps):
                            self.validate(done)
                        if due(done, cfg.sample_interval, cfg.steps):
                            self.sample(done)
                        if self.plan.evaluation is not None and due(done, self.plan.evaluation.interval, cfg.steps):
                            self.evaluate(done)
                        if due(done, cfg.ckpt_interval, cfg.steps):
                            self.checkpoint(done)
                    if stop_after is not None and done >= stop_after:
                        break
                    if log_step and done < cfg.steps:  # after every hook of the step: none is skipped by the stop
                        self.stop_if_asked(stop, done)
            self.settle()
        except (RunFailed, ckpt.CheckpointWriteError, OSError) as e:
            raise RunFailed(str(e), self.how_to_continue()) from e
        finally:
            self.bar.close()
            self.log.close()
        if self.summary["step"] == cfg.steps:
            self.finish()
        self.summary.update(active_time_s=self.clock.active_s, wall_s=self.clock.wall())
        return self.summary

    def train_step(self, step: int) -> None:
        """One optimizer step on the batch of ``step``, timed part by part, then the EMA update.

        With an optimizer that votes on the device (the Muon family) nothing here waits for the device: the loss
        and gradient-norm check is folded into the gradients the optimizer votes on, its vote masks the step and
        the EMA update, and the window keeps the vote, read at the next logging step (:meth:`settle`). Other
        optimizers have their check read on the host before they step, every step.
        """
        env, cfg = self.env, self.cfg
        timer = PhaseTimer(env.device)
        x1, y = get_batch(self.data.train_set, self.data.batches.indices(step))
        x1, y = x1.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        timer.mark()

        # One lr for every group: the Muon family scales its matrix updates to AdamW's RMS itself.
        self.lr = self.plan.lr_schedule.lr(step)
        for group in self.opt.param_groups:
            group["lr"] = self.lr

        # Dropout, times and noise from (seed, step, data-parallel rank) alone: nothing to carry across a
        # restart, and the ranks of one tensor- or context-parallel group draw the same.
        gen = step_generator(cfg.seed, step, self.dp.rank, env.device)
        drop = torch.rand(x1.shape[0], generator=gen, device=env.device) < cfg.class_dropout
        with self.autocast:
            loss = flow_loss(
                functools.partial(self.model, drop_labels=drop), x1, y, timesteps=self.timesteps, generator=gen
            )
        loss.backward()
        grad_norm = clip_grad_norm(self.model, cfg.grad_clip)
        timer.mark()
        log_step = due(step + 1, cfg.log_interval, cfg.steps)
        if not self.device_vote:
            if not all_finite(loss, grad_norm, env):  # never applied, whatever the optimizer
                self.opt.zero_grad(set_to_none=True)
                self.nonfinite(step, loss, grad_norm)
                self.window.skip(timer.finish(self.window, sync=log_step))
                self.clock.active_s += timer.step_s
                return
            self.guard.passed()
        else:
            fold_into_gradients(self.model, finite_flag(loss, grad_norm))
        try:
            self.opt.step()
        except FloatingPointError:  # --nonfinite raise: the optimizer's vote failed, nothing was applied
            self.opt.zero_grad(set_to_none=True)
            self.nonfinite(step, loss, grad_norm)
            raise
        taken = self.opt.last_step_taken if self.device_vote and cfg.nonfinite == "skip" else None
        timer.mark()
        self.opt.zero_grad(set_to_none=True)
        self.ema.update(self.model, mask=taken)
        times = timer.finish(self.window, sync=log_step)
        self.clock.active_s += timer.step_s
        if taken is None:
            self.window.add(loss, grad_norm, times)
        else:
            self.window.add_voted(step, taken, loss, grad_norm, times)

    def take_lock(self, create: bool) -> None:
        """Lock the run directory (:class:`RunLock`; rank 0), creating it first with ``create``."""
        if self.lock is not None:
            if create:
                self.layout.root.mkdir(parents=True, exist_ok=True)
            self.lock.acquire()

    def stop_if_asked(self, stop: SignalStop, done: int) -> None:
        """At a logging step: if a rank received a stop signal, save a checkpoint (unless this step saved one) and
        raise :class:`RunStopped`."""
        signum = stop.agreed(self.env)
        if not signum:
            return
        if self.saved_at != done:
            self.checkpoint(done)
        name = signal.Signals(signum).name
        self.record({"kind": "stopped", "step": done, "signal": name})
        said = self.env.is_main
        raise RunStopped(
            f"stopped by {name} after step {done} of {self.cfg.steps}, checkpoint {self.summary['checkpoint']}"
            if said
            else "",
            signum,
            f"continue with dimuon train --resume {self.layout.root}" if said else "",
        )

    def settle(self) -> None:
        """Read the votes of the steps since the last read (one host read) and account each skipped one: its
        ``nonfinite`` record (``step`` the step it happened at, ``logged_at`` now), the count, ``--skip-limit``."""
        for step, taken, loss, grad_norm in self.window.settle():
            if taken:
                self.guard.passed()
            else:
                self.nonfinite(step, loss, grad_norm)

    def nonfinite(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | float) -> None:
        """A step with a non-finite loss or gradient norm: log it, then skip it or stop (``--nonfinite``)."""
        x1, _ = get_batch(self.data.train_set, self.data.batches.indices(step))  # the batch, read again
        bad = (~torch.isfinite(x1.flatten(1)).all(dim=1)).nonzero().flatten().tolist()
        items = self.data.batches.indices(step)
        mine = [describe_item(self.data.train_set, int(items[i])) for i in bad]
        bad_items = [d for part in all_gather_objects(mine, self.env) for d in part]
        global_loss = torch.tensor(mean_over_ranks(loss.detach().float(), self.env))  # as every rank sees it
        record, message = self.guard.event(
            step + 1, self.cfg.steps, global_loss, grad_norm, bad_items, self.data.batches.global_batch_size
        )
        if self.summary["step"] != step + 1:  # read at a later logging step
            record["logged_at"] = self.summary["step"]
        self.record(record)
        self.summary["skipped_steps"] = self.guard.skipped
        if self.guard.stops():
            raise RunFailed(message)
        if self.env.is_main:
            self.bar.write(f"dimuon train: {message}")

    # ----------------------------------------------------------------------------------------------
    # Hooks
    # ----------------------------------------------------------------------------------------------

    def record(self, rec: dict[str, Any]) -> None:
        """Append a record stamped with the run's active and wall time."""
        self.log.write(self.clock.stamp(rec))

    def log_train(self, done: int) -> None:
        """The ``train`` record of the steps since the last one (and the optimizer's communication)."""
        self.settle()
        comm, by_dim, refresh = self.window_stats(reset=True)
        rec = train_record(self.window, done, self.lr, self.data.batches, self.env, comm, refresh)
        if by_dim:  # the optimizer's bytes per mesh dimension (sharded runs)
            rec["comm_bytes_per_step_by_mesh_dim"] = {
                dim: sum(v["bytes"] for v in kinds.values()) / (self.window.steps + self.window.skipped)
                for dim, kinds in by_dim.items()
            }
        self.record(rec)
        loss = "-" if rec["loss"] is None else f"{rec['loss']:.4f}"  # every step of the window skipped
        self.bar.set_postfix(loss=loss, step_ms=f"{rec['step_ms']:.0f}", opt_ms=f"{rec['opt_ms']:.1f}", refresh=False)
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
            images = sample(
                self.model,
                labels,
                self.data.image_shape,
                steps=cfg.sample_steps,
                method=cfg.sample_method,
                cfg_scale=cfg.cfg_scale,
                generator=gen,
            )
        path = self.layout.sample_grid(done)
        if env.is_main:
            nrow = self.data.num_classes if self.data.num_classes <= 20 else None
            save_grid(images, path, nrow=nrow, scale=2 if self.data.image_shape[1] < 64 else 1)
        self.record({"kind": "sample", "step": done, "path": str(path), "sample_s": round(time.perf_counter() - t, 3)})
        self.summary["samples"] = str(path)

    def evaluate(self, done: int) -> None:
        """Generation quality of the current weights, into the run's evaluation series and the log."""
        assert self.generation is not None
        entry = self.generation(self.model, self.ema, done, self.clock.active_s)
        self.record({"kind": "gen_eval", "step": done, **{k: entry[k] for k in GEN_EVAL_KEYS}})
        self.summary.update(fd=entry["fd"], feature_space=entry["feature_space"])
        if self.env.is_main:
            self.bar.write(
                f"step {done}: FD {entry['fd']:.3f} ({entry['feature_space']}), precision "
                f"{entry['precision']:.3f}, recall {entry['recall']:.3f} in {entry['eval_s']:.1f} s"
            )

    def checkpoint(self, done: int) -> None:
        """Save the training state (every rank), keep the newest checkpoints, redraw the loss plots."""
        t = time.perf_counter()
        self.settle()  # the count saved is every step's so far
        comm, by_dim, refresh = self.window_stats(reset=False)  # the window goes on after the save
        progress = {
            **self.clock.progress(),
            "skipped_steps": self.guard.skipped,
            "skipped_in_a_row": self.guard.in_a_row,
            ckpt.LOG_WINDOW: self.window.state(self.env, comm, by_dim, refresh_counts(refresh)),
        }
        path = ckpt.save_checkpoint(
            self.layout.root,
            done,
            model=self.model,
            optimizer=self.opt,
            ema=self.ema,
            progress=progress,
            meta=self.meta,
            env=self.env,
        )
        if self.env.is_main:
            # Checkpoints set aside by a resume from an earlier one are replaced now (all of them at the end).
            ckpt.drop_superseded(self.layout.root, None if done == self.cfg.steps else done)
            ckpt.prune_checkpoints(self.layout.root, self.cfg.keep_checkpoints)
            self.plot()
        self.record(
            {"kind": "checkpoint", "step": done, "path": str(path), "ckpt_s": round(time.perf_counter() - t, 3)}
        )
        self.summary["checkpoint"] = str(path)
        self.saved_at = done

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
        if self.plan.auto_resume is not None:
            print(f"dimuon train: {self.plan.auto_resume.describe()}")
        elif self.resume_from is not None:
            print(f"dimuon train: resumed from {self.resume_from} at step {self.start}")
        elif self.plan.resume is not None:
            print(f"dimuon train: restarted {self.plan.resume.run} from step 0 (it had no checkpoint)")
        if self.plan.changed:
            print(
                "dimuon train: changed on resume: "
                + ", ".join(f"{flag} {was} -> {now}" for flag, (was, now) in self.plan.changed.items())
            )
        self.log.write(
            {
                "kind": "start",
                "step": self.start,
                "world_size": env.world,
                "device": str(env.device),
                "parallel": {
                    "dp_replicate": self.par.dp_replicate,
                    "dp_shard": self.par.dp_shard,
                    "cp": self.par.cp,
                    "tp": self.par.tp,
                },
                "params": n_params,
                "torch_version": torch.__version__,
                "resumed_from": str(self.resume_from or ""),
                **({"changed": self.plan.changed} if self.plan.resume is not None else {}),
            }
        )

    def finish(self) -> None:
        """The final loss plots and the closing line (rank 0)."""
        if not self.env.is_main:
            return
        s = self.summary
        if self.start == self.cfg.steps:  # resumed at its last step: nothing ran now, so report what the run recorded
            self.recall_summary()
        self.plot()
        print(
            f"dimuon train: done, step {self.cfg.steps}; val loss {s.get('val_loss', math.nan):.4f} "
            f"(EMA {s.get('val_loss_ema', math.nan):.4f}); training time "
            f"{self.clock.active_s:.1f} s of {self.clock.wall():.1f} s; samples {s.get('samples', '-')}"
            + (f"; FD {s['fd']:.3f} ({s['feature_space']})" if "fd" in s else "")
        )
        if self.guard.skipped:
            print(
                f"dimuon train: {self.guard.skipped} step(s) of this run were skipped for a non-finite loss or "
                f"gradient (--nonfinite skip); the nonfinite records of {self.layout.metrics} name them"
            )

    def recall_summary(self) -> None:
        """Fill the summary from the run's records: its last validation, sample grid and evaluation."""
        for rec in read_jsonl(self.layout.metrics):
            if rec.get("kind") == "val":
                self.summary.update(val_loss=rec["val_loss"], val_loss_ema=rec["val_loss_ema"])
            elif rec.get("kind") == "sample":
                self.summary["samples"] = rec["path"]
            elif rec.get("kind") == "gen_eval" and rec.get("fd") is not None:
                self.summary.update(fd=rec["fd"], feature_space=rec["feature_space"])

    def how_to_continue(self) -> str:
        """What the user can do with the run directory after a failure (rank 0's view of it)."""
        out, at = self.layout.root, self.summary["step"]
        found = list_checkpoints(out)
        if found:
            return (
                f"the run stopped after step {at}; its newest checkpoint is step {found[-1][0]}: continue with "
                f"dimuon train --resume {out} (flags such as --lr or --nonfinite may change)"
            )
        return (
            f"the run stopped after step {at}, before its first checkpoint: dimuon train --resume {out} "
            "restarts it from step 0 (flags such as --lr or --nonfinite may change)"
        )

    def plot(self) -> list[Path]:
        cfg = self.cfg
        title = f"{cfg.model} on {cfg.dataset}, {cfg.optimizer} lr {cfg.lr:g}, batch {cfg.batch_size}"
        records = read_jsonl(self.layout.metrics)
        return plot_losses(records, self.layout.plots, title=title) + plot_refreshes(records, self.layout.plots, title)

    def comm_stats(self, by_mesh_dim: bool = False) -> dict[str, dict[str, Any]]:
        """The optimizer's collectives since the last reset, per kind or per mesh dimension (none for
        optimizers that do not count them)."""
        stats = getattr(self.opt, "comm_stats", None)
        if stats is None:
            return {}
        return stats(by_mesh_dim=True) if by_mesh_dim else stats()

    def optimizer_stats(self, name: str, reset: bool = True) -> dict[str, Any]:
        """The optimizer's ``name()`` statistics since their last reset (its collectives for ``comm_stats``, its
        spectral steps for ``refresh_stats``), then reset unless ``reset`` is False; empty for optimizers that do
        not keep them."""
        stats, reset_stats = getattr(self.opt, name, None), getattr(self.opt, f"reset_{name}", None)
        out = stats() if stats is not None else {}
        if reset and reset_stats is not None:
            reset_stats()
        return out

    def window_stats(self, reset: bool) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """The optimizer's statistics of the window's steps, those carried from before a resume added: its
        collectives per kind and per mesh dimension, and its ``refresh_stats()``; ``reset``: its counts start again
        (at a train record, not at a checkpoint)."""
        by_dim = add_counts(self.window.comm_by_mesh_dim, self.comm_stats(by_mesh_dim=True))  # before the reset
        comm = add_counts(self.window.comm, self.optimizer_stats("comm_stats", reset))
        refresh = add_refresh_counts(self.window.refresh, self.optimizer_stats("refresh_stats", reset))
        return comm, by_dim, refresh


# --------------------------------------------------------------------------------------------------
# Pieces of a step
# --------------------------------------------------------------------------------------------------


def step_generator(seed: int, step: int, rank: int, device: torch.device) -> torch.Generator:
    """A generator seeded from (seed, rank, step) through NumPy's SeedSequence, so streams never overlap."""
    state = np.random.SeedSequence([seed, rank, step]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(state) & ((1 << 63) - 1))


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """The global gradient norm (sharded gradients on any mesh included) before clipping, clipped to ``max_norm``
    if > 0."""
    return clip_grad_norm_over_meshes(model.parameters(), max_norm)


def finite_flag(loss: torch.Tensor, grad_norm: torch.Tensor | float) -> torch.Tensor:
    """0-d bool on the device: this rank's loss and the global gradient norm are finite (no host read)."""
    norm = torch.as_tensor(grad_norm, device=loss.device)
    return torch.isfinite(loss.detach()).all() & torch.isfinite(norm).all()


def fold_into_gradients(model: torch.nn.Module, ok: torch.Tensor) -> None:
    """Let the optimizer's non-finite vote carry the harness's verdict ``ok``: ``where(ok, 0, nan)`` is added to
    one entry of this rank's first non-empty local gradient (``x + 0 = x``), so a rank whose loss is not finite
    fails the vote of every rank, without a host read or a collective of its own."""
    for p in model.parameters():
        if p.grad is None:
            continue
        local = local_tensor(p.grad)
        if local.numel() > 0:
            local[(0,) * local.ndim].add_(torch.where(ok, 0.0, math.nan))
            return


class PhaseTimer:
    """The phases of one step (data, forward and backward, optimizer): host clocks on a CPU; on a GPU, CUDA
    events read at the next logging step, so no step but a logging one waits for the device."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = [time.perf_counter()]
        self.events = [self._event()] if self.cuda else []
        self.step_s = 0.0

    @staticmethod
    def _event() -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self) -> None:
        self.host.append(time.perf_counter())
        if self.cuda:
            self.events.append(self._event())

    def finish(self, window: Window, sync: bool) -> StepTimes:
        """The step's times (``sync``: wait for the device first, at a logging step); on a GPU the phases are
        handed to ``window`` as events and read there."""
        if sync and self.cuda:
            torch.cuda.synchronize()
        end = time.perf_counter()
        self.step_s = end - self.host[0]
        if self.cuda:
            window.add_events(self.events)
            return StepTimes(0.0, 0.0, 0.0, self.step_s)
        return StepTimes(*phase_seconds([b - a for a, b in itertools.pairwise(self.host)]), self.step_s)
