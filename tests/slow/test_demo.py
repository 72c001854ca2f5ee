"""The default ``dimuon train`` (the README's demo) end to end: outputs and legible digits; its time is printed
(``pytest -m slow -s``), not asserted, since it depends on the machine and its load."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

HANG_S = 3600  # only a guard against a hung run: about 200 s on two idle cores


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    run = tmp_path_factory.mktemp("demo") / "run"
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "dimuon.cli", "train", "--out", str(run), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"\nthe default demo took {elapsed:.0f} s wall")
    return run, elapsed


def test_default_demo_leaves_metrics_plots_samples_and_a_checkpoint(demo_run: tuple[Path, float]) -> None:
    from dimuon.dit import list_checkpoints

    run, _ = demo_run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["kind"] == "val"]
    assert val and val[-1]["val_loss_ema"] < 0.21, val[-1]
    assert (run / "plots" / "loss_vs_step.png").is_file() and (run / "plots" / "loss_vs_time.png").is_file()
    steps, _ = list_checkpoints(run)[-1]
    assert (run / "samples" / f"step_{steps:07d}.png").is_file()
    assert json.loads((run / "config.json").read_text())["steps"] == steps


def test_default_demo_samples_are_recognisable_digits(demo_run: tuple[Path, float], tmp_path: Path) -> None:
    """A classifier trained on MNIST itself (99 % held-out accuracy) must read most samples as their label."""
    from dimuon.data import build_dataset, get_batch
    from dimuon.dit import list_checkpoints, load_model_for_eval, sample
    from dimuon.metrics.features.classifier import load_or_train_classifier

    run, _ = demo_run
    model, info = load_model_for_eval(list_checkpoints(run)[-1][1])
    cfg = info["config"]
    train_set = build_dataset("mnist", "train")
    val_set = build_dataset("mnist", "val")
    x, y = get_batch(train_set, range(len(train_set)))
    xv, yv = get_batch(val_set, range(len(val_set)))
    classifier = load_or_train_classifier(x, y, tmp_path / "cache", "mnist", xv, yv)
    assert classifier.test_accuracy > 0.97
    labels = torch.arange(cfg["sample_count"]) % info["num_classes"]
    images = sample(
        model,
        labels,
        info["image_shape"],
        steps=cfg["sample_steps"],
        method=cfg["sample_method"],
        cfg_scale=cfg["cfg_scale"],
        generator=torch.Generator().manual_seed(cfg["seed"]),
    )
    with torch.no_grad():
        predicted = classifier.net(images.clamp(-1, 1)).argmax(dim=1)
    accuracy = (predicted == labels).float().mean().item()
    assert accuracy >= 0.9, f"only {accuracy:.0%} of the demo's samples are read as their label"
