"""The gloo launcher: a time limit or an interrupt of the launching process leaves no rank behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from dimuon.bench.launch import run_gloo

from . import launch_scenarios as ls

pytestmark = pytest.mark.multirank


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_an_exception_in_the_launcher_kills_the_ranks(tmp_path: Path) -> None:
    def expired(signum: int, frame: object) -> None:
        raise TimeoutError("the launcher's time limit")

    before = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, 8.0)
    try:
        with pytest.raises(TimeoutError, match="the launcher's time limit"):
            run_gloo(ls.hang_after_writing_pid, 2, str(tmp_path), timeout_s=300)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]
    time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)  # killed and reaped, not left holding a GPU for 300 s
