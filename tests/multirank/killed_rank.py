"""Test-only: ``python -m dimuon.cli`` under torchrun, but on torchrun's first attempt rank 1 dies as a node does.

``torchrun ... tests/multirank/killed_rank.py STEP train FLAGS...`` runs ``dimuon train FLAGS...``; while
``TORCHELASTIC_RESTART_COUNT`` is 0, rank 1 sends itself SIGKILL as it begins optimizer step ``STEP`` (counted
from 1, as checkpoints are), between two checkpoints; its peer then fails in the step's collectives or is stopped
by the agent. The attempts torchrun restarts run untouched. Used by ``tests/multirank/test_train_restart.py``;
dimuon itself has no such hook.
"""

from __future__ import annotations

import os
import signal
import sys

from dimuon import cli
from dimuon.train.loop import Trainer


def main(argv: list[str]) -> int:
    kill_step, command = int(argv[0]), argv[1:]
    train_step = Trainer.train_step

    def step_or_die(self: Trainer, step: int) -> None:
        if step + 1 == kill_step and self.env.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        train_step(self, step)

    Trainer.train_step = step_or_die  # type: ignore[method-assign]
    return cli.main(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
