"""DCP save/load of a sharded model + optimizer mid-period: exact continuation, and resharding 4 -> 2 ranks."""

import pytest
import torch

from dimuon.bench.launch import run_gloo

from . import scenarios as sc

pytestmark = pytest.mark.multirank

SAVE_AT = 4  # periodic, k = 3: mid-period (steps 3 spectral, 4 and 5 RowNorm, 6 spectral)
SCHEDULES = {
    "periodic_row_muon": ("periodic_row_muon", {"k": 3, "gamma": 0.15}),
    # Per-matrix phases and references in the state: the staleness decides on these batches, per matrix.
    "adaptive_row_muon": ("adaptive_row_muon", {"threshold": 0.3, "k_min": 2, "k_max": 4}),
    # The signals measured for the next step are in the state too (the checkpoint loads in place into them).
    "adaptive_lagged": ("adaptive_row_muon", {"threshold": 0.1, "k_min": 1, "k_max": 3, "signal_lag": 1}),
}


@pytest.fixture(scope="module", params=list(SCHEDULES))
def checkpoint(request, tmp_path_factory):
    optimizer, opts = SCHEDULES[request.param]
    path = str(tmp_path_factory.mktemp("dcp") / "step4")
    straight = run_gloo(sc.dcp_save_then_continue, 4, path, optimizer, opts, SAVE_AT, timeout_s=300)
    return optimizer, opts, path, straight


def test_resume_at_same_world_is_identical(checkpoint):
    optimizer, opts, path, straight = checkpoint
    resumed = run_gloo(sc.dcp_load_and_continue, 4, path, optimizer, opts, SAVE_AT, timeout_s=300)
    assert set(resumed[0]["phase"]) == {SAVE_AT}  # every group continues at the saved phase
    for name, expect in straight[0]["params"].items():
        assert torch.equal(resumed[0]["params"][name], expect), name
    assert resumed[0]["refreshes"] == straight[0]["refreshes"]  # the same decisions after the resume


def test_resume_at_two_ranks_continues_the_schedule(checkpoint):
    optimizer, opts, path, straight = checkpoint
    resumed = run_gloo(sc.dcp_load_and_continue, 2, path, optimizer, opts, SAVE_AT, timeout_s=300)
    assert set(resumed[0]["phase"]) == {SAVE_AT}  # every group continues at the saved phase
    refreshes: list = []
    reference = sc.reference("odd", optimizer, opts, refreshes=refreshes)
    if optimizer == "periodic_row_muon":
        assert resumed[0]["kinds"][0] == "StepKind.ROWNORM"  # t = 4 with k = 3
    else:
        assert all(isinstance(age, int) and age >= 1 for age in resumed[0]["ages"])  # per-matrix phases came back
        assert resumed[0]["refreshes"] == refreshes[SAVE_AT:]
    for name, expect in reference.items():
        assert (resumed[0]["params"][name] - expect).abs().max() <= 1e-5, name
        assert (straight[0]["params"][name] - expect).abs().max() <= 1e-5, name
