"""Fixtures shared by the test packages."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import pytest
import torch

# Set by ``dimuon bench gpu`` for its tests part: a per-test time limit (a test past it fails, the others still
# run) and a line per finished test appended to a file, so that an overrun of the whole part keeps its results.
TEST_TIMEOUT_ENV = "DIMUON_TEST_TIMEOUT_S"
TEST_LOG_ENV = "DIMUON_TEST_LOG"


@pytest.fixture(autouse=True)
def per_test_time_limit() -> Iterator[None]:
    """Fail the running test with a TimeoutError once ``$DIMUON_TEST_TIMEOUT_S`` seconds pass (off without it)."""
    limit = float(os.environ.get(TEST_TIMEOUT_ENV) or 0)
    if limit <= 0 or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"the test ran past its {limit:g} s limit (${TEST_TIMEOUT_ENV})")

    before = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


@pytest.fixture(autouse=True, scope="session")
def ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in the tests' process however it was started: a shell without job control
    starts a background job with SIGINT ignored, which the run would keep (dimuon leaves an ignored signal ignored)
    and the stop tests would then see no Ctrl-C at all. Put back after the session."""
    before = signal.getsignal(signal.SIGINT)
    if before is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if before is signal.SIG_IGN:
        signal.signal(signal.SIGINT, before)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``$DIMUON_TEST_LOG``: one JSON line per test outcome (its call, or a setup that failed or skipped)."""
    path = os.environ.get(TEST_LOG_ENV)
    if not path or not (report.when == "call" or (report.when == "setup" and report.outcome != "passed")):
        return
    outcome = "error" if report.when == "setup" and report.failed else report.outcome
    with open(path, "a", encoding="utf-8") as log:
        log.write(json.dumps({"test": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 3)}) + "\n")


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny models (far faster than two on shared cores), restored after.

    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``; being module-scoped it is
    set before the module's own module-scoped fixtures (trained runs) are built.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
