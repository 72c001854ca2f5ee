"""Rank-aware diagnostics: rank 0 speaks for all unless a record is meant for every rank, which then names its rank."""

from __future__ import annotations

import logging

import pytest

from dimuon.log import ALL_RANKS, configure, get_logger


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
