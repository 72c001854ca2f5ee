"""``dimuon eval``: generation quality (FD, precision/recall/density/coverage) over a run's checkpoints.

For every complete checkpoint of ``--run`` (EMA weights by default) it draws a fixed, seeded, class-balanced
set of samples, scores them against the run's held-out split in one feature space, and writes
``<run>/eval/results.json``, ``results.md``, ``fd_vs_step.png`` and ``fd_vs_time.png``. Results are keyed by
a hash of everything that changes the numbers (feature space, sampler, seed, counts, EMA), so changing a
setting starts a new series instead of mixing numbers, and a rerun skips the checkpoints already scored.
``--compare RUN ...`` plots and tabulates already-evaluated runs side by side.

Run ``dimuon eval --help`` (or ``python -m dimuon.eval --help``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import tyro
from tqdm.auto import tqdm

from dimuon.dit.checkpoint import CheckpointError, list_checkpoints, load_model_for_eval
from dimuon.eval.compare import compare_runs
from dimuon.eval.samples_cache import load_samples, samples_key, save_samples
from dimuon.io import RunLayout, read_jsonl, unwritable_reason
from dimuon.log import configure, get_logger, run_command
from dimuon.metrics.eval_settings import EvalSettings, check_eval_settings
from dimuon.metrics.results import markdown
from dimuon.metrics.series import RunEvaluation, check_device, timestamp

__all__ = [
    "Config",
    "NoCheckpointsError",
    "active_time_from_metrics",
    "check_config",
    "evaluate_checkpoints",
    "main",
    "parse",
    "select_checkpoints",
]

log = get_logger(__name__)


@dataclass
class Config(EvalSettings):
    """Generation quality (FD, precision/recall/density/coverage) over a run's checkpoints."""

    run: Path | None = None
    """Run directory (holds checkpoints/ and metrics.jsonl); outputs go to <run>/eval/."""
    compare: tuple[Path, ...] = ()
    """Instead of evaluating: compare already-evaluated runs (FD vs step and vs active time, best FD)."""
    every: int = 1
    """Evaluate every K-th checkpoint in step order (always including the latest)."""
    latest: bool = False
    """Evaluate the latest checkpoint only (a run's final quality, e.g. in another feature space)."""
    device: str = "auto"
    """Device for sampling and features: auto (cuda if available), cpu, cuda, cuda:1, ..."""
    threads: int | None = None
    """CPU intra-op threads (default: torch's; 1 is much faster for tiny models on busy cores)."""
    out: Path = Path("eval-compare")
    """Output directory of --compare."""
    progress: bool = True
    """Progress bars."""
    samples_cache: Path | None = None
    """Keep each checkpoint's generated samples in this directory and reuse them when the same checkpoint is
    scored with the same sampling settings again (another feature space, a rescore): the same images, sampled
    once. Keyed by the checkpoint's bytes, the sampling settings, the device type and the torch version."""


class NoCheckpointsError(FileNotFoundError):
    """The run directory holds no complete checkpoint (yet)."""


def select_checkpoints(
    checkpoints: Sequence[tuple[int, Path]], every: int, latest: bool = False
) -> list[tuple[int, Path]]:
    """Every `every`-th checkpoint in step order, plus the latest; with `latest`, the latest alone."""
    if every < 1:
        raise ValueError(f"--every must be >= 1, got {every}")
    if latest:
        return list(checkpoints[-1:])
    chosen = [c for i, c in enumerate(checkpoints) if i % every == 0]
    if checkpoints and chosen[-1] != checkpoints[-1]:
        chosen.append(checkpoints[-1])
    return chosen


def active_time_from_metrics(run: Path, step: int) -> float | None:
    """Active training seconds at `step` from ``metrics.jsonl`` (last row at or before it), if logged."""
    best: tuple[int, float] | None = None
    for row in read_jsonl(RunLayout(run).metrics):
        s, t = row.get("step"), row.get("active_time_s")
        if isinstance(s, int) and isinstance(t, (int, float)) and s <= step and (best is None or s >= best[0]):
            best = (s, float(t))
    return None if best is None else best[1]


def evaluate_checkpoints(
    evaluation: RunEvaluation, every: int = 1, latest: bool = False, samples_cache: Path | None = None
) -> dict[str, Any]:
    """Evaluate every `every`-th checkpoint of the run and the latest (with `latest`, the latest alone) into its
    series; counts and output paths.

    Checkpoints already in the series are skipped; one that fails to load is recorded as failed (never over a
    score the series already has) and the others are evaluated; one removed meanwhile (pruned by the training
    run) is counted as gone, not failed. The evaluator is built from the first loadable checkpoint's data set. With
    `samples_cache`, each checkpoint's samples are kept there and reused when the same checkpoint is scored
    with the same sampling settings again (:mod:`dimuon.eval.samples_cache`).
    """
    run = evaluation.run
    listed = list_checkpoints(run)
    checkpoints = select_checkpoints(listed, every, latest)
    if not checkpoints:
        raise NoCheckpointsError(f"no complete checkpoints under {RunLayout(run).checkpoints}")
    counts = {"evaluated": 0, "skipped": 0, "failed": 0, "gone": 0}
    pending_failures: list[dict[str, Any]] = []
    bar = tqdm(checkpoints, desc="checkpoints", unit="ckpt", disable=not evaluation.progress)
    for step, path in bar:
        bar.set_postfix(step=step)
        if evaluation.key is not None and step in evaluation.done_steps():
            counts["skipped"] += 1
            continue
        t0 = time.perf_counter()
        try:
            model, info = load_model_for_eval(path, use_ema=evaluation.settings.ema, map_location="cpu")
            load_s = time.perf_counter() - t0
        except CheckpointError as exc:
            if not path.exists():  # pruned since it was listed: nothing is wrong with it
                log.info("checkpoint %s was removed while this evaluation ran", path)
                counts["gone"] += 1
                continue
            log.warning("skipping checkpoint %s: %s", path, exc)
            counts["failed"] += 1
            failure = {"step": step, "status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            if evaluation.key is None:
                pending_failures.append(failure)
            else:
                evaluation.record(failure)
            continue
        if evaluation.evaluator is None:
            evaluation.setup(info)
            done = evaluation.done_steps()
            for failure in pending_failures:  # a step scored before keeps its score
                if failure["step"] in done:
                    counts["failed"] -= 1
                    counts["skipped"] += 1
                else:
                    evaluation.record(failure)
            if step in evaluation.done_steps():
                counts["skipped"] += 1
                continue
        assert evaluation.evaluator is not None
        t0 = time.perf_counter()  # the one-off setup (classifier, real features) is not counted
        given = collect = key = None
        if samples_cache is not None:
            key = samples_key(path, evaluation.settings, evaluation.device)
            given = load_samples(samples_cache, key)
            collect = [] if given is None else None
        row, images = evaluation.evaluator.evaluate_with_samples(model, given=given, collect=collect)
        if collect:
            save_samples(samples_cache, key, torch.cat(collect))
        if samples_cache is not None:
            row["samples_reused"] = given is not None
        active = info.get("active_time_s")
        if active is None:
            active = active_time_from_metrics(run, step)
        checkpoint = str(path.relative_to(run)) if path.is_relative_to(run) else str(path)
        entry = evaluation.record_scores(
            step,
            row,
            images,
            active,
            wall_s=round(load_s + time.perf_counter() - t0, 3),  # load, sample, score, grid
            device=str(evaluation.device),
            evaluated_at=timestamp(),
            checkpoint=checkpoint,
        )
        counts["evaluated"] += 1
        bar.set_postfix(step=step, fd=f"{entry['fd']:.3g}")
    bar.close()
    outputs: list[Path] = []
    if evaluation.key is not None:
        # A failure of a checkpoint that is gone (e.g. pruned by the training run) is no longer news.
        evaluation.forget_failures_except({step for step, _ in listed})
        evaluation.save()
        outputs = [evaluation.layout.results, evaluation.layout.results_md, *evaluation.plot()]
    else:
        log.warning("no checkpoint of %s could be loaded; nothing was written", run)
    return {"key": evaluation.key, **counts, "outputs": [str(p) for p in outputs]}


def _check_writable(flag: str, path: Path, what: str) -> None:
    reason = unwritable_reason(path)
    if reason is not None:
        raise ValueError(f"{flag}: {what} {path} cannot be written: {reason}")


def check_config(cfg: Config) -> None:
    """Reject inconsistent flags, and outputs that cannot be written, before any work starts."""
    if bool(cfg.run) == bool(cfg.compare):
        raise ValueError("pass either --run RUN_DIR (evaluate) or --compare RUN_DIR ... (compare), not both")
    if cfg.compare:
        _check_writable("--out", Path(cfg.out), "the output directory")
        return
    check_eval_settings(cfg)
    if not Path(cfg.run).is_dir():
        raise ValueError(f"--run {cfg.run}: no such directory")
    if cfg.every < 1:
        raise ValueError(f"--every must be >= 1, got {cfg.every}")
    if cfg.latest and cfg.every != 1:
        raise ValueError(f"pass --every {cfg.every} or --latest (the latest checkpoint alone), not both")
    if cfg.threads is not None and cfg.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {cfg.threads}")
    check_device(cfg.device)
    _check_writable("--run", RunLayout(cfg.run).eval, "the results directory")
    if cfg.cache_dir is not None:
        _check_writable("--cache-dir", Path(cfg.cache_dir), "the feature cache")
    if cfg.samples_cache is not None:
        _check_writable("--samples-cache", Path(cfg.samples_cache), "the samples cache")


def parse(argv: Sequence[str]) -> Config:
    """``dimuon eval``'s flags, nothing run: SystemExit(2) for a flag the parser refuses. :func:`check_config`
    is left to the run (it looks at --run and the output directories on disk)."""
    return tyro.cli(Config, args=list(argv), prog="dimuon eval")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dimuon eval`` and ``python -m dimuon.eval``: 0 done, 1 nothing evaluated or a failed
    write, 2 bad flags, 130 interrupted (a rerun continues: every scored checkpoint is saved at once)."""
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = parse(args)
    configure("dimuon eval")

    def body() -> int:
        check_config(cfg)
        return _run(cfg)

    return run_command(
        "dimuon eval",
        body,
        usage=(ValueError,),
        failures=(NoCheckpointsError,),
        interrupted="the same command continues (checkpoints already scored are kept and skipped)",
    )


def _run(cfg: Config) -> int:
    """Evaluate ``--run`` or compare ``--compare``, printing the tables; the exit status."""
    if cfg.compare:
        record = compare_runs(cfg.compare, cfg, cfg.out)
        print(Path(record["outputs"][0]).read_text(encoding="utf-8"))
        print("wrote " + ", ".join(record["outputs"]))
        return 0
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    evaluation = RunEvaluation(cfg.run, cfg, cfg.device, cfg.progress)
    summary = evaluate_checkpoints(evaluation, cfg.every, cfg.latest, cfg.samples_cache)
    if evaluation.key is not None:
        print(markdown({"evaluations": {evaluation.key: evaluation.series}}, evaluation.run.name))
    print(
        f"evaluated {summary['evaluated']}, skipped {summary['skipped']} (already in results.json), "
        f"failed {summary['failed']}"
        + (f", gone {summary['gone']} (removed while this ran)" if summary["gone"] else "")
        + f"; series {summary['key']}"
    )
    print("wrote " + ", ".join(summary["outputs"]))
    return 0 if summary["evaluated"] + summary["skipped"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
