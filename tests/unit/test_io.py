"""Files and runs: one atomic-write policy, strict JSON, JSONL that survives a torn last line, grids, step names,
the run layout (its marker, dimuon's own files among a user's) and the output checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import dimuon.io as dio
from dimuon.io import (
    JsonlLog,
    RunLayout,
    atomic_path,
    free_bytes,
    make_grid,
    read_json_object,
    read_jsonl,
    read_tensors,
    remove_steps_after,
    save_figure_atomic,
    save_grid,
    step_name,
    step_of,
    truncate_jsonl,
    unwritable_reason,
    write_bytes_atomic,
    write_json_atomic,
    write_tensors_atomic,
)


def test_atomic_json_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2, "p": Path("x")})
    assert json.loads(path.read_text()) == {"a": 2, "p": "x"}
    assert path.read_text().endswith("}\n")
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_atomic_files_get_the_mode_of_a_new_file_under_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        path = write_json_atomic(tmp_path / "r.json", {"a": 1})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640  # group-readable, as open() would make it; not owner-only


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "state.bin"
    write_bytes_atomic(path, b"old")  # creates the missing parent directory
    with pytest.raises(RuntimeError, match="disk full"), atomic_path(path) as tmp:
        assert tmp.parent == path.parent and tmp.name.startswith(".state.bin.")
        tmp.write_bytes(b"half of the new")
        raise RuntimeError("disk full")
    assert path.read_bytes() == b"old"
    assert [p.name for p in path.parent.iterdir()] == ["state.bin"]
    with pytest.raises(TypeError):
        write_bytes_atomic(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_bytes() == b"old" and [p.name for p in path.parent.iterdir()] == ["state.bin"]


def test_figures_and_tensors_go_through_the_same_policy(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = save_figure_atomic(fig, tmp_path / "plot.png", dpi=50)
    plt.close(fig)
    assert path.read_bytes()[:4] == b"\x89PNG"
    tensors = {"features": torch.arange(6.0).reshape(2, 3)}
    write_tensors_atomic(tmp_path / "f.safetensors", tensors, {"space": "x", "p": Path("y")})
    back, meta = read_tensors(tmp_path / "f.safetensors")
    assert torch.equal(back["features"], tensors["features"]) and meta == {"space": "x", "p": "y"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.safetensors", "plot.png"]


def test_jsonl_is_readable_after_every_write_and_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = JsonlLog(path)
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 1.0 / step})
        assert [r["step"] for r in read_jsonl(path)] == list(range(1, step + 1))  # flushed at once
    log.close()
    with path.open("a") as f:
        f.write('{"step": 4, "lo')  # a write cut short by a kill
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_truncate_keeps_records_up_to_the_checkpoint_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"kind": "train", "step": s}) + "\n" for s in (0, 5, 10, 15)) + '{"ste')
    assert truncate_jsonl(path, 10) == 2  # step 15 and the torn line
    assert [r["step"] for r in read_jsonl(path)] == [0, 5, 10]
    assert truncate_jsonl(tmp_path / "missing.jsonl", 3) == 0


def test_grid_tiles_images_row_major_with_padding(tmp_path: Path) -> None:
    images = torch.stack([torch.full((1, 4, 4), v) for v in (-1.0, 0.0, 1.0)])  # black, grey, white
    grid = make_grid(images, nrow=2, pad=1)
    assert grid.shape == (2 * 5 + 1, 2 * 5 + 1) and grid.dtype == np.uint8
    assert grid[1, 1] == 0 and grid[1, 6] == 128 and grid[6, 1] == 255 and grid[6, 6] == 0
    white = make_grid(images, nrow=2, pad=1, background=1.0)
    assert white[0, 0] == 255 and white[6, 6] == 255 and white[1, 1] == 0
    rgb = make_grid(torch.zeros(2, 3, 4, 4), nrow=2, pad=0)
    assert rgb.shape == (4, 8, 3)
    path = save_grid(images, tmp_path / "g.png", nrow=3, scale=2)
    from PIL import Image

    with Image.open(path) as img:
        assert img.size == (2 * (3 * 6 + 2), 2 * (6 + 2))
    with pytest.raises(ValueError, match="non-empty"):
        make_grid(torch.zeros(0, 1, 4, 4))


def test_step_names_round_trip_and_only_they_are_removed_after_a_step(tmp_path: Path) -> None:
    assert step_name(250) == "step_0000250" and step_name(3, ".png") == "step_0000003.png"
    assert step_of("x/step_0000250") == 250 and step_of("step_0000003.png", ".png") == 3
    assert step_of("step_0000003.png") is None and step_of("step_12.png", ".png") is None
    for name in ("step_0000002.png", "step_0000004.png", "step_0000009.png", "step_0000009.txt", "mine.png"):
        (tmp_path / name).write_bytes(b"x")
    removed = remove_steps_after(tmp_path, 3)
    assert [p.name for p in removed] == ["step_0000004.png", "step_0000009.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.png", "step_0000002.png", "step_0000009.txt"]
    assert remove_steps_after(tmp_path / "missing", 0) == []


def test_run_layout_names_every_file_of_a_run(tmp_path: Path) -> None:
    run = RunLayout(tmp_path / "run")
    assert run.config == tmp_path / "run" / "config.json" and run.metrics.name == "metrics.jsonl"
    assert run.checkpoint(250) == tmp_path / "run" / "checkpoints" / "step_0000250"
    assert run.superseded(750) == tmp_path / "run" / "checkpoints" / "step_0000750.superseded"
    assert run.sample_grid(8) == tmp_path / "run" / "samples" / "step_0000008.png"
    assert run.results == tmp_path / "run" / "eval" / "results.json"
    assert run.eval_grid("abc", 3) == tmp_path / "run" / "eval" / "grids" / "abc" / "step_0000003.png"
    assert run.feature_cache == tmp_path / "run" / "eval" / "feature_cache"
    assert [p.name for p in run.entries()] == list(RunLayout.ENTRIES)
    assert not run.is_run()
    run.plots.mkdir(parents=True)
    assert not run.is_run()  # a directory is a run by its marker, not by the names it holds
    write_json_atomic(run.marker, {"format": 1})
    assert run.is_run()


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path


def test_only_dimuon_s_own_files_are_its_and_clear_leaves_the_user_s(tmp_path: Path) -> None:
    run = RunLayout(tmp_path / "run")
    ours = [
        run.marker,
        run.config,
        run.metrics,
        run.checkpoint(250) / "meta.json",
        run.checkpoint(250) / "state.pt",
        run.checkpoint(500) / "__0_0.distcp",
        run.checkpoint(500) / ".metadata",
        run.checkpoints / ".tmp-step_0000750" / ".state.pt.k2j_x1.tmp",
        run.superseded(1000) / "meta.json",
        run.sample_grid(250),
        run.plots / "loss_vs_step.png",
        run.plots / ".loss_vs_time.png.abc123.tmp",
        run.tensorboard / "events.out.tfevents.1.host",
        run.results,
        run.results_md,
        run.eval / "fd_vs_step.png",
        run.eval_grid("3f2a", 250),
        run.feature_cache / "classifier-mnist28-12345678.safetensors",
        run.feature_cache / "real-mnist-0a1b2c3d-val-n500-classifier.safetensors",
    ]
    theirs = [
        run.eval / "run_eval.py",
        run.plots / "fig1.png",
        run.root / "notes.txt",
        run.root / "config.yaml",
        run.checkpoint(250) / "notes.md",
        run.samples / "best.png",
        run.checkpoints / "step_12" / "meta.json",
        run.root / "data" / "config.json",
    ]
    for path in ours + theirs:
        _touch(path)
    assert run.owned_files() == sorted(ours)
    assert run.foreign_files() == sorted(theirs)
    assert sorted(run.clear()) == sorted(ours)
    left = sorted(p for p in run.root.rglob("*") if p.is_file())
    assert left == sorted(theirs)
    # Directories dimuon's files left empty are gone; those holding a user's file stay.
    assert not run.tensorboard.exists() and not (run.eval / "grids").exists() and not run.checkpoint(500).exists()
    assert run.plots.is_dir() and run.checkpoint(250).is_dir() and not run.is_run()


def test_json_files_and_records_are_strict_json(tmp_path: Path) -> None:
    record = {
        "loss": float("nan"),
        "grad_norm": torch.tensor(float("inf")),
        "lr": np.float32(0.5),
        "per_t": {"0.05": -float("inf")},
        "items": (1, np.int64(2)),
        "path": tmp_path,
    }
    log = JsonlLog(tmp_path / "m.jsonl")
    log.write(record)
    log.close()
    write_json_atomic(tmp_path / "r.json", record)

    def refuse(token: str) -> None:
        raise ValueError(f"non-standard JSON token {token}")

    expected = {
        "loss": None,
        "grad_norm": None,
        "lr": 0.5,
        "per_t": {"0.05": None},
        "items": [1, 2],
        "path": str(tmp_path),
    }
    assert json.loads((tmp_path / "m.jsonl").read_text(), parse_constant=refuse) == expected
    assert json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse) == expected


def test_output_checks_name_what_is_wrong(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert unwritable_reason(tmp_path / "new" / "deeper") is None
    _touch(tmp_path / "file")
    assert unwritable_reason(tmp_path / "file" / "run") == f"{tmp_path / 'file'} is a file, not a directory"
    monkeypatch.setattr(dio.os, "access", lambda path, mode: False)
    assert "its parent" in unwritable_reason(tmp_path / "new") and "not writable" in unwritable_reason(tmp_path)
    assert free_bytes(tmp_path / "not" / "yet") > 0


def test_a_json_object_file_is_read_and_anything_else_is_refused_naming_the_flag_and_file(tmp_path):
    good = tmp_path / "good.json"
    good.write_text('{"a": 1}')
    assert read_json_object(good, "--config-file") == {"a": 1}
    for name, data, words in (
        ("list.json", b"[1, 2]", "must hold a record, not a JSON list"),
        ("text.json", b"garbage", "not JSON (Expecting value: line 1 column 1 (char 0))"),
        ("binary.json", b"\xff\xfe\x00", "not a text file (not UTF-8)"),
    ):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ValueError, match=r"^--calibrate .*" + name) as info:
            read_json_object(path, "--calibrate", "a record")
        assert str(info.value) == f"--calibrate {path}{'' if words.startswith('must') else ':'} {words}"
    with pytest.raises(ValueError, match=r"^--calibrate .*missing.json: No such file or directory$"):
        read_json_object(tmp_path / "missing.json", "--calibrate")
