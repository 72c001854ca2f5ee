"""The call-boundary counter on real gloo ranks: every kind's bytes, dimuon's own counters against it, and the
peers' traffic (each peer skipped, with the reason, where it cannot run)."""

import pytest

from dimuon.bench.launch import run_gloo
from dimuon.bench.peers import PEERS

from . import peer_scenarios as ps

pytestmark = [pytest.mark.multirank, pytest.mark.filterwarnings("ignore::FutureWarning")]
WORLD = 4
F32 = 4


@pytest.fixture(scope="module")
def collectives():
    return run_gloo(ps.collectives, WORLD, timeout_s=300)


def _one(kind: str, nbytes: int) -> dict:
    return {kind: {"calls": 1, "bytes": nbytes}}


def test_tensor_collectives_book_their_textbook_bytes_per_rank(collectives):
    for rank, c in enumerate(collectives):
        assert c["all_gather_single"] == _one("all_gather", 3 * 5 * F32)
        assert c["all_reduce"] == _one("all_reduce", 2 * 7 * F32 * 3 // 4)
        assert c["all_to_all_single"] == _one("all_to_all", sum(s + 1 for s in range(WORLD) if s != rank) * F32)
        assert c["broadcast"] == _one("broadcast", 0 if rank == 2 else 6 * F32)
        assert c["gather"] == _one("gather", 3 * 3 * F32 if rank == 1 else 0)
        assert c["scatter"] == _one("scatter", 0 if rank == 3 else 3 * F32)
        assert c["isend_irecv"] == {"send": {"calls": 1, "bytes": 0}, "recv": {"calls": 1, "bytes": 4 * F32}}
        expected = {0: _one("broadcast", 5 * F32), 2: _one("broadcast", 0)}.get(rank, {})
        assert c["broadcast_subgroup"] == expected, rank  # src is a global rank, 1 in the subgroup


def test_object_collectives_count_one_call_and_the_tensors_they_move(collectives):
    for c in collectives:
        # The other ranks' int64 sizes, then their pickled objects (all the same size here).
        assert c["all_gather_object"] == _one("all_gather_object", 3 * 8 + 3 * c["object_bytes"])


def test_dtensor_redistributions_are_seen_through_the_functional_collectives(collectives):
    for c in collectives:
        assert c["full_tensor"] == _one("all_gather", 3 * 2 * 3 * F32)
        assert c["replicate_to_shard"] == {}  # a local slice, no communication
        assert c["shard0_to_shard1"] == _one("all_to_all", 2 * 8 * F32 * 3 // 4)  # booked once, as an all-to-all
        assert c["partial_to_replicate"] == _one("all_reduce", 2 * 4 * F32 * 3 // 4)


@pytest.fixture(scope="module")
def dimuon_counts():
    return run_gloo(ps.dimuon_counts, WORLD, timeout_s=600)


@pytest.mark.parametrize("case", [c[0] for c in ps.DIMUON_CASES] + ["muon_replicated_broadcast"])
def test_dimuon_comm_stats_equal_the_call_boundary_count(dimuon_counts, case):
    for rank, per_rank in enumerate(dimuon_counts):
        for step, (own, boundary) in enumerate(per_rank[case]):
            assert own == boundary, (rank, step)
    assert any(boundary for per_rank in dimuon_counts for _, boundary in per_rank[case])  # traffic was there


@pytest.fixture(scope="module")
def peers():
    return run_gloo(ps.peer_traffic, 2, timeout_s=600)


def test_torch_optim_muon_under_fsdp2_takes_the_whole_matrix_step(peers):
    # DTensor's op rules gather what each product needs: the update is the one-process one, up to the
    # rounding of its bf16 Newton-Schulz (orthogonalizing each half of a 32 x 32 matrix apart differs by 0.5).
    local = ps.first_update("torch_muon", ps.small(None))
    for sharded, one_process in zip(peers[0]["torch_muon_update"], local):
        assert ((sharded - one_process).norm() / one_process.norm()).item() < 0.05


@pytest.mark.parametrize("key", list(PEERS))
def test_each_installed_peer_steps_under_fsdp2_and_its_traffic_is_seen(peers, key):
    status = peers[0][key]["status"]
    if not status["runnable"]:
        pytest.skip(status["reason"])
    world = len(peers)
    for rank, result in enumerate(peers):
        entry, shard = result[key], result["shard_bytes"]
        assert entry["first_step"] is None and all(entry["moved"]), rank
        stats = entry["stats"]
        if key == "muon_fsdp2":  # matrix i gathered to rank i % W, rows scattered back
            own = [i for i in range(len(shard)) if i % world == rank]
            assert stats == {
                "gather": {"calls": len(shard), "bytes": sum((world - 1) * shard[i] for i in own)},
                "scatter": {"calls": len(shard), "bytes": sum(shard[i] for i in range(len(shard)) if i not in own)},
            }
        elif key == "heavyball":  # full_tensor() of update, gradient and parameter of every matrix
            assert stats == {"all_gather": {"calls": 3 * len(shard), "bytes": 3 * (world - 1) * sum(shard)}}
        else:
            assert stats.get("all_gather", {}).get("bytes", 0) > 0, stats


@pytest.fixture(scope="module")
def peers_hsdp():
    return run_gloo(ps.peers_on_hsdp, 4, timeout_s=600)


@pytest.mark.parametrize("key", list(PEERS))
def test_peers_under_hsdp_take_the_whole_matrix_step_or_fail_with_a_reason(peers_hsdp, key):
    entry = peers_hsdp[0][key]
    if not entry["status"]["runnable"]:
        pytest.skip(entry["status"]["reason"])
    if key == "muon_fsdp2":  # 1-D meshes only: the bench comm row says why
        assert all(r[key].get("error") for r in peers_hsdp)
        return
    assert "error" not in entry, entry.get("error")
    local = ps.first_update(key, ps.small(None))
    for rank_result in peers_hsdp:  # bf16 Newton-Schulz rounding apart, the one-process update on every rank
        for sharded, one_process in zip(rank_result[key]["update"], local):
            assert ((sharded - one_process).norm() / one_process.norm()).item() < 0.05
