"""The training loop on tiny runs: learning, the run directory, exact resume, and run-directory safety."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from tests.train_runs import records, tiny_config, without_timing

from dimuon.dit import list_checkpoints
from dimuon.train import ConfigError, train
from dimuon.train.run import main as train_main
from dimuon.train.sample import main as sample_main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_loss_decreases_on_a_tiny_run(tmp_path: Path) -> None:
    cfg = tiny_config(
        tmp_path / "run",
        steps=60,
        batch_size=32,
        warmup_steps=5,
        log_interval=10,
        val_interval=0,
        val_samples=64,
        ckpt_interval=0,
        lr=5e-3,
    )
    summary = train(cfg)
    train_losses = [r["loss"] for r in records(tmp_path / "run") if r["kind"] == "train"]
    assert train_losses[-1] < 0.75 * train_losses[0], train_losses
    # A zero-output model (the DiT's init) scores E|x1 - x0|^2, about 1.6 on MNIST in [-1, 1].
    assert summary["val_loss"] < 0.9 and summary["val_loss_ema"] < 1.2, summary


def test_run_directory_holds_config_metrics_checkpoints_samples_and_plots(tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = train(tiny_config(run))
    assert json.loads((run / "config.json").read_text())["model"] == "DiT-T/4"
    assert [s for s, _ in list_checkpoints(run)] == [4, 8]
    assert summary["checkpoint"] == str(run / "checkpoints" / "step_0000008")
    with Image.open(run / "samples" / "step_0000008.png") as img:
        assert img.size == (2 * (10 * 30 + 2), 2 * (1 * 30 + 2))  # 10 classes per row, 28 px + 2 px padding, x2
    assert (run / "plots" / "loss_vs_step.png").is_file() and (run / "plots" / "loss_vs_time.png").is_file()
    recs = records(run)
    train_recs = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train_recs] == [2, 4, 6, 8]
    for key in ("loss", "lr", "grad_norm", "step_ms", "fwd_bwd_ms", "opt_ms", "comm_bytes_per_step"):
        assert all(isinstance(r[key], float) for r in train_recs), key
    assert all(r["opt_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in train_recs)
    val = [r for r in recs if r["kind"] == "val"]
    assert [r["step"] for r in val] == [4, 8] and len(val[0]["val_per_t"]) == 10
    times = [r["active_time_s"] for r in recs if "active_time_s" in r]
    assert times == sorted(times)


def test_refresh_decisions_are_logged_and_plotted(tmp_path: Path) -> None:
    from dimuon.train import OptimOptions

    run = tmp_path / "run"
    train(
        tiny_config(
            run,
            optimizer="adaptive_row_muon",
            optim=OptimOptions(threshold=0.3, k_min=2, k_max=3),
            val_interval=0,
            ckpt_interval=0,
        )
    )
    windows = [r["refresh"] for r in records(run) if r["kind"] == "train"]
    assert len(windows) == 4 and len(windows[0]["matrices"]) == 5 * 2 + 2  # DiT-T/4: 2 blocks x 5, t-MLP, final adaLN
    assert all(f == 0.5 for f in windows[0]["matrices"].values())  # steps 0 (first, spectral) and 1 (k_min)
    for w in windows:
        assert all(1 / 3 <= f <= 1 / 2 for f in w["matrices"].values())  # intervals of 2 or 3 steps
        assert w["spectral_fraction"] == pytest.approx(sum(w["matrices"].values()) / len(w["matrices"]), abs=1e-3)
    assert (run / "plots" / "refreshes.png").is_file()
    train(tiny_config(tmp_path / "adamw", optimizer="adamw", steps=2, val_interval=0, ckpt_interval=0))
    assert all("refresh" not in r for r in records(tmp_path / "adamw"))
    assert not (tmp_path / "adamw" / "plots" / "refreshes.png").exists()


def test_resume_equals_an_uninterrupted_run_bitwise(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    overrides = dict(steps=10, ckpt_interval=4, val_interval=5, optimizer="periodic_row_muon")
    train(tiny_config(straight, **overrides))
    partial = train(tiny_config(resumed, **overrides), stop_after=7)  # "killed" 3 steps after a checkpoint
    assert partial["step"] == 7 and [s for s, _ in list_checkpoints(resumed)] == [4]
    train(tiny_config(resumed, resume=str(resumed), **overrides))

    a = torch.load(straight / "checkpoints/step_0000010/state.pt", weights_only=True)
    b = torch.load(resumed / "checkpoints/step_0000010/state.pt", weights_only=True)
    for part in ("model",):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert all(torch.equal(a["ema"]["weights"][k], b["ema"]["weights"][k]) for k in a["ema"]["weights"])
    assert a["ema"]["num_updates"] == b["ema"]["num_updates"] == 10
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    assert [g["step"] for g in a["optimizer"]["param_groups"]] == [g["step"] for g in b["optimizer"]["param_groups"]]
    # Same log, once the lines written after the checkpoint by the "killed" run were dropped.
    assert without_timing(records(straight)) == without_timing(records(resumed))


# A checkpoint between two logging steps: the window of the record after it began before the checkpoint.
OFF_THE_LOG = dict(steps=8, log_interval=3, ckpt_interval=4, val_interval=0, optimizer="periodic_row_muon")


def test_a_resume_off_a_logging_step_writes_the_log_of_an_uninterrupted_run(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(tiny_config(straight, **OFF_THE_LOG))
    train(tiny_config(resumed, **OFF_THE_LOG), stop_after=5)  # "killed" after step 5, its checkpoint at 4
    train(tiny_config(resumed, resume=str(resumed), **OFF_THE_LOG))
    # The record of step 6 averages steps 4 to 6 in both: loss, gradient norm and the share of spectral steps
    # (PeriodicRowMuon takes one in three, so a window of steps 5 and 6 alone would have none).
    log = [r for r in without_timing(records(resumed)) if r["kind"] == "train"]
    assert [r["step"] for r in log] == [3, 6, 8]
    assert log[1]["refresh"]["spectral_fraction"] == round(1 / 3, 4)
    assert without_timing(records(straight)) == without_timing(records(resumed))
    # The window travels in the checkpoint's progress (not among meta.json's top-level counters).
    meta = json.loads((resumed / "checkpoints/step_0000004/meta.json").read_text())
    assert meta["progress"]["log_window"]["steps"] == 1 and "log_window" not in meta


def test_a_checkpoint_saved_without_the_log_window_still_resumes(tmp_path: Path) -> None:
    from dimuon.dit.checkpoint import file_record

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(tiny_config(straight, **OFF_THE_LOG))
    train(tiny_config(resumed, **OFF_THE_LOG), stop_after=5)
    # Made as a checkpoint written before the window was kept: no log_window in its progress.
    ckpt = resumed / "checkpoints/step_0000004"
    state = torch.load(ckpt / "state.pt", weights_only=True)
    del state["progress"]["log_window"]
    torch.save(state, ckpt / "state.pt")
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["progress"]["log_window"]
    meta["files"]["state.pt"] = file_record(ckpt / "state.pt")
    (ckpt / "meta.json").write_text(json.dumps(meta))

    train(tiny_config(resumed, resume=str(resumed), **OFF_THE_LOG))
    a = torch.load(straight / "checkpoints/step_0000008/state.pt", weights_only=True)
    b = torch.load(resumed / "checkpoints/step_0000008/state.pt", weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    # Its first record after the resume starts an empty window: steps 5 and 6 only, the rest as before.
    log_a = [r for r in without_timing(records(straight)) if r["kind"] == "train"]
    log_b = [r for r in without_timing(records(resumed)) if r["kind"] == "train"]
    assert [r["step"] for r in log_b] == [3, 6, 8]
    assert log_b[1]["refresh"]["spectral_fraction"] == 0.0 and log_b[1]["loss"] != log_a[1]["loss"]
    assert [log_a[0], log_a[2]] == [log_b[0], log_b[2]]


def test_a_saved_log_window_gives_each_rank_its_own_loss_sum_or_their_mean_at_another_world_size() -> None:
    from dimuon.train.distributed import DistEnv
    from dimuon.train.records import Window

    cpu = torch.device("cpu")
    window = Window()
    window.steps, window.loss, window.grad_norm = 2, torch.tensor(3.0), torch.tensor(0.5)
    state = window.state(DistEnv(0, 1, cpu), {}, {}, {"w": [1, 2]})
    assert state["loss"] == [3.0] and state["refresh"] == {"w": [1, 2]}
    state["loss"] = [3.0, 5.0]  # as two ranks saved it
    assert Window.restored(state, DistEnv(1, 2, cpu)).loss == 5.0
    assert Window.restored(state, DistEnv(0, 1, cpu)).loss == 4.0  # the record's mean over ranks is kept
    assert Window.restored(None, DistEnv(0, 1, cpu)) == Window()


def test_resume_through_the_cli_keeps_the_saved_config_and_extends_the_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, steps=4, schedule="constant"))
    assert train_main(["--resume", str(run), "--steps", "6", "--no-progress"]) == 0
    cfg = json.loads((run / "config.json").read_text())
    assert (cfg["steps"], cfg["model"], cfg["schedule"], cfg["resume"]) == (6, "DiT-T/4", "constant", str(run))
    assert [s for s, _ in list_checkpoints(run)] == [4, 6]


def test_resuming_a_finished_run_reports_what_it_recorded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, steps=4))
    first = capsys.readouterr().out.strip().splitlines()[-1]
    assert train_main(["--resume", str(run), "--no-progress"]) == 0
    again = capsys.readouterr().out.strip().splitlines()[-1]
    val = next(r for r in reversed(records(run)) if r["kind"] == "val")
    assert f"val loss {val['val_loss']:.4f} (EMA {val['val_loss_ema']:.4f})" in again and "nan" not in again
    assert first.split("; samples ")[1] == again.split("; samples ")[1]  # the same grid


def test_an_existing_run_is_never_overwritten_silently(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, steps=2, ckpt_interval=0))
    with pytest.raises(ConfigError, match=r"already holds a run \(.*\); pass --resume"):
        train(tiny_config(run, steps=2))
    train(tiny_config(run, steps=3, ckpt_interval=0, overwrite=True))
    assert [s for s, _ in list_checkpoints(run)] == [3]


def test_sample_command_writes_a_grid_from_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    train(tiny_config(run, steps=2, ckpt_interval=0))
    out = tmp_path / "grid.png"
    code = sample_main(
        [
            "--ckpt",
            str(run),
            "--n",
            "12",
            "--cfg",
            "2",
            "--steps",
            "2",
            "--method",
            "euler",
            "--out",
            str(out),
            "--scale",
            "1",
        ]
    )
    assert code == 0, capsys.readouterr().err
    with Image.open(out) as img:
        assert img.size == (10 * 30 + 2, 2 * 30 + 2)  # 12 images, one class per column, two rows
    common = ["--ckpt", str(run), "--n", "16", "--steps", "1", "--method", "euler", "--scale", "1", "--out", str(out)]
    for labels, columns in ((["7"], 4), (["3", "5"], 2)):  # one label: square; several: one column each
        assert sample_main([*common, "--labels", *labels]) == 0, capsys.readouterr().err
        with Image.open(out) as img:
            assert img.size == (columns * 30 + 2, 16 // columns * 30 + 2), labels
    assert sample_main(["--ckpt", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    for args, message in (
        (["--out", str(tmp_path)], f"--out {tmp_path} is a directory; name the PNG file"),
        (["--out", str(tmp_path / "file" / "g.png")], f"--out {tmp_path / 'file' / 'g.png'} cannot be written: "),
        (["--nrow", "0"], "--nrow must be >= 1, got 0"),
        (["--cfg", "-1"], "--cfg must be >= 0"),
        *(
            [(["--device", "cuda"], "--device cuda: CUDA is not available here")]
            if not torch.cuda.is_available()
            else []
        ),
    ):
        assert sample_main(["--ckpt", str(run), *args]) == 2
        assert capsys.readouterr().err.startswith(f"dimuon sample: error: {message}")


def test_tensorboard_without_its_package_is_a_start_up_error(tmp_path: Path) -> None:
    from dimuon.train.logger import tensorboard_available

    if tensorboard_available():
        pytest.skip("tensorboard is installed here")
    with pytest.raises(ConfigError, match="--tensorboard needs the tensorboard package"):
        train(tiny_config(tmp_path / "run", tensorboard=True))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("optimizer", "options"),
    [("adamw", {}), ("muon", {}), ("muon_bp", {"period": 2}), ("adaptive_row_muon", {"threshold": 0.3, "k_max": 3})],
)
def test_every_optimizer_trains_and_resumes_exactly(optimizer: str, options: dict, tmp_path: Path) -> None:
    from dimuon.train import OptimOptions

    overrides = dict(
        steps=4,
        ckpt_interval=2,
        val_interval=0,
        val_samples=8,
        sample_count=10,
        sample_steps=1,
        batch_size=8,
        optimizer=optimizer,
        optim=OptimOptions(**options),
        precision="bf16",
    )
    train(tiny_config(tmp_path / "a", **overrides))
    train(tiny_config(tmp_path / "b", **overrides), stop_after=3)
    train(tiny_config(tmp_path / "b", resume=str(tmp_path / "b"), **overrides))
    a = torch.load(tmp_path / "a/checkpoints/step_0000004/state.pt", weights_only=True)
    b = torch.load(tmp_path / "b/checkpoints/step_0000004/state.pt", weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert not all(torch.equal(a["model"][k], a["ema"]["weights"][k]) for k in a["model"])


def test_the_training_bar_rate_leaves_out_the_time_its_hooks_take() -> None:
    from tqdm import tqdm

    from dimuon.train.loop import bar_paused

    bar = tqdm(total=10, file=io.StringIO(), mininterval=0)
    bar.update(1)
    before = bar.format_dict["elapsed"]
    with bar_paused(bar):
        time.sleep(0.3)  # a validation or a checkpoint
    assert bar.format_dict["elapsed"] - before < 0.2  # the bar's clock did not run through the pause
    bar.close()
    with bar_paused(tqdm(total=1, disable=True)):  # a disabled bar (other ranks, --no-progress) has no clock
        pass
