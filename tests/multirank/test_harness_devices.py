"""The harness on 2 gloo ranks (FSDP2 shards, DCP checkpoint, split evaluation) under the meta-device trap."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dimuon.bench.launch import run_gloo

from .. import device_trap as dt

pytestmark = pytest.mark.multirank


def test_a_sharded_run_makes_every_tensor_on_its_device(tmp_path: Path) -> None:
    ranks = run_gloo(dt.run_harness, 2, "cpu", str(tmp_path / "run"), str(tmp_path / "cache"), True, timeout_s=300)
    assert ranks[0]["summary"] == ranks[1]["summary"]  # records are means over the ranks
    assert all(math.isfinite(v) for v in ranks[0]["summary"].values())
    assert ranks[0]["eval"] is not None and math.isfinite(ranks[0]["eval"]["fd"])
    for r in ranks:  # the trainer restored from the DCP checkpoint steps exactly as the one that wrote it
        for name, p in r["resumed"].items():
            assert torch.equal(p, r["straight"][name]), name
