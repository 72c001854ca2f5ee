"""The run directory: a run is recognised by dimuon's marker, --overwrite deletes only dimuon's files, later
checkpoints wait until a resumed run replaces them, and an output that cannot be written is refused at start-up
(or, failing during a save, leaves nothing half-written behind)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.train_runs import tiny_config

import dimuon.io as dio
from dimuon.dit import list_checkpoints
from dimuon.io import RunLayout
from dimuon.train import ConfigError, TrainConfig, train
from dimuon.train import loop as loop_module
from dimuon.train import rundir as rundir_module
from dimuon.train.loop import Trainer
from dimuon.train.resume import find_resume_point, run_of_checkpoint
from dimuon.train.run import main as train_main
from dimuon.train.rundir import RunLock

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(out: Path, **overrides: Any) -> TrainConfig:
    base = dict(steps=1, ckpt_interval=0, val_interval=0, val_samples=8, sample_count=10, sample_steps=1, batch_size=8)
    return tiny_config(out, **{**base, **overrides})


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_run_holds_its_marker_and_only_files_dimuon_recognises_as_its_own(tmp_path: Path) -> None:
    run = RunLayout(tmp_path / "run")
    train(tiny(run.root, steps=2, ckpt_interval=1))
    assert run.is_run() and json.loads(run.marker.read_text())["created_by"] == "dimuon train"
    assert run.foreign_files() == [] and len(run.owned_files()) > 8


def test_overwrite_deletes_dimuon_s_files_and_keeps_the_user_s(tmp_path: Path) -> None:
    run = RunLayout(tmp_path / "run")
    train(tiny(run.root, steps=2, ckpt_interval=1))
    mine = [
        write(run.eval / "run_eval.py", "print('mine')"),
        write(run.plots / "fig1.png", "png"),
        write(run.root / "notes.txt", "notes"),
    ]
    with pytest.raises(ConfigError, match=r"already holds a run \(its newest checkpoint is step 2\); pass --resume"):
        train(tiny(run.root))
    train(tiny(run.root, overwrite=True))
    assert [s for s, _ in list_checkpoints(run.root)] == [1]  # step 2 of the old run is gone
    assert [p.read_text() for p in mine] == ["print('mine')", "png", "notes"]
    assert run.is_run() and sorted(run.foreign_files()) == sorted(mine)


def test_a_directory_without_the_marker_is_not_a_run_and_is_never_written_into(tmp_path: Path) -> None:
    out = tmp_path / "analysis"
    mine = [write(out / "eval" / "run_eval.py", "x"), write(out / "plots" / "fig1.png", "y")]
    for overwrite in (False, True):
        with pytest.raises(
            ConfigError,
            match=r"is not a dimuon run \(it has no \.dimuon-run\.json\) but holds "
            r"plots/ \(1 file: plots/fig1\.png\), eval/ \(1 file: eval/run_eval\.py\)",
        ):
            train(tiny(out, overwrite=overwrite))
    assert sorted(p for p in out.rglob("*") if p.is_file()) == sorted(mine)
    # Files at names a run never uses do not stop it (e.g. a launcher's log beside the run).
    log = write(tmp_path / "launched" / "train.log", "log")
    train(tiny(log.parent))
    assert log.read_text() == "log" and RunLayout(log.parent).is_run()


def test_resuming_from_an_earlier_checkpoint_sets_later_ones_aside_until_they_are_replaced(tmp_path: Path) -> None:
    run = RunLayout(tmp_path / "run")
    train(tiny(run.root, steps=4, ckpt_interval=1))
    old_four = (run.checkpoint(4) / "meta.json").read_text()
    # Resume from step 2 and "crash" right after the checkpoint of step 3.
    train(tiny(run.root, steps=4, ckpt_interval=1, resume=str(run.checkpoint(2))), stop_after=3)
    assert [s for s, _ in list_checkpoints(run.root)] == [1, 2, 3]
    assert (run.superseded(4) / "meta.json").read_text() == old_four and not run.superseded(3).exists()
    assert find_resume_point(run.root).step == 3  # never the abandoned trajectory's step 4
    train(tiny(run.root, steps=4, ckpt_interval=1, resume=str(run.root)))
    assert [s for s, _ in list_checkpoints(run.root)] == [1, 2, 3, 4]
    assert not run.superseded(4).exists() and run.foreign_files() == []


def test_a_checkpoint_kept_outside_a_run_starts_a_new_run_and_never_writes_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = RunLayout(tmp_path / "run")
    train(tiny(run.root, steps=2, ckpt_interval=1))
    keep = tmp_path / "mine"  # a user's directory: a copied checkpoint among their own files
    shutil.copytree(run.checkpoint(1), keep / "backups" / "step_0000001")
    mine = [
        write(keep / "config.json", '{"my": "own config"}'),
        write(keep / "metrics.jsonl", '{"step": 50, "note": "mine"}\n'),
        write(keep / "samples" / "step_0000040.png", "png"),
    ]
    before = {p: p.read_bytes() for p in keep.rglob("*") if p.is_file()}
    assert train_main(["--resume", str(keep / "backups" / "step_0000001"), "--no-progress"]) == 2
    assert "is not in the checkpoints/ directory of a dimuon run" in capsys.readouterr().err
    fork = tmp_path / "fork"
    assert train_main(["--resume", str(keep / "backups" / "step_0000001"), "--out", str(fork), "--no-progress"]) == 0
    assert {p: p.read_bytes() for p in keep.rglob("*") if p.is_file()} == before and not RunLayout(keep).is_run()
    assert [s for s, _ in list_checkpoints(fork)] == [2] and all(p.exists() for p in mine)
    assert find_resume_point(run.root).run == run.root  # a run's own checkpoints still continue it in place


def test_pruned_and_replaced_checkpoints_keep_a_user_s_files(tmp_path: Path) -> None:
    run = RunLayout(tmp_path / "run")
    train(tiny(run.root, steps=2, ckpt_interval=1))
    note = write(run.checkpoint(1) / "NOTES.md", "why step 1 matters")
    train(tiny(run.root, steps=4, ckpt_interval=1, keep_checkpoints=1, resume=str(run.root)))
    assert [s for s, _ in list_checkpoints(run.root)] == [4] and note.read_text() == "why step 1 matters"
    assert sorted(p.name for p in run.checkpoint(1).iterdir()) == ["NOTES.md"]  # dimuon's files of it are gone
    # A checkpoint replaced by another of its step: the user's file stays beside the new one's files.
    mine = write(tmp_path / "target" / "NOTES.md", "mine")
    write(tmp_path / "target" / "meta.json", "{}")
    dio.move_checkpoint(run.checkpoint(4), tmp_path / "target")
    assert sorted(p.name for p in (tmp_path / "target").iterdir()) == ["NOTES.md", "meta.json", "state.pt"]
    assert mine.read_text() == "mine" and not run.checkpoint(4).exists()


def test_an_unwritable_out_is_refused_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path / "file", "x")
    assert train_main(["--out", str(tmp_path / "file" / "run"), "--steps", "1", "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith(
        f"dimuon train: error: --out {tmp_path / 'file' / 'run'} cannot be "
        f"written: {tmp_path / 'file'} is a file, not a directory"
    )
    monkeypatch.setattr(dio.os, "access", lambda path, mode: False)  # as a read-only file system answers
    with pytest.raises(ConfigError, match=r"cannot be written: its parent .* is not writable"):
        train(tiny(tmp_path / "ro" / "run"))
    assert not (tmp_path / "ro").exists()


def test_too_little_free_space_for_a_checkpoint_is_refused_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dimuon.train.rundir as rundir

    monkeypatch.setattr(rundir, "free_bytes", lambda path: 3 << 20)
    with pytest.raises(
        ConfigError,
        match=r"3 MiB free on its file system, but one checkpoint of this run takes "
        r"about \d+ MiB .* free some space or choose another --out",
    ):
        train(tiny(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_save_that_fails_leaves_no_partial_checkpoint_and_an_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_save = torch.save

    def full_disk(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        Path(f).write_bytes(b"PK\x03\x04 partial")
        raise RuntimeError("[enforce fail at inline_container.cc:783] . unexpected pos 2889536 vs 2889424")

    run = tmp_path / "run"
    monkeypatch.setattr(torch, "save", full_disk)
    code = train_main(
        [
            "--out",
            str(run),
            "--model",
            "DiT-T/4",
            "--steps",
            "1",
            "--batch-size",
            "8",
            "--val-samples",
            "8",
            "--sample-count",
            "10",
            "--sample-steps",
            "1",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err.splitlines()
    assert code == 1, err
    assert (
        err[0].startswith(
            f"dimuon train: error: could not write the checkpoint of step 1 to {run}/checkpoints/"
            "step_0000001 (RuntimeError: "
        )
        and "unexpected pos" in err[0]
    )
    assert err[0].endswith("nothing of it was left behind")
    assert err[1].startswith("dimuon train: the run stopped after step 1, before its first checkpoint")
    assert list((run / "checkpoints").iterdir()) == []  # no .tmp-step_ directory, no hidden partial file
    monkeypatch.setattr(torch, "save", real_save)
    assert train_main(["--resume", str(run), "--no-progress"]) == 0  # the same directory, rerun from step 0
    assert [s for s, _ in list_checkpoints(run)] == [1]


# Another process training the run: it holds the run's lock until it is killed.
HOLDER = """
import sys, time
from pathlib import Path
from dimuon.io import RunLayout
from dimuon.train.rundir import RunLock
RunLock(RunLayout(Path(sys.argv[1]))).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_a_run_another_process_trains_is_refused_naming_it_until_that_process_ends(tmp_path: Path) -> None:
    run = RunLayout(tmp_path / "run")
    train(tiny(run.root))
    log = run.metrics.read_text()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run.root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"is being trained by another process \(pid {holder.pid} on "):
            train(tiny(run.root, resume=str(run.root), steps=2))
        with pytest.raises(ConfigError, match="is being trained by another process"):
            train(tiny(run.root, overwrite=True))
        assert run.metrics.read_text() == log and [s for s, _ in list_checkpoints(run.root)] == [1]  # untouched
    finally:
        holder.kill()
        holder.wait()
    train(tiny(run.root, resume=str(run.root), steps=2))  # a killed holder leaves no stale lock
    assert [s for s, _ in list_checkpoints(run.root)] == [1, 2] and run.lock.is_file()


def test_the_lock_is_held_while_the_run_trains_and_survives_overwrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = RunLayout(tmp_path / "run")
    refused: list[str] = []
    original = Trainer.train_step

    def step(self: Trainer, s: int) -> None:
        try:
            RunLock(run).acquire()  # as a second process would
        except ConfigError as e:
            refused.append(str(e))
        original(self, s)

    monkeypatch.setattr(Trainer, "train_step", step)
    train(tiny(run.root, steps=2))
    train(tiny(run.root, steps=1, overwrite=True))
    assert len(refused) == 3 and f"pid {os.getpid()} on " in refused[0]
    assert run.lock.is_file() and run.lock not in run.foreign_files()


def test_a_run_made_in_out_after_the_first_check_is_refused_under_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another launch of the same command finishes its run in --out between this one's check and its lock.
    out = tmp_path / "run"
    other = tmp_path / "other"
    train(tiny(other, steps=2, ckpt_interval=1))
    real_open = loop_module.open_data

    def open_data_while_the_other_launch_finishes(*args: Any, **kwargs: Any) -> Any:
        shutil.copytree(other, out, dirs_exist_ok=True)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(loop_module, "open_data", open_data_while_the_other_launch_finishes)
    with pytest.raises(ConfigError, match="already holds a run"):
        train(tiny(out))
    assert [s for s, _ in list_checkpoints(out)] == [1, 2]  # the other launch's run is whole


def test_an_overwrite_cut_short_leaves_a_run_that_overwrite_can_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = RunLayout(tmp_path / "run")
    train(tiny(run.root, steps=2, ckpt_interval=1))
    real_unlink, calls = Path.unlink, []

    def unlink_then_die(self: Path, *args: Any, **kwargs: Any) -> None:
        calls.append(self)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed in the middle of the deletion
        real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", unlink_then_die)
    with pytest.raises(KeyboardInterrupt):
        run.clear()
    monkeypatch.undo()
    assert run.is_run()  # the marker goes last
    train(tiny(run.root, overwrite=True))
    assert [s for s, _ in list_checkpoints(run.root)] == [1]


def test_a_resume_cut_short_after_setting_aside_picks_the_step_it_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    train(tiny(run, steps=4, ckpt_interval=2, log_interval=1))
    first = dict(list_checkpoints(run))[2]

    def killed(*args: Any, **kwargs: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(rundir_module, "truncate_jsonl", killed)
    with pytest.raises(KeyboardInterrupt):
        train(tiny(run, steps=4, ckpt_interval=2, log_interval=1, resume=str(first)))
    monkeypatch.undo()
    assert [s for s, _ in list_checkpoints(run)] == [2]  # step 4 set aside before any record was dropped
    assert find_resume_point(run).checkpoint.name == first.name


def test_a_checkpoint_named_from_inside_checkpoints_resumes_its_run_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    train(tiny(run, steps=2, ckpt_interval=1))
    monkeypatch.chdir(run / "checkpoints")
    assert run_of_checkpoint(Path("step_0000001")) == run.resolve()


def test_overwrite_with_a_resume_of_the_run_itself_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny(run, steps=2, ckpt_interval=1))
    with pytest.raises(ConfigError, match=r"--overwrite cannot go with --resume of .*own checkpoint"):
        train(tiny(run, steps=3, ckpt_interval=1, resume=str(run), overwrite=True))
    assert [s for s, _ in list_checkpoints(run)] == [1, 2]
