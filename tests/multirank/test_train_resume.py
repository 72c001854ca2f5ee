"""Training on 2 gloo ranks (FSDP2 + DCP): resume equals an uninterrupted run, DCP checkpoints load for eval."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from dimuon.bench.launch import run_gloo
from dimuon.dit.checkpoint import CheckpointError, list_checkpoints, load_model_for_eval, read_meta
from dimuon.train import TrainConfig, train
from tests.train_runs import TINY, records, without_timing

from . import train_scenarios as sc

pytestmark = pytest.mark.multirank

BASE: dict[str, Any] = {**TINY, "steps": 10, "warmup_steps": 3, "optimizer": "periodic_row_muon"}


def _log(run: Path) -> list[dict[str, Any]]:
    return without_timing(records(run))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict]]:
    root = tmp_path_factory.mktemp("train2")
    straight, resumed = root / "straight", root / "resumed"
    results = run_gloo(sc.straight_and_resumed, 2, BASE, str(straight), str(resumed), 7)
    return straight, resumed, results


def test_resume_on_two_ranks_equals_an_uninterrupted_run(runs: tuple[Path, Path, list[dict]]) -> None:
    straight, resumed, results = runs
    assert results[0]["partial"]["step"] == 7
    assert [s for s, _ in list_checkpoints(straight)] == [4, 8, 10]
    assert [s for s, _ in list_checkpoints(resumed)] == [4, 8, 10]
    for use_ema in (True, False):
        a, _ = load_model_for_eval(straight / "checkpoints" / "step_0000010", use_ema=use_ema)
        b, _ = load_model_for_eval(resumed / "checkpoints" / "step_0000010", use_ema=use_ema)
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(x, y), (use_ema, name)
    assert _log(straight) == _log(resumed)
    # Both ranks saw the same global numbers.
    assert results[0]["b"]["val_loss"] == results[1]["b"]["val_loss"]


# A checkpoint between two logging steps: the DCP checkpoint carries the log window, each rank's loss sum its own.
OFF_THE_LOG: dict[str, Any] = {**BASE, "steps": 8, "log_interval": 3, "ckpt_interval": 4, "val_interval": 0}


@pytest.fixture(scope="module")
def off_the_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("train2_window")
    straight, resumed = root / "straight", root / "resumed"
    run_gloo(sc.straight_and_resumed, 2, OFF_THE_LOG, str(straight), str(resumed), 5)
    return straight, resumed


def test_a_resume_off_a_logging_step_on_two_ranks_writes_the_uninterrupted_log(off_the_log: tuple[Path, Path]) -> None:
    straight, resumed = off_the_log
    assert [r["step"] for r in _log(resumed) if r["kind"] == "train"] == [3, 6, 8]
    assert _log(straight) == _log(resumed)


def test_the_log_window_of_a_dcp_checkpoint_resumes_in_one_process(
    off_the_log: tuple[Path, Path], tmp_path: Path
) -> None:
    straight, _ = off_the_log
    torch.set_num_threads(1)
    fork = tmp_path / "fork"
    train(TrainConfig(out=str(fork), resume=str(straight / "checkpoints" / "step_0000004"), **OFF_THE_LOG))
    a = [r for r in _log(straight) if r["kind"] == "train"]
    b = [r for r in _log(fork) if r["kind"] == "train"]
    # Step 6 covers steps 4 to 6 here too, the spectral step of step 4 with them. (Its loss is not the two-rank
    # run's: one process draws the noise of data-parallel rank 0 for the whole batch.)
    assert [r["step"] for r in b] == [3, 6, 8] and a[0] == b[0]
    assert b[1]["refresh"] == a[1]["refresh"] and b[1]["refresh"]["spectral_fraction"] == round(1 / 3, 4)


def test_dcp_checkpoints_load_for_eval_without_a_process_group(runs: tuple[Path, Path, list[dict]]) -> None:
    straight, _, _ = runs
    ckpt_dir = straight / "checkpoints" / "step_0000010"
    meta = read_meta(ckpt_dir)
    assert meta["kind"] == "dcp" and meta["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(meta["files"])
    model, info = load_model_for_eval(ckpt_dir)
    assert not model.training and info["step"] == 10 and info["image_shape"] == (1, 28, 28)
    raw, _ = load_model_for_eval(ckpt_dir, use_ema=False)
    assert any(not torch.equal(x, y) for x, y in zip(model.state_dict().values(), raw.state_dict().values()))


def test_damaged_dcp_shard_is_reported(runs: tuple[Path, Path, list[dict]], tmp_path: Path) -> None:
    import shutil

    straight, _, _ = runs
    ckpt_dir = tmp_path / "step_0000010"
    shutil.copytree(straight / "checkpoints" / "step_0000010", ckpt_dir)
    shard = ckpt_dir / "__1_0.distcp"
    assert shard.is_file()
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: truncated"):
        load_model_for_eval(ckpt_dir)


def test_dcp_checkpoint_resumes_in_one_process_into_a_new_run(
    runs: tuple[Path, Path, list[dict]], tmp_path: Path
) -> None:
    straight, _, _ = runs
    torch.set_num_threads(1)
    fork = tmp_path / "fork"
    summary = train(TrainConfig(out=str(fork), resume=str(straight / "checkpoints" / "step_0000008"), **BASE))
    assert summary["step"] == 10
    # The fork starts with the source run's history up to its checkpoint.
    steps = [r["step"] for r in _log(fork) if r["kind"] == "train"]
    assert steps == [2, 4, 6, 8, 10]
    assert [s for s, _ in list_checkpoints(fork)] == [10]


def test_a_signal_to_one_rank_stops_both_at_one_checkpoint_and_resume_is_exact(
    runs: tuple[Path, Path, list[dict]], tmp_path: Path
) -> None:
    straight, _, _ = runs
    stopped = tmp_path / "stopped"
    # Rank 1 alone is signalled during step 5 (1-based): both stop after step 6, the next logging step.
    results = run_gloo(sc.stopped_by_signal, 2, BASE, str(stopped), 1, 4)
    for r in results:
        assert r["stopped"] is not None and r["stopped"]["status"] == 128 + signal.SIGUSR1
        assert r["checkpoints"] == [4, 6]
    assert "stopped by SIGUSR1 after step 6 of 10" in results[0]["stopped"]["message"]
    assert results[1]["stopped"]["message"] == ""  # one report, from rank 0
    assert [s for s, _ in list_checkpoints(stopped)] == [4, 6, 8, 10]  # the stop's checkpoint, kept as any other
    a, _ = load_model_for_eval(straight / "checkpoints" / "step_0000010", use_ema=False)
    b, _ = load_model_for_eval(stopped / "checkpoints" / "step_0000010", use_ema=False)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    extra = [r for r in _log(stopped) if r["kind"] in ("checkpoint", "stopped") and r["step"] == 6]
    assert extra == [{"kind": "checkpoint", "step": 6}, {"kind": "stopped", "step": 6, "signal": "SIGUSR1"}]
    assert [r for r in _log(stopped) if r not in extra] == _log(straight)
