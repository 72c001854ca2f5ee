"""torchtitan's optimizer container with dimuon's optimizers on 2 FSDP2 gloo ranks: the sharded run follows one
process, and a resume from torchtitan's checkpoint manager (its container's flat, FQN-keyed optimizer state in
DCP) continues bitwise equal to the uninterrupted run, as does one through torch's optimizer state-dict API."""

from __future__ import annotations

import pytest
import torch

from dimuon.bench.launch import run_gloo

pytest.importorskip("torchtitan.components.optimizer", reason="needs torchtitan (see README: torchtitan)")

from . import torchtitan_scenarios as sc

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("torchtitan"))
    straight = run_gloo(sc.straight, 2, root, timeout_s=300)
    resumed = run_gloo(sc.resume, 2, root, timeout_s=300)
    return straight, resumed


@pytest.mark.parametrize("mode", sc.MODES)
def test_sharded_run_follows_one_process(runs, mode) -> None:
    straight, _ = runs
    assert any("Shard(dim=0)" in p for p in straight[0][mode]["placements"])
    single = sc.one_process(mode)
    halves = zip(*(rank[mode]["losses"] for rank in straight))  # each rank's loss is on its half of the batch
    assert [sum(pair) / len(pair) for pair in halves] == pytest.approx(single["losses"], rel=1e-5)
    for name, expect in single["params"].items():
        for rank in straight:
            assert (rank[mode]["params"][name] - expect).abs().max().item() <= 1e-5, name


@pytest.mark.parametrize("mode", sc.MODES)
def test_resume_from_torchtitans_checkpoint_is_bitwise_equal(runs, mode) -> None:
    straight, resumed = runs
    for rank in range(2):
        got, expect = resumed[rank][mode], straight[rank][mode]
        assert got["step"] == sc.SAVE_AT
        assert set(got["phases"]) == {sc.SAVE_AT}  # every dimuon group continues at the saved phase
        assert got["losses"] == expect["losses"][sc.SAVE_AT :]
        for name, value in expect["params"].items():
            assert torch.equal(got["params"][name], value), name


def test_resume_through_torchs_optimizer_state_dict_is_bitwise_equal(runs) -> None:
    straight, resumed = runs
    got, expect = resumed[0]["torch-state-dict"], straight[0]["dimuon"]
    assert got["losses"] == expect["losses"][sc.SAVE_AT :]
    for name, value in expect["params"].items():
        assert torch.equal(got["params"][name], value), name
