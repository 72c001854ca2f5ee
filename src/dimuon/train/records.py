"""What a training run writes into ``metrics.jsonl`` (and TensorBoard): the records and the clock that stamps them.

Every record after the ``start`` record carries ``active_time_s`` (seconds spent in training steps,
summed over the run and its resumptions) and ``wall_s`` (the run's elapsed time, without the time
between a kill and its resume); :class:`RunClock` keeps both.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dimuon.data import BatchSchedule
from dimuon.dit import EMA
from dimuon.dit import validation_loss as flow_validation_loss
from dimuon.io import JsonlLog
from dimuon.train.distributed import DistEnv, all_gather_objects, mean_over_ranks
from dimuon.train.logger import TensorBoardLog

__all__ = [
    "RunClock",
    "RunLog",
    "StepTimes",
    "Window",
    "add_counts",
    "add_refresh_counts",
    "refresh_counts",
    "train_record",
    "validation_record",
]


@dataclass
class RunClock:
    """Active training time and wall time of a run across its resumptions (the ``progress`` a checkpoint keeps)."""

    active_s: float = 0.0
    wall_before_s: float = 0.0  # wall time of the sessions before this one
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def resumed(cls, progress: dict[str, float]) -> RunClock:
        """The clock of a run continuing from a checkpoint's ``progress``."""
        return cls(float(progress.get("active_time_s", 0.0)), float(progress.get("wall_time_s", 0.0)))

    def restart(self) -> None:
        """This session's wall time counts from now (set-up and resuming are not the run's time)."""
        self.started = time.perf_counter()

    def wall(self) -> float:
        return self.wall_before_s + time.perf_counter() - self.started

    def progress(self) -> dict[str, float]:
        """The counters a checkpoint stores and a resumed run restores."""
        return {"active_time_s": self.active_s, "wall_time_s": self.wall()}

    def stamp(self, record: dict[str, Any]) -> dict[str, Any]:
        return {**record, "active_time_s": round(self.active_s, 4), "wall_s": round(self.wall(), 4)}


@dataclass
class StepTimes:
    """Where one training step's seconds went: data, forward/backward (with clipping), optimizer, all."""

    data_s: float
    fwd_bwd_s: float
    opt_s: float
    step_s: float


def phase_seconds(spans: list[float]) -> tuple[float, float, float]:
    """(data, forward and backward, optimizer) from the spans between a step's marks (a skipped step has two)."""
    return spans[0], spans[1], spans[2] if len(spans) > 2 else 0.0


@dataclass
class Window:
    """Sums over the steps since the last training record (losses over the steps taken, times over all).

    A checkpoint keeps the window (:meth:`state`) and a resumed run starts from it (:meth:`restored`), so the
    first record after a resume covers the same steps, with the same sums, as the uninterrupted run's: the loss
    and gradient-norm sums go through the checkpoint as floats that hold the running float32 sums exactly.
    The optimizer's statistics of the steps before the resume (``comm``, ``comm_by_mesh_dim``, ``refresh``) come
    back with it, to be added to the optimizer's own at the next record.
    """

    steps: int = 0  # steps taken
    skipped: int = 0  # steps skipped for a non-finite loss or gradient (--nonfinite skip)
    loss: torch.Tensor | float = 0.0
    grad_norm: torch.Tensor | float = 0.0
    data_s: float = 0.0
    fwd_bwd_s: float = 0.0
    opt_s: float = 0.0
    step_s: float = 0.0
    pending: list[Any] = field(default_factory=list)  # (step, vote, loss, grad_norm) of steps not yet read
    events: list[Any] = field(default_factory=list)  # CUDA events of each step's phases, not yet read
    # The optimizer's statistics of the window's steps before a resume (its comm_stats() without and with
    # by_mesh_dim, its spectral-step counts as refresh_counts() gives them); empty otherwise.
    comm: dict[str, Any] = field(default_factory=dict)
    comm_by_mesh_dim: dict[str, Any] = field(default_factory=dict)
    refresh: dict[str, list[int]] = field(default_factory=dict)

    def state(
        self,
        env: DistEnv,
        comm: dict[str, Any],
        comm_by_mesh_dim: dict[str, Any],
        refresh: dict[str, list[int]],
    ) -> dict[str, Any]:
        """The window as a checkpoint's ``progress`` keeps it (every rank calls this; plain numbers, lists and
        dicts, the same on every rank): each rank's loss sum in rank order, the rest as rank 0 has it. The step
        counts and the gradient norm are global, and only rank 0 writes records, so its times and the
        optimizer statistics given (this window's so far, carried ones included) are the ones that matter.
        The votes must have been read (:meth:`settle`)."""
        assert not self.pending, "settle the window before saving it"
        self.read_events()
        losses = all_gather_objects(float(self.loss), env)
        mine = {
            "steps": self.steps,
            "skipped": self.skipped,
            "loss": losses,
            "grad_norm": float(self.grad_norm),
            "data_s": self.data_s,
            "fwd_bwd_s": self.fwd_bwd_s,
            "opt_s": self.opt_s,
            "step_s": self.step_s,
            "comm": comm,
            "comm_by_mesh_dim": comm_by_mesh_dim,
            "refresh": refresh,
        }
        return all_gather_objects(mine, env)[0]

    @classmethod
    def restored(cls, state: dict[str, Any] | None, env: DistEnv) -> Window:
        """The window a checkpoint saved (:meth:`state`), for this rank; an empty one for a checkpoint without
        it. At another world size than the saved one every rank takes the mean of the saved loss sums, which
        keeps the record's mean over ranks."""
        if not state:
            return cls()
        losses = [float(x) for x in state["loss"]]
        loss = losses[env.rank] if len(losses) == env.world else sum(losses) / len(losses)
        return cls(
            steps=int(state["steps"]),
            skipped=int(state["skipped"]),
            loss=loss,
            grad_norm=float(state["grad_norm"]),
            data_s=float(state["data_s"]),
            fwd_bwd_s=float(state["fwd_bwd_s"]),
            opt_s=float(state["opt_s"]),
            step_s=float(state["step_s"]),
            comm=dict(state.get("comm") or {}),
            comm_by_mesh_dim=dict(state.get("comm_by_mesh_dim") or {}),
            refresh={name: [int(s), int(n)] for name, (s, n) in (state.get("refresh") or {}).items()},
        )

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor | float, times: StepTimes) -> None:
        """Account one step (the loss stays a tensor: no device sync per step)."""
        self.steps += 1
        self.loss = self.loss + loss.detach().float()
        self.grad_norm = self.grad_norm + grad_norm
        self.add_times(times)

    def add_voted(
        self, step: int, taken: torch.Tensor, loss: torch.Tensor, grad_norm: torch.Tensor | float, times: StepTimes
    ) -> None:
        """Account a step the optimizer took or skipped on the device (``taken``, its vote, unread): the loss and
        gradient norm summed where it was taken; which it was is read by :meth:`settle`."""
        self.pending.append((step, taken, loss.detach(), grad_norm))
        self.loss = self.loss + torch.where(taken, loss.detach().float(), 0.0)
        self.grad_norm = self.grad_norm + torch.where(taken, torch.as_tensor(grad_norm, device=taken.device), 0.0)
        self.add_times(times)

    def settle(self) -> list[tuple[int, bool, torch.Tensor, torch.Tensor | float]]:
        """The pending steps as ``(step, taken, loss, grad_norm)``, their votes read at once (one host read),
        now counted as taken or skipped."""
        if not self.pending:
            return []
        flags = torch.stack([taken for _, taken, _, _ in self.pending]).tolist()
        out = [(step, bool(flag), loss, norm) for (step, _, loss, norm), flag in zip(self.pending, flags)]
        self.pending = []
        self.steps += sum(flags)
        self.skipped += len(flags) - sum(flags)
        return out

    def add_events(self, events: list[Any]) -> None:
        """A step's CUDA events (its start, then one per phase), read when the times are asked for."""
        self.events.append(events)

    def read_events(self) -> None:
        """The phases of the steps timed by CUDA events, added to the sums (waits for the last)."""
        for events in self.events:
            events[-1].synchronize()
            spans = [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(events)]
            data, fwd_bwd, opt = phase_seconds(spans)
            self.data_s += data
            self.fwd_bwd_s += fwd_bwd
            self.opt_s += opt
        self.events = []

    def skip(self, times: StepTimes) -> None:
        """Account a skipped step: its time, not its (non-finite) loss."""
        self.skipped += 1
        self.add_times(times)

    def add_times(self, times: StepTimes) -> None:
        self.data_s += times.data_s
        self.fwd_bwd_s += times.fwd_bwd_s
        self.opt_s += times.opt_s
        self.step_s += times.step_s


def train_record(
    window: Window,
    done: int,
    lr: float,
    batches: BatchSchedule,
    env: DistEnv,
    comm: dict[str, dict[str, float]],
    refresh: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``train`` record of a window: mean loss over its steps taken and the ranks (None if every step was
    skipped), the skipped steps, timing split over all steps, communication, and (``refresh``: the optimizer's
    ``refresh_stats()`` over the window) the share of spectral steps."""
    window.read_events()
    taken, n = window.steps, window.steps + window.skipped
    loss = torch.as_tensor(window.loss, dtype=torch.float32, device=env.device) / max(taken, 1)
    rec: dict[str, Any] = {
        "kind": "train",
        "step": done,
        "epoch": round(batches.num_epochs(done), 4),
        "lr": lr,
        "loss": mean_over_ranks(loss, env) if taken else None,
        "grad_norm": float(window.grad_norm) / taken if taken else None,
        "skipped_steps": window.skipped,
        "step_ms": 1e3 * window.step_s / n,
        "data_ms": 1e3 * window.data_s / n,
        "fwd_bwd_ms": 1e3 * window.fwd_bwd_s / n,
        "opt_ms": 1e3 * window.opt_s / max(taken, 1),  # skipped steps call no optimizer
        "samples_per_s": batches.global_batch_size * n / window.step_s,
    }
    rec["comm_bytes_per_step"] = sum(v["bytes"] for v in comm.values()) / n
    rec["comm"] = {kind: {"calls": v["calls"] / n, "bytes": v["bytes"] / n} for kind, v in comm.items()}
    if refresh and refresh.get("steps"):
        rec["refresh"] = {
            "spectral_fraction": round(refresh["spectral_fraction"], 4),
            "matrices": {name: round(m["fraction"], 4) for name, m in refresh["matrices"].items()},
        }
    return rec


def add_counts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two nested dicts of counts added key by key (a key of one of them alone kept as it is)."""
    out = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict):
            out[key] = add_counts(out[key], value)
        else:
            out[key] = out[key] + value
    return out


def refresh_counts(stats: dict[str, Any]) -> dict[str, list[int]]:
    """``{matrix: [spectral steps, steps]}`` of an optimizer's ``refresh_stats()`` (empty without any)."""
    return {name: [m["spectral"], m["steps"]] for name, m in stats.get("matrices", {}).items()}


def add_refresh_counts(counts: dict[str, list[int]], stats: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's ``refresh_stats()`` with the spectral-step ``counts`` of earlier steps added, its fractions
    computed over both (``stats`` as it is when there are none)."""
    if not counts:
        return stats
    total = {name: list(c) for name, c in counts.items()}
    for name, (spectral, steps) in refresh_counts(stats).items():
        c = total.setdefault(name, [0, 0])
        c[0] += spectral
        c[1] += steps
    matrices = {name: {"spectral": s, "steps": n, "fraction": s / n} for name, (s, n) in total.items()}
    spectral = sum(s for s, _ in total.values())
    steps = sum(n for _, n in total.values())
    return {
        "spectral_fraction": spectral / steps if steps else 0.0,
        "spectral": spectral,
        "steps": steps,
        "matrices": matrices,
    }


def validation_record(
    model: torch.nn.Module, ema: EMA, val_x: torch.Tensor, val_y: torch.Tensor, seed: int
) -> dict[str, Any]:
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


class RunLog:
    """The run's records: appended to ``metrics.jsonl`` and mirrored to TensorBoard, on rank 0 only."""

    def __init__(self, metrics: Path, tensorboard: Path | None, enabled: bool) -> None:
        self._jsonl = JsonlLog(metrics) if enabled else None
        self._tb = TensorBoardLog(tensorboard) if enabled and tensorboard is not None else None

    def write(self, record: dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(record)
        if self._tb is not None:
            self._tb.write(record)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
