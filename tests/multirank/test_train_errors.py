"""Errors of a sharded run are reported on every rank: start-up errors naming the flag, bad data found by any
rank's share of the check, a non-finite step seen on one rank's batch, and flags changed on resume applied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dimuon.bench.launch import run_gloo

from . import train_scenarios as sc

pytestmark = pytest.mark.multirank


def test_one_process_baseline_is_refused_under_fsdp(tmp_path: Path) -> None:
    base = dict(model="DiT-T/2", dataset="digits", optimizer="torch_muon", batch_size=16, steps=2, progress=False)
    messages = run_gloo(sc.config_error, 2, base, str(tmp_path / "run"))
    assert all(
        m is not None and m.startswith("--optimizer torch_muon: torch_muon runs in one process only") for m in messages
    ), messages


def _arrays(path: Path, rows: dict[int, float]) -> Path:
    images = np.random.default_rng(0).uniform(-1, 1, (40, 1, 8, 8)).astype(np.float32)
    for row, value in rows.items():
        images[row, 0, 2, 2] = value
    np.savez(path, images=images, labels=np.arange(40) % 2)
    return path


def test_bad_data_non_finite_steps_and_resumed_options_on_two_ranks(tmp_path: Path) -> None:
    last_row = 39  # in the last rank's share of the start-up check
    nan = _arrays(tmp_path / "nan.npz", {last_row: np.nan})
    from dimuon.data import BatchSchedule, build_dataset

    index = build_dataset("arrays", "train", path=_arrays(tmp_path / "huge.npz", {})).index
    first = int(index[BatchSchedule(len(index), 8, 0).global_indices(0)[-1]])  # in rank 1's half of step 1
    huge = _arrays(tmp_path / "huge.npz", {first: 1e30})
    base: dict[str, Any] = dict(
        model="DiT-T/4",
        dataset="arrays",
        batch_size=8,
        steps=4,
        log_interval=1,
        val_interval=0,
        val_samples=4,
        sample_count=2,
        sample_steps=1,
        ckpt_interval=0,
        warmup_steps=1,
        progress=False,
        optimizer="periodic_row_muon",
    )
    configs = [
        dict(base, data_path=str(nan), out=str(tmp_path / "nan")),
        dict(base, data_path=str(huge), out=str(tmp_path / "raise")),
        dict(base, data_path=str(huge), out=str(tmp_path / "skip"), nonfinite="skip"),
    ]
    (bad_data, stopped, skipped), other = run_gloo(sc.outcomes, 2, configs)
    assert other == [bad_data, stopped, skipped]  # every rank reports the same
    assert bad_data == (
        "ConfigError",
        f"--dataset arrays --data-path {nan}: 1 item of the data set cannot be used: "
        f"row {last_row} of {nan} holds NaN or inf values",
    )
    assert stopped[0] == "RunFailed" and stopped[1].startswith("step 1 of 4: ") and "--nonfinite skip" in stopped[1]
    assert skipped == ("done", 1)

    fork = dict(
        base,
        data_path=str(huge),
        out=str(tmp_path / "fork"),
        resume=str(tmp_path / "skip"),
        steps=5,
        nonfinite="skip",
        optim={"k": 7, "gamma": 0.5, "weight_decay": 0.1},
        ema_decay=0.5,
        ema_warmup=False,
    )
    from dimuon.train import OptimOptions

    fork["optim"] = OptimOptions(**fork["optim"])
    for options in run_gloo(sc.resumed_options, 2, fork):
        assert options["k"] == {7} and options["gamma"] == {0.5} and options["weight_decay"] == {0.1}
        assert options["steps"] == {4}  # the saved counters continue: the skipped step took its schedule slot
        assert options["ema"] == (0.5, False, 4)  # its counter too (its values were masked)
