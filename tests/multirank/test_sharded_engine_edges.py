"""The sharded engine at its edges, on 2 and 4 gloo ranks:

- a Muon parameter whose gradient is None on some ranks only: the ranks agree (through the one vote) on the
  parameters to step, so they never issue different collectives; with ``nonfinite="raise"`` every rank raises a
  RuntimeError naming the parameter, with ``"skip"`` every rank skips the step (and the rank that knows warns);
  a gradient missing on every rank leaves that parameter alone, as in one process;
- two mesh dimensions sharding one tensor dimension: the flattened group is made without
  ``DeviceMesh._flatten``, which registered a flattened mesh on the user's mesh, after which torch's own
  ``full_tensor()`` of an uneven ``(Shard(d), Shard(d))`` parameter came back wrong;
- fp32 and fp64 momenta in one bucket: each travels in its own payload dtype (gather, owner, replica exchange, whole
  matrices), so the fp64 parameter steps as in one process.
"""

import pytest
import torch

from dimuon.bench.launch import run_gloo

from . import engine_edge_scenarios as es

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def two_ranks():
    return run_gloo(es.two_ranks, 2, es.GRADIENT_CASES, timeout_s=300)


@pytest.mark.parametrize("case", es.GRADIENT_CASES, ids=lambda c: c[0])
def test_a_gradient_missing_on_some_ranks_only_is_one_decision_on_every_rank(two_ranks, case):
    key, opt_name, policy, drops = case
    runs = [r["gradients"][key] for r in two_ranks]
    bad = es.MISMATCHED[drops]
    for rank, r in enumerate(runs):
        for t, outcome in enumerate(r["outcomes"]):
            if t in bad and policy == "raise":
                assert outcome.startswith("raised: ") and "None on some ranks and not on others" in outcome, (rank, t)
                assert "'w0'" in outcome and ("'w1'" in outcome) == (drops == "each_its_own"), (rank, t, outcome)
            else:
                assert outcome == "stepped", (rank, t, outcome)
        assert r["skipped"] == (len(bad) if policy == "skip" else 0), rank
        assert r["phase"] == es.STEPS - (len(bad) if policy == "raise" else 0), rank  # a raised step takes no slot
        for t, seen in enumerate(r["warnings"]):
            knows = drops == "each_its_own" or rank == 1  # every rank's set changed, or this rank's alone
            assert len(seen) == (1 if policy == "skip" and t in bad and knows else 0), (rank, t, seen)
            if seen:
                assert "'w0'" in seen[0] and "the step is skipped on every rank" in seen[0], seen[0]
    # The same parameters on every rank, and those of one process that never took the steps the ranks disagreed on.
    expect = es.gradients_reference(opt_name, policy, drops)
    for name, ref in expect.items():
        assert torch.equal(runs[0]["params"][name], runs[1]["params"][name]), name
        torch.testing.assert_close(runs[0]["params"][name], ref, rtol=1e-5, atol=1e-6, msg=name)


def test_fp32_and_fp64_momenta_travel_each_in_its_own_dtype(two_ranks):
    expect = es.mixed_reference()
    for rank_result in two_ranks:
        for key, params in rank_result["mixed"].items():
            assert params["w64"].dtype == torch.float64
            # fp64 Newton-Schulz of an fp64 momentum: one process's result to fp64 rounding, not fp32's (~1e-8)
            assert (params["w64"] - expect["w64"]).abs().max().item() < 1e-12, key
            torch.testing.assert_close(params["w32"], expect["w32"], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("refresh", ["owner", "gather"])
def test_the_flattened_group_leaves_the_users_mesh_and_its_full_tensors_as_they_were(refresh):
    results = run_gloo(es.flattened, 4, refresh, timeout_s=300)
    expect = es.flattened_reference()
    for rank, r in enumerate(results):
        assert all(r["before"].values()), r["before"]
        assert r["after"] == r["before"], (rank, r["after"])  # torch's own full_tensor(), after the optimizer
        assert r["registered"] == 0
        for name, value in r["params"].items():
            torch.testing.assert_close(value, expect[name], rtol=1e-5, atol=1e-6, msg=name)
        # One pipeline stage's (dp, tp) submesh: its own two ranks, made by every rank of the world together.
        stage = r["stage"]
        assert stage["group_ranks"] == [2 * (rank // 2), 2 * (rank // 2) + 1] and stage["registered"] == 0
        a, b = stage["rows"]
        torch.testing.assert_close(stage["local"], expect["w"][a:b], rtol=1e-5, atol=1e-6)
