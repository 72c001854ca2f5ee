"""Records and run directories of ``dimuon bench quality`` as a race leaves them, written by hand for tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dimuon.io import RunLayout, save_grid
from dimuon.metrics.results import settings_key

SETTINGS = {"feature_space": "classifier-x", "num_samples": 10, "sample_steps": 2}


def record(rows: list[dict], optimizers: dict) -> dict[str, Any]:
    """A bench quality record with the rows and the per-optimizer summaries given."""
    return {"eval_settings": SETTINGS, "optimizers": optimizers, "runs": rows}


def row(name: str, optimizer: str, lr: float, seed: int, fd: float | None, run_dir: str = "", **extra: Any) -> dict:
    """One finished run of a record."""
    return {
        "name": name,
        "optimizer": optimizer,
        "lr": lr,
        "seed": seed,
        "status": "ok",
        "fd": fd,
        "precision": 0.5,
        "recall": 0.4,
        "val_loss_ema": 0.2,
        "opt_ms": 10.0,
        "step_ms": 100.0,
        "active_time_s": 200.0,
        "spectral_fraction": None,
        "run_dir": run_dir,
        **extra,
    }


def write_run(root: Path, name: str, fds: list[float], grid: bool, losses: list[float] | None = None) -> Path:
    """``<root>/runs/<name>`` with an evaluation series every 500 steps (a failed entry among them, a series of
    other settings beside them), with ``losses`` a validation pass every 250 steps in its metrics (EMA loss
    ``losses[i]`` at step ``250 (i + 1)``, a training entry between) and, with ``grid``, the last evaluation's
    sample grid."""
    layout = RunLayout(root / "runs" / name)
    layout.eval.mkdir(parents=True)
    if losses is not None:
        lines = [{"kind": "train", "step": 1, "loss": 1.0}] + [
            {"kind": "val", "step": 250 * (i + 1), "val_loss": v + 0.1, "val_loss_ema": v} for i, v in enumerate(losses)
        ]
        layout.metrics.write_text("".join(json.dumps(e) + "\n" for e in lines))
    key = settings_key(SETTINGS)
    entries = [
        {"step": 500 * (i + 1), "status": "ok", "fd": fd, "active_time_s": 60.0 * (i + 1)} for i, fd in enumerate(fds)
    ]
    entries.insert(1, {"step": 750, "status": "failed", "error": "x"})
    layout.results.write_text(
        json.dumps(
            {
                "format": 1,
                "evaluations": {
                    key: {"settings": SETTINGS, "entries": entries},
                    "other": {
                        "settings": {**SETTINGS, "num_samples": 99},
                        "entries": [{"step": 500, "status": "ok", "fd": 1}],
                    },
                },
            }
        )
    )
    if grid:
        save_grid(torch.zeros(2, 1, 8, 8), layout.eval_grid(key, 500 * len(fds)))
    return layout.root
