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
