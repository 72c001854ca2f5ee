"""The gloo launcher: ranks see the launching process as it is when they start, release their semaphores before they
leave, and a time limit or an interrupt of the launching process leaves no rank behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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


def test_ranks_see_the_launching_process_s_environment_and_directory_as_they_are_now(tmp_path, monkeypatch) -> None:
    """Ranks fork from a server started at the first launch: a variable set or removed and a directory changed since
    reach them all the same (the variables the launcher sets for the process group aside)."""
    run_gloo(ls.what_a_rank_sees, 1)  # the server is up before the changes below
    monkeypatch.setenv("DIMUON_LAUNCH_CHECK", "set after the first launch")
    monkeypatch.delenv("PYTEST_CURRENT_TEST")  # set (by pytest) when the server started
    monkeypatch.chdir(tmp_path)
    launcher = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"}
    for env, cwd in run_gloo(ls.what_a_rank_sees, 2):
        assert {k: v for k, v in env.items() if k not in launcher} == dict(os.environ)
        assert cwd == str(tmp_path)


def test_a_rank_releases_its_semaphores_before_it_leaves(tmp_path: Path) -> None:
    """A finished rank leaves without the interpreter's teardown: a lock it made (a named semaphore) is released
    first, so the launching process's resource tracker finds nothing leaked when that process exits."""
    script = tmp_path / "launch_two.py"
    script.write_text(
        "from dimuon.bench.launch import run_gloo\n"
        "from tests.multirank import launch_scenarios as ls\n"
        "if __name__ == '__main__':\n"
        "    print(run_gloo(ls.make_a_lock, 2))\n"
    )
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": path},
        check=False,
    )
    assert run.returncode == 0 and run.stdout.strip() == "[0, 1]", run.stderr
    assert "leaked semaphore" not in run.stderr, run.stderr
