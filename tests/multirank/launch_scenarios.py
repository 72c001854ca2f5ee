"""Rank functions for the launcher's own tests (importable by spawned ranks)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def hang_after_writing_pid(rank: int, world: int, where: str) -> None:
    """Write this rank's pid to ``where/rank{rank}.pid``, then hang (as a rank stuck in a collective would)."""
    (Path(where) / f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(120)


def what_a_rank_sees(rank: int, world: int) -> tuple[dict[str, str], str]:
    """This rank's environment and working directory."""
    return dict(os.environ), os.getcwd()


LOCKS: list = []


def make_a_lock(rank: int, world: int) -> int:
    """A multiprocessing lock made in the rank and kept (a named semaphore, as a progress bar's lock is): registered
    with the resource tracker until the rank's exit releases it."""
    import multiprocessing

    LOCKS.append(multiprocessing.get_context("spawn").Lock())
    return rank
