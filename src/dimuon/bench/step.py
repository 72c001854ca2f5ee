"""``dimuon bench step``: end-to-end training-step time per optimizer, split into forward/backward and optimizer.

Each optimizer trains the same DiT on the same data for a few whole log windows with ``dimuon train`` (one
process, and under ``torchrun`` with FSDP2 on ``--worlds`` ranks), so the step is the real one: data, forward,
backward, gradient clipping, ``opt.step()``, EMA. A window is the optimizer's period (or a multiple of it),
so the periodic optimizers' cheap and spectral steps are averaged in their real proportion; the first window
holds the warm-up and is left out, the others give medians (and with ``--repeats``, medians over runs taken in
rounds). Per optimizer and world size the report has the
step time, its split, the optimizer's share of the step, its logical bytes per step (``opt.comm_stats()``),
and ratios against AdamW measured in the same invocation. ``torch_muon`` runs in one process only (it
refuses sharded parameters).

Run ``dimuon bench step --help`` (or ``python -m dimuon.bench.step --help``).
"""

from __future__ import annotations

import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from dimuon.bench.quality_runs import launch, log_tail
from dimuon.bench.report import (
    check_train_flags,
    format_markdown_table,
    join_flag_values,
    machine_info,
    named_values,
    parse_bench_flags,
    parse_or_none,
    train_results,
)
from dimuon.dit import DIT_MODELS
from dimuon.io import save_figure_atomic, write_json_atomic, write_text_atomic
from dimuon.optim import OPTIMIZERS
from dimuon.optim.build import LABELS, ONE_PROCESS_ONLY
from dimuon.train.optim_options import accepted_parameters
from dimuon.train.plan import TrainPlan

DEFAULT_OPTIMIZERS = ("adamw", "torch_muon", "muon", "periodic_row_muon", "muon_bp", "adaptive_row_muon")
# The option that sets an optimizer's period, in the optimizer's own spelling (--optim.k, --optim.period, and the
# adaptive schedule's longest interval --optim.k-max).
PERIOD_OPTIONS = ("k", "period", "k_max")


@dataclass
class Config:
    """Training-step time of each optimizer on a real DiT step, in one process and under FSDP2."""

    model: str = "DiT-S/2"
    """DiT to train (its matrices decide the optimizer's share of the step)."""
    dataset: str = "mnist"
    """Data set of dimuon train (mnist: 28 x 28, so DiT-S/2 sees 196 tokens)."""
    batch_size: int = 16
    """Global batch size (split over the ranks)."""
    optimizers: tuple[str, ...] = DEFAULT_OPTIMIZERS
    """Optimizers to time, each with its default options (see --train-args for others)."""
    worlds: tuple[int, ...] = (1, 4)
    """Process counts: 1 runs dimuon train directly, more run it under torchrun with FSDP2 (gloo on CPU)."""
    window: int = 6
    """Fewest steps per log window; each optimizer's window is the smallest multiple of its period at least this."""
    windows: int = 2
    """Windows measured after the warm-up window (the report's medians are over these)."""
    repeats: int = 1
    """Runs per optimizer and world size, taken in rounds (every optimizer once per round), so that drifts of a
    shared machine's speed reach every optimizer alike; each figure is the median over the repeats."""
    threads: int | None = None
    """CPU threads per process (default: torch's own; under torchrun, cores / ranks)."""
    train_args: str = ""
    """Further dimuon train flags for every run, one shell-quoted string (e.g. '--precision bf16')."""
    train_args_of: tuple[str, ...] = ()
    """Further dimuon train flags of one optimizer, as NAME=FLAGS (e.g. 'muon_bp=--optim.blocks 4'), after
    --train-args."""
    out: Path = Path("bench-step")
    """Output directory: runs/, results.json, results.md, step_time.png."""
    progress: bool = True
    """Show a progress bar over the runs."""


def train_plan(cfg: Config, optimizer: str) -> TrainPlan:
    """One optimizer's runs as ``dimuon train`` reads them at start-up: their flags (:func:`run_flags`, with
    ``--steps`` and ``--log-interval`` at their defaults, as the window is not known yet) checked by
    :func:`~dimuon.bench.report.check_train_flags`. ValueError names the optimizer's --train-args /
    --train-args-of and the bad flag as ``dimuon train`` does."""
    argv = run_flags(cfg, optimizer, cfg.out / "runs" / run_name(optimizer, 1))
    return check_train_flags(argv, f"--train-args / --train-args-of {optimizer}")


def period_of(plan: TrainPlan) -> int:
    """Steps after which the run's optimizer schedule repeats (1 for non-periodic ones; the adaptive schedule's
    longest interval, ``k_max``): the option as the run's flags set it, else the optimizer's default."""
    defaults = {name: p.default for name, (p, _) in accepted_parameters(OPTIMIZERS[plan.optimizer.name]).items()}
    for key in PERIOD_OPTIONS:
        if isinstance(defaults.get(key), int):
            return int(plan.optimizer.kwargs.get(key, defaults[key]))
    return 1


def window_steps(cfg: Config, optimizer: str) -> int:
    """Steps per log window: the smallest multiple of the optimizer's period (as its flags set it) that is at
    least --window."""
    period = period_of(train_plan(cfg, optimizer))
    return period * math.ceil(cfg.window / period)


def check_config(cfg: Config) -> None:
    """One clear error per bad flag, before anything runs."""
    if cfg.model not in DIT_MODELS:
        raise ValueError(f"--model must be one of {sorted(DIT_MODELS)}, got {cfg.model!r}")
    unknown = [o for o in cfg.optimizers if o not in OPTIMIZERS]
    if not cfg.optimizers or unknown or len(set(cfg.optimizers)) != len(cfg.optimizers):
        raise ValueError(
            f"--optimizers must name distinct values from {sorted(OPTIMIZERS)}, got {list(cfg.optimizers)}"
        )
    if not cfg.worlds or any(w < 1 for w in cfg.worlds) or len(set(cfg.worlds)) != len(cfg.worlds):
        raise ValueError(f"--worlds must be distinct process counts >= 1, got {list(cfg.worlds)}")
    bad_batch = [w for w in cfg.worlds if cfg.batch_size % w]
    if cfg.batch_size < 1 or bad_batch:
        raise ValueError(
            f"--batch-size must be >= 1 and divisible by every --worlds entry, got {cfg.batch_size} "
            f"(not by {bad_batch})"
        )
    for flag, value in (("--window", cfg.window), ("--windows", cfg.windows), ("--repeats", cfg.repeats)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if cfg.threads is not None and cfg.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {cfg.threads}")
    for name in cfg.optimizers:  # every run's flags, as dimuon train checks them at start-up
        train_plan(cfg, name)


def extra_train_args(cfg: Config) -> dict[str, list[str]]:
    """Per optimizer, the further ``dimuon train`` flags: --train-args, then its --train-args-of entry."""
    per = named_values(cfg.train_args_of, "--train-args-of", cfg.optimizers, "NAME=FLAGS")
    out = {}
    for name in cfg.optimizers:
        try:
            out[name] = shlex.split(cfg.train_args) + shlex.split(per.get(name, ""))
        except ValueError as exc:
            raise ValueError(f"--train-args / --train-args-of {name}: {exc}") from None
    return out


def run_name(optimizer: str, world: int, repeat: int = 0) -> str:
    return f"{optimizer}-w{world}" + (f"-r{repeat}" if repeat else "")


def run_flags(cfg: Config, optimizer: str, run_dir: Path, window: int | None = None) -> list[str]:
    """The ``dimuon train`` flags of one run: whole windows, the end-of-run hooks made cheap, then --train-args
    and the optimizer's --train-args-of (the last given wins); without ``window``, no --steps or --log-interval."""
    windows = [] if window is None else ["--steps", str(window * (1 + cfg.windows)), "--log-interval", str(window)]
    return [
        "--out",
        str(run_dir),
        "--overwrite",
        "--no-progress",
        "--optimizer",
        optimizer,
        "--model",
        cfg.model,
        "--dataset",
        cfg.dataset,
        "--batch-size",
        str(cfg.batch_size),
        *windows,
        "--warmup-steps",
        "1",
        "--val-interval",
        "0",
        "--val-samples",
        "16",
        "--ckpt-interval",
        "0",
        "--sample-count",
        "10",
        "--sample-steps",
        "2",
        *extra_train_args(cfg)[optimizer],
    ]


def train_command(cfg: Config, optimizer: str, world: int, run_dir: Path) -> list[str]:
    """The ``dimuon train`` command of one run (:func:`run_flags`), in one process or under torchrun."""
    train = run_flags(cfg, optimizer, run_dir, window_steps(cfg, optimizer))
    if world == 1:
        if cfg.threads is not None:
            train += ["--threads", str(cfg.threads)]
        return [sys.executable, "-m", "dimuon.cli", "train", *train]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "-m",
        "dimuon.cli",
        "train",
        *train,
    ]


def threads_of(cfg: Config, world: int) -> int | None:
    """Threads per process: --threads, else for several ranks the cores shared out among them."""
    if cfg.threads is not None:
        return cfg.threads
    return None if world == 1 else max(1, (os.cpu_count() or 1) // world)


def measure(cfg: Config, optimizer: str, world: int, repeat: int = 0) -> dict[str, Any]:
    """One run: train, then read its step-time split; a run that cannot or did not finish gets its reason."""
    row: dict[str, Any] = {
        "optimizer": optimizer,
        "label": LABELS.get(optimizer, optimizer),
        "world": world,
        "window": window_steps(cfg, optimizer),
    }
    if world > 1 and optimizer in ONE_PROCESS_ONLY:
        return {**row, "status": "not run", "error": f"one process only: {ONE_PROCESS_ONLY[optimizer]}"}
    run_dir = cfg.out / "runs" / run_name(optimizer, world, repeat)
    log = cfg.out / "runs" / f"{run_name(optimizer, world, repeat)}.log"
    log.unlink(missing_ok=True)
    command = train_command(cfg, optimizer, world, run_dir)
    start = time.perf_counter()
    code = launch(command, log, threads_of(cfg, world))
    row.update(command=command, log=str(log), seconds=round(time.perf_counter() - start, 1))
    if code != 0:
        return {**row, "status": "failed", "error": f"dimuon train exited with status {code}", "tail": log_tail(log)}
    return {**row, "status": "ok", **train_results(run_dir)}


TIMES = ("step_ms", "data_ms", "fwd_bwd_ms", "opt_ms", "comm_bytes_per_step", "samples_per_s", "steps_per_s")


def combine(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """One optimizer and world size over its repeats: the first repeat's row with every time the median over
    the repeats (each repeat's step time kept in ``repeat_step_ms``); the first repeat that did not finish
    decides the status."""
    bad = next((r for r in repeats if r["status"] != "ok"), None)
    if bad is not None or len(repeats) == 1:
        return bad if bad is not None else repeats[0]
    row = {
        **repeats[0],
        **{key: statistics.median(r[key] for r in repeats) for key in TIMES},
        "records_used": sum(r["records_used"] for r in repeats),
        "repeats": len(repeats),
        "repeat_step_ms": [r["step_ms"] for r in repeats],
    }
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Per world size, step and optimizer time against AdamW's (same invocation), and the optimizer's share."""
    for row in rows:
        if row["status"] != "ok":
            continue
        row["opt_share"] = row["opt_ms"] / row["step_ms"]
        base = next(
            (r for r in rows if r["optimizer"] == "adamw" and r["world"] == row["world"] and r["status"] == "ok"), None
        )
        row["step_x_adamw"] = row["step_ms"] / base["step_ms"] if base else None
        row["opt_x_adamw"] = row["opt_ms"] / base["opt_ms"] if base and base["opt_ms"] > 0 else None


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    """One table per world size: the split, the share, the bytes and the ratios; rows that did not run say why."""
    out = []
    for world in dict.fromkeys(r["world"] for r in rows):
        table = []
        for r in (r for r in rows if r["world"] == world):
            if r["status"] != "ok":
                table.append([r["label"], *(["-"] * 8), f"{r['status']}: {r['error']}"])
                continue
            table.append(
                [
                    r["label"],
                    f"{r['step_ms']:.0f}",
                    f"{r['fwd_bwd_ms']:.0f}",
                    f"{r['opt_ms']:.0f}",
                    f"{r['data_ms']:.1f}",
                    f"{100 * r['opt_share']:.0f}%",
                    f"{r['comm_bytes_per_step'] / 2**20:.2f}",
                    _ratio(r["step_x_adamw"]),
                    _ratio(r["opt_x_adamw"]),
                    f"{r['window']}-step windows x {r['records_used']}"
                    + (f" ({r['repeats']} runs)" if r.get("repeats", 1) > 1 else ""),
                ]
            )
        where = "one process" if world == 1 else f"{world} ranks, FSDP2"
        out += [
            f"**{where}**",
            "",
            format_markdown_table(
                [
                    "optimizer",
                    "step ms",
                    "fwd+bwd ms",
                    "optimizer ms",
                    "data ms",
                    "optimizer share",
                    "MiB/step",
                    "step x AdamW",
                    "optimizer x AdamW",
                    "medians over",
                ],
                table,
            ),
            "",
        ]
    return "\n".join(out).rstrip() + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Stacked bars per optimizer and world size: data, forward/backward and optimizer milliseconds per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return None
    worlds = list(dict.fromkeys(r["world"] for r in ok))
    fig, axes = plt.subplots(1, len(worlds), figsize=(5 * len(worlds), 4), squeeze=False, layout="constrained")
    for ax, world in zip(axes[0], worlds):
        mine = [r for r in ok if r["world"] == world]
        names = [r["label"] for r in mine]
        bottom = [0.0] * len(mine)
        for key, label in (("data_ms", "data"), ("fwd_bwd_ms", "forward + backward"), ("opt_ms", "optimizer")):
            values = [r[key] for r in mine]
            ax.bar(names, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title("one process" if world == 1 else f"{world} ranks, FSDP2", fontsize=9)
        ax.set_ylabel("ms per training step (median)")
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    save_figure_atomic(fig, path)
    plt.close(fig)
    return path


def run(cfg: Config, argv: list[str] | None = None) -> dict[str, Any]:
    """Every optimizer at every world size, then the record, the Markdown and the plot; returns the record."""
    check_config(cfg)
    cfg.out.mkdir(parents=True, exist_ok=True)
    grid = [(o, w, rep) for w in cfg.worlds for rep in range(cfg.repeats) for o in cfg.optimizers]
    measured: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with tqdm(grid, desc="bench step", unit="run", disable=not cfg.progress) as bar:
        for optimizer, world, repeat in bar:
            bar.set_postfix_str(run_name(optimizer, world, repeat))
            row = measure(cfg, optimizer, world, repeat)
            measured.setdefault((optimizer, world), []).append(row)
            if row["status"] == "failed":
                bar.write(f"run {run_name(optimizer, world, repeat)} failed: {row['error']}\n{row['tail']}")
    rows = [combine(repeats) for repeats in measured.values()]
    add_ratios(rows)
    title = f"{cfg.model} on {cfg.dataset}, global batch {cfg.batch_size}"
    record = {
        "benchmark": "step",
        "command": shlex.join(["dimuon", "bench", "step", *(argv or [])]),
        "machine": machine_info(argv),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "rows": rows,
    }
    text = f"# Training-step time: {title}\n\n{markdown(rows)}"
    write_json_atomic(cfg.out / "results.json", record)
    write_text_atomic(cfg.out / "results.md", text)
    plot(rows, cfg.out / "step_time.png", title)
    record["markdown"] = text
    return record


def parse(argv: Sequence[str]) -> Config:
    """The flags parsed (``--train-args '--flag value'`` taken as one value) and checked by :func:`check_config`,
    every run's flags by ``dimuon train``'s parser and plan, nothing run: SystemExit(2) for a flag a parser
    refuses, ValueError for a value a check refuses."""
    return parse_bench_flags(Config, join_flag_values(argv), "dimuon bench step", check_config)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dimuon bench step``: 0 when every run that was due finished, 1 otherwise, 2 on bad flags."""
    given = sys.argv[1:] if argv is None else argv
    cfg = parse_or_none(parse, given, "dimuon bench step")  # parse joins the flag values itself
    args = join_flag_values(given)  # the command line the record keeps
    if cfg is None:
        return 2
    record = run(cfg, args)
    print(record["markdown"] + f"\nwrote {cfg.out / 'results.json'}, results.md, step_time.png")
    return 0 if all(r["status"] in ("ok", "not run") for r in record["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
