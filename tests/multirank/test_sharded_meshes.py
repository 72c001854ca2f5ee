"""HSDP 2 x 2, tensor parallel 4 and FSDP 2 x TP 2 on 4 gloo ranks against one process: parameters, the
collectives each map issues per mesh dimension, their order on every rank, checkpoints that move across
topologies, and the clear error for the layouts the optimizer refuses."""

import pytest
import torch

from dimuon.bench.launch import run_gloo

from . import mesh_scenarios as ms

pytestmark = pytest.mark.multirank

WORLD = 4
OPTIMIZERS = [
    ("gather", "muon", {"refresh": "gather"}),
    ("owner", "muon", {"refresh": "owner"}),
    ("prm", "periodic_row_muon", {"k": 3}),
    ("bp", "muon_bp", {"period": 3}),
]
CASES = (
    [(f"{key}_{name}", key, optimizer, opts) for key in ms.MESHES for name, optimizer, opts in OPTIMIZERS]
    + [
        ("hsdp2x2_split", "hsdp2x2", "muon", {"replica_refresh": "split", "refresh": "gather"}),
        ("hsdp2x2_split_owner", "hsdp2x2", "muon", {"replica_refresh": "split", "refresh": "owner"}),
        ("hsdp2x2_prm_split", "hsdp2x2", "periodic_row_muon", {"k": 3, "replica_refresh": "split"}),
    ]
    + [(f"{key}_adaptive", key, "adaptive_row_muon", {"threshold": 0.5}) for key in ms.MESHES]
    # decided from the previous step's signal: the same decisions as one process's, on replicas and TP ranks
    + [
        (f"{key}_adaptive_lag", key, "adaptive_row_muon", {"threshold": 0.5, "signal_lag": 1})
        for key in ("hsdp2x2", "fsdp2xtp2")
    ]
)
CHECK = "all_reduce[check]"
# Replica 1 finds every matrix stale, replica 0 measures: one decision for the world makes both refresh everything.
SKEWED = [("hsdp2x2_adaptive_skewed", "hsdp2x2", "adaptive_row_muon", {"threshold": 0.5, ms.SKEW: True})]


REPOINT_OPTS = {"k": 3}


@pytest.fixture(scope="module")
def spawned():
    return run_gloo(ms.everything, WORLD, CASES + SKEWED, REPOINT_OPTS, timeout_s=300)


@pytest.fixture(scope="module")
def meshes(spawned):
    return [r["parity"] for r in spawned]


def test_placements_are_the_ones_torch_makes(meshes):
    placements = meshes[0]
    assert placements["hsdp2x2_gather"]["placements"]["wide_c.weight"] == "(Replicate(), Shard(dim=0))"
    assert placements["tp4_gather"]["placements"]["wide_c.weight"] == "(Shard(dim=0),)"
    assert placements["tp4_gather"]["placements"]["wide_r.weight"] == "(Shard(dim=1),)"
    assert placements["fsdp2xtp2_gather"]["placements"]["wide_c.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["fsdp2xtp2_gather"]["placements"]["wide_r.weight"] == "(Shard(dim=0), Shard(dim=1))"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_parameters_match_one_process(meshes, case):
    name, key, optimizer, opts = case
    expect = ms.reference(key, optimizer, opts)
    for rank_result in meshes:
        got = rank_result[name]["params"]
        for pname, ref in expect.items():
            assert (got[pname] - ref).abs().max().item() <= 1e-5, (name, pname)


def _optimizer_kinds(step: dict) -> dict[str, set[str]]:
    """Mesh dimension -> the collective kinds the optimizer issued there (the vote left out)."""
    return {dim: set(kinds) - {CHECK} for dim, kinds in step["by_dim"].items() if set(kinds) - {CHECK}}


def test_block_steps_move_nothing(meshes):
    for key in ms.MESHES:
        for rank_result in meshes:
            log = rank_result[f"{key}_bp"]["log"]
            for t, step in enumerate(log):
                if t % 3:
                    assert _optimizer_kinds(step) == {}, (key, t)


def test_rownorm_reduces_only_split_oriented_rows(meshes):
    # 4 bytes per sum, ring all-reduce 2(W-1)/W. Oriented rows split across ranks: HSDP (Shard(0) over 2):
    # the columns of the tall matrices tall_c (13), tall_r (14), thin_r (3); TP 4: tall_c's 13 columns
    # (Shard(0)) and wide_r's 14 rows (Shard(1)). Wide Shard(0) matrices (wide_c, thin_c, the fused
    # squares) and tall Shard(1) ones add nothing. One all-reduce per Muon parameter group needing one.
    expect = {"hsdp2x2": ("shard", 2 * 1 / 2 * 4 * (13 + 14 + 3), 2), "tp4": ("tp", 2 * 3 / 4 * 4 * (13 + 14), 2)}
    for key, (dim, nbytes, calls) in expect.items():
        for rank_result in meshes:
            for t, step in enumerate(rank_result[f"{key}_prm"]["log"]):
                if t % 3 == 0:
                    continue
                assert _optimizer_kinds(step) == {dim: {"all_reduce"}}
                assert step["by_dim"][dim]["all_reduce"]["bytes"] == nbytes
                assert step["by_dim"][dim]["all_reduce"]["calls"] == calls
    # FSDP 2 x TP 2: tall column-wise rows are split over both dimensions (the flattened group), the row-wise
    # weights' rows over dp (tall ones) and their columns over tp (wide ones).
    for rank_result in meshes:
        step = rank_result["fsdp2xtp2_prm"]["log"][1]
        assert _optimizer_kinds(step) == {"dp+tp": {"all_reduce"}, "tp": {"all_reduce"}, "dp": {"all_reduce"}}
        assert step["by_dim"]["dp+tp"]["all_reduce"]["bytes"] == 2 * 3 / 4 * 4 * 13


def test_spectral_steps_stay_in_the_shard_group(meshes):
    for rank_result in meshes:
        assert _optimizer_kinds(rank_result["hsdp2x2_gather"]["log"][0]) == {"shard": {"all_gather"}}
        assert _optimizer_kinds(rank_result["hsdp2x2_owner"]["log"][0]) == {"shard": {"all_to_all"}}
        assert _optimizer_kinds(rank_result["tp4_gather"]["log"][0]) == {"tp": {"all_gather"}}
        assert _optimizer_kinds(rank_result["fsdp2xtp2_gather"]["log"][0]) == {"dp+tp": {"all_gather"}}
        assert _optimizer_kinds(rank_result["fsdp2xtp2_owner"]["log"][0]) == {"dp+tp": {"all_to_all"}}


def test_adaptive_decisions_agree_and_its_signal_stays_in_the_shard_group(meshes):
    shard_dim = {"hsdp2x2": "shard", "tp4": "tp", "fsdp2xtp2": "dp+tp"}
    for key in ms.MESHES:
        counts = [[step["spectral"] for step in r[f"{key}_adaptive"]["log"]] for r in meshes]
        assert all(c == counts[0] for c in counts), key  # every rank took the same kinds of steps
        assert 0 < sum(counts[0][1:]) < 4 * (ms.STEPS - 1), (key, counts[0])  # the signal decided both ways
        for r in meshes:
            for step in r[f"{key}_adaptive"]["log"][1:]:
                signal = {dim for dim, kinds in step["by_dim"].items() if "all_reduce[signal]" in kinds}
                assert signal == {shard_dim[key]}, (key, signal)


def test_layouts_and_process_groups_are_made_at_construction_not_in_the_first_step(spawned):
    for r in spawned:
        c = r["construction"]
        muon_weights = len(ms.LAYERS)  # every weight is in a Muon group here
        # every weight's mesh has its dp+tp group (FSDP2 hands each parameter its own mesh object; the engine makes
        # the group once), made without DeviceMesh._flatten, which would register a flattened mesh on the user's mesh
        assert c["prepared"] == {
            "engine": "ShardedEngine",
            "placements": muon_weights,
            "flattened": muon_weights,
            "mesh_flattened": 0,
        }
        assert c["first_step"] == {"new_group": 0, "flatten": 0, "derive_layout": 0}
        assert c["same_engine"]


def test_replicas_whose_signals_differ_take_one_decision(meshes):
    """Replica 1's signal says every matrix is stale, replica 0's does not: the world agrees on the larger value,
    so every rank refreshes every matrix at every step (Muon's steps), issues the same collectives, and the
    parameters are Muon's."""
    ((name, key, _, _),) = SKEWED
    matrices = 4  # the col-style weights and the fused matrix (the row-style group is AdamW's here)
    for r in meshes:
        assert [step["spectral"] for step in r[name]["log"]] == [matrices] * ms.STEPS
        assert [step["calls"] for step in r[name]["log"]] == [step["calls"] for step in meshes[0][name]["log"]]
        agree = {
            dim for step in r[name]["log"][1:] for dim, kinds in step["by_dim"].items() if "all_reduce[agree]" in kinds
        }
        assert agree == {"world"}
    expect = ms.reference(key, "muon", {})
    for pname, value in meshes[0][name]["params"].items():
        if pname.endswith("weight") and not pname.endswith("_r.weight"):
            torch.testing.assert_close(value, expect[pname], rtol=1e-4, atol=1e-5, msg=pname)


def test_split_replicas_trade_shard_bytes_for_replicate_bytes(meshes):
    for rank_result in meshes:
        repeat, split = (rank_result[k]["log"][0]["by_dim"] for k in ("hsdp2x2_gather", "hsdp2x2_split"))
        # Every replica refreshes: nothing crosses replicas but the vote, one all-reduce over the world.
        assert "replicate" not in repeat and set(repeat["world"]) == {CHECK}
        # one all-gather per Muon parameter group (col, row, fused) hands the replicas' pieces over
        assert split["replicate"]["all_gather"]["calls"] == 3 and split["replicate"]["all_gather"]["bytes"] > 0
        assert split["shard"]["all_gather"]["bytes"] < repeat["shard"]["all_gather"]["bytes"]
    # The two replicas of a piece together refresh each matrix once: shard bytes add up to one repeat.
    shard_split = sum(r["hsdp2x2_split"]["log"][0]["by_dim"]["shard"]["all_gather"]["bytes"] for r in meshes)
    shard_repeat = sum(r["hsdp2x2_gather"]["log"][0]["by_dim"]["shard"]["all_gather"]["bytes"] for r in meshes)
    assert shard_split == shard_repeat / 2


def test_every_rank_of_a_group_issues_the_same_sequence(meshes):
    for name, *_ in CASES:
        for t in range(ms.STEPS):
            steps = [r[name]["log"][t] for r in meshes]
            groups = {(dim, members) for s in steps for dim, members in s["groups"].items()}
            for dim, members in groups:
                sequences = [[c for c in steps[r]["calls"] if c[0] == dim] for r in members]
                assert all(s == sequences[0] for s in sequences), (name, t, dim, members)
            assert all(s["calls"][0][1] == CHECK for s in steps)  # the vote comes first


def test_unsupported_layouts_fail_at_construction_naming_the_parameter(spawned):
    errors = spawned[0]["unsupported"]
    assert errors["3d_mesh"] == "accepted"  # three sharding dimensions: one flattened group, judged by placements
    assert "Partial placements are not supported" in errors["partial"]
    assert "a mesh without mesh_dim_names cannot be flattened" in errors["unnamed_2d"]
    assert "Shard(d) for d > 1" in errors["shard_dim2"] and "Shard(dim=2)" in errors["shard_dim2"]
    assert "two _StridedShard placements on one dimension" in errors["nested_strided"]
    assert "sharded by rows only" in errors["adaptive_cols"] and "'w'" in errors["adaptive_cols"]
    assert "'qkv.weight'" in errors["nested_strided"] and "(dp=2, tp=2)" in errors["nested_strided"]


def test_checkpoint_moves_from_hsdp_to_fsdp_to_one_process(tmp_path):
    opts = {"k": 3}
    root = str(tmp_path)
    run_gloo(ms.topology_save, WORLD, root, "hsdp2x2", None, 0, 4, opts, timeout_s=300)
    resumed = run_gloo(ms.topology_save, WORLD, root, "fsdp4", f"{root}/hsdp2x2", 4, 6, opts, timeout_s=300)
    assert all(set(r["phase"]) == {4} for r in resumed)  # t = 4 with k = 3: a RowNorm step comes next
    phase, params = ms.single_process_resume(f"{root}/fsdp4", 6, 8, opts)
    assert set(phase) == {6}  # t = 6: the spectral step of the next period
    expect = ms.reference("hsdp2x2", "periodic_row_muon", opts, steps=8)
    for name, ref in expect.items():
        assert (params[name] - ref).abs().max().item() <= 1e-5, name


def test_parameters_replaced_after_construction_take_their_new_layout(spawned):
    results = [r["repointed"] for r in spawned]
    expect = ms.reference("hsdp2x2", "periodic_row_muon", REPOINT_OPTS)
    n_params = len(expect)
    for r in results:
        for name, ref in expect.items():
            assert (r["params"][name] - ref).abs().max().item() <= 1e-5, name
        assert r["momentum"] == ["DTensor"] * len(ms.LAYERS)  # the unsharded zeros made at construction are gone
        assert r["state_keys"] == list(range(n_params))
        assert set(r["log"][0]["by_dim"]) == {"mesh_dim0"} and "all_to_all" in r["log"][0]["kinds"]  # owner
