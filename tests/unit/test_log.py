"""Rank-aware diagnostics: rank 0 speaks for all unless a record is meant for every rank, which then names its rank."""

from __future__ import annotations

import logging

import pytest

from dimuon.log import ALL_RANKS, configure, get_logger, run_command


@pytest.fixture
def command_logging():
    """``configure`` as a command does it, undone afterwards."""
    root = logging.getLogger("dimuon")
    handlers, level = list(root.handlers), root.level
    configure("dimuon test")
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_rank_zero_speaks_and_other_ranks_only_when_asked(monkeypatch, capsys, command_logging) -> None:
    log = get_logger("dimuon.test_log")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    log.info("one line for the run")
    log.warning("every rank says this", extra=ALL_RANKS)
    monkeypatch.setenv("RANK", "1")
    log.info("rank 1 keeps quiet")
    log.warning("every rank says this", extra=ALL_RANKS)
    assert capsys.readouterr().err.splitlines() == [
        "dimuon test: one line for the run",
        "dimuon test: [rank 0] every rank says this",
        "dimuon test: [rank 1] every rank says this",
    ]


def test_one_process_has_no_rank_prefix_and_configure_is_idempotent(monkeypatch, capsys, command_logging) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    configure("dimuon test")  # a second call replaces the handler instead of adding one
    get_logger("dimuon.test_log").warning("careful", extra=ALL_RANKS)
    get_logger("dimuon.test_log").debug("not at the default level")
    assert capsys.readouterr().err == "dimuon test: careful\n"


def test_run_command_turns_what_a_user_can_act_on_into_one_error_line(capsys) -> None:

    class Stopped(RuntimeError):
        hint = "resume it with --resume"

    def raising(exc: BaseException):
        def body() -> int:
            raise exc

        return body

    assert run_command("cmd", lambda: 0) == 0
    cases = [
        (ValueError("--x must be > 0"), 2, "cmd: error: --x must be > 0\n"),
        (Stopped("step 3 diverged"), 1, "cmd: error: step 3 diverged\ncmd: resume it with --resume\n"),
        (OSError(28, "No space left on device"), 1, "cmd: error: [Errno 28] No space left on device\n"),
        (KeyboardInterrupt(), 130, "cmd: interrupted; rerun it\n"),
    ]
    for exc, status, err in cases:
        assert (
            run_command("cmd", raising(exc), usage=(ValueError,), failures=(Stopped,), interrupted="rerun it") == status
        )
        assert capsys.readouterr().err == err
    with pytest.raises(TypeError):  # anything else is a bug: its traceback is kept
        run_command("cmd", raising(TypeError("bug")), usage=(ValueError,))
