"""The run directory of ``dimuon train``: refuse to mix two runs, and make it consistent with the starting step.

Starting afresh replaces the entries a run consists of (:attr:`dimuon.io.RunLayout.ENTRIES`) and
nothing else. Continuing in place drops what was logged or saved after the checkpoint (a killed run
may have written some); forking from another run's checkpoint starts with that run's log up to it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from dimuon.io import JsonlLog, RunLayout, read_jsonl, remove_steps_after, truncate_jsonl, write_json_atomic
from dimuon.log import get_logger
from dimuon.metrics.results import truncate_results
from dimuon.train.checkpoint import remove_checkpoints_after
from dimuon.train.config import ConfigError

__all__ = ["check_run_dir", "continues_in_place", "prepare_run_dir"]

log = get_logger(__name__)


def _run_of(checkpoint: Path) -> Path:
    """The run directory of a checkpoint directory (``<run>/checkpoints/step_N``)."""
    return checkpoint.parent.parent


def continues_in_place(layout: RunLayout, resume_from: Path | None) -> bool:
    """Whether the run resumes from a checkpoint of its own ``--out``."""
    return resume_from is not None and _run_of(resume_from).resolve() == layout.root.resolve()


def check_run_dir(layout: RunLayout, resume_from: Path | None, overwrite: bool) -> None:
    """Refuse to mix two runs in one directory unless asked to (before any expensive work)."""
    run_dir = layout.root
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--out {run_dir} exists and is not a directory")
    if layout.holds_run() and not continues_in_place(layout, resume_from) and not overwrite:
        raise ConfigError(
            f"--out {run_dir} already holds a run; pass --resume {run_dir} to continue it, "
            "--overwrite to replace it, or another --out"
        )


def prepare_run_dir(layout: RunLayout, config: dict[str, Any], resume_from: Path | None, start: int) -> None:
    """Make the run directory consistent with step ``start`` and write ``config.json`` (rank 0 only)."""
    if continues_in_place(layout, resume_from):
        dropped = truncate_jsonl(layout.metrics, start) + truncate_results(layout.root, start)
        removed = remove_checkpoints_after(layout.root, start)
        remove_steps_after(layout.samples, start)
        if dropped or removed:
            log.info("resuming at step %d: dropped %d log records and %d checkpoint(s) written after it",
                     start, dropped, len(removed))
    else:
        for path in layout.entries():
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        layout.root.mkdir(parents=True, exist_ok=True)
        if resume_from is not None:
            # A run forked from another run's checkpoint starts with that run's history up to it.
            history = [r for r in read_jsonl(RunLayout(_run_of(resume_from)).metrics) if int(r.get("step", 0)) <= start]
            fork_log = JsonlLog(layout.metrics)
            for rec in history:
                fork_log.write(rec)
            fork_log.close()
    layout.samples.mkdir(parents=True, exist_ok=True)
    layout.checkpoints.mkdir(parents=True, exist_ok=True)
    write_json_atomic(layout.config, config)
