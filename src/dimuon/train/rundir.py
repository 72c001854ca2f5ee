"""The run directory of ``dimuon train``: refuse to mix two runs, never touch a user's files, and make it
consistent with the starting step.

A directory is a run when it holds dimuon's marker (:attr:`dimuon.io.RunLayout.marker`), written when the
run is created. Starting afresh in a run (``--overwrite``) deletes dimuon's own files there and nothing
else (:meth:`dimuon.io.RunLayout.clear`); a directory without the marker is not a run, and dimuon neither
writes into nor deletes the entries of a run it finds there. Continuing in place drops what was logged
after the checkpoint (a killed run may have written some) and sets later checkpoints aside until the run
replaces them; forking from another run's checkpoint starts with that run's log up to it. One process at a time
trains a run directory (:class:`RunLock`).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from types import TracebackType
from typing import Any

from dimuon.dit.checkpoint import list_checkpoints
from dimuon.io import (
    JsonlLog,
    RunLayout,
    free_bytes,
    lock_file,
    read_jsonl,
    remove_steps_after,
    truncate_jsonl,
    unlock_file,
    unwritable_reason,
    write_json_atomic,
)
from dimuon.log import get_logger
from dimuon.metrics.results import truncate_results
from dimuon.metrics.series import timestamp
from dimuon.train.checkpoint import set_aside_checkpoints_after
from dimuon.train.config import ConfigError
from dimuon.train.resume import ResumePoint

__all__ = [
    "RunLock",
    "check_free_space",
    "check_run_dir",
    "check_same_start",
    "continues_in_place",
    "describe_entries",
    "prepare_run_dir",
    "start_of",
]

log = get_logger(__name__)

MIB = 1 << 20


def continues_in_place(layout: RunLayout, resume: ResumePoint | None) -> bool:
    """Whether the run resumes a run in its own ``--out``."""
    return resume is not None and resume.run is not None and resume.run.resolve() == layout.root.resolve()


def start_of(resume: ResumePoint | None) -> str | None:
    """What a rank starts from, as the ranks compare it: the checkpoint, the run restarted from step 0, or None
    (a new run)."""
    return None if resume is None else str(resume.checkpoint or resume.run)


def check_same_start(starts: list[str | None]) -> None:
    """Refuse to start when the ranks (``starts``: :func:`start_of` of each, in rank order) found different things
    to continue, so that no rank loads another checkpoint than its peers: the nodes see different files in
    ``--out`` (not one shared file system, or one that shows a node an old listing)."""
    if len(set(starts)) > 1:
        ranks: dict[str | None, list[int]] = {}
        for rank, start in enumerate(starts):
            ranks.setdefault(start, []).append(rank)
        found = "; ".join(
            f"{start or 'a new run'} on rank {r[0]}" + (f" and {len(r) - 1} more" if len(r) > 1 else "")
            for start, r in ranks.items()
        )
        raise ConfigError(
            f"the ranks found different things to start from in --out ({found}): every node must see the same "
            "files there (one shared file system); rerun once they do"
        )


def describe_entries(paths: list[Path], root: Path, shown: int = 5) -> str:
    """``eval/ (2 files: eval/run_eval.py, ...), notes.txt``: what a directory holds, for messages."""
    parts = []
    for path in paths[:shown]:
        if path.is_dir():
            files = sorted(str(p.relative_to(root)) for p in path.rglob("*") if not p.is_dir())
            listed = ", ".join(files[:2]) + (", ..." if len(files) > 2 else "")
            parts.append(
                f"{path.name}/ ({len(files)} file{'s' if len(files) != 1 else ''}" + (f": {listed})" if files else ")")
            )
        else:
            parts.append(path.name)
    return ", ".join(parts) + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


def _run_summary(layout: RunLayout) -> str:
    found = list_checkpoints(layout.root)
    if not found:
        return "it has no checkpoint yet, so --resume restarts it from step 0 with its config"
    return f"its newest checkpoint is step {found[-1][0]}"


def check_run_dir(layout: RunLayout, resume: ResumePoint | None, overwrite: bool) -> None:
    """Refuse an ``--out`` that cannot be written, a user's directory, or another run unless asked to
    replace it (before any expensive work; nothing is written)."""
    run_dir = layout.root
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--out {run_dir} exists and is not a directory")
    reason = unwritable_reason(run_dir)
    if reason is not None:
        raise ConfigError(f"--out {run_dir} cannot be written: {reason}")
    if continues_in_place(layout, resume):
        if overwrite:
            raise ConfigError(
                f"--overwrite cannot go with --resume of {run_dir}'s own checkpoint: the resume continues the run "
                "that --overwrite would delete; pass one of them"
            )
        return
    if layout.is_run():
        if not overwrite:
            raise ConfigError(
                f"--out {run_dir} already holds a run ({_run_summary(layout)}); pass --resume {run_dir} to "
                "continue it, --overwrite to replace it (only the files dimuon wrote are deleted), or another --out"
            )
        return
    taken = [p for p in layout.entries() if p.exists()]
    if taken:
        raise ConfigError(
            f"--out {run_dir} is not a dimuon run (it has no {layout.MARKER}) but holds "
            f"{describe_entries(taken, run_dir)} where a run writes its files; dimuon neither writes into nor "
            "deletes them: choose another --out, or move them away"
        )


def check_free_space(layout: RunLayout, checkpoint_bytes: int) -> None:
    """Refuse to start when the file system of ``--out`` cannot take one more checkpoint, with margin."""
    needed = checkpoint_bytes + checkpoint_bytes // 4 + 16 * MIB
    free = free_bytes(layout.root)
    if free < needed:
        raise ConfigError(
            f"--out {layout.root}: {free / MIB:.0f} MiB free on its file system, but one checkpoint of this run "
            f"takes about {checkpoint_bytes / MIB:.0f} MiB (model, EMA and optimizer state) and a run needs "
            f"{needed / MIB:.0f} MiB with margin; free some space or choose another --out"
        )


def prepare_run_dir(
    layout: RunLayout, config: dict[str, Any], resume: ResumePoint | None, start: int, overwrite: bool
) -> None:
    """Make the run directory consistent with step ``start`` and write ``config.json`` (rank 0 only, holding the
    run's lock: ``--out`` is checked again here, since another launch may have made a run in it meanwhile)."""
    check_run_dir(layout, resume, overwrite)
    if continues_in_place(layout, resume):
        # The later checkpoints first: a resume cut short after this still picks this step, not a later one
        # whose log records would be gone.
        set_aside = set_aside_checkpoints_after(layout.root, start)
        dropped = truncate_jsonl(layout.metrics, start) + truncate_results(layout.root, start)
        remove_steps_after(layout.samples, start)
        if dropped or set_aside:
            log.info(
                "resuming at step %d: dropped %d log records written after it%s",
                start,
                dropped,
                f"; set aside the later checkpoint(s) {', '.join(p.name for p in set_aside)} until the run "
                "replaces them"
                if set_aside
                else "",
            )
    else:
        if layout.is_run():  # --overwrite (check_run_dir refused it otherwise)
            removed = layout.clear()
            log.info("--overwrite: deleted the %d files of the run in %s", len(removed), layout.root)
        layout.root.mkdir(parents=True, exist_ok=True)
        layout.mark("dimuon train")  # first: from now on the directory is a run
        if resume is not None and resume.run is not None:
            # A run forked from another run's checkpoint starts with that run's history up to it.
            history = [r for r in read_jsonl(RunLayout(resume.run).metrics) if int(r.get("step", 0)) <= start]
            fork_log = JsonlLog(layout.metrics)
            for rec in history:
                fork_log.write(rec)
            fork_log.close()
    if not layout.is_run():  # a run made before runs were marked, continued in place
        layout.mark("dimuon train")
    layout.samples.mkdir(parents=True, exist_ok=True)
    layout.checkpoints.mkdir(parents=True, exist_ok=True)
    write_json_atomic(layout.config, config)


class RunLock:
    """An exclusive lock on a run directory for as long as one process trains it (rank 0 holds it).

    Two trainings of one directory (the same command launched twice, a resubmitted job while the first still
    runs) would interleave their checkpoints and logs; the second is refused at start-up instead, naming the
    first. The lock is ``flock`` on :attr:`dimuon.io.RunLayout.lock`, which the kernel drops when the process
    ends however it ends, so a killed run never leaves a stale lock (the file stays; it is dimuon's and is never
    deleted, not even by ``--overwrite``). A file system without locks (some network or FUSE mounts) is trained
    without one, with a warning (:func:`dimuon.io.lock_file`). A context manager: the lock is released at exit.
    """

    def __init__(self, layout: RunLayout) -> None:
        self.layout = layout
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock if the directory exists and it is not held yet; :class:`ConfigError` naming the holder
        when another process holds it."""
        if self._fd is not None or not self.layout.root.is_dir():
            return
        path = self.layout.lock
        try:
            fd = lock_file(path, wait=False)
        except BlockingIOError:
            raise ConfigError(
                f"--out {self.layout.root} is being trained by another process ({_holder(path)}); wait for it to "
                "end, stop it (SIGTERM saves a checkpoint first), or choose another --out"
            ) from None
        if fd is None:  # no locks on this file system
            return
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": timestamp()}
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(holder) + "\n").encode())
        self._fd = fd

    def release(self) -> None:
        unlock_file(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def _holder(path: Path) -> str:
    """Who holds the lock, as its file says (``pid 1234 on host-a since ...``)."""
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
        return f"pid {holder['pid']} on {holder['host']} since {holder['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its process is not recorded"
