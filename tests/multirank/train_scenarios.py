"""Rank-side programs of the multi-rank training tests (importable, so spawned ranks can run them)."""

from __future__ import annotations

from typing import Any

from dimuon.train import TrainConfig, train


def straight_and_resumed(rank: int, world: int, base: dict[str, Any], out_a: str, out_b: str, stop: int) -> dict:
    """Train ``base["steps"]`` steps straight into ``out_a``; in ``out_b`` stop at ``stop`` and resume."""
    a = train(TrainConfig(out=out_a, **base))
    partial = train(TrainConfig(out=out_b, **base), stop_after=stop)
    b = train(TrainConfig(out=out_b, resume=out_b, **base))
    return {"a": a, "partial": partial, "b": b}


def train_once(rank: int, world: int, base: dict[str, Any], out: str) -> dict:
    """Train ``base`` once into ``out`` (every rank returns its summary)."""
    return train(TrainConfig(out=out, **base))


def config_error(rank: int, world: int, base: dict[str, Any], out: str) -> str | None:
    """The ConfigError message that training ``base`` raises on this rank (None if it trains)."""
    from dimuon.train import ConfigError

    try:
        train(TrainConfig(out=out, **base))
    except ConfigError as e:
        return str(e)
    return None


def outcomes(rank: int, world: int, configs: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Train each config in turn: ``("done", skipped steps)`` or ``(error type, message)`` on this rank."""
    from dimuon.train import ConfigError
    from dimuon.train.failures import RunFailed

    found: list[tuple[str, Any]] = []
    for cfg in configs:
        try:
            found.append(("done", train(TrainConfig(**cfg))["skipped_steps"]))
        except (ConfigError, RunFailed) as e:
            found.append((type(e).__name__, str(e)))
    return found


def resumed_options(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Set up (not train) a resumed run: what its optimizer groups and EMA run with on this rank."""
    from dimuon.train.distributed import setup
    from dimuon.train.loop import Trainer
    from dimuon.train.plan import resolve

    trainer = Trainer(resolve(TrainConfig(**cfg)), setup("cpu"))
    muon = [g for g in trainer.opt.param_groups if g["algorithm"] == "muon"]
    return {
        "k": {g["k"] for g in muon},
        "gamma": {g["gamma"] for g in muon},
        "weight_decay": {g["weight_decay"] for g in trainer.opt.param_groups},
        "steps": {g["step"] for g in muon},
        "ema": (trainer.ema.decay, trainer.ema.warmup, trainer.ema.num_updates),
    }


def parallel_runs(rank: int, world: int, base: dict[str, Any], root: str, layouts: dict[str, dict]) -> dict:
    """Train ``base`` once per named ``--parallel.*`` layout into ``root/<name>``; a layout may resume another's
    checkpoint (``resume``: a path under ``root``). Every rank returns the summaries."""
    from dimuon.train.config import ParallelOptions

    out = {}
    for name, layout in layouts.items():
        layout = dict(layout)
        resume = layout.pop("resume", None)
        cfg = TrainConfig(
            out=f"{root}/{name}",
            parallel=ParallelOptions(**layout),
            resume=f"{root}/{resume}" if resume else None,
            **base,
        )
        out[name] = train(cfg)
    return out


def stopped_by_signal(
    rank: int, world: int, base: dict[str, Any], out: str, signal_rank: int, at_step: int
) -> dict[str, Any]:
    """Train ``base`` into ``out`` with rank ``signal_rank`` alone sending itself SIGUSR1 during step ``at_step``
    (0-based), then resume it to the end: how the stop ended on this rank, the checkpoints it left, the summary."""
    import os
    import signal

    from dimuon.dit.checkpoint import list_checkpoints
    from dimuon.train.loop import Trainer
    from dimuon.train.stop import RunStopped

    original = Trainer.train_step

    def step(self: Trainer, s: int) -> None:
        if s == at_step and rank == signal_rank:
            os.kill(os.getpid(), signal.SIGUSR1)
        original(self, s)

    stopped: dict[str, Any] | None = None
    Trainer.train_step = step  # type: ignore[method-assign]
    try:
        train(TrainConfig(out=out, **base))
    except RunStopped as e:
        stopped = {"status": e.status, "message": str(e)}
    finally:
        Trainer.train_step = original  # type: ignore[method-assign]
    left = [s for s, _ in list_checkpoints(out)]
    return {"stopped": stopped, "checkpoints": left, "resumed": train(TrainConfig(out=out, resume=out, **base))}
