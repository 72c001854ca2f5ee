"""One run's ``eval/results.json`` written by several processes at once (the training run and ``dimuon eval``,
or two ``dimuon eval`` of other settings): every save merges into the file as it is, under a lock, so no writer
loses another's series or entries."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dimuon.io import RunLayout, locked
from dimuon.metrics.eval_settings import EvalSettings, sampling_settings
from dimuon.metrics.results import newest_first, pick_series, truncate_results
from dimuon.metrics.series import RunEvaluation

SCORES = {"fd": 1.0, "precision": 0.5, "recall": 0.5, "density": 1.0, "coverage": 0.5}


def opened(run: Path, key: str, seed: int = 0) -> RunEvaluation:
    """A writer of the series ``key``, opened as ``setup`` opens one (without building an evaluator)."""
    settings = EvalSettings(seed=seed)
    ev = RunEvaluation(run, settings, device="cpu", progress=False)
    ev.key = key
    series = {
        "settings": {
            "feature_space": "classifier-x",
            "num_real": 10,
            "dataset": {"name": "mnist", "kwargs": {}},
            **sampling_settings(settings),
        },
        "reference": None,
        "created": "now",
        "entries": [],
    }
    ev.results["evaluations"].setdefault(key, series)
    return ev


def entry(step: int, fd: float = 1.0, status: str = "ok") -> dict[str, Any]:
    return {"step": step, "status": status, "active_time_s": 1.0, "eval_s": 1.0, **SCORES, "fd": fd}


def on_disk(run: Path) -> dict[str, list[tuple[int, float]]]:
    results = json.loads(RunLayout(run).results.read_text())["evaluations"]
    return {k: [(e["step"], e.get("fd")) for e in v["entries"]] for k, v in results.items()}


def test_writers_opened_at_once_keep_each_other_s_series_and_entries(tmp_path: Path) -> None:
    run = tmp_path / "run"
    training, other_space, same_series = opened(run, "k1"), opened(run, "k2", seed=1), opened(run, "k1")
    training.record(entry(1))
    other_space.record(entry(1, fd=5.0))  # opened before the first save: it read an empty file
    same_series.record(entry(2, fd=2.0))  # scores another step of the training run's series
    training.record(entry(3, fd=3.0))
    assert on_disk(run) == {"k1": [(1, 1.0), (2, 2.0), (3, 3.0)], "k2": [(1, 5.0)]}
    assert training.done_steps() == {1, 2, 3}  # what the others scored is known to it now
    assert "## Settings `k2`" in RunLayout(run).results_md.read_text()


def test_a_step_scored_again_replaces_the_other_writer_s_entry_and_a_dropped_failure_stays_dropped(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    a, b = opened(run, "k1"), opened(run, "k1")
    a.record(entry(1, status="failed"))
    a.record(entry(2))
    b.record(entry(1, fd=7.0))  # the failed step scored by the other writer
    assert on_disk(run) == {"k1": [(1, 7.0), (2, 1.0)]}
    a.record(entry(4, status="failed"))
    a.forget_failures_except({1, 2})  # step 4's checkpoint is gone
    a.save()
    b.save()  # b never saw step 4: nothing brings it back
    assert on_disk(run) == {"k1": [(1, 7.0), (2, 1.0)]}


def test_a_save_waits_for_the_lock_and_a_resume_truncates_under_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    writer = opened(run, "k1")
    writer.record(entry(1))
    layout = RunLayout(run)
    saved = threading.Event()
    with locked(layout.results_lock):  # another process is between its read and its write
        thread = threading.Thread(target=lambda: (writer.record(entry(2)), saved.set()))
        thread.start()
        time.sleep(0.3)
        assert not saved.is_set() and on_disk(run) == {"k1": [(1, 1.0)]}
    thread.join(timeout=10)
    assert saved.is_set() and on_disk(run) == {"k1": [(1, 1.0), (2, 1.0)]}
    assert truncate_results(run, 1) == 1 and on_disk(run) == {"k1": [(1, 1.0)]}


def test_the_newest_series_is_picked_by_instant_and_a_tie_goes_to_the_one_added_last() -> None:
    stamp = "2026-12-04T10:00:00+00:00"
    same_second = [("full", {"updated": stamp}), ("small", {"updated": stamp})]
    assert [k for k, _ in newest_first(same_second)] == ["small", "full"]
    # 11:30 at +02:00 is 09:30 UTC: older than 10:00 UTC although its text sorts after it.
    offsets = [("utc", {"updated": stamp}), ("east", {"updated": "2026-12-04T11:30:00+02:00"})]
    assert [k for k, _ in newest_first(offsets)] == ["utc", "east"]
    millis = [("later", {"updated": "2026-12-04T10:00:00.250+00:00"}), ("earlier", {"updated": stamp})]
    assert [k for k, _ in newest_first(millis)] == ["later", "earlier"]
    assert [k for k, _ in newest_first([("unstamped", {}), ("created", {"created": stamp})])] == [
        "created",
        "unstamped",
    ]


def test_a_series_is_picked_in_the_feature_space_the_flags_name(tmp_path: Path) -> None:
    from dimuon.metrics.generation import file_digest

    weights = tmp_path / "vitl14.pth"
    weights.write_bytes(b"weights")
    other = tmp_path / "other.pth"
    other.write_bytes(b"other weights")
    base = {**sampling_settings(EvalSettings()), "num_real": 10, "dataset": {"name": "mnist", "kwargs": {}}}

    def series(space: str, key: str, updated: str) -> dict[str, Any]:
        return {"settings": {**base, "feature_space": space, "feature_key": key}, "updated": updated}

    digest = file_digest(weights)[:8]
    results = {
        "evaluations": {
            "l": series("dinov2-vitl14", f"dinov2-vitl14-{digest}", "2026-12-04T10:00:00+00:00"),
            "s": series("dinov2-vits14", "dinov2-vits14-12345678", "2026-12-04T11:00:00+00:00"),  # newer
            "l2": series("dinov2-vitl14", "dinov2-vitl14-87654321", "2026-12-04T09:00:00+00:00"),
            "i": series("inception-v3-fid", "inception-v3-fid", "2026-12-04T12:00:00+00:00"),
        }
    }
    pick = lambda **kw: pick_series(results, EvalSettings(**kw), tmp_path)[0]  # noqa: E731
    assert pick(features="dinov2", dinov2_arch="vitl14") == "l"  # the newest ViT-L/14, not the newer ViT-S/14
    assert pick(features="dinov2", dinov2_arch="vits14") == "s"
    assert pick(features="dinov2", dinov2_weights=weights) == "l"
    assert pick(features="inception") == "i"
    with pytest.raises(ValueError, match=r"no series with dinov2-vitl14 \(.*other.pth\) features"):
        pick(features="dinov2", dinov2_weights=other)
    with pytest.raises(ValueError, match="no series with classifier features"):
        pick(features="classifier")
