"""The harness under the meta-device trap: ``dimuon train`` steps and hooks, a resume and ``dimuon eval``.

Set-up (data, model built on the host and moved, optimizer, EMA, feature extractor and real features)
runs as usual; then the work of a run (training steps with bf16 autocast, loss, clipping, optimizer
and EMA updates, the train record, validation, a sample grid with guidance, an in-training evaluation,
a checkpoint, restoring it into a fresh trainer, and ``dimuon eval`` over the checkpoint) runs with
the default device set to meta. A tensor made there without ``device=`` lands on meta, and the first
op that mixes it with real data, copies it out or reads it on the host fails. The same program runs
in one process, on 2 gloo ranks (FSDP2, DCP) and on a GPU, and returns what the run computed, so a
run with the trap can be held to one without it.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dimuon.dit.checkpoint import list_checkpoints, read_meta
from dimuon.eval.run import evaluate_checkpoints
from dimuon.metrics.series import RunEvaluation
from dimuon.train import TrainConfig
from dimuon.train.checkpoint import load_training_state
from dimuon.train.config import EvalOptions
from dimuon.train.distributed import DistEnv, setup
from dimuon.train.loop import Trainer
from dimuon.train.plan import resolve

STEPS = 2  # every hook runs after the last step


@contextlib.contextmanager
def trap(on: bool) -> Iterator[None]:
    """Default device meta (``on``), or nothing.

    Exempt: torch's DCP, which keeps its planner's offsets in tensors made on the default device (host
    bookkeeping, CPU in every real process); the state it saves and loads is dimuon's and stays trapped.
    """
    if not on:
        yield
        return
    with torch.device("meta"), _host_default(dcp, "save"), _host_default(dcp, "load"):
        yield


@contextlib.contextmanager
def _host_default(module: Any, name: str) -> Iterator[None]:
    """Run ``module.name`` with the CPU as default device while the block lasts."""
    original = getattr(module, name)

    def on_host(*args: Any, **kwargs: Any) -> Any:
        with torch.device("cpu"):
            return original(*args, **kwargs)

    setattr(module, name, on_host)
    try:
        yield
    finally:
        setattr(module, name, original)


def check_trap_catches() -> None:
    """The trap is live: an allocation without ``device=`` lands on meta."""
    with trap(True):
        assert torch.empty(1).device.type == "meta"


def tiny_config(out: Path, cache: Path, device: str, **overrides: Any) -> TrainConfig:
    """DiT-T/2 on 8x8 digits under bf16 autocast; validation, samples, evaluation and a checkpoint at the end."""
    base: dict[str, Any] = dict(
        model="DiT-T/2",
        dataset="digits",
        batch_size=16,
        steps=STEPS,
        warmup_steps=1,
        log_interval=1,
        val_interval=0,
        val_samples=16,
        sample_interval=0,
        sample_count=10,
        sample_steps=2,
        ckpt_interval=0,
        precision="bf16",
        device=device,
        progress=False,
        out=str(out),
        eval=EvalOptions(
            interval=STEPS, num_samples=12, sample_steps=2, cfg=2.0, batch_size=6, cache_dir=cache, reference=False
        ),
    )
    return TrainConfig(**{**base, **overrides})


def host_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters on the CPU (gathered from shards: every rank calls this)."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu() for n, p in model.named_parameters()
    }


def run_harness(rank: int, world: int, device: str, root: str, cache: str, trapped: bool) -> dict[str, Any]:
    """Train, evaluate, checkpoint, restore and ``dimuon eval`` in ``root`` with (``trapped``) or without the trap.

    ``cache`` holds the feature classifier and the real-set features (runs may share it). Returns the run's
    numbers: the summary, the parameters after one more step from the restored checkpoint and from the
    trainer that wrote it, and the ``dimuon eval`` scores (rank 0).
    """
    root_dir = Path(root)
    env: DistEnv = setup(device)
    check_trap_catches()

    trainer = Trainer(resolve(tiny_config(root_dir / "run", Path(cache), device)), env)
    with trap(trapped):
        summary = trainer.fit()
    ((step, ckpt),) = list_checkpoints(root_dir / "run")
    assert step == STEPS, step

    # A fresh trainer (no evaluation) takes the checkpoint's state; one more step matches the writer's.
    fresh = Trainer(resolve(tiny_config(root_dir / "fresh", Path(cache), device, eval=EvalOptions())), env)
    with trap(trapped):
        load_training_state(ckpt, model=fresh.model, optimizer=fresh.opt, ema=fresh.ema, env=env)
        fresh.train_step(STEPS)
        trainer.train_step(STEPS)
    resumed, straight = host_params(fresh.model), host_params(trainer.model)

    scores = None
    if env.is_main:  # dimuon eval is one process: it reads the (DCP) checkpoint without a process group
        copy = root_dir / "copy"  # the run without its in-training scores, which dimuon eval would skip
        shutil.copytree(root_dir / "run", copy, ignore=shutil.ignore_patterns("eval"))
        evaluation = RunEvaluation(copy, tiny_config(copy, Path(cache), device).eval, device, progress=False)
        evaluation.setup(read_meta(ckpt))  # builds the feature extractor and real features: set-up, no trap
        with trap(trapped):
            evaluate_checkpoints(evaluation)
        (entry,) = evaluation.series["entries"]
        scores = {k: entry[k] for k in ("fd", "precision", "recall", "density", "coverage")}
    keys = ("train_loss", "val_loss", "val_loss_ema", "fd")
    return {"summary": {k: summary[k] for k in keys}, "resumed": resumed, "straight": straight, "eval": scores}
