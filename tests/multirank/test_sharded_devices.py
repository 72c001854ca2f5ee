"""The sharded engine on the device it will meet: gloo on CPU here, NCCL on a GPU (one process, so one
GPU suffices; the CUDA case is skipped without one). Same results as one process, state on the
parameters' device, exposed communication time measured (CUDA events on a GPU)."""

import math

import pytest
import torch

from dimuon.bench.launch import run_gloo

from . import scenarios as sc

pytestmark = pytest.mark.multirank

CUDA = pytest.param(
    "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_sharded_paths_in_one_process(device):
    backend = "nccl" if device == "cuda" else "gloo"
    (result,) = run_gloo(sc.one_process_sharded, 1, device, backend=backend, timeout_s=300)
    assert set(result) == {key for key, _, _ in sc.ONE_PROCESS_CASES}
    for key, r in result.items():
        assert r["gap"] <= 1e-5, (key, r["gap"])
        assert r["misplaced"] == [], key
        assert all(math.isfinite(s) and s >= 0 for s in r["exposed"]), key
        assert "all_reduce[check]" in r["kinds"], key  # the non-finite vote runs on the device's backend


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_owner_broadcasts_are_one_group_launch_on_nccl_and_one_each_on_gloo(device):
    backend = "nccl" if device == "cuda" else "gloo"
    world = 1 if device == "cuda" else 2  # one GPU here: NCCL takes one rank per device
    for r in run_gloo(sc.grouped_broadcasts, world, device, backend=backend, timeout_s=300):
        assert r["values"] == [[4.0] * 3, [6.0] * 5, [3.0] * 2]  # rank 0's on every rank
        assert r["grouped"] == (device == "cuda") and r["calls"] == 3
        assert r["launches"] == (1 if device == "cuda" else 3)
