"""Where ``--resume`` continues from: a checkpoint, or step 0 of a run that has not written one yet.

``--resume PATH`` names a checkpoint directory or a run directory (its newest complete checkpoint). A run
that stopped before its first checkpoint (a divergence in the first steps, a kill during set-up) can be
resumed too: it restarts from step 0 with the config it was started with (its ``config.json``), in place,
so that its directory never blocks a rerun. Which flags may change on resume is decided in
:func:`dimuon.train.config.check_resume_flags`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dimuon.dit.checkpoint import CheckpointError, list_checkpoints, read_meta
from dimuon.io import RunLayout, step_of

__all__ = ["ResumePoint", "find_resume_point"]


@dataclass(frozen=True)
class ResumePoint:
    """A run to continue: its directory, the checkpoint to load (None: restart from step 0), its config."""

    run: Path
    checkpoint: Path | None
    step: int
    config: dict[str, Any]

    @property
    def where(self) -> str:
        """How messages name it."""
        return f"checkpoint {self.checkpoint}" if self.checkpoint is not None else f"run {self.run}"


def _from_checkpoint(checkpoint: Path) -> ResumePoint:
    meta = read_meta(checkpoint)
    return ResumePoint(checkpoint.parent.parent, checkpoint, int(meta["step"]), meta["config"])


def find_resume_point(path: str | Path) -> ResumePoint:
    """The checkpoint ``path`` names (a checkpoint directory, or a run's newest complete one), or step 0
    of a dimuon run without a checkpoint; :class:`CheckpointError` if there is nothing to resume."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or run directory")
    if step_of(path) is not None or (path / "meta.json").exists():
        return _from_checkpoint(path)
    found = list_checkpoints(path)
    if found:
        return _from_checkpoint(found[-1][1])
    layout = RunLayout(path)
    if not (layout.is_run() and layout.config.is_file()):
        raise CheckpointError(
            f"{path}: nothing to resume, it is not a dimuon run directory (no {layout.MARKER} and config.json) "
            f"and holds no complete checkpoint under {layout.checkpoints}"
        )
    try:
        config = json.loads(layout.config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{layout.config}: unreadable run config ({e})") from None
    return ResumePoint(path, None, 0, config)
