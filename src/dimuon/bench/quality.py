"""``dimuon bench quality``: generation quality and training cost of the optimizers on one DiT task.

Trains the same DiT on the same data once per (optimizer, learning rate, seed), each run a
``dimuon train`` process with in-training generation-quality evaluation (``--eval.*``), and puts
what each run reached (FD, precision/recall/density/coverage, EMA validation loss) beside what it
cost (optimizer milliseconds per step, step milliseconds, active training time). Per optimizer it
takes the learning rate with the lowest final FD (mean over seeds) and sets it against AdamW's.

Runs live in ``<out>/runs/<optimizer>-lr<lr>-s<seed>/`` with their output in ``train.log``. A rerun
skips the finished runs (last step evaluated), resumes the interrupted ones from their newest
checkpoint and reports failed ones without stopping the others. Outputs: ``<out>/results.json``,
``<out>/results.md``, ``<out>/fd_vs_lr.png`` and ``<out>/best_lr/`` (``dimuon eval --compare`` of
each optimizer's best-lr runs: FD against step and against active training time).

Run ``dimuon bench quality --help`` (or ``python -m dimuon.bench.quality --help``).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any

import tyro
from tqdm.auto import tqdm

from dimuon.bench.report import format_markdown_table, format_table, machine_info, write_json_atomic
from dimuon.dit import DATASETS, DIT_MODELS
from dimuon.metrics import eval_run
from dimuon.metrics.eval_run import (
    describe_settings,
    load_results,
    pick_series,
    save_figure_atomic,
    write_text_atomic,
)
from dimuon.metrics.eval_settings import EvalSettings, check_eval_settings
from dimuon.optim import OPTIMIZERS
from dimuon.train.checkpoint import list_checkpoints
from dimuon.train.config import EvalOptions, TrainConfig
from dimuon.train.logger import read_jsonl

BASELINE = "adamw"
TRAIN_DEFAULTS = TrainConfig()
LOG_NAME = "train.log"
TAIL_LINES = 15

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
# What a run in each mode is reported as having been.
ACTIONS = {"new": "started", "resume": "resumed", "restart": "restarted"}


class FlagError(ValueError):
    """A flag value that cannot work; the message names the flag and what is allowed."""


@dataclass
class QualityEval(EvalOptions):
    """Generation-quality evaluation inside every run (forwarded to dimuon train as --eval.*)."""

    interval: Annotated[
        int | None,
        tyro.conf.arg(help="Steps between evaluations; the last step is always evaluated (default: --steps / 4)."),
    ] = None
    cache_dir: Annotated[
        Path | None,
        tyro.conf.arg(help="Feature cache shared by all runs, so the classifier trains once (default: <out>/feature_cache)."),
    ] = None


@dataclass
class Config:
    """Generation quality and training cost of the optimizers, side by side on one DiT task."""

    optimizers: tuple[str, ...] = tuple(OPTIMIZERS)
    """Optimizers to train, from: adamw muon periodic_row_muon muon_bp."""
    lrs: tuple[float, ...] = (TRAIN_DEFAULTS.lr,)
    """Peak learning rates tried for every optimizer without an --lr-grid entry."""
    lr_grid: tuple[str, ...] = ()
    """Per-optimizer learning rates instead of --lrs, as NAME=LR,LR,... (e.g. --lr-grid adamw=1e-3,3e-3)."""
    seeds: tuple[int, ...] = (0,)
    """Training seeds: every (optimizer, lr) is trained once per seed."""
    model: str = TRAIN_DEFAULTS.model
    """DiT registry name (as dimuon train --model)."""
    dataset: str = TRAIN_DEFAULTS.dataset
    """Data set (as dimuon train --dataset)."""
    steps: int = TRAIN_DEFAULTS.steps
    """Optimizer steps of every run."""
    batch_size: int = TRAIN_DEFAULTS.batch_size
    """Global batch size of every run."""
    eval: QualityEval = field(default_factory=QualityEval)
    train_args: str = ""
    """Further dimuon train flags for every run, one shell-quoted string (e.g. --train-args '--ema-decay 0.99')."""
    train_args_of: tuple[str, ...] = ()
    """Further dimuon train flags for one optimizer, as NAME=FLAGS (e.g. 'periodic_row_muon=--optim.k 4')."""
    jobs: int = 1
    """Training processes at a time."""
    threads: int | None = None
    """CPU threads per training process (default: torch's with --jobs 1, else cores / jobs)."""
    out: Path = Path("bench-quality")
    """Output directory: runs/, feature_cache/, results.json, results.md, plots."""
    progress: bool = True
    """Show a progress bar over the runs."""


@dataclass(frozen=True)
class RunSpec:
    """One point of the grid: an optimizer at a learning rate and a seed."""

    optimizer: str
    lr: float
    seed: int

    @property
    def name(self) -> str:
        """Directory name of the run, e.g. ``muon-lr0.01-s0``."""
        return f"{self.optimizer}-lr{self.lr:g}-s{self.seed}"


@dataclass
class Outcome:
    """What this invocation did with one run (skipped, started, resumed, restarted, refused) and how it ended."""

    spec: RunSpec
    action: str
    command: list[str] | None = None
    returncode: int | None = None
    seconds: float = 0.0
    error: str | None = None


# --------------------------------------------------------------------------------------------------
# The grid
# --------------------------------------------------------------------------------------------------


def _named_values(items: Sequence[str], flag: str, names: Sequence[str], form: str) -> dict[str, str]:
    """``("NAME=VALUE", ...)`` -> ``{NAME: VALUE}``; a mistake names the flag, its form and the allowed names."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in names or not value.strip():
            raise FlagError(f"{flag} expects {form} with NAME one of {list(names)}, got {item!r}")
        if name in out:
            raise FlagError(f"{flag} names {name} twice")
        out[name] = value
    return out


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


def eval_interval(cfg: Config) -> int:
    """Steps between evaluations: --eval.interval, or a quarter of the run."""
    return cfg.eval.interval if cfg.eval.interval is not None else max(1, cfg.steps // 4)


def threads_per_run(cfg: Config) -> int | None:
    """--threads, or with several jobs the cores shared out among them (None: torch's own choice)."""
    if cfg.threads is not None or cfg.jobs == 1:
        return cfg.threads
    return max(1, (os.cpu_count() or 1) // cfg.jobs)


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


def _check_names(flag: str, given: Sequence[str], allowed: Iterable[str]) -> None:
    """``given`` is a non-empty list of distinct members of ``allowed``."""
    allowed = list(allowed)
    if not given or len(set(given)) != len(given) or any(v not in allowed for v in given):
        raise FlagError(f"{flag} must name distinct values from: {', '.join(allowed)}; got {list(given)}")


def _check_choice(flag: str, value: str, allowed: Iterable[str]) -> None:
    """``value`` is one of ``allowed``."""
    if value not in allowed:
        raise FlagError(f"{flag} must be one of: {', '.join(allowed)}; got {value!r}")


def check_config(cfg: Config) -> None:
    """One clear error per bad option, naming the flag and what is allowed, before any run starts."""
    _check_names("--optimizers", cfg.optimizers, OPTIMIZERS)
    _check_choice("--model", cfg.model, DIT_MODELS)
    _check_choice("--dataset", cfg.dataset, DATASETS)
    if not cfg.lrs:
        raise FlagError("--lrs must name at least one learning rate")
    for lr in cfg.lrs:
        _learning_rate("--lrs", lr)
    if not cfg.seeds or len(set(cfg.seeds)) != len(cfg.seeds) or min(cfg.seeds) < 0:
        raise FlagError(f"--seeds must be distinct integers >= 0, got {list(cfg.seeds)}")
    for flag, value in (("--steps", cfg.steps), ("--batch-size", cfg.batch_size), ("--jobs", cfg.jobs),
                        ("--threads", cfg.threads), ("--eval.interval", cfg.eval.interval)):
        if value is not None and value < 1:
            raise FlagError(f"{flag} must be an integer >= 1, got {value}")
    try:
        check_eval_settings(cfg.eval, prefix="--eval.")
    except ValueError as exc:
        raise FlagError(str(exc)) from None
    train_args_of(cfg)
    expand_grid(cfg)


def notes(cfg: Config) -> list[str]:
    """Warnings about a grid that runs but may not measure what is meant (printed and kept in the report)."""
    found = []
    extra = train_args_of(cfg)
    if "muon_bp" in extra and not any(a.split("=")[0] == "--optim.blocks" for a in extra["muon_bp"]):
        found.append("muon_bp trains in one process with its default --optim.blocks 1, where a block step is a "
                     "full Newton-Schulz step, i.e. it takes the same steps as muon; pass --train-args-of "
                     "'muon_bp=--optim.blocks 4' for the row blocks of 4 FSDP ranks")
    if BASELINE not in cfg.optimizers:
        found.append(f"{BASELINE} is not among --optimizers: the x AdamW columns stay empty")
    return found


# --------------------------------------------------------------------------------------------------
# Launching runs
# --------------------------------------------------------------------------------------------------


def eval_flags(cfg: Config) -> list[str]:
    """Every evaluation setting as a ``dimuon train --eval.*`` flag, spelled out so each run records it."""
    values = {f.name: getattr(cfg.eval, f.name) for f in fields(cfg.eval)}
    values.update(interval=eval_interval(cfg), cache_dir=cfg.eval.cache_dir or cfg.out / "feature_cache")
    flags: list[str] = []
    for name, value in values.items():
        flag = "--eval." + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--eval.no-" + name.replace("_", "-"))
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def train_command(cfg: Config, spec: RunSpec, extra: Sequence[str], mode: str = "new") -> list[str]:
    """The ``dimuon train`` command of one run; ``mode`` resume continues it, restart replaces its files."""
    run_dir = cfg.out / "runs" / spec.name
    cmd = [sys.executable, "-m", "dimuon.cli", "train", "--out", str(run_dir),
           "--optimizer", spec.optimizer, "--lr", repr(spec.lr), "--seed", str(spec.seed),
           "--model", cfg.model, "--dataset", cfg.dataset, "--steps", str(cfg.steps),
           "--batch-size", str(cfg.batch_size), "--no-progress"]
    threads = threads_per_run(cfg)
    if threads is not None:
        cmd += ["--threads", str(threads)]
    cmd += [*eval_flags(cfg), *extra]
    if mode == "resume":
        cmd += ["--resume", str(run_dir)]
    elif mode == "restart":
        cmd.append("--overwrite")
    return cmd


def find_series(run_dir: Path, settings: EvalSettings) -> dict[str, Any] | None:
    """The run's evaluation series made with ``settings``, or None while it has none."""
    path = run_dir / "eval" / "results.json"
    if not path.is_file():
        return None
    try:
        return pick_series(load_results(path), settings, path)[1]
    except ValueError:
        return None


def ok_entries(series: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The successfully scored entries of a series, in step order (none without a series)."""
    return [e for e in (series or {}).get("entries", []) if e.get("status") == "ok"]


def is_finished(run_dir: Path, settings: EvalSettings, steps: int) -> bool:
    """Whether the run's last step is evaluated with ``settings``."""
    return any(e["step"] == steps for e in ok_entries(find_series(run_dir, settings)))


def run_mode(run_dir: Path, settings: EvalSettings, steps: int) -> str:
    """done (last step evaluated), resume (a complete checkpoint), restart (files, no checkpoint) or new."""
    if is_finished(run_dir, settings, steps):
        return "done"
    if list_checkpoints(run_dir):
        return "resume"
    if run_dir.is_dir() and any(p.name != LOG_NAME for p in run_dir.iterdir()):
        return "restart"
    return "new"


def foreign_run(run_dir: Path, cfg: Config, spec: RunSpec) -> str | None:
    """Why ``run_dir`` holds a run of another task, grid point or a longer schedule (not to be reused), else None."""
    path = run_dir / "config.json"
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # a torn config is rewritten by the restarted run
    want = {"model": cfg.model, "dataset": cfg.dataset, "batch_size": cfg.batch_size,
            "optimizer": spec.optimizer, "lr": spec.lr, "seed": spec.seed}
    diff = [f"{k} {saved.get(k)!r} (asked for {v!r})" for k, v in want.items() if saved.get(k) != v]
    if isinstance(saved.get("steps"), int) and saved["steps"] > cfg.steps:  # more steps continue a run; fewer cannot
        diff.append(f"steps {saved['steps']} (asked for {cfg.steps})")
    if not diff:
        return None
    return f"{run_dir} holds a run with {', '.join(diff)}; use another --out or delete that directory"


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file (empty if it does not exist)."""
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def launch(cmd: Sequence[str], log_path: Path, threads: int | None) -> int:
    """Run one command with its output appended to ``log_path`` (after a ``$ command`` line); its exit status."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        return subprocess.run(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, check=False).returncode


def execute(cfg: Config, spec: RunSpec, extra: Sequence[str]) -> Outcome:
    """Bring one run to its evaluated last step: skip it if it is there, else start, resume or restart it."""
    run_dir = cfg.out / "runs" / spec.name
    foreign = foreign_run(run_dir, cfg, spec)
    if foreign is not None:
        return Outcome(spec, "refused", error=foreign)
    mode = run_mode(run_dir, cfg.eval, cfg.steps)
    if mode == "done":
        return Outcome(spec, "skipped", returncode=0)
    cmd = train_command(cfg, spec, extra, mode)
    start = time.perf_counter()
    try:
        code = launch(cmd, run_dir / LOG_NAME, threads_per_run(cfg))
    except OSError as exc:
        return Outcome(spec, ACTIONS[mode], cmd, None, time.perf_counter() - start, f"could not start: {exc}")
    outcome = Outcome(spec, ACTIONS[mode], cmd, code, time.perf_counter() - start)
    if code != 0:
        outcome.error = f"dimuon train exited with status {code}"
    elif not is_finished(run_dir, cfg.eval, cfg.steps):
        outcome.error = f"dimuon train finished without an evaluation of step {cfg.steps} with these --eval.* settings"
    return outcome


def failure_message(cfg: Config, outcome: Outcome) -> str:
    """A failed run's error, log path and the tail of its log."""
    log = cfg.out / "runs" / outcome.spec.name / LOG_NAME
    tail = log_tail(log) if outcome.command else ""
    text = f"run {outcome.spec.name} failed: {outcome.error}"
    if tail:
        text += f"\n  last lines of {log}:\n" + "\n".join("    " + line for line in tail.splitlines())
    return text


def run_grid(cfg: Config, specs: Sequence[RunSpec]) -> list[Outcome]:
    """Execute every run, ``--jobs`` at a time, reporting failures as they happen; outcomes in grid order."""
    extra = train_args_of(cfg)
    outcomes: dict[RunSpec, Outcome] = {}
    bar = tqdm(total=len(specs), unit="run", desc="quality bench", disable=not cfg.progress)
    with ThreadPoolExecutor(max_workers=cfg.jobs) as pool:
        futures = {pool.submit(execute, cfg, s, extra[s.optimizer]): s for s in specs}
        for future in as_completed(futures):
            outcome = future.result()
            outcomes[outcome.spec] = outcome
            if outcome.error:
                tqdm.write(failure_message(cfg, outcome), file=sys.stderr)
            bar.set_postfix_str(f"{outcome.spec.name} {outcome.action}", refresh=False)
            bar.update(1)
    bar.close()
    return [outcomes[s] for s in specs]


# --------------------------------------------------------------------------------------------------
# Reading runs
# --------------------------------------------------------------------------------------------------


def latest_by_step(records: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """Records of one kind, one per step (the last written wins), in step order."""
    by_step = {r["step"]: r for r in records if r.get("kind") == kind and isinstance(r.get("step"), int)}
    return [by_step[s] for s in sorted(by_step)]


def _median(values: Iterable[Any]) -> float | None:
    nums = [float(v) for v in values if isinstance(v, (int, float))]
    return statistics.median(nums) if nums else None


def cost_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Training cost and loss from ``metrics.jsonl``: median optimizer and step ms, active time, final losses."""
    train = latest_by_step(records, "train")
    val = latest_by_step(records, "val")
    active = [r["active_time_s"] for r in records if isinstance(r.get("active_time_s"), (int, float))]
    return {
        "trained_steps": train[-1]["step"] if train else 0,
        "opt_ms": _median(r.get("opt_ms") for r in train),
        "step_ms": _median(r.get("step_ms") for r in train),
        "active_time_s": max(active) if active else None,
        "val_loss": val[-1].get("val_loss") if val else None,
        "val_loss_ema": val[-1].get("val_loss_ema") if val else None,
    }


def quality_summary(series: dict[str, Any] | None) -> dict[str, Any]:
    """Best FD (with its step) and the last evaluation's scores of a series (Nones without one)."""
    ok = ok_entries(series)
    if not ok:
        return {"evaluations": 0, "eval_step": None, "fd": None, "best_fd": None, "best_fd_step": None,
                "precision": None, "recall": None, "density": None, "coverage": None,
                "reference_fd": None, "feature_space": None}
    best, last = eval_run.summarize(ok, None), ok[-1]
    reference = series.get("reference") or {}
    return {
        "evaluations": len(ok),
        "eval_step": last["step"],
        **{m: last[m] for m in eval_run.METRICS},
        "best_fd": best["best_fd"],
        "best_fd_step": best["best_step"],
        "reference_fd": reference.get("fd"),
        "feature_space": series["settings"]["feature_space"],
    }


def run_row(cfg: Config, outcome: Outcome, extra: Sequence[str]) -> dict[str, Any]:
    """One run of the table: grid point, status, what it reached, what it cost, its commands."""
    spec = outcome.spec
    run_dir = cfg.out / "runs" / spec.name
    series = find_series(run_dir, cfg.eval) if outcome.action != "refused" else None
    quality = quality_summary(series)
    status = "ok" if quality["eval_step"] == cfg.steps and not outcome.error else "failed"
    return {
        "name": spec.name,
        "optimizer": spec.optimizer,
        "lr": spec.lr,
        "seed": spec.seed,
        "status": status,
        "action": outcome.action,
        "error": outcome.error,
        **cost_summary(read_jsonl(run_dir / "metrics.jsonl") if outcome.action != "refused" else []),
        **quality,
        "train_s": round(outcome.seconds, 2),
        "run_dir": str(run_dir),
        "log": str(run_dir / LOG_NAME),
        "command": shlex.join(train_command(cfg, spec, extra)),
        "launched": shlex.join(outcome.command) if outcome.command else None,
    }


# --------------------------------------------------------------------------------------------------
# Summarizing
# --------------------------------------------------------------------------------------------------


def _mean(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def best_lr(rows: Sequence[dict[str, Any]]) -> float | None:
    """The learning rate whose finished runs reach the lowest final FD on average over their seeds."""
    by_lr: dict[float, list[float]] = {}
    for r in rows:
        if r["status"] == "ok":
            by_lr.setdefault(r["lr"], []).append(r["fd"])
    return min(by_lr, key=lambda lr: statistics.fmean(by_lr[lr])) if by_lr else None


SUMMARY_KEYS = ("fd", "best_fd", "val_loss_ema", "opt_ms", "step_ms", "active_time_s")
RATIO_KEYS = ("fd", "opt_ms", "active_time_s", "target_active_time_s")


def optimizer_summary(rows: Sequence[dict[str, Any]], optimizers: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per optimizer, its finished runs at its best learning rate averaged over seeds."""
    summary: dict[str, dict[str, Any]] = {}
    for name in optimizers:
        mine = [r for r in rows if r["optimizer"] == name]
        lr = best_lr(mine)
        chosen = [r for r in mine if r["lr"] == lr and r["status"] == "ok"]
        fds = [r["fd"] for r in chosen]
        summary[name] = {
            "lr": lr,
            "lrs_tried": sorted({r["lr"] for r in mine}),
            "seeds": [r["seed"] for r in chosen],
            "runs": [r["name"] for r in chosen],
            **{key: _mean(chosen, key) for key in SUMMARY_KEYS},
            "fd_min": min(fds) if fds else None,
            "fd_max": max(fds) if fds else None,
        }
    return summary


def add_ratios(summary: dict[str, dict[str, Any]], baseline: str = BASELINE) -> None:
    """``<key>_ratio`` of every optimizer against the baseline's best-lr numbers (None without a baseline)."""
    base = summary.get(baseline, {})
    for s in summary.values():
        for key in RATIO_KEYS:
            b, v = base.get(key), s.get(key)
            s[f"{key}_ratio"] = v / b if v is not None and b else None


def compare_best(cfg: Config, summary: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """``dimuon eval --compare`` of every best-lr run into ``<out>/best_lr``; adds time to the target FD."""
    runs = [cfg.out / "runs" / name for s in summary.values() for name in s["runs"]]
    if not runs:
        return None
    settings = {f.name: getattr(cfg.eval, f.name) for f in fields(EvalSettings)}
    try:
        record = eval_run.compare_runs(eval_run.Config(**settings, compare=tuple(runs), out=cfg.out / "best_lr"))
    except ValueError as exc:
        warnings.warn(f"no best-lr comparison: {exc}", stacklevel=2)
        return None
    reached = {Path(r["run"]).name: r["summary"] for r in record["runs"]}
    for s in summary.values():
        times = [reached[n]["target_active_time_s"] for n in s["runs"]]
        s["target_active_time_s"] = statistics.fmean(times) if times and None not in times else None
    return record


def plot_fd_vs_lr(rows: Sequence[dict[str, Any]], optimizers: Sequence[str], path: Path, title: str = "") -> Path | None:
    """Final FD against learning rate, one line per optimizer through its seed means, seeds as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in optimizers:
        mine = [r for r in ok if r["optimizer"] == name]
        lrs = sorted({r["lr"] for r in mine})
        if not lrs:
            continue
        means = [statistics.fmean(r["fd"] for r in mine if r["lr"] == lr) for lr in lrs]
        (line,) = ax.plot(lrs, means, "o-", label=name)
        ax.scatter([r["lr"] for r in mine], [r["fd"] for r in mine], s=12, alpha=0.5, color=line.get_color())
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final FD (lower is better)")
    ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save_figure_atomic(fig, path)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _f(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


SUMMARY_HEADERS = ["optimizer", "best lr", "seeds", "final FD", "x AdamW", "best FD", "EMA val loss",
                   "opt ms/step", "x AdamW", "step ms", "active time (s)", "x AdamW",
                   "time to target (s)", "x AdamW"]
RUN_HEADERS = ["run", "status", "EMA val loss", "best FD (step)", "final FD", "precision", "recall",
               "density", "coverage", "opt ms/step", "step ms", "active time (s)"]


def _right(headers: Sequence[str], text_columns: int) -> list[bool]:
    """Column alignment: the first ``text_columns`` left, the numbers right."""
    return [i >= text_columns for i in range(len(headers))]


def summary_rows(record: dict[str, Any]) -> list[list[str]]:
    """One table row per optimizer at its best learning rate."""
    rows = []
    for name, s in record["optimizers"].items():
        rows.append([
            name, _f(s["lr"], "g"), str(len(s["seeds"])), _f(s["fd"]), _f(s["fd_ratio"], ".2f"), _f(s["best_fd"]),
            _f(s["val_loss_ema"], ".4f"), _f(s["opt_ms"], ".1f"), _f(s["opt_ms_ratio"], ".2f"),
            _f(s["step_ms"], ".1f"), _f(s["active_time_s"], ".1f"), _f(s["active_time_s_ratio"], ".2f"),
            _f(s.get("target_active_time_s"), ".1f"), _f(s.get("target_active_time_s_ratio"), ".2f"),
        ])
    return rows


def run_rows(record: dict[str, Any]) -> list[list[str]]:
    """One table row per run of the grid."""
    rows = []
    for r in record["runs"]:
        best = "-" if r["best_fd"] is None else f"{r['best_fd']:.3f} ({r['best_fd_step']})"
        final = _f(r["fd"]) if r["eval_step"] == record["config"]["steps"] else "-"
        rows.append([
            r["name"], r["status"], _f(r["val_loss_ema"], ".4f"), best, final,
            *(_f(r[m] if final != "-" else None) for m in ("precision", "recall", "density", "coverage")),
            _f(r["opt_ms"], ".1f"), _f(r["step_ms"], ".1f"), _f(r["active_time_s"], ".1f"),
        ])
    return rows


def render(record: dict[str, Any], markdown: bool = False) -> str:
    """The report: task and settings, the best-lr summary against AdamW, every run, the failures."""
    table = format_markdown_table if markdown else format_table
    c, m = record["config"], record["machine"]
    lines = [
        "# Generation quality and training cost of the optimizers" if markdown else "dimuon bench quality",
        "",
        f"{c['model']} on {c['dataset']}, batch {c['batch_size']}, {c['steps']} steps, evaluated every "
        f"{record['eval_interval']} steps; {record['jobs']} job(s) at a time, "
        f"{record['threads_per_run'] or 'default'} thread(s) each; torch {m['torch']}, "
        f"{m['cuda'] or m['cpu_model']} ({m['logical_cpus']} logical CPUs), load {m['load_average']}.",
    ]
    if record["eval_settings"]:
        lines += ["", describe_settings(record["eval_settings"]) + "."]
    target = record.get("target_fd")
    lines += [
        "",
        "Per optimizer at its best lr (lowest final FD, mean over seeds); x AdamW: ratio to AdamW at its best lr"
        + (f"; target FD {target:.3f}: the best FD of the worst best-lr run, reached by every one of them."
           if target is not None else "."),
        "",
        table(SUMMARY_HEADERS, summary_rows(record), _right(SUMMARY_HEADERS, 1)),
        "",
        table(RUN_HEADERS, run_rows(record), _right(RUN_HEADERS, 2)),
    ]
    if record["notes"]:
        lines += ["", *(f"Note: {note}." for note in record["notes"])]
    failed = [r for r in record["runs"] if r["status"] != "ok"]
    if failed:
        lines += ["", "Failed or unfinished runs:"]
        lines += [f"- {r['name']}: {r['error'] or 'last step not evaluated'} (log: {r['log']})" for r in failed]
    return "\n".join(lines)


def eval_settings_of(rows: Sequence[dict[str, Any]], cfg: Config) -> dict[str, Any] | None:
    """The recorded settings of the first evaluated run's series (what every FD of the table is measured in)."""
    for r in rows:
        if r["evaluations"]:
            series = find_series(Path(r["run_dir"]), cfg.eval)
            if series is not None:
                return series["settings"]
    return None


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
    outcomes = run_grid(cfg, specs)
    extra = train_args_of(cfg)
    rows = [run_row(cfg, o, extra[o.spec.optimizer]) for o in outcomes]
    summary = optimizer_summary(rows, cfg.optimizers)
    compared = compare_best(cfg, summary)
    add_ratios(summary)
    outputs = [cfg.out / "results.json", cfg.out / "results.md"]
    space = next((r["feature_space"] for r in rows if r["feature_space"]), "")
    title = f"FD at step {cfg.steps} in {space}; lines: mean over seeds"
    lr_plot = plot_fd_vs_lr(rows, cfg.optimizers, cfg.out / "fd_vs_lr.png", title)
    outputs += [lr_plot] if lr_plot else []
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


def join_flag_values(args: Sequence[str], flags: Sequence[str] = ("--train-args",)) -> list[str]:
    """``--train-args '--x 1'`` -> ``--train-args=--x 1``: a value that starts with -- is taken as the value."""
    out: list[str] = []
    it = iter(args)
    for arg in it:
        out.append(arg)
        if arg in flags:
            value = next(it, None)
            if value is not None:
                out[-1] = f"{arg}={value}"
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dimuon bench quality``; 0 when every run finished, 1 when some failed, 2 on bad flags."""
    args = join_flag_values(sys.argv[1:] if argv is None else argv)
    cfg = tyro.cli(Config, args=args, prog="dimuon bench quality")
    try:
        record = run(cfg, args)
    except FlagError as exc:
        print(f"dimuon bench quality: error: {exc}", file=sys.stderr)
        return 2
    print(render(record) + "\n\nwrote " + ", ".join(record["outputs"]))
    return 0 if all(r["status"] == "ok" for r in record["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
