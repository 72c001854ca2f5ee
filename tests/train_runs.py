"""Tiny training runs and their logs, shared by the training-loop tests (one process and multi-rank)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dimuon.train import TrainConfig

TIMING_KEYS = {
    "active_time_s",
    "wall_s",
    "step_ms",
    "data_ms",
    "fwd_bwd_ms",
    "opt_ms",
    "samples_per_s",
    "eval_s",
    "sample_s",
    "ckpt_s",
    "path",
    "resumed_from",
}


# A run of a few 25 ms steps: DiT-T/4 on MNIST, small validation and sample budgets.
TINY: dict[str, Any] = dict(
    model="DiT-T/4",
    batch_size=16,
    steps=8,
    warmup_steps=2,
    log_interval=2,
    val_interval=4,
    val_samples=16,
    sample_count=10,
    sample_steps=2,
    ckpt_interval=4,
    progress=False,
)


def tiny_config(out: Path, **overrides: Any) -> TrainConfig:
    """:data:`TINY` into ``out``, with ``overrides``."""
    return TrainConfig(**{**TINY, "out": str(out), **overrides})


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_timing(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in recs if r["kind"] != "start"]
