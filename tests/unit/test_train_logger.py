"""Run records: atomic JSON, JSONL that survives a torn last line, truncation on resume, image grids."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dimuon.train.images import make_grid, save_grid
from dimuon.train.logger import JsonlLog, atomic_write_json, read_jsonl, truncate_jsonl


def test_atomic_json_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    atomic_write_json(path, {"a": 1})
    atomic_write_json(path, {"a": 2, "p": Path("x")})
    assert json.loads(path.read_text()) == {"a": 2, "p": "x"}
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


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
    rgb = make_grid(torch.zeros(2, 3, 4, 4), nrow=2, pad=0)
    assert rgb.shape == (4, 8, 3)
    path = save_grid(images, tmp_path / "g.png", nrow=3, scale=2)
    from PIL import Image

    with Image.open(path) as img:
        assert img.size == (2 * (3 * 6 + 2), 2 * (6 + 2))
    with pytest.raises(ValueError, match="non-empty"):
        make_grid(torch.zeros(0, 1, 4, 4))
