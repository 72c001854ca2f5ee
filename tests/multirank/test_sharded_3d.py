"""HSDP over tensor parallelism (``dp_replicate x dp_shard x tp`` = 2 x 2 x 2) on 8 gloo ranks against one process:
dimuon's DiT with its plan (in the default run), and under the slow marker every optimizer and refresh on torch's
own Colwise/RowwiseParallel plan with FSDP2 over the (replicate, shard) sub-mesh, a matrix replicated over all three
dimensions, each rank's collectives per mesh dimension, and layouts judged by their placements."""

import pytest
import torch

from dimuon.bench.launch import run_gloo
from dimuon.optim import build, param_groups

from . import mesh3d_scenarios as m3
from . import mesh_scenarios as ms

pytestmark = pytest.mark.multirank

WORLD = 8
LAYOUT = (2, 2, 2)
CHECK = "all_reduce[check]"
CASES = [
    ("gather", "muon", {"refresh": "gather"}),
    ("owner", "muon", {"refresh": "owner"}),
    ("owner_split", "muon", {"refresh": "owner", "replica_refresh": "split"}),
    ("gather_split", "muon", {"refresh": "gather", "replica_refresh": "split"}),
    ("prm", "periodic_row_muon", {"k": 3}),
    ("prm_split", "periodic_row_muon", {"k": 3, "replica_refresh": "split"}),
    ("bp", "muon_bp", {"period": 3}),
    ("adaptive", "adaptive_row_muon", {"threshold": 0.5}),
]


def test_dit_on_hsdp_x_tp_trains_as_one_process():
    """The smoke case of the default run: dimuon's DiT on the 3-D mesh with PeriodicRowMuon, its plan's
    placements, the same saved model and the same training as one process."""
    runs = run_gloo(ms.dit_parallel, WORLD, [LAYOUT], timeout_s=900)
    model = ms.dit_model()
    saved = ms.full_params(model)
    opt = build("periodic_row_muon", param_groups(model), lr=ms.LR, k=2, ns_dtype=torch.float32)
    first = ms.dit_train(model, opt)
    params = ms.full_params(model)
    muon = {n for g in param_groups(model) if g["algorithm"] == "muon" for n, _ in g["params"]}
    placements = runs[0][LAYOUT]["placements"]
    assert placements["blocks.0.attn.qkv.weight"] == "(Replicate(), Shard(dim=1), _StridedShard(dim=0, sf=3))"
    assert placements["blocks.0.mlp.fc1.weight"] == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["blocks.0.mlp.fc2.weight"] == "(Replicate(), Shard(dim=0), Shard(dim=1))"
    assert placements["blocks.0.adaLN_modulation.1.weight"] == "(Replicate(), Shard(dim=0))"
    for rank_result in runs:
        r = rank_result[LAYOUT]
        assert r["saved"].keys() == saved.keys()
        for name, value in saved.items():
            assert r["saved"][name].equal(value), name
        assert (r["out"] - first).abs().max() <= 1e-5
        for name in muon:  # AdamW's first steps amplify rounding in near-zero gradients (as on 2-D meshes)
            assert (r["params"][name] - params[name]).abs().max() <= 1e-4, name


@pytest.fixture(scope="module")
def spawned():
    return run_gloo(m3.everything, WORLD, CASES, timeout_s=1200)


@pytest.mark.slow
def test_torch_plan_placements(spawned):
    placements = spawned[0]["parity"]["gather"]["placements"]
    assert placements["wide_c.weight"] == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["wide_r.weight"] == "(Replicate(), Shard(dim=0), Shard(dim=1))"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_every_optimizer_and_refresh_matches_one_process(spawned, case):
    name, optimizer, opts = case
    expect = ms.reference(m3.KEY, optimizer, opts)
    for rank_result in spawned:
        got = rank_result["parity"][name]["params"]
        for pname, ref in expect.items():
            assert (got[pname] - ref).abs().max().item() <= 1e-5, (name, pname)


def _dims(step: dict) -> dict[str, set[str]]:
    """Mesh dimension -> the collective kinds the optimizer issued there (the vote left out)."""
    return {d: set(k) - {CHECK} for d, k in step["by_dim"].items() if set(k) - {CHECK}}


@pytest.mark.slow
def test_each_step_talks_where_its_pieces_are(spawned):
    """The refresh inside the shard x tp group (flattened: dp_shard+tp), the split's exchange across replicas,
    RowNorm's statistics only where oriented rows are split, MuonBP's block steps nothing."""
    for rank_result in spawned:
        parity = rank_result["parity"]
        owner, gather = _dims(parity["owner"]["log"][0]), _dims(parity["gather"]["log"][0])
        assert "dp_replicate" not in owner and "dp_replicate" not in gather  # "repeat": no bytes across replicas
        assert owner.get("dp_shard+tp") == {"all_to_all"} and gather.get("dp_shard+tp") == {"all_gather"}
        assert _dims(parity["owner_split"]["log"][0])["dp_replicate"] == {"all_gather"}
        rownorm = _dims(parity["prm"]["log"][1])
        assert rownorm and set().union(*rownorm.values()) == {"all_reduce"} and "dp_replicate" not in rownorm
        assert all(_dims(parity["bp"]["log"][t]) == {} for t in (1, 2))
        assert _dims(parity["bp"]["log"][0])  # the full step of the period


@pytest.mark.slow
def test_every_rank_of_a_group_issues_the_same_collectives(spawned):
    for name, _, _ in CASES:
        for t in range(ms.STEPS):
            steps = [r["parity"][name]["log"][t] for r in spawned]
            groups = {(dim, members) for s in steps for dim, members in s["groups"].items()}
            for dim, members in groups:
                sequences = [[c for c in steps[r]["calls"] if c[0] == dim] for r in members]
                assert all(s == sequences[0] for s in sequences), (name, t, dim, members)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["muon", "periodic_row_muon"])
def test_a_matrix_replicated_over_all_three_dimensions(spawned, optimizer):
    expect = m3.replicated_reference(optimizer)
    for rank_result in spawned:
        got = rank_result["replicated"][optimizer]
        assert (got["w"] - expect).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_layouts_are_judged_by_placements_not_names(spawned):
    """A 4-D mesh, a dimension named dp_shard_cp and three sharding dimensions are taken; Partial is refused,
    naming the parameter and the supported forms."""
    errors = spawned[0]["refusals"]
    assert errors["4d_mesh"] == errors["cp_dim"] == errors["three_shard"] == "accepted"
    assert "Partial placements are not supported" in errors["partial"] and "'w'" in errors["partial"]
    assert "HSDP x TP" in errors["partial"] and "dp_shard_cp" in errors["partial"]  # the supported forms are named


@pytest.mark.slow
def test_a_nan_or_a_missing_gradient_on_some_ranks_skips_the_step_everywhere(spawned):
    for rank_result in spawned:
        assert rank_result["vote"]["moved"] == [True, False, False, True] and rank_result["vote"]["skipped"] == 2
