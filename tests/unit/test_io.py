"""Files and runs: one atomic-write policy, JSONL that survives a torn last line, grids, step names, the run layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dimuon.io import (
    JsonlLog,
    RunLayout,
    atomic_path,
    make_grid,
    read_jsonl,
    read_tensors,
    remove_steps_after,
    save_figure_atomic,
    save_grid,
    step_name,
    step_of,
    truncate_jsonl,
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
    assert run.sample_grid(8) == tmp_path / "run" / "samples" / "step_0000008.png"
    assert run.results == tmp_path / "run" / "eval" / "results.json"
    assert run.eval_grid("abc", 3) == tmp_path / "run" / "eval" / "grids" / "abc" / "step_0000003.png"
    assert run.feature_cache == tmp_path / "run" / "eval" / "feature_cache"
    assert not run.holds_run()
    run.plots.mkdir(parents=True)
    assert run.holds_run()
    assert [p.name for p in run.entries()] == list(RunLayout.ENTRIES)
