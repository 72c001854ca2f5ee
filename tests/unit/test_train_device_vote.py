"""The training step waits for nothing on the device with the Muon family: no host read in ``train_step`` with
``--nonfinite skip`` (the optimizer's vote masks the step and the EMA, read at the next logging step), one with
``--nonfinite raise`` (the optimizer's vote); the skipped step is still logged with the step it happened at."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dimuon.bench.census import tracing
from dimuon.bench.peers import CallCounter, count_collectives
from dimuon.data import BatchSchedule, build_dataset
from dimuon.train import TrainConfig, train
from dimuon.train import loop as loop_module
from dimuon.train.failures import RunFailed

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILY = ("muon", "periodic_row_muon", "muon_bp", "adaptive_row_muon")
SIGNAL_SITE = "core.py:read"  # AdaptiveRowMuon's own read of its staleness signals (StepContext.read)


def arrays(path: Path, bad_rows: tuple[int, ...] = ()) -> Path:
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (40, 1, 8, 8)).astype(np.float32)
    images[list(bad_rows), 0, 3, 3] = 1e30  # finite, its square is not
    np.savez(path, images=images, labels=np.arange(40) % 2)
    return path


def config(data: Path, out: Path, **extra: Any) -> TrainConfig:
    base = dict(
        model="DiT-T/4",
        dataset="arrays",
        data_path=str(data),
        batch_size=8,
        steps=4,
        log_interval=4,
        val_interval=0,
        val_samples=4,
        sample_count=2,
        sample_steps=1,
        ckpt_interval=0,
        warmup_steps=1,
        progress=False,
        out=str(out),
    )
    return TrainConfig(**{**base, **extra})


def bad_step(data: Path) -> tuple[int, int]:
    """A training row and the 0-based step whose batch first draws it."""
    row, steps = bad_steps(data, 100)
    return row, steps[0]


def bad_steps(data: Path, steps: int) -> tuple[int, list[int]]:
    """A training row and the 0-based steps (of the first ``steps``) whose batches draw it."""
    index = build_dataset("arrays", "train", path=data).index
    row = int(index[5])
    batches = BatchSchedule(len(index), 8, 0)
    return row, [s for s in range(steps) if row in index[batches.indices(s)]]


@pytest.fixture
def traced_steps(monkeypatch):
    """Host reads of every ``train_step`` by site, in step order."""
    reads: list[dict[str, int]] = []
    original = loop_module.Trainer.train_step

    def step(self, s: int) -> None:
        with count_collectives(CallCounter()) as counter, tracing(counter) as tally:
            try:
                original(self, s)
            finally:
                reads.append(dict(tally.read_sites))

    monkeypatch.setattr(loop_module.Trainer, "train_step", step)
    return reads


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("optimizer", FAMILY)
def test_skip_reads_nothing_in_a_step_and_logs_the_skip_at_the_logging_step(optimizer, tmp_path, traced_steps):
    data = tmp_path / "data.npz"
    row, bad = bad_steps(arrays(data), 8)
    arrays(data, bad_rows=(row,))
    out = tmp_path / "run"
    summary = train(config(data, out, optimizer=optimizer, nonfinite="skip", steps=8, ckpt_interval=8))
    assert len(traced_steps) == 8 and bad
    for sites in traced_steps:
        assert {k: n for k, n in sites.items() if SIGNAL_SITE not in k} == {}, sites
    recs = records(out)
    skipped = [r for r in recs if r["kind"] == "nonfinite"]
    assert [(r["step"], r["action"], r["skipped_total"]) for r in skipped] == [
        (s + 1, "skipped", i + 1) for i, s in enumerate(bad)
    ]
    for r in skipped:  # read at the logging step after it (every 4 steps)
        assert r.get("logged_at", r["step"]) == 4 * -(-r["step"] // 4)
    assert [r["step"] for r in recs if r["kind"] == "train"] == [4, 8]
    assert sum(r["skipped_steps"] for r in recs if r["kind"] == "train") == len(bad) == summary["skipped_steps"]
    state = torch.load(next((out / "checkpoints").iterdir()) / "state.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in [*state["model"].values(), *state["ema"]["weights"].values()])


@pytest.mark.parametrize("optimizer", ["periodic_row_muon", "adaptive_row_muon"])
def test_raise_reads_once_per_step_and_stops_naming_the_step(optimizer, tmp_path, traced_steps):
    data = tmp_path / "data.npz"
    row, bad = bad_step(arrays(data))
    arrays(data, bad_rows=(row,))
    with pytest.raises(RunFailed, match=rf"^step {bad + 1} of \d+: .*The step was not applied"):
        train(config(data, tmp_path / "run", optimizer=optimizer, steps=bad + 2))
    assert len(traced_steps) == bad + 1
    for sites in traced_steps[:-1]:  # the failing step also reads what it names
        assert sum(sites.values()) <= 1, sites


@pytest.mark.parametrize("optimizer", ["periodic_row_muon", "adaptive_row_muon"])
def test_the_skipped_step_leaves_weights_optimizer_state_and_ema_bitwise_unchanged(optimizer, tmp_path, monkeypatch):
    data = tmp_path / "data.npz"
    row, bad = bad_step(arrays(data))
    arrays(data, bad_rows=(row,))
    seen = {}
    original = loop_module.Trainer.train_step

    def snapshot(trainer) -> list[torch.Tensor]:
        tensors = [p.detach().clone() for p in trainer.model.parameters()]
        tensors += [e.clone() for e in trainer.ema.weights().values()]
        for state in trainer.opt.state.values():
            tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
        return tensors

    def step(self, s: int) -> None:
        before = snapshot(self) if s == bad else None
        original(self, s)
        if before is not None:
            seen["same"] = all(torch.equal(a, b) for a, b in zip(before, snapshot(self), strict=True))

    monkeypatch.setattr(loop_module.Trainer, "train_step", step)
    train(config(data, tmp_path / "run", optimizer=optimizer, nonfinite="skip", steps=bad + 2))
    assert seen == {"same": True}
