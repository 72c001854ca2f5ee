"""``--resume auto``: one command for a run's first launch and for every restart (``torchrun --max-restarts``).

It starts a new run in an absent or empty ``--out``, continues the run there from its newest checkpoint that
passes its manifest (passing over damaged ones and saves that never finished), and refuses what is not a
dimuon run, exactly as plain ``--resume`` refuses a flag a resumed run cannot change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.train_runs import records, tiny_config, without_timing

from dimuon.dit import list_checkpoints
from dimuon.dit.checkpoint import CheckpointError
from dimuon.io import RunLayout
from dimuon.train import ConfigError, TrainConfig, train
from dimuon.train.resume import auto_resume_point
from dimuon.train.run import main as train_main
from dimuon.train.run import parse_config
from dimuon.train.rundir import check_same_start

pytestmark = pytest.mark.usefixtures("one_thread")

FLAGS = [
    "--model",
    "DiT-T/4",
    "--batch-size",
    "8",
    "--val-interval",
    "0",
    "--val-samples",
    "8",
    "--sample-count",
    "10",
    "--sample-steps",
    "1",
    "--log-interval",
    "1",
    "--no-progress",
]


def tiny(out: Path, **overrides: Any) -> TrainConfig:
    base = dict(
        steps=1,
        ckpt_interval=0,
        val_interval=0,
        val_samples=8,
        sample_count=10,
        sample_steps=1,
        batch_size=8,
        log_interval=1,
    )
    return tiny_config(out, **{**base, **overrides})


@pytest.fixture(scope="module")
def run3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run with checkpoints at steps 1, 2 and 3 (copied by each test that changes it)."""
    run = tmp_path_factory.mktemp("auto") / "run"
    train(tiny(run, steps=3, ckpt_interval=1))
    assert [s for s, _ in list_checkpoints(run)] == [1, 2, 3]
    return run


def copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def test_an_absent_or_empty_out_starts_a_new_run(tmp_path: Path) -> None:
    for out in (tmp_path / "absent", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        found = auto_resume_point(out)
        assert found.point is None and found.passed_over == ()
        assert "holds no run yet, so a new run starts there at step 0" in found.describe()
        assert parse_config(["--resume", "auto", "--out", str(out), "--lr", "0.003"]).lr == 0.003
    # A launcher's log beside the run is no reason to refuse: the new run is created next to it, which stays.
    other = tmp_path / "with-log"
    (other / "slurm-1.out").parent.mkdir()
    (other / "slurm-1.out").write_text("job log\n")
    assert auto_resume_point(other).point is None
    train(tiny(other, resume="auto"))
    assert RunLayout(other).is_run() and (other / "slurm-1.out").read_text() == "job log\n"


def test_a_run_resumes_from_its_newest_checkpoint(run3: Path) -> None:
    found = auto_resume_point(run3)
    assert found.point is not None and found.point.step == 3 and found.passed_over == ()
    assert found.point.checkpoint == run3 / "checkpoints" / "step_0000003" and found.point.run == run3
    assert found.describe().startswith(f"--resume auto: resumed from {run3}/checkpoints/step_0000003 at step 3")


def test_an_incomplete_newest_checkpoint_is_passed_over_for_the_one_before(run3: Path, tmp_path: Path) -> None:
    run = copy(run3, tmp_path / "run")
    ckpts = run / "checkpoints"
    state = ckpts / "step_0000003" / "state.pt"
    state.write_bytes(state.read_bytes()[:-100])  # a piece shorter than its manifest says
    (ckpts / ".tmp-step_0000004").mkdir()  # a save killed while it was written
    (ckpts / ".tmp-step_0000004" / "__0_0.distcp").write_bytes(b"partial")
    found = auto_resume_point(run)
    assert found.point is not None and found.point.step == 2
    assert len(found.passed_over) == 2
    assert found.passed_over[0] == "step 4 (.tmp-step_0000004: a save that did not finish)"
    assert found.passed_over[1].startswith(f"step 3 ({state}: truncated")
    assert "passed over step 4" in found.describe()
    # A corrupted piece (same size, other bytes) and a missing manifest are passed over alike.
    blob = bytearray((ckpts / "step_0000002" / "state.pt").read_bytes())
    blob[-1] ^= 0xFF
    (ckpts / "step_0000002" / "state.pt").write_bytes(bytes(blob))
    (ckpts / "step_0000001" / "meta.json").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"no checkpoint of the run in .* passes its manifest: step 4 .*; "
        r"step 3 .*truncated.*; step 2 .*corrupted",
    ):
        auto_resume_point(run)


def test_the_cli_resumes_from_the_one_before_and_the_run_replaces_the_damaged_one(
    run3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = copy(run3, tmp_path / "run")
    meta = run / "checkpoints" / "step_0000003" / "meta.json"
    meta.write_text(meta.read_text()[:-10])  # unreadable metadata
    assert train_main(["--resume", "auto", "--out", str(run), "--steps", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"dimuon train: --resume auto: resumed from {run}/checkpoints/step_0000002 at step 2" in out
    assert "passed over step 3" in out
    assert [s for s, _ in list_checkpoints(run)] == [1, 2, 3, 4]
    steps = [r["step"] for r in records(run) if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4]  # the step-3 record of the abandoned trajectory was replaced


def test_a_foreign_directory_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    (foreign / "checkpoints").mkdir(parents=True)
    files = {foreign / "config.json": '{"mine": 1}', foreign / "checkpoints" / "model.ckpt": "weights"}
    for path, text in files.items():
        path.write_text(text)
    with pytest.raises(
        ConfigError,
        match=r"is not a dimuon run \(it has no \.dimuon-run\.json\) but holds "
        r"config\.json, checkpoints/ \(1 file: checkpoints/model\.ckpt\)",
    ):
        train(tiny(foreign, resume="auto"))
    assert train_main(["--resume", "auto", "--out", str(foreign), *FLAGS]) == 2
    assert sorted(p for p in foreign.rglob("*") if p.is_file()) == sorted(files)
    assert all(path.read_text() == text for path, text in files.items())


def test_dimuon_checkpoints_without_the_run_marker_are_refused_naming_the_explicit_resume(
    run3: Path, tmp_path: Path
) -> None:
    run = copy(run3, tmp_path / "copy")
    RunLayout(run).marker.unlink()  # a copy without dimuon's marker
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match=rf"holds checkpoints but is not marked as a dimuon run .*--resume {run}"):
        auto_resume_point(run)
    with pytest.raises(CheckpointError, match="is not marked as a dimuon run"):
        train(tiny(run, resume="auto", steps=4))
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_frozen_flag_is_refused_as_plain_resume_refuses_it(run3: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for resume in (str(run3), "auto"):
        assert train_main(["--resume", resume, "--out", str(run3), "--seed", "1", "--steps", "4"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"dimuon train: error: --seed cannot change on resume (it fixes the data order and the "
            f"training noise of every step): checkpoint {run3}/checkpoints/step_0000003 was trained "
            "with --seed 0, this run asks for 1"
        ), err
    assert train_main(["--resume", "auto", "--out", str(run3), "--steps", "2"]) == 2
    assert "--steps 2 is behind the step 3 of checkpoint" in capsys.readouterr().err
    assert train_main(["--resume", "auto", "--out", str(run3), "--overwrite"]) == 2
    assert "--overwrite cannot go with --resume auto" in capsys.readouterr().err
    assert [s for s, _ in list_checkpoints(run3)] == [1, 2, 3]


def test_a_run_without_a_checkpoint_restarts_from_step_0_with_its_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    train(tiny(run, steps=3, lr=0.003), stop_after=1)  # stopped before its first checkpoint
    found = auto_resume_point(run)
    assert found.point is not None and found.point.checkpoint is None and found.point.config["lr"] == 0.003
    cfg = parse_config(["--resume", "auto", "--out", str(run), "--no-progress"])
    assert (cfg.resume, cfg.lr, cfg.steps) == ("auto", 0.003, 3)
    assert train(cfg)["step"] == 3
    assert f"--resume auto: restarted {run} from step 0 with its config" in capsys.readouterr().out
    RunLayout(run).config.unlink()
    for path in RunLayout(run).checkpoints.iterdir():
        shutil.rmtree(path)
    with pytest.raises(CheckpointError, match=r"recorded neither its config\.json nor a checkpoint"):
        auto_resume_point(run)


def test_the_same_command_starts_stops_and_continues_bitwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    straight, auto = tmp_path / "straight", tmp_path / "auto"
    overrides = dict(steps=6, ckpt_interval=2, optimizer="periodic_row_muon")
    train(tiny(straight, **overrides))
    assert train(tiny(auto, resume="auto", **overrides), stop_after=3)["step"] == 3  # "killed" after step 3
    assert "holds no run yet" in capsys.readouterr().out
    assert train(tiny(auto, resume="auto", **overrides))["step"] == 6
    assert "--resume auto: resumed from" in capsys.readouterr().out
    a = torch.load(straight / "checkpoints/step_0000006/state.pt", weights_only=True)
    b = torch.load(auto / "checkpoints/step_0000006/state.pt", weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(a["ema"]["weights"][k], b["ema"]["weights"][k]) for k in a["ema"]["weights"])
    assert without_timing(records(straight)) == without_timing(records(auto))
    starts = [r for r in records(auto) if r["kind"] == "start"]
    assert [(r["step"], Path(r["resumed_from"]).name) for r in starts] == [(0, ""), (2, "step_0000002")]
    assert json.loads((auto / "config.json").read_text())["resume"] == "auto"


def test_ranks_that_found_different_starting_points_are_refused() -> None:
    check_same_start(["runs/x/checkpoints/step_0000004"] * 2)
    check_same_start([None, None])
    with pytest.raises(
        ConfigError,
        match=r"\(runs/x/checkpoints/step_0000004 on rank 0 and 2 more; a new run on rank 2\): "
        "every node must see the same files",
    ):
        check_same_start(
            [
                "runs/x/checkpoints/step_0000004",
                "runs/x/checkpoints/step_0000004",
                None,
                "runs/x/checkpoints/step_0000004",
            ]
        )
