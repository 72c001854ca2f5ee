"""The metrics registry: every metric described, and the names the records and reports use taken from it."""

from __future__ import annotations

import dataclasses
from typing import get_args, get_type_hints

import pytest

from dimuon.bench import quality, quality_config, quality_report
from dimuon.metrics import results
from dimuon.metrics.registry import DIRECTIONS, GENERATION, METRICS, SELECTION, Metric
from dimuon.train import loop

REQUIRED = {
    "fd",
    "precision",
    "recall",
    "density",
    "coverage",
    "val_loss",
    "val_loss_ema",
    "opt_ms",
    "step_ms",
    "active_time_s",
    "target_active_time_s",
    "spectral_fraction",
    "eval_s",
}


def test_every_metric_is_described() -> None:
    assert set(METRICS) >= REQUIRED
    assert DIRECTIONS == ("lower", "higher")
    for name, m in METRICS.items():
        assert m.name == name
        assert m.label.strip() and m.doc.strip()
        assert m.direction in DIRECTIONS
        assert isinstance(m.unit, str) and m.unit == m.unit.strip()
    assert METRICS["fd"].direction == "lower" and METRICS["recall"].direction == "higher"
    assert METRICS["active_time_s"].unit == "s" and METRICS["opt_ms"].unit == "ms" and METRICS["fd"].unit == ""


def test_a_metric_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        METRICS["fd"].label = "Fréchet distance"  # type: ignore[misc]


def test_headings_carry_the_unit() -> None:
    assert METRICS["active_time_s"].heading == "active time (s)"
    assert METRICS["fd"].heading == "FD"
    assert METRICS["fd"].axis_note == "lower is better"


@pytest.mark.parametrize(
    ("direction", "best", "worst", "superlative"), [("lower", 1.0, 5.0, "lowest"), ("higher", 5.0, 1.0, "highest")]
)
def test_best_follows_the_direction(direction: str, best: float, worst: float, superlative: str) -> None:
    m = Metric("x", "x", direction, "", "a test metric", "cost")  # type: ignore[arg-type]
    values = [3.0, 1.0, 5.0, 2.0]
    assert m.best(values) == best and m.worst(values) == worst
    assert m.better(best, worst) and not m.better(worst, best) and not m.better(best, best)
    assert m.reaches(best, best) and m.reaches(best, worst) and not m.reaches(worst, best)
    assert m.pick([("a", 3.0), ("b", best), ("c", best)], key=lambda p: p[1]) == ("b", best)  # the first of ties
    assert m.superlative == superlative


def test_generation_metrics_come_from_the_registry() -> None:
    assert GENERATION == ("fd", "precision", "recall", "density", "coverage")
    assert results.METRICS == GENERATION
    assert all(METRICS[m].kind == "generation" for m in GENERATION)
    assert loop.GEN_EVAL_KEYS[: len(GENERATION)] == GENERATION
    assert set(loop.GEN_EVAL_KEYS) - set(GENERATION) == {"feature_space", "num_samples", "eval_s"}


def test_selection_metrics_come_from_the_registry() -> None:
    assert tuple(quality_report.SELECTION_METRICS) == SELECTION == ("val_loss_ema", "fd")
    for name, label in quality_report.SELECTION_METRICS.items():
        assert METRICS[name].label in label and METRICS[name].direction == "lower"
    assert quality_report.SELECTION_METRICS == {"val_loss_ema": "EMA validation loss", "fd": "final FD"}
    hint = get_type_hints(quality_config.Config)["select_by"]
    assert get_args(hint) == SELECTION


def test_report_keys_are_registered() -> None:
    assert set(quality_report.SUMMARY_KEYS) - {"best_fd"} <= set(METRICS)
    assert set(quality_report.RATIO_KEYS) <= set(METRICS)
    assert set(quality_report.COST_AXES) <= set(METRICS)


def test_report_headers_use_the_labels() -> None:
    assert quality_report.RUN_HEADERS[4:9] == ["final FD", "precision", "recall", "density", "coverage"]
    assert quality_report.SUMMARY_HEADERS[11] == METRICS["active_time_s"].heading == "active time (s)"
    assert quality_report.SUMMARY_HEADERS[13] == "time to target (s)"


def test_select_by_refuses_an_unknown_metric() -> None:
    cfg = quality_config.Config(select_by="recall")  # type: ignore[arg-type]
    with pytest.raises(quality.FlagError, match=r"--select-by must be one of: val_loss_ema, fd; got 'recall'"):
        quality.check_config(cfg)


def test_best_lr_takes_the_direction_of_its_metric(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [
        {"lr": 1e-3, "status": "ok", "fd": 10.0, "recall": 0.2},
        {"lr": 1e-2, "status": "ok", "fd": 20.0, "recall": 0.6},
    ]
    assert quality_report.best_lr(rows, "fd") == 1e-3
    assert quality_report.best_lr(rows, "recall") == 1e-2
    flipped = dataclasses.replace(METRICS["fd"], direction="higher")
    monkeypatch.setitem(quality_report.REGISTRY, "fd", flipped)
    assert quality_report.best_lr(rows, "fd") == 1e-2
