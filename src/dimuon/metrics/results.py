"""The results store of a run's generation-quality evaluations: ``<run>/eval/results.json`` and ``results.md``.

A results file holds one *series* per set of settings (everything that changes the numbers: feature
space, data set, sample counts, seed, sampler, steps, guidance, EMA), keyed by a hash of them; each
series lists one entry per evaluated step. ``dimuon eval`` and ``dimuon train --eval.*`` write the
same series, ``dimuon eval --compare`` and ``dimuon bench quality`` read them. This module loads,
filters, picks a series, truncates, summarizes and renders Markdown; it computes no metric. Every change is
a read-change-write under a lock (:func:`update_results`), so processes writing one run's file at once (training
and ``dimuon eval``) keep each other's entries.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dimuon.io import RunLayout, locked, remove_steps_after, write_json_atomic, write_text_atomic
from dimuon.metrics.eval_settings import EvalSettings, sampling_settings
from dimuon.metrics.registry import GENERATION
from dimuon.metrics.registry import METRICS as REGISTRY

__all__ = [
    "METRICS",
    "RESULTS_FORMAT",
    "describe_settings",
    "format_value",
    "load_results",
    "markdown",
    "ok_entries",
    "pick_series",
    "save_results",
    "settings_key",
    "summarize",
    "truncate_results",
    "update_results",
]

RESULTS_FORMAT = 1
METRICS = GENERATION
"""The scores of every entry of a series, in table order."""
FD = REGISTRY["fd"]


def load_results(path: Path) -> dict[str, Any]:
    """The results file, or an empty one; a file of another format is an error rather than overwritten."""
    if not path.is_file():
        return {"format": RESULTS_FORMAT, "evaluations": {}}
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("format") != RESULTS_FORMAT or not isinstance(data.get("evaluations"), dict):
        raise ValueError(f"{path} is not a dimuon eval results file of format {RESULTS_FORMAT}")
    return data


def save_results(layout: RunLayout, results: dict[str, Any]) -> None:
    """Write ``results.json`` and its Markdown rendering ``results.md`` atomically."""
    write_json_atomic(layout.results, results)
    write_text_atomic(layout.results_md, markdown(results, layout.root.resolve().name))


def update_results(layout: RunLayout, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Read ``results.json`` as it is now, apply ``change`` to it and write it back (with ``results.md``), holding
    ``eval/.results.lock`` throughout: the processes that write one run's results (the training run, any number
    of ``dimuon eval``) never lose each other's entries. Returns what was written."""
    layout.eval.mkdir(parents=True, exist_ok=True)
    with locked(layout.results_lock):
        results = load_results(layout.results)
        change(results)
        save_results(layout, results)
    return results


def settings_key(settings: dict[str, Any]) -> str:
    """Ten hex digits of a hash of the settings: one results series per key."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


def ok_entries(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The successfully scored entries of a series (failed checkpoints are recorded too)."""
    return [e for e in entries if e.get("status") == "ok"]


def truncate_results(run: Path, max_step: int) -> int:
    """Drop every series' entries (and grids) after `max_step`: a run resumed there rewrites them; returns how many."""
    layout = RunLayout(run)
    if not layout.results.is_file():
        return 0
    dropped = 0

    def drop(results: dict[str, Any]) -> None:
        nonlocal dropped
        for key, ev in results["evaluations"].items():
            kept = [e for e in ev["entries"] if e["step"] <= max_step]
            dropped += len(ev["entries"]) - len(kept)
            ev["entries"] = kept
            remove_steps_after(layout.eval_grids(key), max_step)

    update_results(layout, drop)
    return dropped


def newest_first(series: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """Series ``(key, series)`` most recently updated first. Stamps are compared as instants (any UTC offset); of
    series stamped alike (two evaluations in one stamp's tick) the later in the file, i.e. the one added last, wins."""

    def instant(ev: dict[str, Any]) -> float:
        stamp = ev.get("updated") or ev.get("created")
        return datetime.datetime.fromisoformat(stamp).timestamp() if stamp else -math.inf

    order = sorted(range(len(series)), key=lambda i: (instant(series[i][1]), i), reverse=True)
    return [series[i] for i in order]


def feature_space_test(cfg: EvalSettings) -> tuple[str, Callable[[dict[str, Any]], bool]]:
    """The feature space `cfg` names, in words, and a test of a series' settings for it: the classifier's of any
    data set, Inception's, or DINOv2's of ``dinov2_arch`` (and of the ``dinov2_weights`` file, where given)."""
    from dimuon.metrics.features.dinov2 import dinov2_space
    from dimuon.metrics.features.inception import INCEPTION_SPACE

    if cfg.features == "dinov2":
        space = dinov2_space(cfg.dinov2_arch)
        if cfg.dinov2_weights is None:
            return space, lambda s: s["feature_space"] == space
        from dimuon.metrics.generation import dinov2_feature_key  # reads the weights file: only where asked for

        key = dinov2_feature_key(cfg.dinov2_arch, cfg.dinov2_weights)
        return f"{space} ({cfg.dinov2_weights})", lambda s: s.get("feature_key") == key
    if cfg.features == "inception":
        return INCEPTION_SPACE, lambda s: s["feature_space"] == INCEPTION_SPACE
    return f"{cfg.features}", lambda s: s["feature_space"].startswith(f"{cfg.features}-")


def pick_series(
    results: dict[str, Any],
    cfg: EvalSettings,
    where: Path,
    space: tuple[str, Callable[[dict[str, Any]], bool]] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The series of a results file made with the sampling settings and feature space of `cfg`, against a real set
    of `cfg.num_real` images where given (the latest, if several). ``space``: :func:`feature_space_test` of `cfg`
    where the caller picks from several runs (made once: it may hash a weights file)."""
    want = sampling_settings(cfg)
    space, in_space = space or feature_space_test(cfg)
    matches = [
        (key, ev)
        for key, ev in results["evaluations"].items()
        if all(ev["settings"].get(k) == v for k, v in want.items()) and in_space(ev["settings"])
    ]
    if not matches:
        have = "\n".join(f"  {k}: {describe_settings(ev['settings'])}" for k, ev in results["evaluations"].items())
        raise ValueError(
            f"{where} has no series with {space} features and {want}; pass the flags used to evaluate it. "
            f"It has:\n{have or '  (nothing)'}"
        )
    if cfg.num_real is not None:  # the size asked for (a real set capped at the split's size holds fewer)
        matches = [m for m in matches if m[1]["settings"].get("num_real") == cfg.num_real] or matches
    return newest_first(matches)[0]


def summarize(entries: list[dict[str, Any]], target: float | None) -> dict[str, Any]:
    """Best and last FD of a series, and the first step and active time at which FD <= target."""
    ok = ok_entries(entries)
    best = FD.pick(ok, key=lambda e: e["fd"])
    reach = next((e for e in ok if target is not None and FD.reaches(e["fd"], target)), None)
    return {
        "best_fd": best["fd"],
        "best_step": best["step"],
        "best_active_time_s": best.get("active_time_s"),
        "best_precision": best["precision"],
        "best_recall": best["recall"],
        "last_fd": ok[-1]["fd"],
        "last_step": ok[-1]["step"],
        "checkpoints": len(ok),
        "target_step": None if reach is None else reach["step"],
        "target_active_time_s": None if reach is None else reach.get("active_time_s"),
    }


# --------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------


def format_value(v: Any, digits: int = 3) -> str:
    """A table cell: floats with ``digits`` decimals, a dash for a missing value."""
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def describe_settings(s: dict[str, Any]) -> str:
    """One line naming everything behind a series' numbers."""
    return (
        f"feature space `{s['feature_space']}` · {s['num_samples']} samples (class-balanced, seed {s['seed']}) · "
        f"{s['sampler']} {s['sample_steps']} steps, cfg {s['cfg_scale']:g} · "
        f"{'EMA' if s['ema'] else 'raw'} weights · real set: {s['num_real']} images of the "
        f"`{s['dataset']['name']}` val split{real_subset_words(s)}"
    )


def real_subset_words(s: dict[str, Any]) -> str:
    """How a series' real set was chosen from part of its split, in words (nothing for the whole split)."""
    if s.get("real_subset"):
        return f" ({s['real_subset']})"
    return ""


def markdown(results: dict[str, Any], run_name: str) -> str:
    """All series of a results file as Markdown tables (most recently updated first)."""
    lines = [f"# Generation quality: `{run_name}`", ""]
    for key, ev in newest_first(list(results["evaluations"].items())):
        s = ev["settings"]
        lines += [f"## Settings `{key}`", "", describe_settings(s), ""]
        ref = ev.get("reference")
        if ref:
            lines += [
                f"Reference ({ref['n_fake']} training images against the same real set, i.e. a generator "
                "equal to the data at this sample count): "
                + ", ".join(f"{REGISTRY[m].label} {ref[m]:.3f}" for m in METRICS)
                + ".",
                "",
            ]
        lines += [
            "| " + " | ".join(["step", *(REGISTRY[k].heading for k in ("active_time_s", *METRICS, "eval_s"))]) + " |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for e in ev["entries"]:
            if e.get("status") != "ok":
                lines.append(f"| {e['step']} | — | failed: {e.get('error', '?')} | | | | | |")
                continue
            t = format_value(e.get("active_time_s"), 1)
            vals = " | ".join(format_value(e[m]) for m in METRICS)
            lines.append(f"| {e['step']} | {t} | {vals} | {format_value(e.get('eval_s'), 1)} |")
        lines.append("")
    return "\n".join(lines)
