"""Diagnostics through ``logging``, rank-aware: one line per event, not one per process.

Modules take their logger from :func:`get_logger`. Under several processes a record is emitted on
rank 0 only, unless it is logged with ``extra=ALL_RANKS``; then every rank emits it and the line
carries its rank. The command entry points call :func:`configure` once, which prints INFO and above
to stderr as ``<command>: [rank r] message``; used as a library, dimuon leaves the logging setup to
the application (Python's default shows warnings and errors). User-facing progress (the start and
end lines of a run, progress bars, tables) is printed, not logged.

Layering: low level, like ``dimuon.io``; it imports nothing else of dimuon.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

__all__ = ["ALL_RANKS", "configure", "get_logger", "run_command"]

ALL_RANKS = {"all_ranks": True}  # extra= of a record every rank should emit
_HANDLER_NAME = "dimuon-command"


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: from the process group, else from torchrun's environment."""
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.get_rank(), torch_dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class RankFilter(logging.Filter):
    """Pass rank 0's records, and every rank's records marked ``all_ranks``; set ``record.rank_prefix``."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank, world = _rank_and_world()
        every_rank = bool(getattr(record, "all_ranks", False))
        if rank != 0 and not every_rank:
            return False
        record.rank_prefix = f"[rank {rank}] " if world > 1 and every_rank else ""
        return True


class _StderrHandler(logging.StreamHandler):
    """A stream handler that writes to the current ``sys.stderr`` (which tests and tools may swap)."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def get_logger(name: str) -> logging.Logger:
    """The logger of a dimuon module (``__name__``), with the rank filter attached once."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RankFilter) for f in logger.filters):
        logger.addFilter(RankFilter())
    return logger


def configure(prog: str, level: int = logging.INFO) -> None:
    """Print dimuon's records at ``level`` and above to stderr as ``<prog>: [rank r] message`` (idempotent)."""
    root = logging.getLogger("dimuon")
    for handler in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(handler)
    handler = _StderrHandler()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter(f"{prog}: %(rank_prefix)s%(message)s", defaults={"rank_prefix": ""}))
    root.addHandler(handler)
    root.setLevel(level)


def run_command(
    prog: str,
    body: Callable[[], int],
    *,
    usage: tuple[type[BaseException], ...] = (),
    failures: tuple[type[BaseException], ...] = (),
    stops: tuple[type[BaseException], ...] = (),
    interrupted: str = "",
) -> int:
    """``body()``'s exit status, or one ``<prog>: error: ...`` line on stderr and the status of what went wrong.

    2: a ``usage`` error (a bad flag, input or checkpoint, found before any work); 1: one of ``failures``
    (the command stopped before doing all it was asked to; an exception's ``hint`` is printed on a second
    line) or an ``OSError`` (an output that could not be written); 130: interrupted, with ``interrupted``
    saying how to go on. One of ``stops`` (a stop on request, with its state saved): its message and ``hint`` lines
    (where not empty), and its ``status``.
    """
    try:
        return body()
    except usage as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except stops as e:
        if str(e):
            print(f"{prog}: {e}", file=sys.stderr)
        if getattr(e, "hint", ""):
            print(f"{prog}: {e.hint}", file=sys.stderr)
        return int(getattr(e, "status", 1))
    except (*failures, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        if getattr(e, "hint", ""):
            print(f"{prog}: {e.hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted" + (f"; {interrupted}" if interrupted else ""), file=sys.stderr)
        return 130
