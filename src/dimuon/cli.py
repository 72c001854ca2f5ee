"""``dimuon train | sample | eval | groups | bench <name>``: one entry point, one typed config per command.

Each command lives in its own module and parses its own flags (its ``parse``, which its ``main`` calls); this
file only dispatches, so ``dimuon bench optimizer --help`` and ``python -m dimuon.bench.optimizer --help`` are
the same. :func:`parse` returns a command line's checked config without running it (the docs' commands are
checked with it). It is the top layer and imports no command until one is asked for (the one place that loads
modules by name).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

import dimuon

COMMANDS: dict[str, str] = {
    "train": "dimuon.train.run",
    "sample": "dimuon.train.sample",
    "eval": "dimuon.eval.run",
    "groups": "dimuon.groups",
    "plan": "dimuon.plan.command",
}
BENCHMARKS: dict[str, str] = {
    "optimizer": "dimuon.bench.optimizer",
    "comm": "dimuon.bench.comm",
    "quality": "dimuon.bench.quality",
    "gpu": "dimuon.bench.gpu",
    "step": "dimuon.bench.step",
    "census": "dimuon.bench.census",
    "traffic": "dimuon.bench.traffic",
    "host": "dimuon.bench.host",
}

USAGE = """usage: dimuon <command> [options]
       dimuon --version

commands:
  train              train a DiT (single process, or under torchrun with FSDP2)
  sample             sample images from a checkpoint
  eval               generation quality (FD, precision/recall/density/coverage) over a run's checkpoints
  groups             which parameters of a model go to Muon and which to AdamW, and why
  plan               predict a training step on a GPU cluster for every optimizer (a model, from the census)
  bench optimizer    optimizer step time on DiT parameter shapes
  bench comm         logical communication and step time of the optimizers on 4 gloo ranks
  bench quality      generation quality and training cost of the optimizers over an lr x seed grid
  bench step         training-step time per optimizer (forward/backward vs optimizer), one process and FSDP2
  bench census       what one optimizer step costs at 4-256 ranks: collectives, host reads, ops, NS FLOPs per rank
  bench traffic      bytes one memory-bound step moves (RowNorm eager and fused, fused AdamW), counted per op
  bench host         Python calls and host time per optimizer step on tiny matrices, eager and compiled
  bench gpu          the GPU check: CUDA tests, optimizer bench on DiT-XL/2 shapes, a bf16 training run

'dimuon <command> --help' lists each command's options; 'dimuon --version' (-V) prints the version."""


def route(argv: Sequence[str]) -> tuple[str, str, list[str]]:
    """``(prog, module, the command's own flags)`` of a command line (``["bench", "step", "--worlds", "1"]``).

    SystemExit(0) after printing the usage (no command, ``-h``, ``--help``, ``bench --help``) or the version
    (``-V``, ``--version``); SystemExit(2) after printing why for an unknown command or benchmark.
    """
    args = list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0)
    if args[0] in ("-V", "--version"):
        print(f"dimuon {dimuon.__version__}")
        raise SystemExit(0)
    command, rest = args[0], args[1:]
    if command == "bench":
        if rest and rest[0] in ("-h", "--help"):
            print(USAGE)
            raise SystemExit(0)
        if not rest or rest[0] not in BENCHMARKS:
            got = repr(rest[0]) if rest else "nothing"
            print(f"dimuon bench: expected one of {sorted(BENCHMARKS)}, got {got}\n\n{USAGE}", file=sys.stderr)
            raise SystemExit(2)
        return f"dimuon bench {rest[0]}", BENCHMARKS[rest[0]], rest[1:]
    if command in COMMANDS:
        return f"dimuon {command}", COMMANDS[command], rest
    print(f"dimuon: unknown command {command!r}; expected one of {[*COMMANDS, 'bench']}\n\n{USAGE}", file=sys.stderr)
    raise SystemExit(2)


def parse(argv: Sequence[str], *, saved_defaults: bool = True) -> object:
    """The checked config of a ``dimuon`` command line (``["train", "--lr", "1e-3"]``), without running it.

    Nothing is built, written or launched: the command module's ``parse`` reads the flags and runs those of its
    start-up checks that write nothing and need no input files. SystemExit(2) after the message on stderr for a
    flag the parser refuses or a value a check refuses (as ``dimuon <command>`` exits); SystemExit(0) after
    printing the help, usage or version. ``saved_defaults=False``: ``dimuon train --resume RUN`` takes its
    defaults from the flags' own instead of RUN's saved config, so a command naming a run that is not here is
    checked for its flags alone.
    """
    prog, module, rest = route(argv)
    command = importlib.import_module(module)
    options = {} if saved_defaults or module != COMMANDS["train"] else {"saved_defaults": False}
    try:
        return command.parse(rest, **options)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


# The status of a program ended by SIGPIPE (128 + 13), as a shell reports ``dimuon plan | head``'s first command.
READER_GONE_STATUS = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dimuon``: run the command ``argv`` names; its exit status (0 after the usage or version,
    2 for an unknown command, 141 when the reader of its output left early, as ``| head`` does)."""
    try:
        try:
            return run(sys.argv[1:] if argv is None else argv)
        finally:
            sys.stdout.flush()  # here, not at exit, so that a reader gone is seen below
    except BrokenPipeError:
        # Quietly, as a program SIGPIPE ends: no traceback, and nothing left for the interpreter's last flush.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return READER_GONE_STATUS


def run(argv: Sequence[str]) -> int:
    """Run the command ``argv`` names and return its exit status."""
    try:
        _, module, rest = route(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    result = int(importlib.import_module(module).main(rest) or 0)
    leave_if_distributed(result)
    return result


def leave_if_distributed(code: int) -> None:
    """In a rank under torchrun, or a process that joined a process group, end it now with ``code``.

    torch 2.13 with gloo can abort at interpreter exit once a process group or device mesh exists (SIGABRT,
    "terminate called without an active exception"), with or without ``destroy_process_group``; torchrun then
    reports a finished run as failed and stops the other ranks. The command's work is done and its files are
    closed, so the rank flushes its output and leaves without the interpreter's teardown. A command may have
    destroyed its group already (``dimuon train`` does, as a library call should): the abort can come anyway.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return
    if not (dist.is_initialized() or dist.is_torchelastic_launched()):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
