"""The results of ``dimuon bench quality``, from the run directories: one row per run (training cost
and losses from ``metrics.jsonl``, generation quality from the evaluation series in
``eval/results.json``), each optimizer's best learning rate and its ratios to the AdamW baseline,
the ``dimuon eval --compare`` of the best-lr runs, the plot of final FD against learning rate and the
text and Markdown tables. It reads run files and formats numbers but launches nothing, so that a
report can be rebuilt, and tested, from the files runs leave behind.
"""

from __future__ import annotations

import shlex
import statistics
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from dimuon.bench.quality_config import VARIANT_SEPARATOR, Config, RunSpec, base_optimizer, run_directory
from dimuon.bench.quality_runs import LOG_NAME, Outcome, find_series, series_entries, train_command
from dimuon.bench.report import format_markdown_table, format_table
from dimuon.eval.compare import compare_runs
from dimuon.io import RunLayout, read_jsonl, save_figure_atomic
from dimuon.log import get_logger
from dimuon.metrics.plots import SAVE_KWARGS, error_bars
from dimuon.metrics.registry import METRICS as REGISTRY
from dimuon.metrics.registry import SELECTION
from dimuon.metrics.results import METRICS, describe_settings, summarize

log = get_logger(__name__)

# The optimizer the others are set against (the x AdamW columns)
BASELINE = "adamw"


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


def spectral_fraction(train: Sequence[dict[str, Any]]) -> float | None:
    """Share of the Muon matrices' steps that were spectral over the run, from the train records' ``refresh``
    (windows weighted by their steps); None for an optimizer without refresh statistics."""
    windows = [
        (r["step"] - prev["step"] if prev else r["step"], r["refresh"]["spectral_fraction"])
        for prev, r in zip([None, *train], train)
        if "refresh" in r
    ]
    steps = sum(n for n, _ in windows)
    return sum(n * f for n, f in windows) / steps if steps else None


def cost_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Training cost and loss from ``metrics.jsonl``: median optimizer and step ms, active time, the share of
    spectral steps, final losses."""
    train = latest_by_step(records, "train")
    val = latest_by_step(records, "val")
    active = [r["active_time_s"] for r in records if isinstance(r.get("active_time_s"), (int, float))]
    return {
        "trained_steps": train[-1]["step"] if train else 0,
        "spectral_fraction": spectral_fraction(train),
        "opt_ms": _median(r.get("opt_ms") for r in train),
        "step_ms": _median(r.get("step_ms") for r in train),
        "active_time_s": max(active) if active else None,
        "val_loss": val[-1].get("val_loss") if val else None,
        "val_loss_ema": val[-1].get("val_loss_ema") if val else None,
    }


def quality_summary(series: dict[str, Any] | None) -> dict[str, Any]:
    """Best FD (with its step) and the last evaluation's scores of a series (Nones without one)."""
    ok = series_entries(series)
    if not ok:
        return {
            "evaluations": 0,
            "eval_step": None,
            "fd": None,
            "best_fd": None,
            "best_fd_step": None,
            "precision": None,
            "recall": None,
            "density": None,
            "coverage": None,
            "reference_fd": None,
            "feature_space": None,
        }
    best, last = summarize(ok, None), ok[-1]
    reference = series.get("reference") or {}
    return {
        "evaluations": len(ok),
        "eval_step": last["step"],
        **{m: last[m] for m in METRICS},
        "best_fd": best["best_fd"],
        "best_fd_step": best["best_step"],
        "reference_fd": reference.get("fd"),
        "feature_space": series["settings"]["feature_space"],
    }


def quality_curve(series: dict[str, Any] | None, records: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """The run's quality over training, small enough to publish with its row (a checkout without the run's
    directory rebuilds its curves from it): each evaluation's step, FD and active time, each validation pass's
    step and EMA loss."""
    ok = series_entries(series)
    val = [r for r in latest_by_step(records, "val") if r.get("val_loss_ema") is not None]
    return {
        "steps": [e["step"] for e in ok],
        "fd": [e["fd"] for e in ok],
        "active_time_s": [e.get("active_time_s") for e in ok],
        "loss_steps": [r["step"] for r in val],
        "val_loss_ema": [r["val_loss_ema"] for r in val],
    }


def run_row(cfg: Config, outcome: Outcome, extra: Sequence[str]) -> dict[str, Any]:
    """One run of the table: grid point, status, what it reached, what it cost, its curve, its commands."""
    spec = outcome.spec
    run_dir = run_directory(cfg, spec)
    series = find_series(run_dir, cfg.eval) if outcome.action != "refused" else None
    records = read_jsonl(RunLayout(run_dir).metrics) if outcome.action != "refused" else []
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
        **cost_summary(records),
        **quality,
        "curve": quality_curve(series, records),
        "train_s": round(outcome.seconds, 2),
        "run_dir": str(run_dir),
        "log": str(run_dir / LOG_NAME),
        "command": shlex.join(train_command(cfg, spec, extra)),
        "launched": shlex.join(outcome.command) if outcome.command else None,
    }


def kept_row(cfg: Config, spec: RunSpec, earlier: dict[str, Any], extra: Sequence[str]) -> dict[str, Any]:
    """A finished run's row kept from ``cfg.keep_rows_of`` (its directory is not here): what it reached and cost
    as recorded there, where it would live and the command it was trained with as this grid spells them."""
    run_dir = run_directory(cfg, spec)
    return {
        **earlier,
        "name": spec.name,
        "optimizer": spec.optimizer,
        "action": "kept",
        "error": None,
        "kept_from": str(cfg.keep_rows_of),
        "train_s": 0.0,
        "run_dir": str(run_dir),
        "log": str(run_dir / LOG_NAME),
        "command": shlex.join(train_command(cfg, spec, extra)),
        "launched": None,
    }


# --------------------------------------------------------------------------------------------------
# Summarizing
# --------------------------------------------------------------------------------------------------


def _mean(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


FD = REGISTRY["fd"]
FINAL_FD = f"final {FD.label}"
BEST_FD = f"best {FD.label}"


def _selection_label(name: str) -> str:
    """A selection metric's name in reports: FD is the final one ("best FD" is another column)."""
    return FINAL_FD if name == FD.name else REGISTRY[name].label


SELECTION_METRICS = {name: _selection_label(name) for name in SELECTION}
"""What may choose a best lr (``--select-by``), with its name in reports."""


def by_lr(rows: Sequence[dict[str, Any]], key: str) -> dict[float, list[float]]:
    """The values of ``key`` of the finished runs, per learning rate (seeds in row order)."""
    out: dict[float, list[float]] = {}
    for r in rows:
        if r["status"] == "ok" and r.get(key) is not None:
            out.setdefault(r["lr"], []).append(r[key])
    return out


def short_lrs(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
    """The learning rates with fewer finished runs than the grid's seeds (a run failed or is not done yet)."""
    seeds = len({r.get("seed") for r in rows})
    return sorted(lr for lr in {r["lr"] for r in rows} if len(by_lr(rows, key).get(lr, [])) < seeds)


def best_lr(rows: Sequence[dict[str, Any]], key: str = "val_loss_ema") -> float | None:
    """The learning rate whose finished runs reach the best ``key`` (the lowest loss, say) on average over their
    seeds, among those with every seed finished (a mean of fewer seeds is not compared with full ones; only where
    no lr has them all are the rest compared, and :func:`selection` says so)."""
    values = by_lr(rows, key)
    short = set(short_lrs(rows, key))
    candidates = {lr: v for lr, v in values.items() if lr not in short} or values
    return REGISTRY[key].pick(candidates, key=lambda lr: statistics.fmean(candidates[lr])) if candidates else None


def selection(rows: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    """How one optimizer's lr was chosen: per lr tried the mean and range of ``key`` over seeds, the best lr,
    whether it sits on the grid's edge, and the neighbours whose seed range overlaps the best's (a flat
    choice: the metric cannot tell them apart)."""
    values = by_lr(rows, key)
    lrs = sorted(values)
    best = best_lr(rows, key)
    table = {
        f"{lr:g}": {"mean": statistics.fmean(v), "min": min(v), "max": max(v), "seeds": len(v)}
        for lr, v in sorted(values.items())
    }
    flat = []
    if best is not None:
        i, b = lrs.index(best), table[f"{best:g}"]
        for j in (i - 1, i + 1):
            if 0 <= j < len(lrs):
                n = table[f"{lrs[j]:g}"]
                if n["min"] <= b["max"] and b["min"] <= n["max"]:
                    flat.append(lrs[j])
    return {
        "by": key,
        "lrs": table,
        "best": best,
        "on_edge": best is not None and len(lrs) > 1 and best in (lrs[0], lrs[-1]),
        "flat_with": flat,
        "short": short_lrs(rows, key),  # left out of the choice (or all short: chosen among them)
    }


SUMMARY_KEYS = ("fd", "best_fd", "val_loss_ema", "spectral_fraction", "opt_ms", "step_ms", "active_time_s")
RATIO_KEYS = ("fd", "opt_ms", "active_time_s", "target_active_time_s")


def optimizer_summary(
    rows: Sequence[dict[str, Any]], optimizers: Sequence[str], select_by: str = "val_loss_ema"
) -> dict[str, dict[str, Any]]:
    """Per optimizer, its finished runs at its best learning rate (lowest mean ``select_by``) averaged over
    seeds, with how that lr was chosen."""
    summary: dict[str, dict[str, Any]] = {}
    for name in optimizers:
        mine = [r for r in rows if r["optimizer"] == name]
        lr = best_lr(mine, select_by)
        chosen = [r for r in mine if r["lr"] == lr and r["status"] == "ok"]
        fds = [r["fd"] for r in chosen]
        losses = [r["val_loss_ema"] for r in chosen if r.get("val_loss_ema") is not None]
        ms = [r["opt_ms"] for r in chosen if r["opt_ms"] is not None]
        summary[name] = {
            "lr": lr,
            "lrs_tried": sorted({r["lr"] for r in mine}),
            "seeds": [r["seed"] for r in chosen],
            "runs": [r["name"] for r in chosen],
            **{key: _mean(chosen, key) for key in SUMMARY_KEYS},
            "fd_min": min(fds) if fds else None,
            "fd_max": max(fds) if fds else None,
            "val_loss_ema_min": min(losses) if losses else None,
            "val_loss_ema_max": max(losses) if losses else None,
            "opt_ms_min": min(ms) if ms else None,
            "opt_ms_max": max(ms) if ms else None,
            "selection": selection(mine, select_by),
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
    """``dimuon eval --compare`` of every best-lr run here into ``<out>/best_lr`` (a row kept from an earlier
    record has no directory to compare); adds time to the target FD where every seed's run is here."""
    runs = [path for s in summary.values() for name in s["runs"] if (path := cfg.out / "runs" / name).is_dir()]
    if not runs:
        return None
    try:
        record = compare_runs(runs, cfg.eval, cfg.out / "best_lr")
    except ValueError as exc:
        log.warning("no best-lr comparison: %s", exc)
        return None
    reached = {Path(r["run"]).name: r["summary"] for r in record["runs"]}
    for s in summary.values():
        times = [reached[n]["target_active_time_s"] if n in reached else None for n in s["runs"]]
        s["target_active_time_s"] = statistics.fmean(times) if times and None not in times else None
    return record


def plot_fd_vs_lr(
    rows: Sequence[dict[str, Any]], optimizers: Sequence[str], path: Path, title: str = ""
) -> Path | None:
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
    ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    return _save_fd_axes(fig, ax, path, title)


# The cost axes of the frontier plots: a summary key and its axis label.
COST_AXES = {
    "opt_ms": "optimizer ms per step (median over the run's log records)",
    "spectral_fraction": "share of spectral (Newton-Schulz) steps of the Muon matrices",
}


def plot_fd_frontier(
    summary: dict[str, dict[str, Any]],
    rows: Sequence[dict[str, Any]],
    path: Path,
    title: str = "",
    cost: str = "opt_ms",
) -> Path | None:
    """The quality/cost frontier: final FD against a cost (``COST_AXES``: optimizer ms per step, or the share of
    spectral steps, which counts Newton-Schulz work without the machine's noise), each entry at its best lr
    (mean over seeds, bars from the lowest to the highest seed, seeds as dots); the variants of one optimizer
    are joined in order of cost and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    placed = {name: s for name, s in summary.items() if s["fd"] is not None and s[cost] is not None}
    if not placed:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours: dict[str, str] = {}
    for base in dict.fromkeys(base_optimizer(name) for name in placed):
        mine = sorted(((n, s) for n, s in placed.items() if base_optimizer(n) == base), key=lambda x: x[1][cost])
        xs, ys = [s[cost] for _, s in mine], [s["fd"] for _, s in mine]
        (line,) = ax.plot(xs, ys, "o-" if len(mine) > 1 else "o", label=base)
        colours[base] = line.get_color()
        for n, s in mine:
            seen = [r[cost] for r in rows if r["name"] in s["runs"] and r[cost] is not None] or [s[cost]]
            ax.errorbar(
                s[cost],
                s["fd"],
                xerr=error_bars([s[cost]], [min(seen)], [max(seen)]),
                yerr=error_bars([s["fd"]], [s["fd_min"]], [s["fd_max"]]),
                color=line.get_color(),
                alpha=0.5,
                lw=1,
                capsize=2,
            )
            label = n.split(VARIANT_SEPARATOR, 1)[1] if VARIANT_SEPARATOR in n else ""
            if label:
                ax.annotate(
                    label,
                    (s[cost], s["fd"]),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                    color=line.get_color(),
                )
    dots = [
        r
        for r in rows
        if r["status"] == "ok"
        and r[cost] is not None
        and r["name"] in {run for s in placed.values() for run in s["runs"]}
    ]
    ax.scatter(
        [r[cost] for r in dots],
        [r["fd"] for r in dots],
        s=10,
        alpha=0.4,
        c=[colours[base_optimizer(r["optimizer"])] for r in dots],
    )
    ax.set_xlabel(COST_AXES[cost])
    return _save_fd_axes(fig, ax, path, title)


def _save_fd_axes(fig, ax, path: Path, title: str) -> Path:
    """Finish a plot of final FD on its y axis (label, title, grid, legend) and write it atomically."""
    import matplotlib.pyplot as plt

    ax.set_ylabel(f"{FINAL_FD} ({FD.axis_note})")
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save_figure_atomic(fig, path, **SAVE_KWARGS)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _f(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


# Report column texts where they differ from the registry's headings (shorter, or per step).
EMA_LOSS_COLUMN, OPT_MS_COLUMN, STEP_MS_COLUMN = "EMA val loss", "opt ms/step", "step ms"
RATIO_COLUMN = "x AdamW"
SCORES = tuple(m for m in METRICS if m != FD.name)  # the scores of a run's last evaluation beside its FD

SUMMARY_HEADERS = [
    "optimizer",
    "best lr",
    "seeds",
    FINAL_FD,
    RATIO_COLUMN,
    BEST_FD,
    EMA_LOSS_COLUMN,
    REGISTRY["spectral_fraction"].heading,
    OPT_MS_COLUMN,
    RATIO_COLUMN,
    STEP_MS_COLUMN,
    REGISTRY["active_time_s"].heading,
    RATIO_COLUMN,
    REGISTRY["target_active_time_s"].heading,
    RATIO_COLUMN,
]
RUN_HEADERS = [
    "run",
    "status",
    EMA_LOSS_COLUMN,
    f"{BEST_FD} (step)",
    FINAL_FD,
    *(REGISTRY[m].heading for m in SCORES),
    REGISTRY["spectral_fraction"].heading,
    OPT_MS_COLUMN,
    STEP_MS_COLUMN,
    REGISTRY["active_time_s"].heading,
]


def _right(headers: Sequence[str], text_columns: int) -> list[bool]:
    """Column alignment: the first ``text_columns`` left, the numbers right."""
    return [i >= text_columns for i in range(len(headers))]


def summary_rows(record: dict[str, Any]) -> list[list[str]]:
    """One table row per optimizer at its best learning rate."""
    rows = []
    for name, s in record["optimizers"].items():
        rows.append(
            [
                name,
                _f(s["lr"], "g"),
                str(len(s["seeds"])),
                _f(s["fd"]),
                _f(s["fd_ratio"], ".2f"),
                _f(s["best_fd"]),
                _f(s["val_loss_ema"], ".4f"),
                _f(s["spectral_fraction"], ".3f"),
                _f(s["opt_ms"], ".1f"),
                _f(s["opt_ms_ratio"], ".2f"),
                _f(s["step_ms"], ".1f"),
                _f(s["active_time_s"], ".1f"),
                _f(s["active_time_s_ratio"], ".2f"),
                _f(s.get("target_active_time_s"), ".1f"),
                _f(s.get("target_active_time_s_ratio"), ".2f"),
            ]
        )
    return rows


def run_rows(record: dict[str, Any]) -> list[list[str]]:
    """One table row per run of the grid."""
    rows = []
    for r in record["runs"]:
        best = "-" if r["best_fd"] is None else f"{r['best_fd']:.3f} ({r['best_fd_step']})"
        final = _f(r["fd"]) if r["eval_step"] == record["config"]["steps"] else "-"
        rows.append(
            [
                r["name"],
                r["status"],
                _f(r["val_loss_ema"], ".4f"),
                best,
                final,
                *(_f(r[m] if final != "-" else None) for m in SCORES),
                _f(r["spectral_fraction"], ".3f"),
                _f(r["opt_ms"], ".1f"),
                _f(r["step_ms"], ".1f"),
                _f(r["active_time_s"], ".1f"),
            ]
        )
    return rows


def selection_lines(summary: dict[str, dict[str, Any]]) -> list[str]:
    """One line per optimizer: the chooser's mean (lowest..highest over seeds) at every lr tried, the best
    marked, whether it is on the grid's edge, and the neighbours it cannot be told apart from."""
    lines = []
    for name, s in summary.items():
        sel = s.get("selection")
        if not sel or sel["best"] is None:
            continue
        digits = ".4f" if sel["by"] == "val_loss_ema" else ".2f"
        cells = ", ".join(
            f"{'**' if float(lr) == sel['best'] else ''}{lr}: {v['mean']:{digits}}"
            + (f" ({v['min']:{digits}}..{v['max']:{digits}}, {v['seeds']} seeds)" if v["seeds"] > 1 else " (1 seed)")
            + ("**" if float(lr) == sel["best"] else "")
            for lr, v in sel["lrs"].items()
        )
        notes = (["on the grid's edge: widen it"] if sel["on_edge"] else []) + (
            [f"flat: seed ranges overlap at {', '.join(f'{lr:g}' for lr in sel['flat_with'])}"]
            if sel["flat_with"]
            else []
        )
        if sel.get("short"):
            notes.append(f"not every seed finished at {', '.join(f'{lr:g}' for lr in sel['short'])}: not compared")
        lines.append(
            f"- {name}: best lr {sel['best']:g} by {SELECTION_METRICS[sel['by']]}"
            + (f" ({'; '.join(notes)})" if notes else "")
            + f"; {cells}"
        )
    return lines


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
    select_by = c.get("select_by", "fd")  # records before --select-by chose by FD
    lines += [
        "",
        f"Per optimizer at its best lr ({REGISTRY[select_by].superlative} {SELECTION_METRICS[select_by]}, mean over "
        f"seeds); {RATIO_COLUMN}: ratio to AdamW at its best lr"
        + (
            f"; target FD {target:.3f}: the best FD of the worst best-lr run, reached by every one of them."
            if target is not None
            else "."
        ),
        "",
        table(SUMMARY_HEADERS, summary_rows(record), _right(SUMMARY_HEADERS, 1)),
        *(
            ["", "How each lr was chosen (mean over seeds, lowest..highest):", *selection]
            if (selection := selection_lines(record["optimizers"]))
            else []
        ),
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
