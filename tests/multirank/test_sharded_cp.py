"""Context parallelism on 8 gloo ranks against one process: FSDP2 over the flattened data x context ranks under
tensor parallelism, ``(dp_shard, cp, tp) = (2, 2, 2)`` in torchtitan's form and in torch's SPMD form (in the default
run, one spawn), and under the slow marker every optimizer and refresh on both, the SPMD form on 4-D meshes
``(dp_replicate, dp_shard, cp, tp)`` with one dimension of size 1 or ``cp`` replicating, and a DCP save on the
context-parallel layout loaded by one process."""

import pytest

from dimuon.bench.launch import run_gloo

from . import cp_scenarios as cs
from . import mesh_scenarios as ms

pytestmark = pytest.mark.multirank

WORLD = 8
CHECK = "all_reduce[check]"
OPTIMIZERS = [
    ("gather", "muon", {"refresh": "gather"}),
    ("owner", "muon", {"refresh": "owner"}),
    ("prm", "periodic_row_muon", {"k": 3}),
    ("prm_owner", "periodic_row_muon", {"k": 3, "refresh": "owner"}),
    ("bp", "muon_bp", {"period": 3}),
    ("adaptive", "adaptive_row_muon", {"threshold": 0.5}),
]
REPLICATED = [  # forms with a replicating dimension: the split refresh too
    ("owner_split", "muon", {"refresh": "owner", "replica_refresh": "split"}),
    ("gather_split", "muon", {"refresh": "gather", "replica_refresh": "split"}),
    ("prm_split", "periodic_row_muon", {"k": 3, "replica_refresh": "split"}),
]
CASES = [(f"{form}/{name}", form, opt, opts) for form in ("titan", "spmd") for name, opt, opts in OPTIMIZERS] + [
    (f"{form}/{name}", form, opt, opts)
    for form in ("spmd4_tp1", "spmd4_dp1", "spmd4_cp_rep")
    for name, opt, opts in [OPTIMIZERS[0], OPTIMIZERS[2], OPTIMIZERS[4], *REPLICATED]
]
SMOKE = [("titan/prm", "titan", "periodic_row_muon", {"k": 2}), ("spmd/owner", "spmd", "muon", {"refresh": "owner"})]


def _close(got: dict, expect: dict, case: str, skip: set[str] = frozenset()) -> None:
    for pname, ref in expect.items():
        if pname not in skip:
            assert (got[pname] - ref).abs().max().item() <= 1e-5, (case, pname)


def test_cp_flattened_into_fsdp_trains_as_one_process():
    """The smoke case of the default run: both forms of FSDP over data x context under TP, PeriodicRowMuon (a
    spectral and a RowNorm step) and Muon's owner refresh, placements as torch gives them, one process's result."""
    runs = run_gloo(cs.parity, WORLD, SMOKE, timeout_s=600)
    for name, _, optimizer, opts in SMOKE:
        expect = ms.reference(name.split("/")[0], optimizer, opts)
        placements = runs[0][name]["placements"]
        assert placements["wide_c.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert placements["wide_r.weight"] == "(Shard(dim=0), Shard(dim=1))"
        assert runs[0][name]["meshes"]["wide_c.weight"] == ("dp_shard_cp", "tp")
        for rank_result in runs:
            _close(rank_result[name]["params"], expect, name)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cp_dcp") / "ckpt")
    return run_gloo(cs.everything, WORLD, CASES, root, timeout_s=1500), root


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_every_optimizer_and_refresh_matches_one_process(spawned, case):
    name, form, optimizer, opts = case
    expect = ms.reference(form, optimizer, opts)
    skip = cs.BP_SKIP.get(form, set()) if optimizer == "muon_bp" else set()
    for rank_result in spawned[0]:
        _close(rank_result["parity"][name]["params"], expect, name, skip)


@pytest.mark.slow
def test_spmd_placements_and_meshes(spawned):
    """What torch 2.13's SPMD fully_shard gives the optimizer: data x context flattened into one dimension named
    ``dp_shard_cp`` (after ``dp_replicate`` for HSDP), or, with ``cp`` not among FSDP's dimensions, the full 4-D
    mesh with ``cp`` replicating."""
    got = {form: spawned[0][0]["parity"][f"{form}/gather"] for form in cs.FORMS}
    assert got["spmd4_tp1"]["meshes"]["wide_c.weight"] == ("dp_replicate", "dp_shard_cp", "tp")
    assert got["spmd4_tp1"]["placements"]["wide_c.weight"] == "(Replicate(), Shard(dim=0), Shard(dim=0))"
    assert got["spmd4_dp1"]["placements"]["wide_c.weight"] == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert got["spmd4_cp_rep"]["meshes"]["wide_r.weight"] == ("dp_replicate", "dp_shard", "cp", "tp")
    assert got["spmd4_cp_rep"]["placements"]["wide_r.weight"] == (
        "(Replicate(), Shard(dim=0), Replicate(), Shard(dim=1))"
    )


def _dims(step: dict) -> dict[str, set[str]]:
    """Mesh dimension -> the collective kinds the optimizer issued there (the vote left out)."""
    return {d: set(k) - {CHECK} for d, k in step["by_dim"].items() if set(k) - {CHECK}}


@pytest.mark.slow
def test_each_step_talks_where_its_pieces_are(spawned):
    """The refresh inside the data x context x tensor group, nothing over ``cp`` alone (no gradient is reduced there
    again), the split's exchange over the replicating dimensions, MuonBP's block steps nothing."""
    for rank_result in spawned[0]:
        parity = rank_result["parity"]
        assert _dims(parity["titan/gather"]["log"][0]) == {"dp_shard_cp+tp": {"all_gather"}}
        assert _dims(parity["spmd/owner"]["log"][0]) == {"dp_shard_cp+tp": {"all_to_all"}}
        assert _dims(parity["spmd4_cp_rep/gather"]["log"][0]) == {"dp_shard+tp": {"all_gather"}}
        # the split's exchange: one all-gather, or one broadcast per owner where there are more replicas than matrices
        assert _dims(parity["spmd4_cp_rep/owner_split"]["log"][0])["dp_replicate+cp"] <= {"all_gather", "broadcast"}
        assert _dims(parity["spmd4_dp1/owner_split"]["log"][0])["dp_replicate"] <= {"all_gather", "broadcast"}
        for name in parity:
            for step in parity[name]["log"]:
                assert "cp" not in step["by_dim"], (name, step["by_dim"])
        assert all(_dims(parity["titan/bp"]["log"][t]) == {} for t in (1, 2))


@pytest.mark.slow
def test_dcp_save_on_the_cp_layout_loads_on_one_process(spawned):
    """Saved after 3 steps on the torchtitan form, loaded by one process that trains 3 more: the same as 6 steps in
    one process, the schedule's phase carried over."""
    root = spawned[1]
    assert spawned[0][0]["dcp"]["phase"] == [3, 3, 3, 3]
    phase, got = ms.single_process_resume(root, 3, ms.STEPS, {"k": 3})
    assert phase == [3, 3, 3, 3]
    _close(got, ms.reference("titan", "periodic_row_muon", {"k": 3}), "dcp")


@pytest.mark.slow
@pytest.mark.parametrize("case", cs.THREE, ids=lambda c: "-".join(c))
def test_a_matrix_sharded_by_all_three_dimensions(spawned, case):
    """``(Shard(0), Shard(0), Shard(1))`` with uneven pieces: its refresh and RowNorm over one flattened group."""
    expect = cs.three_sharding_dims_reference(case[0])
    for rank_result in spawned[0]:
        assert (rank_result["three"][case] - expect).abs().max().item() <= 1e-5, case
