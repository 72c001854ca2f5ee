"""One run's evaluation series under one set of settings: its evaluator, its entries, its grids and plots.

``dimuon eval`` fills a series from checkpoints, the training loop fills it as it trains; both open it
with :meth:`RunEvaluation.setup` (which builds the evaluator against the run's data set and names the
series by its settings) and add one entry per evaluated step with :meth:`RunEvaluation.record_scores`.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import torch

from dimuon.io import RunLayout, save_grid
from dimuon.metrics.eval_settings import EvalSettings, build_evaluator, sampling_settings
from dimuon.metrics.generation import GenerationEvaluator
from dimuon.metrics.plots import plot_series
from dimuon.metrics.prdc import K_DC, K_PR
from dimuon.metrics.results import load_results, ok_entries, settings_key, update_results

__all__ = [
    "GRID_SAMPLES",
    "RunEvaluation",
    "check_device",
    "feature_cache_dir",
    "resolve_device",
    "save_eval_grid",
    "timestamp",
]

GRID_SAMPLES = 100  # samples kept for an evaluation's grid


def feature_cache_dir(run: Path, settings: EvalSettings) -> Path:
    """The feature cache of a run's evaluations: ``settings.cache_dir``, or ``<run>/eval/feature_cache``."""
    return Path(settings.cache_dir or RunLayout(run).feature_cache)


def save_eval_grid(images: torch.Tensor, num_classes: int, path: Path, max_images: int = GRID_SAMPLES) -> None:
    """The first samples as a PNG grid on white; with at most 16 classes each column is one class."""
    ncol = num_classes if num_classes <= 16 else 10
    n = min(images.shape[0], max_images - max_images % ncol if max_images >= ncol else ncol)
    side = max(images.shape[-2:])
    save_grid(images[:n], path, nrow=ncol, scale=max(1, 64 // side), pad=1, background=1.0)


def resolve_device(name: str | torch.device) -> torch.device:
    """``auto`` is CUDA when available, else the CPU; any other name is taken as it is."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_device(name: str, flag: str = "--device") -> None:
    """Raise ValueError naming ``flag`` where ``name`` is no device this machine has (``auto`` always is), before
    any work starts."""
    if name == "auto":
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"{flag} must be auto, cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {name}: CUDA is not available here (auto or cpu run on the CPU)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def timestamp() -> str:
    """The local time with its UTC offset, to the millisecond, as recorded in results files (the newest series of a
    run is the one picked by default: two evaluations a second apart must not tie)."""
    return datetime.datetime.now().astimezone().isoformat(timespec="milliseconds")


class RunEvaluation:
    """One run's ``eval/results.json``: the series of one set of settings, its evaluator (built lazily), its files."""

    def __init__(
        self, run: Path, settings: EvalSettings, device: str | torch.device = "auto", progress: bool = True
    ) -> None:
        self.settings = settings
        self.run = Path(run).resolve()  # named and recorded as itself from anywhere (not "." or "")
        self.layout = RunLayout(self.run)
        self.results = load_results(self.layout.results)
        self.evaluator: GenerationEvaluator | None = None
        self.key: str | None = None
        self.device = resolve_device(device)
        self.progress = progress
        # Steps whose entries this process scored, or dropped, since its last save: they win over the file's.
        self._changed: set[int] = set()
        self._dropped: set[int] = set()

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
        """Build the evaluator from a checkpoint's data set, and open this settings' series.

        ``info`` describes the run as a checkpoint does (``dataset``, ``image_shape``, ``num_classes``).
        """
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
            "dataset": {"name": ds["name"], "kwargs": kwargs},
            "num_real": int(ev.real_feats.shape[0]),
            **({"real_subset": ev.real_subset} if ev.real_subset else {}),
            **sampling_settings(cfg),
            "k_pr": K_PR,
            "k_dc": K_DC,
        }
        settings = json.loads(json.dumps(settings, default=str))
        self.key = settings_key(settings)
        self.evaluator = ev
        self.results["evaluations"].setdefault(
            self.key, {"settings": settings, "reference": None, "created": timestamp(), "entries": []}
        )
        if cfg.reference and not self.series.get("reference"):
            self.series["reference"] = ev.reference(cfg.num_samples, seed=cfg.seed)
            self.save()

    def record(self, entry: dict[str, Any]) -> None:
        """Put one checkpoint's entry in the series (replacing an older one of that step) and save."""
        self._changed.add(entry["step"])
        entries = [e for e in self.series["entries"] if e["step"] != entry["step"]]
        self.series["entries"] = sorted([*entries, entry], key=lambda e: e["step"])
        self.series["updated"] = timestamp()
        self.save()

    def forget_failures_except(self, steps: set[int]) -> None:
        """Drop the failed entries of steps not in ``steps`` (e.g. checkpoints pruned since they failed)."""
        gone = [e for e in self.series["entries"] if e.get("status") != "ok" and e["step"] not in steps]
        self.series["entries"] = [e for e in self.series["entries"] if e not in gone]
        self._dropped.update(e["step"] for e in gone)

    def save(self) -> None:
        """Write this series into ``results.json`` as the file is now (``results.md`` too), atomically and under the
        results' lock: the series and entries other processes wrote meanwhile are kept; the entries this process
        scored since its last save replace theirs of the same step, and those it dropped stay dropped."""
        key, series = self.key, self.series if self.key is not None else None
        changed, dropped = set(self._changed), set(self._dropped)

        def merge(results: dict[str, Any]) -> None:
            results["run"] = str(self.run)
            if key is None or series is None:
                return
            theirs = results["evaluations"].get(key)
            if theirs is not None:  # the file's entries, but those this process scored or dropped since it saved
                mine = [e for e in series["entries"] if e["step"] in changed]
                kept = [e for e in theirs["entries"] if e["step"] not in changed | dropped]
                series["entries"] = sorted([*kept, *mine], key=lambda e: e["step"])
                series["reference"] = series.get("reference") or theirs.get("reference")
            results["evaluations"][key] = series

        self.results = update_results(self.layout, merge)
        self._changed.clear()
        self._dropped.clear()

    def record_scores(
        self, step: int, row: dict[str, Any], images: torch.Tensor, active_time_s: float | None, **extra: Any
    ) -> dict[str, Any]:
        """Record one evaluation's scores (and save its grid); returns the entry."""
        assert self.evaluator is not None and self.key is not None
        if self.settings.grid:
            save_eval_grid(images, self.evaluator.num_classes, self.layout.eval_grid(self.key, step))
        entry = {"step": step, "status": "ok", "active_time_s": active_time_s, **row, **extra}
        self.record(entry)
        return entry

    def plot(self) -> list[Path]:
        """FD against step and against active time of this series."""
        assert self.key is not None
        return plot_series(self.series, self.run.name, self.layout.eval)
