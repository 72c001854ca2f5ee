"""A stop asked for by a signal: the run saves a checkpoint at its next logging step and exits.

SIGTERM (a scheduler's preemption notice, ``kill``), SIGUSR1 (e.g. SLURM's ``--signal=USR1@120``) and SIGINT
(Ctrl-C) ask for the stop; the run finishes its current step and hooks, and at the next logging step saves a
checkpoint (unless that step just saved one) and raises :class:`RunStopped`. A second Ctrl-C acts at once (the
default handler is put back at the first); SIGTERM and SIGUSR1 asked again change nothing.

The ranks agree at logging steps, where the harness reads the device anyway: one 4-byte all-reduce of "the
signal any rank received", so a signal that reaches a single rank stops them all at the same step, and no rank
waits in a collective the others left.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

from dimuon.train.distributed import DistEnv

__all__ = ["STOP_SIGNALS", "RunStopped", "SignalStop"]

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class RunStopped(Exception):
    """The run stopped on request after saving a checkpoint; ``status`` is 128 + the signal's number. The message
    and hint are empty on ranks other than 0 (one report, not one per rank)."""

    def __init__(self, message: str, signum: int, hint: str = "") -> None:
        super().__init__(message)
        self.signum = signum
        self.hint = hint

    @property
    def status(self) -> int:
        return 128 + self.signum


class SignalStop:
    """Signal handlers that record a stop request while a run trains (a context manager).

    Installed only in the main thread of the process (Python delivers signals there); elsewhere, e.g. a run
    started from a worker thread, the signals keep their handlers and :meth:`agreed` sees only other ranks'. A
    signal the process ignores stays ignored (a shell starts background jobs with SIGINT ignored: stop those with
    SIGTERM).
    """

    def __init__(self, announce: bool = True) -> None:
        self.received = 0  # the first signal's number; 0: none yet
        self.announce = announce  # say so on stderr when a signal arrives (rank 0 only: one line, not W)
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalStop:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored on purpose (a background job's SIGINT)
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received:  # Ctrl-C twice: at once
            raise KeyboardInterrupt
        if not self.received:
            self.received = signum
            if not self.announce:
                return
            name = signal.Signals(signum).name
            again = "; Ctrl-C again stops it at once" if signum == signal.SIGINT else ""
            # os.write: print() is not safe inside a signal handler (the interrupted code may hold the stream).
            note = f"dimuon train: {name}: saving a checkpoint at the next logging step, then stopping{again}"
            os.write(2, f"\n{note}\n".encode())

    def agreed(self, env: DistEnv) -> int:
        """The signal to stop for, the same on every rank (any rank's request counts); 0: go on.

        Every rank calls it at the same steps: under a process group it is a collective.
        """
        if not env.distributed:
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int32, device=env.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
