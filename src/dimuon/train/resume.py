"""Where ``--resume`` continues from: a checkpoint, or step 0 of a run that has not written one yet.

``--resume PATH`` names a checkpoint directory or a run directory (its newest complete checkpoint). A run
that stopped before its first checkpoint (a divergence in the first steps, a kill during set-up) can be
resumed too: it restarts from step 0 with the config it was started with (its ``config.json``), in place,
so that its directory never blocks a rerun. Which flags may change on resume is decided in
:func:`dimuon.train.config.check_resume_flags`.

``--resume auto`` (:func:`auto_resume_point`) is the same command for the first launch and for every
restart, as ``torchrun --max-restarts`` needs: the run in ``--out`` continues from its newest checkpoint
that passes its manifest, and a new run starts when ``--out`` holds none yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dimuon.dit.checkpoint import TMP_PREFIX, CheckpointError, list_checkpoints, read_meta, verify_checkpoint
from dimuon.io import RunLayout, step_of

__all__ = ["AutoResume", "ResumePoint", "auto_resume_point", "find_resume_point"]


@dataclass(frozen=True)
class ResumePoint:
    """A run to continue: its directory (None for a checkpoint kept outside a run's ``checkpoints/``: it can only
    start a new run, in an ``--out`` given), the checkpoint to load (None: restart from step 0), its config."""

    run: Path | None
    checkpoint: Path | None
    step: int
    config: dict[str, Any]
    # What the data set made of flags left to it (--image-size, --channels, --num-classes), from the checkpoint.
    resolved: dict[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        """How messages name it."""
        return f"checkpoint {self.checkpoint}" if self.checkpoint is not None else f"run {self.run}"


def run_of_checkpoint(checkpoint: Path) -> Path | None:
    """The run a checkpoint belongs to: the directory whose ``checkpoints/`` holds it, if that is a dimuon run
    (marked, or a run from before the marker: its ``config.json`` and ``metrics.jsonl``). None for a checkpoint
    copied anywhere else, whose grandparent is nobody's run to continue or write into."""
    parent = Path(checkpoint).absolute().parent  # "step_N" given from inside checkpoints/ has a parent too
    layout = RunLayout(parent.parent)
    if parent.name != layout.checkpoints.name:
        return None
    if layout.is_run() or (layout.config.is_file() and layout.metrics.is_file()):
        return layout.root
    return None


def _from_checkpoint(checkpoint: Path, meta: dict[str, Any] | None = None) -> ResumePoint:
    meta = read_meta(checkpoint) if meta is None else meta
    shape, classes = meta.get("image_shape"), meta.get("num_classes")
    resolved = {}
    if isinstance(shape, list) and len(shape) == 3:
        resolved.update(channels=shape[0], image_size=shape[1])
    if isinstance(classes, int):
        resolved["num_classes"] = classes
    return ResumePoint(run_of_checkpoint(checkpoint), checkpoint, int(meta["step"]), meta["config"], resolved)


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


@dataclass(frozen=True)
class AutoResume:
    """What ``--resume auto`` found in ``--out``: the point to continue from (None: start a new run there), and
    the newer checkpoints it passed over, each with why."""

    out: Path
    point: ResumePoint | None
    passed_over: tuple[str, ...] = ()

    def describe(self) -> str:
        """The start line of the run: which it did, from which checkpoint and step."""
        if self.point is None:
            text = f"--resume auto: {self.out} holds no run yet, so a new run starts there at step 0"
        elif self.point.checkpoint is None:
            text = f"--resume auto: restarted {self.out} from step 0 with its config (it had no checkpoint)"
        else:
            text = (
                f"--resume auto: resumed from {self.point.checkpoint} at step {self.point.step}, the newest "
                "complete checkpoint in --out"
            )
        return text + ("; passed over " + "; ".join(self.passed_over) if self.passed_over else "")


def auto_resume_point(out: str | Path) -> AutoResume:
    """What ``--resume auto`` continues in ``out``: the newest checkpoint of the run there that passes its
    manifest (:func:`~dimuon.dit.checkpoint.verify_checkpoint`), step 0 of the run if it has no checkpoint
    yet, or nothing (a new run) when ``out`` holds no run.

    Checkpoints are tried newest first; one that fails its manifest (a missing, truncated or corrupted piece)
    or a save that never finished (``checkpoints/.tmp-step_N``, left by a rank killed while writing it) is
    passed over and named in :attr:`AutoResume.passed_over`. Nothing is written here. Refused
    (:class:`CheckpointError`): a directory without dimuon's run marker that holds checkpoints (``--resume
    PATH`` continues such a run explicitly), a run whose every checkpoint fails its manifest, and a run that
    recorded neither its config nor a checkpoint. A directory without the marker that holds a run's files is
    refused at start-up as without ``--resume`` (:func:`dimuon.train.rundir.check_run_dir`): it is never
    written into.
    """
    out = Path(out)
    layout = RunLayout(out)
    if not out.is_dir():  # absent (a new run), or not a directory (refused at start-up, as without --resume)
        return AutoResume(out, None)
    found = list_checkpoints(out)
    if not layout.is_run():
        if found:
            raise CheckpointError(
                f"--resume auto: {out} holds checkpoints but is not marked as a dimuon run (no {layout.MARKER}: "
                f"a run of a dimuon version before the marker, or a copy without it), and --resume auto continues "
                f"only marked runs; continue it once with --resume {out}, which marks it"
            )
        return AutoResume(out, None)
    unfinished = {
        step: path
        for path in (layout.checkpoints.glob(TMP_PREFIX + "step_*") if layout.checkpoints.is_dir() else ())
        if path.is_dir() and (step := step_of(path.name[len(TMP_PREFIX) :])) is not None
    }
    passed: list[tuple[int, str]] = [
        (step, f"step {step} ({path.name}: a save that did not finish)") for step, path in unfinished.items()
    ]
    for step, path in reversed(found):
        try:
            meta = verify_checkpoint(path)
        except CheckpointError as e:
            passed.append((step, f"step {step} ({e})"))
            continue
        notes = tuple(note for s, note in sorted(passed, reverse=True) if s > step)
        return AutoResume(out, _from_checkpoint(path, meta), notes)
    notes = tuple(note for _, note in sorted(passed, reverse=True))
    if found:
        raise CheckpointError(
            f"--resume auto: no checkpoint of the run in {out} passes its manifest: {'; '.join(notes)}; "
            "start it afresh with --overwrite instead of --resume auto, or resume an intact copy of one with "
            "--resume PATH"
        )
    if not layout.config.is_file():
        raise CheckpointError(
            f"--resume auto: the run in {out} recorded neither its config.json nor a checkpoint (it stopped while "
            "it was being set up); start it afresh with --overwrite instead of --resume auto"
        )
    return AutoResume(out, find_resume_point(out), notes)
