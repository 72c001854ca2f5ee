"""Checkpoints: the listing, the eval loader's contract, and damaged checkpoints reported instead of loaded."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from tests.train_runs import tiny_config

from dimuon.data import build_dataset
from dimuon.dit import DiT
from dimuon.dit.checkpoint import (
    CheckpointError,
    find_checkpoint,
    list_checkpoints,
    load_model_for_eval,
    read_meta,
    verify_checkpoint,
)
from dimuon.train import train
from dimuon.train.checkpoint import prune_checkpoints
from dimuon.train.run import main as train_main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run with checkpoints at steps 4 and 8 (copy it before damaging anything)."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    train(tiny_config(run))
    return run


@pytest.fixture
def run_copy(trained_run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(trained_run, dst)
    return dst


def test_list_checkpoints_returns_complete_ones_sorted_and_skips_partial_saves(run_copy: Path) -> None:
    ckpts = run_copy / "checkpoints"
    (ckpts / ".tmp-step_0000012").mkdir()  # a save killed before its rename
    (ckpts / "step_0000016").mkdir()  # no meta.json: never completed
    (ckpts / "notes").mkdir()
    assert list_checkpoints(run_copy) == [(4, ckpts / "step_0000004"), (8, ckpts / "step_0000008")]
    assert list_checkpoints(run_copy / "nowhere") == []
    assert find_checkpoint(run_copy) == ckpts / "step_0000008"


def test_load_model_for_eval_returns_the_ema_model_and_the_run_s_description(trained_run: Path) -> None:
    ckpt_dir = trained_run / "checkpoints" / "step_0000008"
    model, info = load_model_for_eval(ckpt_dir)
    assert isinstance(model, DiT) and not model.training
    state = torch.load(ckpt_dir / "state.pt", weights_only=True)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state["ema"]["weights"][name]), name
    raw, _ = load_model_for_eval(ckpt_dir, use_ema=False)
    assert all(torch.equal(v, state["model"][k]) for k, v in raw.state_dict().items())
    assert not all(torch.equal(v, state["model"][k]) for k, v in model.state_dict().items())

    assert info["step"] == 8 and info["num_classes"] == 10 and info["image_shape"] == (1, 28, 28)
    assert info["config"]["model"] == "DiT-T/4" and info["config"]["steps"] == 8
    assert 0 < info["active_time_s"] < info["wall_time_s"]
    val = build_dataset(info["dataset"]["name"], split="val", **info["dataset"]["kwargs"])
    assert len(val) == 500
    with torch.no_grad():
        out = model(torch.zeros(2, *info["image_shape"]), torch.full((2,), 0.5), torch.tensor([1, 2]))
    assert out.shape == (2, 1, 28, 28)


def test_active_time_grows_from_checkpoint_to_checkpoint(trained_run: Path) -> None:
    times = [read_meta(path)["active_time_s"] for _, path in list_checkpoints(trained_run)]
    assert 0 < times[0] < times[1]


def test_truncated_checkpoint_is_reported_not_loaded(run_copy: Path) -> None:
    state = run_copy / "checkpoints" / "step_0000008" / "state.pt"
    data = state.read_bytes()
    state.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"state\.pt: truncated") as err:
        load_model_for_eval(state.parent)
    assert str(state) in str(err.value)


def test_corrupted_checkpoint_is_reported_not_loaded(run_copy: Path) -> None:
    state = run_copy / "checkpoints" / "step_0000008" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the tensor data
    state.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted, its SHA-256 does not match"):
        verify_checkpoint(state.parent)


def test_missing_pieces_are_reported(run_copy: Path) -> None:
    ckpt_dir = run_copy / "checkpoints" / "step_0000008"
    (ckpt_dir / "state.pt").unlink()
    with pytest.raises(CheckpointError, match=r"missing piece 'state\.pt'"):
        load_model_for_eval(ckpt_dir)
    (ckpt_dir / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable checkpoint metadata"):
        load_model_for_eval(ckpt_dir)
    (ckpt_dir / "meta.json").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint, meta\.json is missing"):
        load_model_for_eval(ckpt_dir)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model_for_eval(run_copy / "checkpoints" / "step_0000999")


def test_a_damaged_state_with_a_matching_manifest_still_fails_cleanly(run_copy: Path) -> None:
    # Damage that the manifest does not catch (it was rewritten to match) must still not load silently.
    ckpt_dir = run_copy / "checkpoints" / "step_0000008"
    (ckpt_dir / "state.pt").write_bytes(b"not a torch file")
    meta = json.loads((ckpt_dir / "meta.json").read_text())
    meta["files"]["state.pt"] = {"bytes": 16, "sha256": hashlib.sha256(b"not a torch file").hexdigest()}
    (ckpt_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_model_for_eval(ckpt_dir)


def test_resume_from_a_damaged_checkpoint_fails_with_its_path(
    run_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = run_copy / "checkpoints" / "step_0000008" / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])
    code = train_main(["--resume", str(run_copy), "--steps", "10", "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert str(state) in err and "truncated" in err
    # Nothing was rewritten: the log and the checkpoints are as the killed run left them.
    assert [s for s, _ in list_checkpoints(run_copy)] == [4, 8]


def test_resume_after_a_kill_during_a_save_uses_the_last_complete_checkpoint(run_copy: Path) -> None:
    ckpts = run_copy / "checkpoints"
    shutil.rmtree(ckpts / "step_0000008")
    (ckpts / ".tmp-step_0000008").mkdir()  # the save that was interrupted
    (ckpts / ".tmp-step_0000008" / "state.pt.partial").write_bytes(b"\0" * 10)
    summary = train(tiny_config(run_copy, resume=str(run_copy)))
    assert summary["step"] == 8
    assert [s for s, _ in list_checkpoints(run_copy)] == [4, 8]
    assert not (ckpts / ".tmp-step_0000008").exists()
    verify_checkpoint(ckpts / "step_0000008")


def test_pruning_keeps_the_newest_checkpoints(run_copy: Path) -> None:
    assert prune_checkpoints(run_copy, 0) == []
    assert prune_checkpoints(run_copy, 1) == [run_copy / "checkpoints" / "step_0000004"]
    assert [s for s, _ in list_checkpoints(run_copy)] == [8]


def test_a_failed_dcp_load_is_an_ordinary_error_of_one_line_per_rank(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from dimuon.dit.checkpoint import DcpFailed, dcp_load

    dcp.save({"a": torch.zeros(3)}, checkpoint_id=str(tmp_path), no_dist=True)
    # torch raises a BaseException here, which the checkpoint code's `except Exception` would let pass.
    with pytest.raises(Exception, match=r"^rank 0: RuntimeError: Missing key in checkpoint state_dict: b\.$") as err:
        dcp_load({"b": torch.zeros(3)}, tmp_path, no_dist=True)
    assert isinstance(err.value, DcpFailed)


def test_the_rng_template_of_a_dcp_checkpoint_comes_from_what_was_saved(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from dimuon.train.checkpoint import saved_rng_template

    cpu = torch.get_rng_state()
    cuda_like = torch.zeros(16, dtype=torch.uint8)  # what a CUDA generator's state looks like
    for name, per_rank in (("cpu", [cpu]), ("cuda", [cpu, cuda_like])):
        where = tmp_path / name
        dcp.save({"rng": [per_rank, per_rank]}, checkpoint_id=str(where), no_dist=True)
        template = saved_rng_template(where, 2)
        # A run on another device than the one that saved it reads the checkpoint's states, not its own.
        assert [[tuple(t.shape) for t in states] for states in template] == [[tuple(t.shape) for t in per_rank]] * 2
