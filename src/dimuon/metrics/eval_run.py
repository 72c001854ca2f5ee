"""``dimuon eval``: generation quality (FD, precision/recall/density/coverage) over a run's checkpoints.

For every complete checkpoint of ``--run`` (EMA weights by default) it draws a fixed, seeded, class-balanced
set of samples, scores them against the run's held-out split in one feature space, and writes
``<run>/eval/results.json``, ``results.md``, ``fd_vs_step.png`` and ``fd_vs_time.png``. Results are keyed by
a hash of everything that changes the numbers (feature space, sampler, seed, counts, EMA), so changing a
setting starts a new series instead of mixing numbers, and a rerun skips the checkpoints already scored.
``--compare RUN ...`` plots and tabulates already-evaluated runs side by side.

Run ``dimuon eval --help`` (or ``python -m dimuon.metrics.eval_run --help``).
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import json
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import tyro
from tqdm.auto import tqdm

from dimuon.io import (
    RunLayout,
    read_jsonl,
    remove_steps_after,
    save_figure_atomic,
    save_grid,
    write_json_atomic,
    write_text_atomic,
)
from dimuon.metrics.eval_settings import (
    EvalSettings,
    build_evaluator,
    check_eval_settings,
    sampling_settings,
)
from dimuon.metrics.generation import GenerationEvaluator

RESULTS_FORMAT = 1
METRICS = ("fd", "precision", "recall", "density", "coverage")


@dataclass
class Config(EvalSettings):
    """Generation quality (FD, precision/recall/density/coverage) over a run's checkpoints."""

    run: Path | None = None
    """Run directory (holds checkpoints/ and metrics.jsonl); outputs go to <run>/eval/."""
    compare: tuple[Path, ...] = ()
    """Instead of evaluating: compare already-evaluated runs (FD vs step and vs active time, best FD)."""
    every: int = 1
    """Evaluate every K-th checkpoint in step order (always including the latest)."""
    device: str = "auto"
    """Device for sampling and features: auto (cuda if available), cpu, cuda, cuda:1, ..."""
    threads: int | None = None
    """CPU intra-op threads (default: torch's; 1 is much faster for tiny models on busy cores)."""
    out: Path = Path("eval-compare")
    """Output directory of --compare."""
    progress: bool = True
    """Progress bars."""


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------


def load_results(path: Path) -> dict[str, Any]:
    """The results file, or an empty one; a file of another format is an error rather than overwritten."""
    if not path.is_file():
        return {"format": RESULTS_FORMAT, "evaluations": {}}
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("format") != RESULTS_FORMAT or not isinstance(data.get("evaluations"), dict):
        raise ValueError(f"{path} is not a dimuon eval results file of format {RESULTS_FORMAT}")
    return data


def settings_key(settings: dict[str, Any]) -> str:
    """Ten hex digits of a hash of the settings: one results series per key."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


def select_checkpoints(checkpoints: Sequence[tuple[int, Path]], every: int) -> list[tuple[int, Path]]:
    """Every `every`-th checkpoint in step order, plus the latest."""
    if every < 1:
        raise ValueError(f"--every must be >= 1, got {every}")
    chosen = [c for i, c in enumerate(checkpoints) if i % every == 0]
    if checkpoints and chosen[-1] != checkpoints[-1]:
        chosen.append(checkpoints[-1])
    return chosen


def active_time_from_metrics(run: Path, step: int) -> float | None:
    """Active training seconds at `step` from ``metrics.jsonl`` (last row at or before it), if logged."""
    best: tuple[int, float] | None = None
    for row in read_jsonl(RunLayout(run).metrics):
        s, t = row.get("step"), row.get("active_time_s")
        if (
            isinstance(s, int)
            and isinstance(t, (int, float))
            and s <= step
            and (best is None or s >= best[0])
        ):
            best = (s, float(t))
    return None if best is None else best[1]


def feature_cache_dir(run: Path, settings: EvalSettings) -> Path:
    """The feature cache of a run's evaluations: ``settings.cache_dir``, or ``<run>/eval/feature_cache``."""
    return Path(settings.cache_dir or RunLayout(run).feature_cache)


def truncate_results(run: Path, max_step: int) -> int:
    """Drop every series' entries (and grids) after `max_step`: a run resumed there rewrites them; returns how many."""
    layout = RunLayout(run)
    if not layout.results.is_file():
        return 0
    results = load_results(layout.results)
    dropped = 0
    for key, ev in results["evaluations"].items():
        kept = [e for e in ev["entries"] if e["step"] <= max_step]
        dropped += len(ev["entries"]) - len(kept)
        ev["entries"] = kept
        remove_steps_after(layout.eval_grids(key), max_step)
    if dropped:
        write_json_atomic(layout.results, results)
        write_text_atomic(layout.results_md, markdown(results, layout.root.name))
    return dropped


def save_eval_grid(images: torch.Tensor, num_classes: int, path: Path, max_images: int = 100) -> None:
    """The first samples as a PNG grid on white; with at most 16 classes each column is one class."""
    ncol = num_classes if num_classes <= 16 else 10
    n = min(images.shape[0], max_images - max_images % ncol if max_images >= ncol else ncol)
    side = max(images.shape[-2:])
    save_grid(images[:n], path, nrow=ncol, scale=max(1, 64 // side), pad=1, background=1.0)


# --------------------------------------------------------------------------------------------------
# Tables and plots
# --------------------------------------------------------------------------------------------------


def _fmt(v: Any, digits: int = 3) -> str:
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
        f"`{s['dataset']['name']}` val split"
    )


def markdown(results: dict[str, Any], run_name: str) -> str:
    """All series of a results file as Markdown tables (most recently updated first)."""
    lines = [f"# Generation quality: `{run_name}`", ""]
    series = sorted(results["evaluations"].items(), key=lambda kv: kv[1].get("updated", ""), reverse=True)
    for key, ev in series:
        s = ev["settings"]
        lines += [f"## Settings `{key}`", "", describe_settings(s), ""]
        ref = ev.get("reference")
        if ref:
            lines += [
                f"Reference ({ref['n_fake']} training images against the same real set, i.e. a generator "
                f"equal to the data at this sample count): FD {ref['fd']:.3f}, precision {ref['precision']:.3f}, "
                f"recall {ref['recall']:.3f}, density {ref['density']:.3f}, coverage {ref['coverage']:.3f}.",
                "",
            ]
        lines += [
            "| step | active time (s) | FD | precision | recall | density | coverage | eval (s) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for e in ev["entries"]:
            if e.get("status") != "ok":
                lines.append(f"| {e['step']} | — | failed: {e.get('error', '?')} | | | | | |")
                continue
            t = _fmt(e.get("active_time_s"), 1)
            vals = " | ".join(_fmt(e[m]) for m in METRICS)
            lines.append(f"| {e['step']} | {t} | {vals} | {_fmt(e.get('eval_s'), 1)} |")
        lines.append("")
    return "\n".join(lines)


def ok_entries(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The successfully scored entries of a series (failed checkpoints are recorded too)."""
    return [e for e in entries if e.get("status") == "ok"]


def _fd_axes(ax: Any, fds: list[float]) -> None:
    ax.set_ylabel("FD (lower is better)")
    ax.grid(True, alpha=0.3)
    pos = [f for f in fds if f > 0]
    if len(pos) == len(fds) and pos and max(pos) / min(pos) > 10:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)


def plot_series(ev: dict[str, Any], run_name: str, out_dir: Path) -> list[Path]:
    """``fd_vs_step.png`` and ``fd_vs_time.png`` of one series; the reference FD as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = ok_entries(ev["entries"])
    s, ref = ev["settings"], ev.get("reference")
    written = []
    for xkey, xlabel, name in (
        ("step", "training step", "fd_vs_step.png"),
        ("active_time_s", "active training time (s)", "fd_vs_time.png"),
    ):
        pts = [(e[xkey], e["fd"]) for e in entries if e.get(xkey) is not None]
        fig, ax = plt.subplots(figsize=(6, 4))
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, "o-", label=run_name)
        if ref:
            ax.axhline(ref["fd"], ls="--", color="gray", label=f"training data, N={ref['n_fake']}")
        ax.set_xlabel(xlabel)
        ax.set_title(
            f"FD in {s['feature_space']}\n{s['sampler']} {s['sample_steps']}, cfg {s['cfg_scale']:g}, "
            f"N={s['num_samples']}",
            fontsize=9,
        )
        _fd_axes(ax, [p[1] for p in pts] + ([ref["fd"]] if ref else []))
        ax.legend(fontsize=8)
        save_figure_atomic(fig, out_dir / name, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(out_dir / name)
    return written


# --------------------------------------------------------------------------------------------------
# Evaluating a run
# --------------------------------------------------------------------------------------------------


def _checkpoint_module() -> Any:
    # The command layer may reach up to the training code; the metric modules never do.
    return importlib.import_module("dimuon.train.checkpoint")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


class NoCheckpointsError(FileNotFoundError):
    """The run directory holds no complete checkpoint (yet)."""


class RunEvaluation:
    """One run's ``eval/results.json``: the series of one set of settings, its evaluator (built lazily), its files.

    ``dimuon eval`` fills it from checkpoints (:meth:`run_all`); the training loop fills it as it trains
    (:meth:`setup` once, then :meth:`record_scores` per evaluation).
    """

    def __init__(
        self, run: Path, settings: EvalSettings, device: str | torch.device = "auto", progress: bool = True
    ) -> None:
        self.settings = settings
        self.run = Path(run)
        self.out_dir = self.run / "eval"
        self.results_path = self.out_dir / "results.json"
        self.results = load_results(self.results_path)
        self.evaluator: GenerationEvaluator | None = None
        self.key: str | None = None
        self.device = _device(device) if isinstance(device, str) else device
        self.progress = progress

    @property
    def cache_dir(self) -> Path:
        """Where the feature classifier and the real-set features are cached."""
        return feature_cache_dir(self.run, self.settings)

    @property
    def series(self) -> dict[str, Any]:
        assert self.key is not None
        return self.results["evaluations"][self.key]

    def done_steps(self) -> set[int]:
        """Steps of this series already scored (failed ones are retried)."""
        return {e["step"] for e in ok_entries(self.series["entries"])}

    def setup(self, info: dict[str, Any]) -> None:
        """Build the evaluator from the first loadable checkpoint's data set, and open this settings' series."""
        cfg, ds = self.settings, info["dataset"]
        kwargs = dict(ds.get("kwargs") or {})
        ev = build_evaluator(cfg, ds["name"], kwargs, self.cache_dir, self.device, self.progress)
        shape = tuple(int(v) for v in info["image_shape"])
        if shape != ev.image_shape or int(info["num_classes"]) != ev.num_classes:
            raise ValueError(
                f"the checkpoint's model ({shape}, {info['num_classes']} classes) does not match its data set "
                f"{ds['name']} ({ev.image_shape}, {ev.num_classes} classes)"
            )
        settings = {
            "feature_space": ev.feature_space,
            "feature_key": ev.feature_key,
            "dataset": {"name": ds["name"], "kwargs": dict(ds.get("kwargs") or {})},
            "num_real": int(ev.real_feats.shape[0]),
            **sampling_settings(cfg),
            "k_pr": 3,
            "k_dc": 5,
        }
        settings = json.loads(json.dumps(settings, default=str))
        self.key = settings_key(settings)
        self.evaluator = ev
        self.results["evaluations"].setdefault(
            self.key, {"settings": settings, "reference": None, "created": _now(), "entries": []}
        )
        if cfg.reference and not self.series.get("reference"):
            self.series["reference"] = ev.reference(cfg.num_samples, seed=cfg.seed)
            self.save()

    def record(self, entry: dict[str, Any]) -> None:
        """Put one checkpoint's entry in the series (replacing an older one of that step) and save."""
        entries = [e for e in self.series["entries"] if e["step"] != entry["step"]]
        self.series["entries"] = sorted([*entries, entry], key=lambda e: e["step"])
        self.series["updated"] = _now()
        self.save()

    def save(self) -> None:
        """Write ``results.json`` and ``results.md`` atomically."""
        self.results["run"] = str(self.run)
        write_json_atomic(self.results_path, self.results)
        write_text_atomic(self.out_dir / "results.md", markdown(self.results, self.run.name))

    def record_scores(
        self, step: int, row: dict[str, Any], images: torch.Tensor, active_time_s: float | None, **extra: Any
    ) -> dict[str, Any]:
        """Record one evaluation's scores (and save its grid); returns the entry."""
        assert self.evaluator is not None and self.key is not None
        if self.settings.grid:
            grid = self.out_dir / "grids" / self.key / f"step_{step:07d}.png"
            save_eval_grid(images, self.evaluator.num_classes, grid)
        entry = {"step": step, "status": "ok", "active_time_s": active_time_s, **row, **extra}
        self.record(entry)
        return entry

    def plot(self) -> list[Path]:
        """FD against step and against active time of this series."""
        assert self.key is not None
        return plot_series(self.series, self.run.name, self.out_dir)

    def run_all(self, every: int = 1) -> dict[str, Any]:
        """Evaluate every `every`-th checkpoint (and the latest); returns counts and output paths."""
        ckpt = _checkpoint_module()
        listed = ckpt.list_checkpoints(self.run)
        checkpoints = select_checkpoints(listed, every)
        if not checkpoints:
            raise NoCheckpointsError(f"no complete checkpoints under {self.run / 'checkpoints'}")
        counts = {"evaluated": 0, "skipped": 0, "failed": 0}
        pending_failures: list[dict[str, Any]] = []
        bar = tqdm(checkpoints, desc="checkpoints", unit="ckpt", disable=not self.progress)
        for step, path in bar:
            bar.set_postfix(step=step)
            if self.key is not None and step in self.done_steps():
                counts["skipped"] += 1
                continue
            t0 = time.perf_counter()
            try:
                model, info = ckpt.load_model_for_eval(path, use_ema=self.settings.ema, map_location="cpu")
                load_s = time.perf_counter() - t0
            except ckpt.CheckpointError as exc:
                warnings.warn(f"skipping checkpoint {path}: {exc}", stacklevel=2)
                counts["failed"] += 1
                failure = {"step": step, "status": "failed", "error": f"{type(exc).__name__}: {exc}"}
                if self.key is None:
                    pending_failures.append(failure)
                else:
                    self.record(failure)
                continue
            if self.evaluator is None:
                self.setup(info)
                for failure in pending_failures:
                    self.record(failure)
                if step in self.done_steps():
                    counts["skipped"] += 1
                    continue
            t0 = time.perf_counter()  # the one-off setup (classifier, real features) is not counted
            row, images = self.evaluator.evaluate_with_samples(model)
            active = info.get("active_time_s")
            if active is None:
                active = active_time_from_metrics(self.run, step)
            checkpoint = str(path.relative_to(self.run)) if path.is_relative_to(self.run) else str(path)
            entry = self.record_scores(
                step,
                row,
                images,
                active,
                wall_s=round(load_s + time.perf_counter() - t0, 3),  # load, sample, score, grid
                device=str(self.device),
                evaluated_at=_now(),
                checkpoint=checkpoint,
            )
            counts["evaluated"] += 1
            bar.set_postfix(step=step, fd=f"{entry['fd']:.3g}")
        bar.close()
        outputs: list[Path] = []
        if self.key is not None:
            # A failure of a checkpoint that is gone (e.g. pruned by the training run) is no longer news.
            present = {step for step, _ in listed}
            self.series["entries"] = [
                e for e in self.series["entries"] if e.get("status") == "ok" or e["step"] in present
            ]
            self.save()
            outputs = [self.results_path, self.out_dir / "results.md"]
            outputs += self.plot()
        else:
            warnings.warn(f"no checkpoint of {self.run} could be loaded; nothing was written", stacklevel=2)
        return {"key": self.key, **counts, "outputs": [str(p) for p in outputs]}


# --------------------------------------------------------------------------------------------------
# Comparing runs
# --------------------------------------------------------------------------------------------------


def pick_series(results: dict[str, Any], cfg: EvalSettings, where: Path) -> tuple[str, dict[str, Any]]:
    """The series of a results file made with the sampling settings of `cfg` (the latest, if several)."""
    want = sampling_settings(cfg)
    matches = [
        (key, ev)
        for key, ev in results["evaluations"].items()
        if all(ev["settings"].get(k) == v for k, v in want.items())
        and ev["settings"]["feature_space"].startswith(cfg.features)
    ]
    if not matches:
        have = "\n".join(
            f"  {k}: {describe_settings(ev['settings'])}" for k, ev in results["evaluations"].items()
        )
        raise ValueError(
            f"{where} has no series with {cfg.features} features and {want}; pass the flags used to evaluate it. "
            f"It has:\n{have or '  (nothing)'}"
        )
    return max(matches, key=lambda kv: kv[1].get("updated", ""))


def run_label(run: Path) -> str:
    """The run directory's name, with the optimizer from its ``config.json`` when that names one."""
    try:
        optimizer = json.loads((run / "config.json").read_text(encoding="utf-8")).get("optimizer")
    except (OSError, ValueError, AttributeError):
        optimizer = None
    return (
        f"{run.name} ({optimizer})" if isinstance(optimizer, str) and optimizer not in run.name else run.name
    )


def summarize(entries: list[dict[str, Any]], target: float | None) -> dict[str, Any]:
    """Best and last FD of a series, and the first step and active time at which FD <= target."""
    ok = ok_entries(entries)
    best = min(ok, key=lambda e: e["fd"])
    reach = next((e for e in ok if target is not None and e["fd"] <= target), None)
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


def compare_runs(cfg: Config) -> dict[str, Any]:
    """FD against step and active time of several evaluated runs in one figure, and a table of best FD per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for run in cfg.compare:
        path = Path(run) / "eval" / "results.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: run 'dimuon eval --run {run}' first")
        key, ev = pick_series(load_results(path), cfg, path)
        if not ok_entries(ev["entries"]):
            raise ValueError(f"{path}: series {key} has no successfully evaluated checkpoint")
        runs.append({"run": str(run), "name": run_label(Path(run)), "key": key, "series": ev})
    spaces = {r["series"]["settings"]["feature_key"] for r in runs}
    if len(spaces) > 1:
        raise ValueError(
            f"the runs were scored in different feature spaces {sorted(spaces)}: FDs are not comparable"
        )
    if len({r["series"]["settings"]["num_real"] for r in runs}) > 1:
        warnings.warn("the runs were scored against real sets of different sizes", stacklevel=2)
    # The FD every run reaches: the worst of the best. Time to reach it compares optimizers at equal quality.
    target = max(min(e["fd"] for e in ok_entries(r["series"]["entries"])) for r in runs)
    for r in runs:
        r["summary"] = summarize(r["series"]["entries"], target)

    settings = runs[0]["series"]["settings"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        ok = ok_entries(r["series"]["entries"])
        axes[0].plot([e["step"] for e in ok], [e["fd"] for e in ok], "o-", label=r["name"])
        timed = [e for e in ok if e.get("active_time_s") is not None]
        axes[1].plot([e["active_time_s"] for e in timed], [e["fd"] for e in timed], "o-", label=r["name"])
    all_fd = [e["fd"] for r in runs for e in ok_entries(r["series"]["entries"])]
    for ax, xlabel in zip(axes, ("training step", "active training time (s)")):
        ax.set_xlabel(xlabel)
        _fd_axes(ax, all_fd)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"FD in {settings['feature_space']} ({settings['sampler']} {settings['sample_steps']}, "
        f"cfg {settings['cfg_scale']:g}, N={settings['num_samples']})",
        fontsize=10,
    )
    out = Path(cfg.out)
    save_figure_atomic(fig, out / "compare_fd.png", dpi=120, bbox_inches="tight")
    plt.close(fig)

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
    for r in runs:
        s = r["summary"]
        lines.append(
            f"| {r['name']} | {s['best_fd']:.3f} | {s['best_step']} | {_fmt(s['best_active_time_s'], 1)} | "
            f"{s['best_precision']:.3f} | {s['best_recall']:.3f} | {s['last_fd']:.3f} ({s['last_step']}) | "
            f"{_fmt(s['target_step'])} | {_fmt(s['target_active_time_s'], 1)} |"
        )
    write_text_atomic(out / "compare.md", "\n".join(lines) + "\n")
    record = {
        "format": RESULTS_FORMAT,
        "settings": settings,
        "target_fd": target,
        "runs": [{k: r[k] for k in ("run", "name", "key", "summary")} for r in runs],
    }
    write_json_atomic(out / "compare.json", record)
    return {**record, "outputs": [str(out / n) for n in ("compare.md", "compare.json", "compare_fd.png")]}


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def check_config(cfg: Config) -> None:
    """Reject inconsistent flags before any work starts."""
    if bool(cfg.run) == bool(cfg.compare):
        raise ValueError("pass either --run RUN_DIR (evaluate) or --compare RUN_DIR ... (compare), not both")
    if cfg.compare:
        return
    check_eval_settings(cfg)
    if not Path(cfg.run).is_dir():
        raise ValueError(f"--run {cfg.run}: no such directory")
    if cfg.every < 1:
        raise ValueError(f"--every must be >= 1, got {cfg.every}")
    if cfg.threads is not None and cfg.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {cfg.threads}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dimuon eval`` and ``python -m dimuon.metrics.eval_run``."""
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = tyro.cli(Config, args=args, prog="dimuon eval")
    try:
        check_config(cfg)
    except ValueError as exc:
        print(f"dimuon eval: error: {exc}", file=sys.stderr)
        return 2
    if cfg.compare:
        record = compare_runs(cfg)
        print(Path(record["outputs"][0]).read_text(encoding="utf-8"))
        print("wrote " + ", ".join(record["outputs"]))
        return 0
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    evaluation = RunEvaluation(cfg.run, cfg, cfg.device, cfg.progress)
    try:
        summary = evaluation.run_all(cfg.every)
    except NoCheckpointsError as exc:
        print(f"dimuon eval: {exc}", file=sys.stderr)
        return 1
    if evaluation.key is not None:
        print(markdown({"evaluations": {evaluation.key: evaluation.series}}, evaluation.run.name))
    print(
        f"evaluated {summary['evaluated']}, skipped {summary['skipped']} (already in results.json), "
        f"failed {summary['failed']}; series {summary['key']}"
    )
    print("wrote " + ", ".join(summary["outputs"]))
    return 0 if summary["evaluated"] + summary["skipped"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
