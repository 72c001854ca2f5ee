"""DCP save/load of a sharded model + optimizer mid-period: exact continuation, and resharding 4 -> 2 ranks."""

import pytest
import torch

from dimuon.optim.distributed.launch import run_gloo

from . import scenarios as sc

pytestmark = pytest.mark.multirank

OPTS = {"k": 3, "gamma": 0.15}
SAVE_AT = 4  # mid-period: steps 3 (spectral), 4 and 5 (RowNorm), 6 (spectral)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "step4")
    straight = run_gloo(sc.dcp_save_then_continue, 4, path, "periodic_row_muon", OPTS, SAVE_AT, timeout_s=300)
    return path, straight


def test_resume_at_same_world_is_identical(checkpoint):
    path, straight = checkpoint
    resumed = run_gloo(sc.dcp_load_and_continue, 4, path, "periodic_row_muon", OPTS, SAVE_AT, timeout_s=300)
    assert set(resumed[0]["phase"]) == {SAVE_AT}  # every group continues at the saved phase
    for name, expect in straight[0]["params"].items():
        assert torch.equal(resumed[0]["params"][name], expect), name


def test_resume_at_two_ranks_continues_the_schedule(checkpoint):
    path, straight = checkpoint
    resumed = run_gloo(sc.dcp_load_and_continue, 2, path, "periodic_row_muon", OPTS, SAVE_AT, timeout_s=300)
    assert set(resumed[0]["phase"]) == {SAVE_AT}  # every group continues at the saved phase
    assert resumed[0]["kinds"][0] == "StepKind.ROWNORM"  # t = 4 with k = 3
    reference = sc.reference("odd", "periodic_row_muon", OPTS)
    for name, expect in reference.items():
        assert (resumed[0]["params"][name] - expect).abs().max() <= 1e-5, name
        assert (straight[0]["params"][name] - expect).abs().max() <= 1e-5, name
