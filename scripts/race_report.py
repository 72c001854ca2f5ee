"""The report of an optimizer race: several ``dimuon bench quality`` records (a main race over seeds, ablations)
turned into the numbers a user asks for before switching optimizers: FD with its spread over seeds, time to
AdamW's quality, FD against K or gamma, and the plots of them. It reads records and run directories and writes
files; it launches nothing, so the report can be rebuilt (and tested) from what runs leave behind.

Time is measured as *steps x a step time*. The step time is, by preference, each optimizer's one-process step
time from a ``dimuon bench step`` record measured on the race's model and batch with every optimizer side by side
and nothing else training (:func:`step_times`); without one, the run's own median step time, which two runs
sharing the cores inflate unevenly. A run's summed step time picks up every moment another job held the core, so
it is kept in the records but not used.
"""

from __future__ import annotations

import itertools
import statistics
import textwrap
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from dimuon.bench.quality_report import BASELINE, EMA_LOSS_COLUMN, latest_by_step
from dimuon.io import RunLayout, read_jsonl, save_figure_atomic
from dimuon.metrics.plots import SAVE_KWARGS, error_bars, fd_axes
from dimuon.metrics.registry import METRICS
from dimuon.metrics.results import load_results, ok_entries, settings_key

__all__ = [
    "ABLATION_METRICS",
    "LEVEL_METRICS",
    "Curve",
    "ablation_summary",
    "dense_levels",
    "fill_curves",
    "finished_rows",
    "load_curves",
    "machine_label",
    "optimizer_summary",
    "plot_ablation",
    "plot_fd_vs_time",
    "plot_gap_vs_params",
    "plot_sample_grids",
    "plot_time_to_levels",
    "plot_time_to_quality",
    "quality_levels",
    "ranking",
    "reach",
    "relative_change",
    "render_levels",
    "run_machines",
    "spread",
    "step_times",
    "target_fd",
    "time_to_levels",
    "timed_by",
]

TIME_BASES = {
    "side by side": "steps x the optimizer's step time measured side by side (dimuon bench step)",
    "run medians": "steps x the run's median step time",
}


# The quality series a time to quality can be read from: the evaluations' FD and the EMA validation loss of the
# run's validation passes (each lower is better); the key of a level's value.
LEVEL_METRICS = {"fd": "FD", "val_loss_ema": "EMA val loss"}


@dataclass(frozen=True)
class Curve:
    """One run's evaluated FD in step order, its EMA validation loss in step order (``loss_steps``, ``losses``;
    empty where its metrics are gone), with what it costs per step."""

    name: str
    optimizer: str
    lr: float
    seed: int
    steps: list[int]
    fds: list[float]
    active_time_s: list[float | None]  # the run's summed step time at each evaluated step
    step_ms: float | None  # its step time: the run's median, or the optimizer's measured side by side
    grid: str | None  # the sample grid of its last evaluation, when the run directory has it
    loss_steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def series(self, metric: str = "fd") -> tuple[list[int], list[float]]:
        """The steps and values of one of :data:`LEVEL_METRICS`."""
        if metric not in LEVEL_METRICS:
            raise ValueError(f"metric must be one of {sorted(LEVEL_METRICS)}, got {metric!r}")
        return (self.steps, self.fds) if metric == "fd" else (self.loss_steps, self.losses)

    def time_s(self, step: float) -> float | None:
        """Training time to ``step``: steps x the step time."""
        return None if self.step_ms is None else step * self.step_ms / 1000.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _run_dir(row: Mapping[str, Any], record_dir: Path | None) -> Path:
    """Where a record's run lives: as recorded, else beside the record (``<record_dir>/runs/<name>``)."""
    recorded = Path(row["run_dir"]) if row.get("run_dir") else None
    if (recorded is not None and recorded.is_dir()) or record_dir is None:
        return recorded or Path(row["name"])
    return record_dir / "runs" / row["name"]


def _curve(row: Mapping[str, Any], settings: Mapping[str, Any], record_dir: Path | None) -> Curve | None:
    """The run's series with the record's evaluation settings, or, where its directory is gone, the curve its
    row carries (``dimuon bench quality`` records one); None without either."""
    layout = RunLayout(_run_dir(row, record_dir))
    key = settings_key(dict(settings))
    series = load_results(layout.results)["evaluations"].get(key) if layout.results.is_file() else None
    entries = sorted(ok_entries(series["entries"]), key=lambda e: e["step"]) if series else []
    if not entries:
        return _published_curve(row)
    grid = layout.eval_grid(key, entries[-1]["step"])
    records = read_jsonl(layout.metrics) if layout.metrics.is_file() else []
    val = [e for e in latest_by_step(records, "val") if e.get("val_loss_ema") is not None]
    return Curve(
        row["name"],
        row["optimizer"],
        row["lr"],
        row["seed"],
        [e["step"] for e in entries],
        [e["fd"] for e in entries],
        [e.get("active_time_s") for e in entries],
        row.get("step_ms"),
        str(grid) if grid.is_file() else None,
        [e["step"] for e in val],
        [e["val_loss_ema"] for e in val],
    )


def _published_curve(row: Mapping[str, Any]) -> Curve | None:
    """The curve a record's row carries (its evaluations and validation passes), or None where it has none."""
    c = row.get("curve")
    if not c or not c.get("steps"):
        return None
    return Curve(
        row["name"],
        row["optimizer"],
        row["lr"],
        row["seed"],
        list(c["steps"]),
        list(c["fd"]),
        list(c["active_time_s"]),
        row.get("step_ms"),
        None,
        list(c.get("loss_steps", [])),
        list(c.get("val_loss_ema", [])),
    )


def finished_rows(record: Mapping[str, Any], name: str, lr: float | None = None) -> list[dict[str, Any]]:
    """The finished runs of one optimizer of a record (at ``lr`` where given)."""
    return [
        r for r in record["runs"] if r["optimizer"] == name and r["status"] == "ok" and (lr is None or r["lr"] == lr)
    ]


def load_curves(
    record: Mapping[str, Any], record_dir: Path | None = None, best_lr_only: bool = True
) -> dict[str, list[Curve]]:
    """Per optimizer of a ``dimuon bench quality`` record, the FD curves of its finished runs (at its best lr
    unless ``best_lr_only`` is False), in seed order. Runs whose directory is gone take the curve their row
    carries; runs without either are left out."""
    settings = record.get("eval_settings")
    curves: dict[str, list[Curve]] = {}
    if not settings:
        return curves
    for name, summary in record["optimizers"].items():
        rows = finished_rows(record, name, summary["lr"] if best_lr_only else None)
        found = [
            c
            for c in (_curve(r, settings, record_dir) for r in sorted(rows, key=lambda r: (r["lr"], r["seed"])))
            if c is not None
        ]
        if found:
            curves[name] = found
    return curves


def fill_curves(
    found: Mapping[str, Sequence[Curve]],
    record: Mapping[str, Any],
    published: Mapping[str, Sequence[Mapping[str, Any]]],
) -> tuple[dict[str, list[Curve]], list[str]]:
    """``found`` (:func:`load_curves`), with an optimizer's published curves (a race.json's ``curves``) in place
    of its own where some of its best-lr runs' directories are gone and the published ones are of exactly those
    runs; and the optimizers so filled. A fresh checkout of a published race rebuilds its report this way."""
    out: dict[str, list[Curve]] = {}
    filled = []
    for name, summary in record["optimizers"].items():
        want = sorted(r["name"] for r in finished_rows(record, name, summary.get("lr"))) if summary.get("lr") else []
        mine = list(found.get(name, []))
        earlier = [Curve(**c) for c in published.get(name, [])]
        if want and sorted(c.name for c in mine) != want and sorted(c.name for c in earlier) == want:
            mine = sorted(earlier, key=lambda c: (c.lr, c.seed))
            filled.append(name)
        if mine:
            out[name] = mine
    return out, filled


def step_times(record: Mapping[str, Any] | None) -> dict[str, dict[str, float]]:
    """Per optimizer, the one-process step and optimizer time (ms) of a ``dimuon bench step`` record: every
    optimizer timed side by side on the same model and batch, alone on the machine."""
    if not record:
        return {}
    return {
        r["optimizer"]: {"step_ms": float(r["step_ms"]), "opt_ms": float(r["opt_ms"])}
        for r in record["rows"]
        if r["status"] == "ok" and r["world"] == 1
    }


def timed_by(
    curves: Mapping[str, Sequence[Curve]], times: Mapping[str, Mapping[str, float]]
) -> tuple[dict[str, list[Curve]], str]:
    """The curves with each optimizer's side-by-side step time (:func:`step_times`), and the time basis (a key of
    ``TIME_BASES``); unchanged (basis ``run medians``) unless ``times`` covers every optimizer, so that no two
    optimizers are timed differently."""
    if not curves or any(name not in times for name in curves):
        return {name: list(cs) for name, cs in curves.items()}, "run medians"
    return (
        {name: [replace(c, step_ms=times[name]["step_ms"]) for c in cs] for name, cs in curves.items()},
        "side by side",
    )


# --------------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------------


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean, lowest, highest and count of the values that exist (Nones without any)."""
    nums = [float(v) for v in values if v is not None]
    if not nums:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(nums), "min": min(nums), "max": max(nums), "n": len(nums)}


def target_fd(curves: Sequence[Curve]) -> float | None:
    """The quality AdamW reaches on every seed: the highest of its seeds' best FDs."""
    return max(min(c.fds) for c in curves) if curves else None


def reach(curve: Curve, target: float, metric: str = "fd") -> dict[str, Any]:
    """When a run first gets to ``metric`` (FD, or EMA validation loss) <= ``target``: the first evaluated step
    that does, and the step estimated by linear interpolation between it and the evaluation before (``bounded``:
    the first evaluation was already there, so the step is an upper bound); Nones when it never does."""
    steps, values = curve.series(metric)
    for i, (step, value) in enumerate(zip(steps, values)):
        if value <= target:
            if i == 0:
                est, bounded = float(step), True
            else:
                s0, v0 = steps[i - 1], values[i - 1]
                est, bounded = s0 + (step - s0) * (v0 - target) / (v0 - value), False
            return {
                "reached": True,
                "eval_step": step,
                "step": est,
                "bounded": bounded,
                "time_s": curve.time_s(est),
                "active_time_s": curve.active_time_s[i] if metric == "fd" else None,
            }
    return {"reached": False, "eval_step": None, "step": None, "bounded": False, "time_s": None, "active_time_s": None}


def optimizer_summary(
    record: Mapping[str, Any],
    curves: Mapping[str, Sequence[Curve]],
    baseline: str = BASELINE,
    side_by_side: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, Any]:
    """Per optimizer at its best lr: final FD, precision, recall and EMA loss over seeds, how much FD still moved
    between the last two evaluations (has it flattened?), step and optimizer time, and the time to the baseline's
    quality (:func:`target_fd` of the baseline's runs) with its ratio to the baseline's own where every seed got
    there. With
    ``side_by_side`` (:func:`step_times`; the curves then :func:`timed_by` it) step and optimizer time are those,
    the runs' own medians kept as ``run_step_ms`` and ``run_opt_ms``."""
    target = target_fd(curves.get(baseline, []))
    table: dict[str, Any] = {}
    for name, s in record["optimizers"].items():
        rows = [r for r in record["runs"] if r["name"] in s["runs"]]
        reached = {c.name: reach(c, target) for c in curves.get(name, [])} if target is not None else {}
        table[name] = {
            "lr": s["lr"],
            "seeds": s["seeds"],
            **{
                key: spread([r.get(key) for r in rows])
                for key in ("fd", "precision", "recall", "val_loss_ema", "active_time_s")
            },
            **{
                key: spread(
                    [side_by_side[name][key]] if side_by_side and name in side_by_side else [r.get(key) for r in rows]
                )
                for key in ("step_ms", "opt_ms")
            },
            **{f"run_{key}": spread([r.get(key) for r in rows]) for key in ("step_ms", "opt_ms")},
            "fd_last_change": spread([c.fds[-1] / c.fds[-2] - 1.0 for c in curves.get(name, []) if len(c.fds) > 1]),
            "time_to_target_s": spread([r["time_s"] for r in reached.values()]),
            "steps_to_target": spread([r["step"] for r in reached.values()]),
            "reached_target": sum(r["reached"] for r in reached.values()),
            "curves": len(curves.get(name, [])),
            "reach": reached,
        }
    base = table.get(baseline, {})
    for entry in table.values():
        # A time to the target is a ratio only where every seed got there (as in the levels table): a mean over
        # the seeds that did would count the fastest ones only.
        every = entry["curves"] > 0 and entry["reached_target"] == entry["curves"]
        for key in ("fd", "opt_ms", "step_ms", "time_to_target_s", "steps_to_target"):
            b, v = base.get(key, {}).get("mean"), entry[key]["mean"]
            counted = every or key not in ("time_to_target_s", "steps_to_target")
            entry[f"{key}_ratio"] = v / b if v is not None and b and counted else None
    return {
        "target_fd": target,
        "baseline": baseline,
        "time_basis": "side by side" if side_by_side else "run medians",
        "optimizers": table,
    }


def ranking(summary: Mapping[str, Any]) -> list[str]:
    """The optimizers of an :func:`optimizer_summary`, best (lowest mean final FD) first; unmeasured ones left out."""
    measured = [(s["fd"]["mean"], name) for name, s in summary["optimizers"].items() if s["fd"]["mean"] is not None]
    return [name for _, name in sorted(measured)]


def quality_levels(curves: Sequence[Curve], metric: str = "fd") -> list[dict[str, float]]:
    """The baseline's quality at each step it was evaluated at on every seed: the highest over its seeds of the
    best ``metric`` so far (a quality every seed has reached by then), as ``{"step", metric}``. The last FD level is
    :func:`target_fd`. Empty where a seed has no such series."""
    series = [c.series(metric) for c in curves]
    if not series or any(not steps for steps, _ in series):
        return []
    steps = sorted(set.intersection(*(set(st) for st, _ in series)))
    return [
        {"step": s, metric: max(min(v for st, v in zip(sts, vals) if st <= s) for sts, vals in series)} for s in steps
    ]


def dense_levels(levels: Sequence[Mapping[str, float]], n: int = 12, metric: str = "fd") -> list[dict[str, float]]:
    """``n`` levels of ``metric`` spaced evenly in its log from the first of ``levels`` to the last (for a smooth
    plot; the crossings in between are interpolated as every crossing is)."""
    if len(levels) < 2:
        return [dict(lv) for lv in levels]
    hi, lo = levels[0][metric], levels[-1][metric]
    return [{"step": None, metric: hi * (lo / hi) ** (i / (n - 1))} for i in range(n)]


def time_to_levels(
    curves: Mapping[str, Sequence[Curve]],
    baseline: str = BASELINE,
    levels: Sequence[Mapping[str, Any]] | None = None,
    metric: str = "fd",
) -> dict[str, Any]:
    """Per optimizer, the time to each of the baseline's :func:`quality_levels` of ``metric`` (FD, or EMA
    validation loss) after its first evaluation (which every run reaches by then at the latest, so it measures
    nothing): the spread over seeds, how many seeds got there, how many only at their first evaluation
    (``bounded``: an upper bound), the ratio of the mean to the baseline's own. Where along the way an optimizer is
    ahead, beyond the one level time to quality names. ``levels`` (e.g. :func:`dense_levels`) replaces the
    evaluation levels. An optimizer without the series (published curves made before losses were kept) is left
    out."""
    levels = list(quality_levels(curves.get(baseline, []), metric)[1:] if levels is None else levels)
    table: dict[str, list[dict[str, Any]]] = {}
    for name, cs in curves.items():
        if any(not c.series(metric)[0] for c in cs):
            continue
        table[name] = []
        for level in levels:
            reached = [reach(c, level[metric], metric) for c in cs]
            table[name].append(
                {
                    **level,
                    "time_s": spread([r["time_s"] for r in reached]),
                    "steps": spread([r["step"] for r in reached]),
                    "reached": sum(r["reached"] for r in reached),
                    "bounded": sum(r["bounded"] for r in reached),
                    "seeds": len(cs),
                }
            )
    for rows in table.values():
        for row, base in zip(rows, table.get(baseline, [])):
            b, v = base["time_s"]["mean"], row["time_s"]["mean"]
            row["ratio"] = v / b if v is not None and b and row["reached"] == row["seeds"] else None
    return {"baseline": baseline, "metric": metric, "levels": levels, "optimizers": table}


def ablation_summary(record: Mapping[str, Any]) -> dict[str, Any]:
    """Per entry and lr of an ablation record: final FD, EMA validation loss, opt ms and spectral share over its
    seeds (the loss resolves what 500-sample FD's seed noise hides)."""
    out: dict[str, Any] = {}
    for name in record["optimizers"]:
        for lr in sorted({r["lr"] for r in record["runs"] if r["optimizer"] == name}):
            rows = finished_rows(record, name, lr)
            out.setdefault(name, {})[f"{lr:g}"] = {
                "seeds": [r["seed"] for r in rows],
                **{
                    key: spread([r.get(key) for r in rows])
                    for key in ("fd", "val_loss_ema", "opt_ms", "spectral_fraction")
                },
            }
    return out


def run_machines(record: Mapping[str, Any]) -> dict[str, int]:
    """How many finished runs of a record trained on each machine (CPU model, or GPU): the record's own, or a
    kept row's (``dimuon bench quality --keep-rows-of``); runs without a recorded machine are not counted."""
    counts: dict[str, int] = {}
    for r in record["runs"]:
        if r["status"] == "ok":
            m = r.get("machine") or record.get("machine")
            if not m:
                continue  # not recorded
            label = machine_label(m)
            counts[label] = counts.get(label, 0) + 1
    return counts


def machine_label(machine: Mapping[str, Any]) -> str:
    """A record's machine as its figures are tagged: the CPU model (or the GPU) and torch's version."""
    return f"{machine.get('cpu_model') or machine.get('cuda') or '?'}, torch {machine.get('torch') or '?'}"


ABLATION_METRICS = {"fd": METRICS["fd"].label, "val_loss_ema": EMA_LOSS_COLUMN}


def relative_change(summary: Mapping[str, Any], before: str, after: str, lr: str, key: str = "fd") -> float | None:
    """Relative change of the mean ``key`` (final FD, EMA val loss) from entry ``before`` to ``after`` at ``lr``
    (0.028: 2.8% worse)."""
    a = summary.get(before, {}).get(lr, {}).get(key, {}).get("mean")
    b = summary.get(after, {}).get(lr, {}).get(key, {}).get("mean")
    return b / a - 1.0 if a and b is not None else None


def best_entries(summary: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """Per lr (highest first) and metric (final FD, EMA val loss): the entry with the lowest mean over seeds (does
    the best gamma move with the lr? do FD and the loss pick the same?)."""
    out: dict[str, dict[str, str]] = {}
    for lr in sorted({lr for by_lr in summary.values() for lr in by_lr}, key=float, reverse=True):
        for key in ABLATION_METRICS:
            means = [
                (mean, name)
                for name, by_lr in summary.items()
                if (mean := by_lr.get(lr, {}).get(key, {}).get("mean")) is not None
            ]
            if means:
                out.setdefault(lr, {})[key] = METRICS[key].pick(means, key=lambda m: m[0])[1]
    return out


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(ax: Any, title: str) -> None:
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)


def _seconds(t: float) -> str:
    return f"{t:.0f} s" if t >= 10 else f"{t:.2g} s"


def plot_fd_vs_time(
    curves: Mapping[str, Sequence[Curve]],
    path: Path,
    target: float | None = None,
    title: str = "",
    time_basis: str = "run medians",
) -> Path | None:
    """FD against training time per optimizer: the mean over seeds at each evaluated step (time: steps x step
    ms, as ``time_basis`` says), a band from the lowest to the highest seed, the target FD dashed."""
    plt = _pyplot()
    drawn = {n: cs for n, cs in curves.items() if cs and all(c.step_ms is not None for c in cs)}
    if not drawn:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    every_fd: list[float] = []
    for name, cs in drawn.items():
        steps = sorted(set.intersection(*(set(c.steps) for c in cs)))
        fds = [[c.fds[c.steps.index(s)] for c in cs] for s in steps]
        times = [statistics.fmean(c.time_s(s) for c in cs) for s in steps]
        (line,) = ax.plot(
            times,
            [statistics.fmean(f) for f in fds],
            "o-",
            ms=3,
            label=f"{name} ({len(cs)} seed{'s' if len(cs) > 1 else ''})",
        )
        if len(cs) > 1:
            ax.fill_between(times, [min(f) for f in fds], [max(f) for f in fds], color=line.get_color(), alpha=0.15)
        every_fd += [x for f in fds for x in f]
    if target is not None:
        ax.axhline(target, ls="--", color="gray", lw=1, label=f"AdamW's quality, FD {target:.2f}")
    ax.set_xlabel(f"training time (s): {TIME_BASES[time_basis]}")
    fd_axes(ax, every_fd)
    _title(ax, title)
    ax.legend(fontsize=8)
    save_figure_atomic(fig, path, **SAVE_KWARGS)
    plt.close(fig)
    return path


def inception_of_runs(table: Mapping[str, Any], names: Collection[str]) -> dict[str, Any]:
    """A published Inception FD table (per optimizer: mean, lowest, highest and its runs) cut to the runs ``names``
    (those of the main record now: a run of an earlier lr is not one of the chosen lr's), the spreads taken again;
    optimizers with none of them left out."""
    out: dict[str, Any] = {}
    for name, entry in table.items():
        runs = [r for r in entry["runs"] if r["run"] in names]
        if runs:
            fds = [r["fd"] for r in runs]
            out[name] = {"fd_mean": statistics.fmean(fds), "fd_min": min(fds), "fd_max": max(fds), "runs": runs}
    return out


def reached_cell(entry: Mapping[str, Any]) -> str:
    """How many of an :func:`optimizer_summary` entry's seeds never got to the target, and how many have no curve
    here to tell (rows kept from a record made before curves were kept): not reached is not the same as not known."""
    seeds, curves = len(entry["seeds"]), entry.get("curves", len(entry["seeds"]))
    never = f"; {curves - entry['reached_target']} never" if entry["reached_target"] < curves else ""
    return never + (f"; {curves} of {seeds} seeds' curves here" if curves < seeds else "")


def plot_time_to_quality(summary: Mapping[str, Any], path: Path, title: str = "") -> Path | None:
    """One bar per optimizer: mean time to the target FD over seeds, whiskers from the fastest to the slowest
    seed, the ratio to AdamW written beside it; an optimizer some seed of which never got there is marked."""
    plt = _pyplot()
    rows = list(summary["optimizers"].items())
    if summary.get("target_fd") is None or not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 0.55 * len(rows) + 1.5))
    for i, (_, s) in enumerate(rows):
        t = s["time_to_target_s"]
        seeds = s.get("curves", len(s["seeds"]))
        if t["mean"] is None:
            ax.text(0, i, "  not reached", va="center", fontsize=8)
            continue
        ax.barh(i, t["mean"], color=f"C{i}", alpha=0.8)
        ax.errorbar(t["mean"], i, xerr=error_bars([t["mean"]], [t["min"]], [t["max"]]), color="black", capsize=3)
        ratio = f"{s['time_to_target_s_ratio']:.2f}x AdamW" if s.get("time_to_target_s_ratio") else ""
        missing = f", {seeds - s['reached_target']} of {seeds} seeds never" if s["reached_target"] < seeds else ""
        ax.text(
            t["max"],
            i,
            f"  {_seconds(t['mean'])}, {s['steps_to_target']['mean']:.0f} steps {ratio}{missing}",
            va="center",
            fontsize=8,
        )
    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.invert_yaxis()
    basis = TIME_BASES[summary.get("time_basis", "run medians")]
    ax.set_xlabel("\n".join(textwrap.wrap(f"training time to FD {summary['target_fd']:.2f} (s): {basis}", 80)))
    ax.set_xlim(0, max((s["time_to_target_s"]["max"] or 0) for _, s in rows) * 1.6 or 1)
    ax.grid(True, axis="x", alpha=0.3)
    _title(ax, title)
    save_figure_atomic(fig, path, **SAVE_KWARGS)
    plt.close(fig)
    return path


def plot_time_to_levels(
    levels: Mapping[str, Any], path: Path, title: str = "", time_basis: str = "run medians"
) -> Path | None:
    """Training time to each of the baseline's quality levels, one line per optimizer (mean over seeds; a level
    some seed never reached is left out), FD falling to the right: where each optimizer is ahead."""
    plt = _pyplot()
    if not levels["levels"]:
        return None
    metric = levels.get("metric", "fd")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in levels["optimizers"].items():
        shown = [r for r in rows if r["reached"] == r["seeds"] and r["time_s"]["mean"] is not None]
        if shown:
            ax.plot([r[metric] for r in shown], [r["time_s"]["mean"] for r in shown], "o-", ms=3, label=name)
    ax.invert_xaxis()
    ax.set_xlabel(
        f"{LEVEL_METRICS[metric]} to reach (lower is better), from {levels['baseline']}'s at its second "
        "evaluation to its best"
    )
    ax.set_ylabel("\n".join(textwrap.wrap(f"training time to it (s): {TIME_BASES[time_basis]}", 50)))
    ax.grid(True, alpha=0.3)
    _title(ax, title)
    ax.legend(fontsize=8)
    save_figure_atomic(fig, path, **SAVE_KWARGS)
    plt.close(fig)
    return path


def plot_gap_vs_params(sizes: Sequence[Mapping[str, Any]], path: Path, dataset: str = "") -> Path | None:
    """PeriodicRowMuon's EMA validation loss gap to Muon (each at its own chosen lr) against the model's
    parameters, whiskers from the best to the worst pairing of their seeds; None without a size."""
    if not sizes:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [s["params"] for s in sizes]
    ys = [100 * s["gap"] for s in sizes]
    lo = [max(0.0, y - 100 * s["gap_min"]) for y, s in zip(ys, sizes)]
    hi = [max(0.0, 100 * s["gap_max"] - y) for y, s in zip(ys, sizes)]
    ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", capsize=4)
    for x, y, s in zip(xs, ys, sizes):
        ax.annotate(s["model"], (x, y), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.axhline(0.5, color="gray", lw=0.8, ls="--", label='the paper\'s "within 0.5%" (FD, 1.3B-4B)')
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e6:.3g}M"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(xs)
    ax.set_xlabel("parameters")
    ax.set_ylabel("EMA validation loss, PeriodicRowMuon over Muon (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _title(ax, f"Does the gap shrink with scale? {dataset}, each optimizer at its own lr, 2 seeds")
    save_figure_atomic(fig, path, **SAVE_KWARGS)
    plt.close(fig)
    return path


def plot_fd_spread(record: Mapping[str, Any], path: Path, title: str = "") -> Path | None:
    """One panel per feature space of the ``fd`` part's record: every score of each optimizer's chosen runs (a
    point per checkpoint and sampling seed, a marker per training seed) and their mean, so that the spread over
    training seeds stands beside the gaps between optimizers; None without a row."""
    spaces = [space for space in ("classifier", "inception") if any(r["space"] == space for r in record["rows"])]
    if not spaces:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(spaces), figsize=(5.5 * len(spaces), 4), squeeze=False)
    names = sorted({n for n, by_space in record["optimizers"].items() if set(spaces) & set(by_space)})
    markers = "os^Dv"
    for ax, space in zip(axes[0], spaces):
        for x, name in enumerate(names):
            summary = record["optimizers"][name].get(space)
            if summary is None:
                continue
            ax.hlines(summary["mean"], x - 0.3, x + 0.3, color="black", lw=1.5)
            for row in summary["rows"]:
                offset = 0.12 * (row["sample_seed"] - 0.5)
                marker = markers[row["train_seed"] % len(markers)]
                ax.plot(x + offset, row["fd"], marker, color=f"C{row['train_seed']}", ms=6, alpha=0.8)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([f"{n}\nlr {record['lrs'][n]:g}" for n in names], fontsize=7)
        ax.set_ylabel(f"FD ({space} features, {record['samples']} samples)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_title(space, fontsize=9)
    from matplotlib.lines import Line2D

    seeds = sorted({r["train_seed"] for r in record["rows"]})
    handles = [
        Line2D([], [], marker=markers[s % len(markers)], color=f"C{s}", ls="", label=f"training seed {s}")
        for s in seeds
    ]
    handles.append(Line2D([], [], color="black", lw=1.5, label="mean"))
    axes[0][-1].legend(handles=handles, fontsize=7)
    if title:
        fig.suptitle(textwrap.fill(title, 110), fontsize=9)
    save_figure_atomic(fig, path, **SAVE_KWARGS)
    plt.close(fig)
    return path


def render_fd_spread(record: Mapping[str, Any]) -> str:
    """Markdown of the ``fd`` part's record: per optimizer and space the mean FD with its training seeds' and
    sampling seeds' half ranges, then every gap with whether it exceeds the two training-seed half ranges."""
    lines = [
        "| optimizer | lr | space | scores | mean FD | training seeds +- | sampling seeds +- |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, by_space in sorted(record["optimizers"].items()):
        for space, t in by_space.items():
            lines.append(
                f"| {name} | {record['lrs'][name]:g} | {space} | {len(t['rows'])} | {t['mean']:.2f} | "
                f"{_half_range(t['train_half_range'], t['mean'])} | {fmt_2f(t['sample_half_range'])} |"
            )
    if record.get("gaps"):
        lines += ["", "| space | a | b | gap (b - a) | training-seed half ranges, summed | resolved |"]
        lines.append("| --- | --- | --- | ---: | ---: | --- |")
        for g in record["gaps"]:
            lines.append(
                f"| {g['space']} | {g['a']} | {g['b']} | {g['gap']:+.2f} | {fmt_2f(g['noise'])} | "
                f"{'-' if g['resolved'] is None else 'yes' if g['resolved'] else 'no'} |"
            )
    return "\n".join(lines)


def _half_range(half: float | None, mean: float) -> str:
    """``2.00 (7%)``, or ``-`` while one training seed is scored."""
    return "-" if half is None else f"{half:.2f} ({100 * half / mean:.0f}%)"


def refresh_frontier(
    summaries: Mapping[str, Mapping[str, Any]], settings: Mapping[str, str]
) -> dict[str, list[dict[str, Any]]]:
    """Per lr that every schedule of ``summaries`` (schedule name -> an :func:`ablation_summary`) ran at, each entry
    with its share of Newton-Schulz steps and EMA validation loss (spreads over seeds), ``settings`` naming each
    entry's setting (``K=3``, ``threshold 0.35``); an adaptive entry (any schedule but the first, the fixed one)
    also gets ``fixed``: the first schedule's loss interpolated at its share, where that lies between two fixed
    entries, and ``verdict``: below/above it beyond both seed ranges, or inside them."""
    names = list(summaries)
    lrs = set.intersection(*(set(lr for by_lr in summ.values() for lr in by_lr) for summ in summaries.values()))
    out: dict[str, list[dict[str, Any]]] = {}
    for lr in sorted(lrs, key=float):
        rows = [
            {
                "schedule": schedule,
                "entry": entry,
                "setting": settings.get(entry, entry.split("/")[-1]),
                "spectral_fraction": by_lr[lr]["spectral_fraction"],
                "val_loss_ema": by_lr[lr]["val_loss_ema"],
            }
            for schedule, summ in summaries.items()
            for entry, by_lr in summ.items()
            if lr in by_lr
            and by_lr[lr]["spectral_fraction"]["mean"] is not None
            and by_lr[lr]["val_loss_ema"]["mean"] is not None
        ]
        fixed = sorted((r for r in rows if r["schedule"] == names[0]), key=lambda r: r["spectral_fraction"]["mean"])
        for r in rows:
            if r["schedule"] != names[0]:
                r["fixed"] = _interpolated(fixed, r["spectral_fraction"]["mean"])
                r["verdict"] = _frontier_verdict(r["val_loss_ema"], r["fixed"])
        out[lr] = rows
    return out


def _interpolated(fixed: Sequence[Mapping[str, Any]], share: float) -> dict[str, float] | None:
    """The fixed schedules' EMA validation loss (mean, lowest, highest) linearly interpolated at ``share`` between
    the two neighbouring entries; None outside their span."""
    for a, b in itertools.pairwise(fixed):
        x0, x1 = a["spectral_fraction"]["mean"], b["spectral_fraction"]["mean"]
        if x0 <= share <= x1:
            w = 0.0 if x1 == x0 else (share - x0) / (x1 - x0)
            return {k: (1 - w) * a["val_loss_ema"][k] + w * b["val_loss_ema"][k] for k in ("mean", "min", "max")}
    return None


def _frontier_verdict(loss: Mapping[str, Any], fixed: Mapping[str, float] | None) -> str:
    """``below`` (better) or ``above`` the fixed schedules at the same share of Newton-Schulz steps, where the seed
    ranges are apart; ``inside the seed ranges`` where they overlap; ``outside the fixed span`` without a
    comparison."""
    if fixed is None:
        return "outside the fixed span"
    if loss["max"] < fixed["min"]:
        return "below"
    if loss["min"] > fixed["max"]:
        return "above"
    return "inside the seed ranges"


def render_frontier(frontier: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """The refresh frontier as one Markdown table: per lr and entry its share of Newton-Schulz steps, its loss and,
    for the adaptive entries, the fixed schedules' loss at that share and the verdict."""
    from dimuon.bench.report import format_markdown_table

    headers = ["lr", "schedule", "setting", "spectral steps", "EMA val loss", "fixed K at that share", "verdict"]
    rows = [
        [
            lr,
            r["schedule"],
            r["setting"],
            _pm(r["spectral_fraction"], ".3f"),
            _pm(r["val_loss_ema"], ".4f"),
            "-" if r.get("fixed") is None else _pm({**r["fixed"], "n": 2}, ".4f"),
            r.get("verdict", "-"),
        ]
        for lr, entries in frontier.items()
        for r in entries
    ]
    return format_markdown_table(headers, rows, [i in (3, 4, 5) for i in range(len(headers))])


def plot_frontier(frontier: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, title: str = "") -> Path | None:
    """EMA validation loss against the share of Newton-Schulz steps, one line per schedule and lr (fixed periods
    joined, adaptive settings as points), whiskers over seeds; None without a point."""
    if not any(frontier.values()):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for lr, entries in frontier.items():
        for schedule in dict.fromkeys(r["schedule"] for r in entries):
            mine = sorted(
                (r for r in entries if r["schedule"] == schedule), key=lambda r: r["spectral_fraction"]["mean"]
            )
            xs = [r["spectral_fraction"]["mean"] for r in mine]
            means = [r["val_loss_ema"]["mean"] for r in mine]
            fixed = schedule == entries[0]["schedule"]
            label = schedule + (f", lr {lr}" if len(frontier) > 1 else "")
            (line,) = ax.plot(xs, means, "o-" if fixed else "s", label=label)
            ax.errorbar(
                xs,
                means,
                yerr=error_bars(
                    means, [r["val_loss_ema"]["min"] for r in mine], [r["val_loss_ema"]["max"] for r in mine]
                ),
                fmt="none",
                color=line.get_color(),
                capsize=3,
                alpha=0.6,
            )
            for x, y, r in zip(xs, means, mine):
                ax.annotate(r["setting"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
    ax.set_xlabel("share of Newton-Schulz (spectral) steps")
    ax.set_ylabel(f"final {EMA_LOSS_COLUMN} (mean, whiskers over seeds)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _title(ax, title)
    save_figure_atomic(fig, path, **SAVE_KWARGS)
    plt.close(fig)
    return path


def plot_ablation(
    summary: Mapping[str, Any],
    points: Mapping[str, tuple[float | str, str]],
    path: Path,
    xlabel: str,
    title: str = "",
    log_x: bool = False,
) -> Path | None:
    """Final FD (left) and EMA validation loss (right) of an ablation: ``points`` maps each entry to its x value
    and the line it belongs to (one line per line name and lr); means over seeds joined, whiskers over seeds.
    String x values are categories."""
    plt = _pyplot()
    placed = [
        (name, *points[name], lr, s)
        for name, by_lr in summary.items()
        if name in points
        for lr, s in by_lr.items()
        if s["fd"]["mean"] is not None
    ]
    if not placed:
        return None
    categories = list(dict.fromkeys(x for _, x, *_ in placed if isinstance(x, str)))
    lrs = {lr for *_, lr, _ in placed}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key in zip(axes, ABLATION_METRICS, strict=True):
        every: list[float] = []
        for line_name in dict.fromkeys(ln for _, _, ln, _, _ in placed):
            for lr in sorted(lrs, key=float):
                mine = sorted(
                    (
                        (categories.index(x) if isinstance(x, str) else x, s[key])
                        for _, x, ln, lr_, s in placed
                        if ln == line_name and lr_ == lr and s.get(key, {}).get("mean") is not None
                    ),
                    key=lambda p: p[0],
                )
                if not mine:
                    continue
                label = " ".join(p for p in (line_name, f"lr {lr}" if len(lrs) > 1 else "") if p)
                xs, values = [x for x, _ in mine], [v for _, v in mine]
                means = [v["mean"] for v in values]
                (line,) = ax.plot(xs, means, "o" if categories else "o-", label=label or None)  # categories: unjoined
                ax.errorbar(
                    xs,
                    means,
                    yerr=error_bars(means, [v["min"] for v in values], [v["max"] for v in values]),
                    fmt="none",
                    color=line.get_color(),
                    capsize=3,
                    alpha=0.6,
                )
                every += [v["min"] for v in values] + [v["max"] for v in values]
        if categories:
            ax.set_xticks(range(len(categories)), categories, fontsize=8)
        if log_x:
            ax.set_xscale("log")
            ax.set_xticks(
                [x for _, x, *_ in placed if not isinstance(x, str)],
                [f"{x:g}" for _, x, *_ in placed if not isinstance(x, str)],
            )
        ax.set_xlabel("\n".join(textwrap.wrap(xlabel, 52)))  # two panels side by side: long labels would meet
        if key == "fd":
            fd_axes(ax, every)
        else:
            ax.grid(True, alpha=0.3)
        ax.set_ylabel(f"final {ABLATION_METRICS[key]} ({METRICS[key].axis_note})")
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle("\n".join(textwrap.wrap(title, 130)), fontsize=9)
    save_figure_atomic(fig, path, **SAVE_KWARGS)
    plt.close(fig)
    return path


def plot_sample_grids(curves: Mapping[str, Sequence[Curve]], path: Path, title: str = "") -> Path | None:
    """The last evaluation's sample grid of each optimizer's first seed side by side (same classes and noise
    for every optimizer: the sampler's seed is the evaluation's)."""
    plt = _pyplot()
    from matplotlib.image import imread

    shown = [(name, cs[0]) for name, cs in curves.items() if cs and cs[0].grid]
    if not shown:
        return None
    images = [imread(c.grid) for _, c in shown]
    aspect = images[0].shape[0] / images[0].shape[1]
    fig, axes = plt.subplots(1, len(shown), figsize=(3.2 * len(shown), 3.2 * aspect + 0.9), squeeze=False)
    for ax, (name, c), image in zip(axes[0], shown, images):
        ax.imshow(image, cmap="gray")
        ax.set_title(f"{name}\nseed {c.seed}, step {c.steps[-1]}, FD {c.fds[-1]:.1f}", fontsize=8)
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=9)
    save_figure_atomic(fig, path, **SAVE_KWARGS)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------


def _pm(s: Mapping[str, Any], spec: str = ".2f") -> str:
    """``mean (min..max)`` of a :func:`spread`, ``mean`` alone for one value, a dash for none."""
    if s["mean"] is None:
        return "-"
    if s["n"] == 1:
        return format(s["mean"], spec)
    return f"{s['mean']:{spec}} ({s['min']:{spec}}..{s['max']:{spec}})"


def fmt_2f(value: float | None) -> str:
    """A number to two decimals, a dash where it was not measured (None)."""
    return "-" if value is None else f"{value:.2f}"


def render_main(main: Mapping[str, Any], inception: Mapping[str, Any] | None = None) -> str:
    """The main race as a Markdown table: per optimizer at its best lr, the spread over seeds of every number."""
    from dimuon.bench.report import format_markdown_table

    headers = [
        "optimizer",
        "lr",
        "seeds",
        "final FD",
        "x AdamW",
        "last FD change",
        "Inception FD",
        "precision",
        "recall",
        "EMA val loss",
        *(
            ("opt ms/step", "step ms")
            if main.get("time_basis") != "side by side"
            else ("opt ms/step (side by side)", "step ms (side by side)")
        ),
        "time to AdamW's FD (s)" if main["target_fd"] is None else f"time to FD {main['target_fd']:.2f} (s)",
        "x AdamW",
        "steps to it",
    ]
    rows = []
    for name, s in main["optimizers"].items():
        inc = (inception or {}).get(name)
        inc_cell = (
            "-"
            if not inc
            else (
                f"{inc['fd_mean']:.2f} ({inc['fd_min']:.2f}..{inc['fd_max']:.2f})"
                if len(inc["runs"]) > 1
                else f"{inc['fd_mean']:.2f}"
            )
        )
        seeds = len(s["seeds"])
        reached = reached_cell(s)
        change = s["fd_last_change"]
        rows.append(
            [
                name,
                f"{s['lr']:g}" if s["lr"] is not None else "-",
                seeds,
                _pm(s["fd"]),
                fmt_2f(s["fd_ratio"]),
                "-" if change["mean"] is None else f"{100 * change['mean']:+.1f}%",
                inc_cell,
                _pm(s["precision"]),
                _pm(s["recall"]),
                _pm(s["val_loss_ema"], ".4f"),
                _pm(s["opt_ms"], ".1f"),
                _pm(s["step_ms"], ".0f"),
                _pm(s["time_to_target_s"], ".0f") + reached,
                fmt_2f(s["time_to_target_s_ratio"]),
                _pm(s["steps_to_target"], ".0f"),
            ]
        )
    return format_markdown_table(headers, rows, [i > 1 for i in range(len(headers))])


def render_levels(levels: Mapping[str, Any]) -> str:
    """Time to each of the baseline's quality levels as a Markdown table: mean seconds, the ratio to the baseline
    (``<=`` where some seed got there at its first evaluation: an upper bound) and, where some seed never got
    there, how many did."""
    from dimuon.bench.report import format_markdown_table

    metric = levels.get("metric", "fd")
    spec = ".2f" if metric == "fd" else ".4f"
    headers = [
        "optimizer",
        *(
            f"{LEVEL_METRICS[metric]} {lv[metric]:{spec}} ({levels['baseline']} step {lv['step']})"
            for lv in levels["levels"]
        ),
    ]
    rows = []
    for name, cells in levels["optimizers"].items():
        row = [name]
        for c in cells:
            if c["reached"] < c["seeds"]:
                row.append(f"{c['reached']} of {c['seeds']} seeds" if c["reached"] else "never")
            else:
                bound = "<=" if c["bounded"] else ""
                row.append(f"{bound}{c['time_s']['mean']:.0f} s ({bound}{fmt_2f(c['ratio'])}x)")
        rows.append(row)
    return format_markdown_table(headers, rows, [i > 0 for i in range(len(headers))])


def render_ablation(summary: Mapping[str, Any]) -> str:
    """An ablation as a Markdown table: one row per entry and lr."""
    from dimuon.bench.report import format_markdown_table

    headers = ["entry", "lr", "seeds", "final FD", "EMA val loss", "spectral steps", "opt ms/step"]
    rows = [
        [
            name,
            lr,
            len(s["seeds"]),
            _pm(s["fd"]),
            _pm(s["val_loss_ema"], ".4f"),
            _pm(s["spectral_fraction"], ".3f"),
            _pm(s["opt_ms"], ".1f"),
        ]
        for name, by_lr in summary.items()
        for lr, s in by_lr.items()
    ]
    return format_markdown_table(headers, rows, [i > 1 for i in range(len(headers))])
