"""``dimuon bench quality``: generation quality and training cost of the optimizers on one DiT task.

Trains the same DiT on the same data once per (optimizer, learning rate, seed), each run a
``dimuon train`` process with in-training generation-quality evaluation (``--eval.*``), and puts
what each run reached (FD, precision/recall/density/coverage, EMA validation loss) beside what it
cost (optimizer milliseconds per step, step milliseconds, active training time). Per optimizer it
takes the learning rate with the lowest mean EMA validation loss over seeds (``--select-by fd``: final FD)
and sets it against AdamW's, and records how flat that choice is.

Runs live in ``<out>/runs/<optimizer>-lr<lr>-s<seed>/`` with their output in ``train.log``. A rerun
skips the finished runs (last step evaluated), scores with ``dimuon eval`` the ones trained to their last step
but not evaluated with these ``--eval.*`` settings, resumes the interrupted ones from their newest checkpoint,
refuses a run directory trained with other ``dimuon train`` flags than this grid's, and reports failed ones
without stopping the others. Outputs: ``<out>/results.json``,
``<out>/results.md``, ``<out>/fd_vs_lr.png`` and ``<out>/best_lr/`` (``dimuon eval --compare`` of
each optimizer's best-lr runs: FD against step and against active training time).

Run ``dimuon bench quality --help`` (or ``python -m dimuon.bench.quality --help``).
"""

from __future__ import annotations

import math
import re
import shlex
import signal
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import tyro

from dimuon.bench.quality_config import VARIANT_SEPARATOR, Config, RunSpec, base_optimizer
from dimuon.bench.quality_report import (
    BASELINE,
    SELECTION_METRICS,
    add_ratios,
    compare_best,
    eval_settings_of,
    kept_row,
    optimizer_summary,
    plot_fd_frontier,
    plot_fd_vs_lr,
    render,
    run_row,
)
from dimuon.bench.quality_runs import (
    eval_interval,
    inspect_run,
    kept_rows,
    load_record,
    run_grid,
    threads_per_run,
    train_plan,
)
from dimuon.bench.report import join_flag_values, machine_info, named_values
from dimuon.data import DATASETS
from dimuon.dit import DIT_MODELS
from dimuon.io import unwritable_reason, write_json_atomic, write_text_atomic
from dimuon.log import configure, run_command
from dimuon.metrics.eval_settings import check_eval_settings
from dimuon.optim import OPTIMIZERS

# ``dimuon train`` flags the benchmark sets itself, each with the flag of this command that controls it.
MANAGED_FLAGS: dict[str, str] = {
    "--out": "--out",
    "--resume": "nothing (a rerun resumes interrupted runs by itself)",
    "--overwrite": "nothing (delete the run directory to start it afresh)",
    "--optimizer": "--optimizers",
    "--lr": "--lrs or --lr-grid",
    "--seed": "--seeds",
    "--model": "--model",
    "--dataset": "--dataset",
    "--steps": "--steps",
    "--batch-size": "--batch-size",
    "--threads": "--threads",
    "--progress": "nothing (runs write logs, not progress bars)",
    "--no-progress": "nothing (runs write logs, not progress bars)",
}


class FlagError(ValueError):
    """A flag value that cannot work; the message names the flag and what is allowed."""


# --------------------------------------------------------------------------------------------------
# The grid
# --------------------------------------------------------------------------------------------------


def _named_values(items: Sequence[str], flag: str, names: Sequence[str], form: str) -> dict[str, str]:
    """:func:`~dimuon.bench.report.named_values`, its mistakes raised as :class:`FlagError`."""
    try:
        return named_values(items, flag, names, form)
    except ValueError as exc:
        raise FlagError(str(exc)) from None


def _learning_rate(flag: str, text: str | float) -> float:
    """A positive, finite learning rate from ``text``, or an error naming ``flag``."""
    try:
        lr = float(text)
    except ValueError:
        raise FlagError(f"{flag}: {text!r} is not a number") from None
    if not (math.isfinite(lr) and lr > 0):
        raise FlagError(f"{flag}: learning rates must be positive numbers, got {text}")
    return lr


def parse_lr_grid(items: Sequence[str], optimizers: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """``--lr-grid adamw=1e-3,3e-3`` -> ``{"adamw": (1e-3, 3e-3)}`` (only optimizers being trained)."""
    grid = _named_values(items, "--lr-grid", optimizers, "NAME=LR[,LR...]")
    return {name: tuple(_learning_rate("--lr-grid", v) for v in value.split(",")) for name, value in grid.items()}


def lr_grid(cfg: Config) -> dict[str, tuple[float, ...]]:
    """Learning rates of every optimizer: its --lr-grid entry where given, else --lrs."""
    overrides = parse_lr_grid(cfg.lr_grid, cfg.optimizers)
    return {name: overrides.get(name, tuple(cfg.lrs)) for name in cfg.optimizers}


def expand_grid(cfg: Config) -> list[RunSpec]:
    """Every (optimizer, lr, seed), seed by seed and lr position by lr position, so that the optimizers
    compared with each other run close together in time (under similar machine load)."""
    lrs = lr_grid(cfg)
    specs = [
        RunSpec(name, lrs[name][i], seed)
        for seed in cfg.seeds
        for i in range(max(len(v) for v in lrs.values()))
        for name in cfg.optimizers
        if i < len(lrs[name])
    ]
    names = [s.name for s in specs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise FlagError(f"the grid holds the same run more than once: {repeated} (repeated learning rate or seed?)")
    return specs


def split_train_args(text: str, flag: str) -> list[str]:
    """Shell-split extra ``dimuon train`` flags, refusing the ones the benchmark sets itself."""
    try:
        tokens = shlex.split(text)
    except ValueError as exc:
        raise FlagError(f"{flag}: {exc}") from None
    for token in tokens:
        name = token.split("=", 1)[0]
        if name.startswith("--eval."):
            raise FlagError(f"{flag}: {name} is forwarded from this command's own {name}; set it there")
        if name in MANAGED_FLAGS:
            raise FlagError(f"{flag}: {name} is set by the benchmark; use {MANAGED_FLAGS[name]}")
    return tokens


def train_args_of(cfg: Config) -> dict[str, list[str]]:
    """Extra ``dimuon train`` flags per optimizer: --train-args, then that optimizer's --train-args-of."""
    common = split_train_args(cfg.train_args, "--train-args")
    per = _named_values(cfg.train_args_of, "--train-args-of", cfg.optimizers, "NAME=FLAGS")
    return {name: common + split_train_args(per.get(name, ""), "--train-args-of") for name in cfg.optimizers}


_LABEL = re.compile(r"[A-Za-z0-9_.=+]+")


def _check_optimizers(entries: Sequence[str]) -> None:
    """--optimizers: distinct entries, each an optimizer name or NAME/LABEL with a label fit for a directory name."""
    allowed = list(OPTIMIZERS)
    bad = [
        e
        for e in entries
        if base_optimizer(e) not in allowed
        or (VARIANT_SEPARATOR in e and not _LABEL.fullmatch(e.split(VARIANT_SEPARATOR, 1)[1]))
    ]
    if not entries or len(set(entries)) != len(entries) or bad:
        raise FlagError(
            f"--optimizers must name distinct values from: {', '.join(allowed)} (or NAME/LABEL, a "
            f"LABEL of letters, digits and _.=+); got {list(entries)}"
        )


def _check_choice(flag: str, value: str, allowed: Iterable[str]) -> None:
    """``value`` is one of ``allowed``."""
    if value not in allowed:
        raise FlagError(f"{flag} must be one of: {', '.join(allowed)}; got {value!r}")


def check_config(cfg: Config) -> None:
    """One clear error per bad option, naming the flag and what is allowed, before any run starts."""
    _check_optimizers(cfg.optimizers)
    _check_choice("--model", cfg.model, DIT_MODELS)
    _check_choice("--dataset", cfg.dataset, DATASETS)
    _check_choice("--select-by", cfg.select_by, SELECTION_METRICS)
    if not cfg.lrs:
        raise FlagError("--lrs must name at least one learning rate")
    for lr in cfg.lrs:
        _learning_rate("--lrs", lr)
    if not cfg.seeds or len(set(cfg.seeds)) != len(cfg.seeds) or min(cfg.seeds) < 0:
        raise FlagError(f"--seeds must be distinct integers >= 0, got {list(cfg.seeds)}")
    for flag, value in (
        ("--steps", cfg.steps),
        ("--batch-size", cfg.batch_size),
        ("--jobs", cfg.jobs),
        ("--threads", cfg.threads),
        ("--eval.interval", cfg.eval.interval),
    ):
        if value is not None and value < 1:
            raise FlagError(f"{flag} must be an integer >= 1, got {value}")
    try:
        check_eval_settings(cfg.eval, prefix="--eval.")
    except ValueError as exc:
        raise FlagError(str(exc)) from None
    for flag, path in (("--out", cfg.out), ("--eval.cache-dir", cfg.eval.cache_dir)):
        reason = None if path is None else unwritable_reason(path)
        if reason is not None:
            raise FlagError(f"{flag} {path} cannot be written: {reason}")
    if cfg.keep_rows_of is not None:
        try:
            load_record(cfg.keep_rows_of)
        except ValueError as exc:
            raise FlagError(f"--keep-rows-of: {exc}") from None
    extra = train_args_of(cfg)
    specs = expand_grid(cfg)
    for entry in cfg.optimizers:  # every run's flags, as dimuon train checks them at start-up
        try:
            train_plan(cfg, next(s for s in specs if s.optimizer == entry), extra[entry])
        except ValueError as exc:
            raise FlagError(str(exc)) from None


def notes(cfg: Config) -> list[str]:
    """Warnings about a grid that runs but may not measure what is meant (printed and kept in the report)."""
    found = []
    extra = train_args_of(cfg)
    for entry, args in extra.items():
        if base_optimizer(entry) == "muon_bp" and not any(a.split("=")[0] == "--optim.blocks" for a in args):
            found.append(
                f"{entry} trains in one process with its default --optim.blocks 1, where a block step is "
                "a full Newton-Schulz step, i.e. it takes the same steps as muon; pass --train-args-of "
                f"'{entry}=--optim.blocks 4' for the row blocks of 4 FSDP ranks"
            )
    if BASELINE not in cfg.optimizers:
        found.append(f"{BASELINE} is not among --optimizers: the x AdamW columns stay empty")
    return found


def _plain(value: Any) -> Any:
    """JSON-ready copy of a config value (paths as strings)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def run(cfg: Config, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the grid, then write ``results.json``, ``results.md`` and the plots; returns the JSON record."""
    check_config(cfg)
    for note in notes(cfg):
        print(f"dimuon bench quality: note: {note}", file=sys.stderr)
    specs = expand_grid(cfg)
    extra = train_args_of(cfg)
    kept, retrained = kept_rows(cfg, specs, extra)
    for note in retrained:
        print(f"dimuon bench quality: note: {note}", file=sys.stderr)
    todo = [s for s in specs if s.name not in kept]
    outcomes = (
        [inspect_run(cfg, s, extra[s.optimizer]) for s in todo] if cfg.report_only else run_grid(cfg, todo, extra)
    )
    made = {o.spec.name: run_row(cfg, o, extra[o.spec.optimizer]) for o in outcomes}
    rows = [kept_row(cfg, s, kept[s.name], extra[s.optimizer]) if s.name in kept else made[s.name] for s in specs]
    summary = optimizer_summary(rows, cfg.optimizers, cfg.select_by)
    compared = compare_best(cfg, summary)
    add_ratios(summary)
    outputs = [cfg.out / "results.json", cfg.out / "results.md"]
    space = next((r["feature_space"] for r in rows if r["feature_space"]), "")
    title = f"FD at step {cfg.steps} in {space}; lines: mean over seeds"
    lr_plot = plot_fd_vs_lr(rows, cfg.optimizers, cfg.out / "fd_vs_lr.png", title)
    outputs += [lr_plot] if lr_plot else []
    for cost, name, what in (
        ("opt_ms", "fd_vs_opt_ms.png", "optimizer time"),
        ("spectral_fraction", "fd_vs_spectral.png", "Newton-Schulz steps"),
    ):
        cost_plot = plot_fd_frontier(
            summary,
            rows,
            cfg.out / name,
            f"FD at step {cfg.steps} in {space} against {what}, each at its best lr",
            cost,
        )
        outputs += [cost_plot] if cost_plot else []
    outputs += [Path(p) for p in compared["outputs"]] if compared else []
    record = {
        "benchmark": "quality",
        "machine": machine_info(argv),
        "config": _plain(asdict(cfg)),
        "jobs": cfg.jobs,
        "threads_per_run": threads_per_run(cfg),
        "eval_interval": eval_interval(cfg),
        "eval_settings": eval_settings_of(rows, cfg),
        "baseline": BASELINE,
        "notes": notes(cfg),
        "target_fd": compared["target_fd"] if compared else None,
        "optimizers": summary,
        "runs": rows,
        "outputs": [str(p) for p in outputs],
    }
    write_json_atomic(cfg.out / "results.json", record)
    write_text_atomic(cfg.out / "results.md", render(record, markdown=True) + "\n")
    return record


def parse(argv: Sequence[str]) -> Config:
    """The flags parsed (``--train-args '--flag value'`` taken as one value), nothing run: SystemExit(2) for a
    flag the parser refuses. :func:`check_config` is left to :func:`run` (it looks at --out, --keep-rows-of
    and the evaluation's files on disk)."""
    return tyro.cli(Config, args=join_flag_values(argv), prog="dimuon bench quality")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dimuon bench quality``; 0 when every run finished, 1 when some failed (or an output could
    not be written), 2 on bad flags, 130 when interrupted (Ctrl-C or SIGTERM: no further run starts, the running
    ones save a checkpoint and stop; a second interrupt kills them)."""
    args = join_flag_values(sys.argv[1:] if argv is None else argv)
    cfg = parse(args)
    configure("dimuon bench quality")

    def body() -> int:
        record = run(cfg, args)
        print(render(record) + "\n\nwrote " + ", ".join(record["outputs"]))
        return 0 if all(r["status"] == "ok" for r in record["runs"]) else 1

    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # a scheduler's stop is a Ctrl-C
    try:
        return run_command(
            "dimuon bench quality",
            body,
            usage=(FlagError,),
            interrupted="the same command continues "
            "(finished runs are skipped, interrupted ones resume from their newest checkpoint)",
        )
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
