"""dimuon bench census in one process: the fake-process-group path at 16 ranks (every rank traced), the layouts
it derives per world size, and clear flag errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from dimuon import cli
from dimuon.bench import census

WORLD = 16
TINY = [
    "--gloo-worlds",
    "--fake-worlds",
    str(WORLD),
    "--fake-model",
    "DiT-T/2",
    "--fake-depth",
    "1",
    "--fake-heads",
    "8",
    "--input-size",
    "8",
    "--num-classes",
    "10",
    "--no-progress",
    "--optimizers",
    "adamw",
    "muon_gather",
    "muon_owner",
    "prm_k3",
    "muon_bp_p5",
    "adaptive",
    "adaptive_skip",
]


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    out = tmp_path_factory.mktemp("census")
    assert census.main([*TINY, "--out", str(out)]) == 0
    assert not dist.is_initialized()  # every fake rank's group destroyed
    return json.loads((out / "census.json").read_text())


def _cases(record, key=None, layout=None):
    return [
        (j, c)
        for j in record["jobs"]
        for c in j["cases"]
        if (key is None or c["optimizer"] == key) and (layout is None or j["layout"] == layout)
    ]


def test_fake_ranks_are_traced_alike_and_the_plan_pass_matches_rank_0(record):
    assert {j["layout"] for j in record["jobs"]} == {"fsdp", "hsdp", "fsdp_tp", "replicated"}
    assert [(r["layout"], r["world"]) for r in record["refused"]] == [("tp", WORLD)]  # 8 heads over 16 ranks
    for job, case in _cases(record):
        assert job["backend"] == "fake" and case["same_sequence_on_all_ranks"], (job["layout"], case["label"])
        if case["optimizer"] in census.PLAN_VARIANTS:
            assert case["ranks_traced"] == WORLD and case["plan_matches_full"], (job["layout"], case["label"])
        else:  # AdamW and the nonfinite="skip" twins: rank 0 only (the balance then from an owner plan alone)
            assert case["ranks_traced"] == 1, (job["layout"], case["label"])
            assert (case["ns_flops_max_over_mean"] is None) == (case["ns_flops_plan"] is None)
    fsdp_tp = next(j for j in record["jobs"] if j["layout"] == "fsdp_tp")
    assert set(fsdp_tp["refused_optimizers"]) == {"adaptive", "adaptive_skip"}  # columns split by tp


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """The owner refresh's cases again with 2 ranks traced, for the work derived from the owner plan."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    out = tmp_path_factory.mktemp("census-sampled")
    flags = [*TINY[: TINY.index("--optimizers")], "--optimizers", "muon_owner", "--flop-ranks", "2"]
    assert census.main([*flags, "--layouts", "fsdp", "hsdp", "fsdp_tp", "--out", str(out)]) == 0
    return json.loads((out / "census.json").read_text())


def test_every_rank_s_work_derived_from_the_owner_plan_is_what_each_rank_traced(record, sampled):
    derived = [(j, c) for j, c in _cases(record) if c["ns_flops_plan"] is not None]
    assert {j["layout"] for j, c in derived if c["optimizer"] == "muon_owner"} == {
        "fsdp",
        "hsdp",
        "fsdp_tp",
        "replicated",
    }
    for job, case in derived:
        plan = case["ns_flops_plan"]
        where = (job["layout"], case["label"], case["step"])
        assert plan["ranks"] == WORLD and plan["ranks_checked"] == case["ranks_traced"], where
        assert plan["matches_traced"] and case["ns_flops_over"] == f"all {WORLD} ranks, from the owner plan", where
        traced = list(case["ns_flops_by_rank"].values())
        if len(traced) == WORLD:
            assert case["ns_flops_max_over_mean"] == pytest.approx(max(traced) * WORLD / sum(traced)), where
    rows = {t["target"]: t["measured"] for t in record["targets"]}
    text = "every rank's Newton-Schulz work derived from the owner plan = what each traced rank ran"
    assert rows[text] == f"{len(derived)} of {len(derived)} cases"
    # Two ranks traced: the same figures over all 16, each checked against the 2 traced ranks.
    for job, case in _cases(sampled):
        full = next(c for j, c in _cases(record, "muon_owner", job["layout"]) if c["step"] == case["step"])
        assert case["ranks_traced"] == case["ns_flops_plan"]["ranks_checked"] == 2, job["layout"]
        for key in ("ns_flops_max", "ns_flops_max_over_mean", "ns_flops_sum_over_model"):
            assert case[key] == pytest.approx(full[key]), (job["layout"], key)
    hsdp = next(c for _, c in _cases(sampled, layout="hsdp"))
    assert hsdp["ns_flops_sum_over_model"] > 1.0  # every replica repeats its group's refresh


def test_a_group_of_rank_0_s_maps_to_its_copy_through_any_rank_on_the_mesh():
    mesh = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])  # 2 x 4: rows the first dimension
    where = census.mesh_coordinates(mesh)
    assert census.member_index(mesh, where, [0, 1, 2, 3], 6) == 2  # the second row's copy: rank 6 is its third
    assert census.member_index(mesh, where, [0, 4], 7) == 1
    assert census.member_index(mesh, where, [0, 1, 2, 3, 4, 5, 6, 7], 5) == 5
    assert census.member_index(mesh, where, [0, 2], 3) is None  # not a whole sub-mesh
    assert census.member_index(mesh, where, [0, 1], 9) is None  # not on the mesh
    assert census.member_index(None, {}, [0, 1], 1) is None  # no mesh


def test_newton_schulz_is_stubbed_and_its_work_counted_per_rank(record):
    for job, case in _cases(record, "muon_owner"):
        if job["layout"] in ("fsdp", "replicated"):  # every matrix once in the world
            assert case["ns_flops_sum_over_model"] == pytest.approx(1.0), job["layout"]
    gather = next(c for _, c in _cases(record, "muon_gather", "fsdp"))
    assert gather["ns_flops_sum_over_model"] == pytest.approx(WORLD) and gather["ns_ops"] == gather["ns_calls"]
    assert gather["ns_dtypes"] == ["bfloat16"] and gather["ns_flops_rank0"] > 0


def test_the_replicated_refresh_broadcasts_go_out_as_one_group_launch(record):
    # 16 ranks, fewer matrices: one broadcast per owner, grouped as NCCL groups them (one launch for the lot).
    for _, case in _cases(record, "muon_owner", "replicated"):
        broadcasts = sum(c["calls"] for c in case["collectives"] if c["kind"] == "broadcast")
        assert broadcasts > 1 and case["launches"] == case["calls"] - broadcasts + 1
        assert "launches: grouped" in census.collective_words(case)
    for _, case in _cases(record, "muon_owner", "fsdp"):  # all-to-alls, one each: nothing grouped
        assert case["launches"] == case["calls"]


def test_host_reads_are_counted_with_their_sites(record):
    for job, case in _cases(record, "adaptive"):
        if case["step"] == 2:  # the vote read with the staleness signals: one read
            assert case["host_reads_by_kind"] == {"tolist": 1}, job["layout"]
            assert list(case["read_sites"]) == ["tolist at dimuon/optim/core.py:read"]
    for _, case in _cases(record, "prm_k3"):  # the vote (with this rank's verdicts, for the message)
        assert case["read_sites"] == {"tolist at dimuon/optim/core.py:step": 1}
    for job, case in _cases(record, "adaptive_skip"):  # the vote stays on the device
        assert case["host_reads"] == (1 if case["step"] == 2 else 0) == census.signal_reads(case), job["layout"]
    rows = {t["target"].split(":")[0]: t["measured"] for t in record["targets"]}
    assert (
        "AdaptiveRowMuon, skip step 2: 0 (+1 signal read)"
        in rows["host reads per optimizer step with nonfinite='skip'"]
    )


def _gather_ops(tmp_path, depth: int) -> tuple[int, int]:
    """Ops and Newton-Schulz calls of Muon's gather refresh on FSDP x TP (column-split pieces) at ``depth``."""
    out = tmp_path / f"depth{depth}"
    flags = [*TINY[: TINY.index("--optimizers")], "--optimizers", "muon_gather", "--layouts", "fsdp_tp"]
    flags[flags.index("--fake-depth") + 1] = str(depth)
    flags += ["--flop-ranks", "1"]  # rank 0's ops: the other ranks' plan passes count nothing here
    assert census.main([*flags, "--out", str(out)]) == 0
    (case,) = [c for j in json.loads((out / "census.json").read_text())["jobs"] for c in j["cases"]]
    return case["ops"], case["ns_ops"]


def test_the_gather_refresh_cuts_column_split_pieces_per_class_not_per_matrix(tmp_path):
    # Four times the blocks: four times the matrices of each class, the same classes and buckets. Assembling the
    # whole matrices and cutting this rank's pieces back out are one index op per class, so nothing grows.
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    assert _gather_ops(tmp_path, 4) == _gather_ops(tmp_path, 1)


def test_a_world_size_gets_the_meshes_of_a_cluster():
    assert census.mesh_words(census.layout_degrees("hsdp", 256)) == "32x8 (dp_replicate x dp_shard)"
    assert census.mesh_words(census.layout_degrees("fsdp_tp", 64)) == "8x8 (dp_shard x tp)"
    assert census.mesh_words(census.layout_degrees("fsdp_tp", 8)) == "4x2 (dp_shard x tp)"
    assert census.mesh_words(census.layout_degrees("hsdp", 8)) == "2x4 (dp_replicate x dp_shard)"
    assert census.layout_degrees("replicated", 8) is None
    assert census.mesh_words(census.layout_degrees("hsdp_tp", 256)) == "4x8x8 (dp_replicate x dp_shard x tp)"
    assert census.mesh_words(census.layout_degrees("hsdp_tp_s4", 256)) == "8x4x8 (dp_replicate x dp_shard x tp)"
    assert census.mesh_words(census.layout_degrees("hsdp_tp", 8)) == "2x2x2 (dp_replicate x dp_shard x tp)"
    with pytest.raises(ValueError, match="HSDP x TP needs two replicas of 8 x 8 ranks or more, got 64"):
        census.layout_degrees("hsdp_tp", 64)
    with pytest.raises(ValueError, match="HSDP needs"):
        census.layout_degrees("hsdp", 2)
    assert census.mesh_words(census.layout_degrees("fsdp_cp_tp", 64)) == "4x2x8 (dp_shard x cp x tp)"
    with pytest.raises(ValueError, match="FSDP over data x context under TP needs 2 x 2 x 8 ranks or more"):
        census.layout_degrees("fsdp_cp_tp", 16)
    assert census.ranks_to_trace(256, None) == list(range(256))
    assert census.ranks_to_trace(256, 5) == [0, 64, 128, 191, 255]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--optimizers", "sgd"], "--optimizers must name some of"),
        (["--layouts", "pp"], "--layouts must name some of"),
        (["--fake-worlds", "1"], "--fake-worlds must be world sizes >= 2"),
        (["--gloo-worlds", "--fake-worlds"], "--gloo-worlds and --fake-worlds are both empty: nothing to count"),
        (["--flop-ranks", "0"], "--flop-ranks must be >= 1"),
        (["--lr", "-1"], "--lr must be a finite number >= 0, got -1.0"),
        (["--lr", "inf"], "--lr must be a finite number >= 0, got inf"),
        (["--fake-model", "DiT-Q/2"], "--fake-model: unknown DiT model"),
        (["--gloo-heads", "5"], "--gloo-model DiT-S/2: 5 heads must divide the hidden size 384"),
    ],
)
def test_bad_flags_are_refused_by_name(flags, message, capsys):
    assert census.main(flags) == 2
    assert capsys.readouterr().err.startswith(f"dimuon bench census: error: {message}")


def test_the_command_is_registered():
    assert cli.BENCHMARKS["census"] == "dimuon.bench.census"
    assert "bench census" in cli.USAGE


def test_a_3d_mesh_is_counted_per_dimension_with_every_rank_s_work_from_the_owner_plan(tmp_path):
    """HSDP x TP (2 x 2 x 2) on the fake group: the owner refresh inside the flattened dp_shard+tp group, no byte
    across replicas, the same sequence on every rank, every rank's Newton-Schulz derived and checked."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    flags = [
        *TINY[: TINY.index("--fake-worlds") + 1],
        "8",
        *TINY[TINY.index("--fake-worlds") + 2 : TINY.index("--optimizers")],
    ]
    out = tmp_path / "census3d"
    assert census.main([*flags, "--optimizers", "muon_owner", "prm_k3", "--layouts", "hsdp_tp", "--out", str(out)]) == 0
    job = json.loads((out / "census.json").read_text())["jobs"][0]
    assert job["mesh"] == "2x2x2 (dp_replicate x dp_shard x tp)"
    owner = next(c for c in job["cases"] if c["optimizer"] == "muon_owner")
    # matrices of the TP plan talk in the group both sharding dimensions make; the others (adaLN) in dp_shard
    assert {c["group"] for c in owner["collectives"] if c["kind"] == "all_to_all"} == {"dp_shard+tp", "dp_shard"}
    assert "dp_replicate" not in owner["own"] and owner["same_sequence_on_all_ranks"]
    assert owner["ns_flops_over"] == "all 8 ranks, from the owner plan" and owner["ns_flops_plan"]["matches_traced"]
    rownorm = next(c for c in job["cases"] if c["optimizer"] == "prm_k3" and c["kind"] == "rownorm")
    assert {c["kind"] for c in rownorm["collectives"]} == {"all_reduce"} and "dp_replicate" not in rownorm["own"]


def test_context_parallel_is_counted_in_the_flattened_data_x_context_group(tmp_path):
    """FSDP over dp_shard x cp flattened under TP (2 x 2 x 2) on the fake group: the owner refresh in dp_shard_cp+tp
    (dp_shard_cp for the matrices outside the TP plan), nothing over cp alone, every rank's work from the plan."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    flags = [
        *TINY[: TINY.index("--fake-worlds") + 1],
        "8",
        *TINY[TINY.index("--fake-worlds") + 2 : TINY.index("--optimizers")],
    ]
    out = tmp_path / "census_cp"
    assert census.main([*flags, "--optimizers", "muon_owner", "--layouts", "fsdp_cp_tp", "--out", str(out)]) == 0
    job = json.loads((out / "census.json").read_text())["jobs"][0]
    assert job["mesh"] == "2x2x2 (dp_shard x cp x tp)"
    owner = next(c for c in job["cases"] if c["optimizer"] == "muon_owner")
    assert {c["group"] for c in owner["collectives"] if c["kind"] == "all_to_all"} == {"dp_shard_cp+tp", "dp_shard_cp"}
    assert "cp" not in owner["own"] and owner["same_sequence_on_all_ranks"]
    assert owner["ns_flops_plan"]["matches_traced"]
