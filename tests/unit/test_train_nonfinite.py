"""Bad data is found at start-up, naming the file or row; a non-finite loss or gradient never passes silently,
with any optimizer: it stops the run with an error naming the step (and the data), or is skipped and counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from dimuon.data import ArrayDataset, BatchSchedule, build_dataset
from dimuon.dit import list_checkpoints
from dimuon.train import TrainConfig, train
from dimuon.train.failures import RunFailed
from dimuon.train.run import main as train_main

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIMIZERS = ("adamw", "muon", "periodic_row_muon", "muon_bp", "torch_muon")
HUGE = 1e30  # finite, but its square is not: a latent scaled wrongly by many orders of magnitude


def arrays(path: Path, bad_rows: tuple[int, ...] = (), value: float = HUGE, n: int = 40) -> Path:
    """``n`` 8x8 one-channel images in [-1, 1], two classes, with ``value`` in the listed rows."""
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (n, 1, 8, 8)).astype(np.float32)
    images[list(bad_rows), 0, 3, 3] = value
    np.savez(path, images=images, labels=np.arange(n) % 2)
    return path


def flags(data: Path, out: Path, **extra: Any) -> list[str]:
    base = {
        "--model": "DiT-T/4",
        "--dataset": "arrays",
        "--data-path": str(data),
        "--batch-size": "8",
        "--steps": "4",
        "--log-interval": "1",
        "--val-interval": "0",
        "--val-samples": "4",
        "--sample-count": "2",
        "--sample-steps": "1",
        "--ckpt-interval": "0",
        "--warmup-steps": "1",
        "--out": str(out),
    }
    base.update({f"--{k.replace('_', '-')}": str(v) for k, v in extra.items()})
    return [*(x for kv in base.items() for x in kv), "--no-progress"]


def config(data: Path, out: Path, **extra: Any) -> TrainConfig:
    base = dict(
        model="DiT-T/4",
        dataset="arrays",
        data_path=str(data),
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
        out=str(out),
    )
    return TrainConfig(**{**base, **extra})


def first_step_drawing(data: Path, row: int) -> int:
    """The 1-based step whose batch holds ``row`` of the array file (seed 0, batch 8)."""
    index = build_dataset("arrays", "train", path=data).index
    batches = BatchSchedule(len(index), 8, 0)
    return next(s + 1 for s in range(100) if row in index[batches.indices(s)])


def records(out: Path) -> list[dict[str, Any]]:
    def refuse(token: str) -> None:
        raise ValueError(f"non-standard JSON token {token}")

    return [json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()]


def a_train_row(data: Path) -> int:
    return int(build_dataset("arrays", "train", path=data).index[5])


# --------------------------------------------------------------------------------------------------
# Data checked at start-up
# --------------------------------------------------------------------------------------------------


def test_bad_data_is_a_start_up_error_naming_the_file_or_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nan = arrays(tmp_path / "nan.npz", bad_rows=(7,), value=np.nan)
    assert train_main(flags(nan, tmp_path / "a")) == 2
    assert capsys.readouterr().err == (
        f"dimuon train: error: --dataset arrays --data-path {nan}: 1 item of the data "
        f"set cannot be used: row 7 of {nan} holds NaN or inf values\n"
    )

    folder = tmp_path / "imgs"
    for cls in ("a", "b"):
        (folder / cls).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(folder / cls / f"{i}.png")
    (folder / "b" / "3.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    assert (
        train_main(
            [*flags(folder, tmp_path / "b", batch_size=4, val_samples=1), "--dataset", "folder", "--image-size", "8"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"1 item of the data set cannot be used: {folder / 'b' / '3.png'} cannot be decoded" in err

    stray = tmp_path / "stray.npz"
    np.savez(stray, images=np.zeros((40, 1, 8, 8), np.float32), labels=np.r_[np.arange(39) % 2, 12])
    assert train_main(flags(stray, tmp_path / "c")) == 2
    assert "label 12 is out of range" in capsys.readouterr().err
    assert train_main([*flags(stray, tmp_path / "c"), "--num-classes", "13"]) == 0  # stated: it trains
    capsys.readouterr()

    assert train_main(flags(arrays(tmp_path / "ok.npz"), tmp_path / "d", batch_size=64)) == 2
    assert capsys.readouterr().err == (
        "dimuon train: error: --batch-size 64 is larger than the 36 training items of "
        f"--dataset arrays --data-path {tmp_path / 'ok.npz'}; pass --batch-size 36 or "
        "less\n"
    )
    assert not any((tmp_path / name).exists() for name in "abd")  # nothing was written for a refused run


# --------------------------------------------------------------------------------------------------
# Non-finite steps
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_non_finite_step_stops_every_optimizer_naming_the_step(optimizer: str, tmp_path: Path) -> None:
    data = tmp_path / "data.npz"
    row = a_train_row(arrays(data))
    arrays(data, bad_rows=(row,))
    step = first_step_drawing(data, row)
    with pytest.raises(
        RunFailed,
        match=rf"^step {step} of 4: (loss|gradient norm) (inf|nan).*the batch's 8 input "
        r"items are finite, so the model or the optimizer diverged\. The step was not "
        r"applied\. Pass --nonfinite skip",
    ):
        train(config(data, tmp_path / "run", optimizer=optimizer, steps=max(step, 2)))
    nonfinite = [r for r in records(tmp_path / "run") if r["kind"] == "nonfinite"]
    assert [(r["step"], r["action"]) for r in nonfinite] == [(step, "stopped")]


def test_skipped_steps_are_counted_logged_and_never_applied(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data.npz"
    row = a_train_row(arrays(data))
    arrays(data, bad_rows=(row,))
    step = first_step_drawing(data, row)
    out = tmp_path / "run"
    assert train_main(flags(data, out, optimizer="adamw", nonfinite="skip")) == 0
    recs = records(out)
    skipped = [r for r in recs if r["kind"] == "nonfinite"]
    assert [(r["step"], r["action"], r["skipped_total"]) for r in skipped] == [(step, "skipped", 1)]
    assert skipped[0]["loss"] is None or skipped[0]["grad_norm"] is None  # non-finite numbers are null
    assert sum(r["skipped_steps"] for r in recs if r["kind"] == "train") == 1
    assert [r["loss"] is None for r in recs if r["kind"] == "train"] == [s == step for s in range(1, 5)]
    state = torch.load(out / "checkpoints/step_0000004/state.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in [*state["model"].values(), *state["ema"]["weights"].values()])
    assert json.loads((out / "checkpoints/step_0000004/meta.json").read_text())["progress"]["skipped_steps"] == 1
    assert "1 step(s) of this run were skipped" in capsys.readouterr().out


def test_too_many_skipped_steps_in_a_row_stop_a_diverged_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = arrays(tmp_path / "data.npz", bad_rows=tuple(range(40)))
    out = tmp_path / "run"
    assert train_main(flags(data, out, nonfinite="skip", skip_limit=2)) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("dimuon train: error: step 2 of 4: ") and "That makes 2 skipped steps in a row" in err[0]
    assert [r["action"] for r in records(out) if r["kind"] == "nonfinite"] == ["skipped", "skipped"]


def test_the_cli_names_flag_and_step_and_the_failed_run_can_be_resumed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data.npz"
    row = a_train_row(arrays(data))
    arrays(data, bad_rows=(row,))
    step = first_step_drawing(data, row)
    out = tmp_path / "run"
    assert train_main(flags(data, out)) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"dimuon train: error: step {step} of 4: ") and "--nonfinite skip" in err[0]
    assert err[1] == (
        f"dimuon train: the run stopped after step {step - 1}, before its first checkpoint: dimuon "
        f"train --resume {out} restarts it from step 0 (flags such as --lr or --nonfinite may change)"
    )
    assert train_main(["--resume", str(out), "--nonfinite", "skip", "--no-progress"]) == 0
    assert [s for s, _ in list_checkpoints(out)] == [4]
    assert json.loads((out / "config.json").read_text())["nonfinite"] == "skip"


def test_non_finite_inputs_of_the_failing_batch_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data.npz"
    row = a_train_row(arrays(data))
    arrays(data, bad_rows=(row,), value=np.nan)
    monkeypatch.setattr(ArrayDataset, "find_problems", lambda self, positions: [])  # as if it went bad later
    with pytest.raises(RunFailed, match=rf"the batch holds non-finite input values: row {row} of {data}\."):
        train(config(data, tmp_path / "run"))


def test_the_streak_of_skipped_steps_goes_on_across_a_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = arrays(tmp_path / "data.npz", bad_rows=tuple(range(40)))  # every step is skipped
    out = tmp_path / "run"
    common = {"nonfinite": "skip", "skip_limit": 3, "ckpt_interval": 2}
    assert train_main(flags(data, out, steps=2, **common)) == 0  # 2 in a row, under the limit
    meta = json.loads((out / "checkpoints/step_0000002/meta.json").read_text())
    assert meta["progress"]["skipped_in_a_row"] == 2
    capsys.readouterr()
    assert train_main([*flags(data, out, steps=4, **common), "--resume", str(out)]) == 1
    err = capsys.readouterr().err
    assert "step 3 of 4: " in err and "That makes 3 skipped steps in a row" in err  # as an unbroken run stops


@pytest.mark.parametrize("optimizer", ["adamw", "periodic_row_muon"])  # the host's check, the optimizer's vote
def test_a_step_skipped_before_a_checkpoint_off_the_log_is_counted_in_the_resumed_run_s_record(
    optimizer: str, tmp_path: Path
) -> None:
    from tests.train_runs import without_timing

    data = tmp_path / "data.npz"
    arrays(data)
    index = build_dataset("arrays", "train", path=data).index
    row = int(index[BatchSchedule(len(index), 8, 0).indices(3)[0]])  # drawn by step 4 alone (5 steps: one epoch)
    arrays(data, bad_rows=(row,))
    common = dict(optimizer=optimizer, nonfinite="skip", steps=5, log_interval=3, ckpt_interval=4)
    train(config(data, tmp_path / "straight", **common))
    train(config(data, tmp_path / "resumed", **common), stop_after=4)  # the window at the checkpoint: steps 4
    train(config(data, tmp_path / "resumed", resume=str(tmp_path / "resumed"), **common))
    straight, resumed = (without_timing(records(tmp_path / run)) for run in ("straight", "resumed"))
    assert [(r["step"], r["skipped_steps"]) for r in resumed if r["kind"] == "train"] == [(3, 0), (5, 1)]
    assert [r["step"] for r in resumed if r["kind"] == "nonfinite"] == [4]
    assert straight == resumed
