"""``dimuon eval --compare``: several evaluated runs side by side (FD against step and active time, best FD).

It reads each run's results store, picks the series with the given sampling settings, refuses runs
scored in different feature spaces, and writes ``compare_fd.png``, ``compare.md`` and ``compare.json``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dimuon.io import RunLayout, save_figure_atomic, write_json_atomic, write_text_atomic
from dimuon.metrics.eval_settings import EvalSettings
from dimuon.metrics.plots import SAVE_KWARGS, fd_axes
from dimuon.metrics.registry import METRICS
from dimuon.metrics.results import (
    RESULTS_FORMAT,
    describe_settings,
    feature_space_test,
    format_value,
    load_results,
    ok_entries,
    pick_series,
    real_subset_words,
    summarize,
)

__all__ = ["compare_runs", "run_label"]


def run_label(run: Path) -> str:
    """The run directory's name, with the optimizer from its ``config.json`` when that names one."""
    try:
        optimizer = json.loads(RunLayout(run).config.read_text(encoding="utf-8")).get("optimizer")
    except (OSError, ValueError, AttributeError):
        optimizer = None
    return f"{run.name} ({optimizer})" if isinstance(optimizer, str) and optimizer not in run.name else run.name


def real_set(settings: dict[str, Any]) -> tuple[str, int, str | None]:
    """What a series was scored against: its data set as built (name and every option, e.g. root and image size),
    the number of real images and how they were chosen from part of the split."""
    return json.dumps(settings["dataset"], sort_keys=True), settings["num_real"], settings.get("real_subset")


def describe_real_set(settings: dict[str, Any]) -> str:
    """``N images of NAME`` and the data set's options where it has any."""
    dataset = settings["dataset"]
    options = ", ".join(f"{k}={v}" for k, v in sorted((dataset.get("kwargs") or {}).items()))
    described = f"{settings['num_real']} images of {dataset['name']}" + (f" ({options})" if options else "")
    return described + real_subset_words(settings)


def compare_runs(runs: Sequence[Path], settings: EvalSettings, out: Path) -> dict[str, Any]:
    """FD against step and active time of several evaluated runs in one figure, and a table of best FD per run.

    ``settings`` pick each run's series (the sampling settings and feature space it was evaluated with);
    the outputs go to ``out``. Returns the JSON record with the output paths.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compared = []
    space = feature_space_test(settings)  # once for every run (a DINOv2 weights file is hashed)
    for run in (Path(r).resolve() for r in runs):  # "." has no name to show
        path = RunLayout(run).results
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: run 'dimuon eval --run {run}' first")
        key, ev = pick_series(load_results(path), settings, path, space)
        if not ok_entries(ev["entries"]):
            raise ValueError(f"{path}: series {key} has no successfully evaluated checkpoint")
        compared.append({"run": str(run), "name": run_label(Path(run)), "key": key, "series": ev})
    spaces = {r["series"]["settings"]["feature_key"] for r in compared}
    if len(spaces) > 1:
        raise ValueError(f"the runs were scored in different feature spaces {sorted(spaces)}: FDs are not comparable")
    real_sets = {real_set(r["series"]["settings"]) for r in compared}
    if len(real_sets) > 1:
        each = ", ".join(f"{r['name']}: {describe_real_set(r['series']['settings'])}" for r in compared)
        raise ValueError(
            f"the runs' series were scored against different real sets ({each}): FDs are not comparable; pass "
            "--num-real N to pick series of one size (evaluate a run with it first where it has none)"
        )
    # The FD every run reaches: the worst of the best. Time to reach it compares optimizers at equal quality.
    fd = METRICS["fd"]
    target = fd.worst(fd.best(e["fd"] for e in ok_entries(r["series"]["entries"])) for r in compared)
    for r in compared:
        r["summary"] = summarize(r["series"]["entries"], target)

    series_settings = compared[0]["series"]["settings"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in compared:
        ok = ok_entries(r["series"]["entries"])
        axes[0].plot([e["step"] for e in ok], [e["fd"] for e in ok], "o-", label=r["name"])
        timed = [e for e in ok if e.get("active_time_s") is not None]
        axes[1].plot([e["active_time_s"] for e in timed], [e["fd"] for e in timed], "o-", label=r["name"])
    all_fd = [e["fd"] for r in compared for e in ok_entries(r["series"]["entries"])]
    for ax, xlabel in zip(axes, ("training step", "active training time (s)")):
        ax.set_xlabel(xlabel)
        fd_axes(ax, all_fd)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"FD in {series_settings['feature_space']} ({series_settings['sampler']} {series_settings['sample_steps']}, "
        f"cfg {series_settings['cfg_scale']:g}, N={series_settings['num_samples']})",
        fontsize=10,
    )
    out = Path(out)
    save_figure_atomic(fig, out / "compare_fd.png", **SAVE_KWARGS)
    plt.close(fig)

    write_text_atomic(out / "compare.md", "\n".join(_table(compared, series_settings, target)) + "\n")
    record = {
        "format": RESULTS_FORMAT,
        "settings": series_settings,
        "target_fd": target,
        "runs": [{k: r[k] for k in ("run", "name", "key", "summary")} for r in compared],
    }
    write_json_atomic(out / "compare.json", record)
    return {**record, "outputs": [str(out / n) for n in ("compare.md", "compare.json", "compare_fd.png")]}


def _table(compared: list[dict[str, Any]], settings: dict[str, Any], target: float) -> list[str]:
    """The Markdown lines of ``compare.md``: the settings, the target FD and one row per run."""
    lines = [
        "# Generation quality: run comparison",
        "",
        describe_settings(settings),
        "",
        f"Target FD {target:.3f}: the best FD of the worst run, i.e. a quality every run reaches.",
        "",
        "| run | best FD | at step | active time (s) | precision | recall | last FD (step) | "
        "step to target | active time to target (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in compared:
        s = r["summary"]
        lines.append(
            f"| {r['name']} | {s['best_fd']:.3f} | {s['best_step']} | {format_value(s['best_active_time_s'], 1)} | "
            f"{s['best_precision']:.3f} | {s['best_recall']:.3f} | {s['last_fd']:.3f} ({s['last_step']}) | "
            f"{format_value(s['target_step'])} | {format_value(s['target_active_time_s'], 1)} |"
        )
    return lines
