"""Expert parallelism on 4 gloo ranks against one process: stacked experts laid out as torchtitan lays them out
(``Shard(0)`` over ``ep``, FSDP2 over ``efsdp`` on each expert's rows or on the experts), every optimizer and
refresh, what each step sends (nothing but the vote for experts over ``ep`` alone), and the layouts refused. The
default run spawns once (the smoke case); the rest is slow."""

import pytest

from dimuon.bench.launch import run_gloo

from . import experts_scenarios as es

pytestmark = pytest.mark.multirank

WORLD = 4
CHECK = "all_reduce[check]"
TOLERANCE = 1e-5


def _assert_matches(got: dict, optimizer: str, opts: dict, experts_only: bool, key: str) -> None:
    expect, refreshes = es.reference(optimizer, opts, experts_only)
    for name, ref in expect.items():
        diff = (got["params"][name] - ref).abs().max().item()
        assert diff <= TOLERANCE, (key, name, diff)
    assert got["refreshes"] == refreshes, key  # the same step kinds as one process, matrix by matrix


def _kinds(step: dict) -> set[str]:
    return {kind for by_kind in step.values() for kind in by_kind}


def test_experts_split_by_rows_and_over_ep_alone_match_one_process():
    """The smoke case: each expert's rows split over efsdp under PeriodicRowMuon (owner refresh in the efsdp group,
    the tall expert's column sums), and the experts alone over ep under Muon, which send only the vote."""
    ranks = run_gloo(es.cases, WORLD, es.SMOKE, timeout_s=300)
    for key, _, optimizer, opts, experts_only in es.SMOKE:
        for r in ranks:
            _assert_matches(r[key], optimizer, opts, experts_only, key)
    assert ranks[0]["rows"]["placements"]["experts.w1"] == "(Shard(dim=1), Shard(dim=0))"
    for r in ranks:
        assert all(_kinds(step) == {CHECK} for step in r["ep_alone"]["stats"]), r["ep_alone"]["stats"]
        refresh = r["rows"]["stats"][0]
        assert set(refresh["efsdp"]) == {"all_to_all"} and set(refresh.get("ep", {})) <= {CHECK}


@pytest.fixture(scope="module")
def spawned():
    return run_gloo(es.everything, WORLD, timeout_s=900)


@pytest.mark.slow
def test_torchtitan_placements(spawned):
    placements = {key: spawned[0]["cases"][f"{key}/gather"]["placements"]["experts.w2"] for key in es.LAYOUTS}
    assert placements == {
        "ep4": "(Shard(dim=1), Shard(dim=0))",  # efsdp of size 1: whole experts
        "efsdp2xep2": "(Shard(dim=1), Shard(dim=0))",
        "efsdp2xep2_rows0": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", es.CASES, ids=lambda c: c[0])
def test_every_optimizer_and_layout_matches_one_process(spawned, case):
    key, _, optimizer, opts, experts_only = case
    for r in spawned:
        _assert_matches(r["cases"][key], optimizer, opts, experts_only, key)
    if optimizer == "adaptive_row_muon":
        refreshes = spawned[0]["cases"][key]["refreshes"]
        assert {flag for step in refreshes for flag in step.values()} == {0, 1}  # the staleness chose both kinds


@pytest.mark.slow
@pytest.mark.parametrize("case", es.OPTIMIZERS, ids=lambda c: c[0])
def test_experts_over_ep_alone_send_only_the_vote(spawned, case):
    """Whole experts on every rank: Newton-Schulz, RowNorm and blocks on the local ones. AdaptiveRowMuon adds its
    decision's statistics (every expert's staleness sums, then the agreed maximum), never a momentum."""
    key, optimizer, _ = case
    allowed = {CHECK} | ({"all_reduce[signal]", "all_reduce[agree]"} if optimizer == "adaptive_row_muon" else set())
    for r in spawned:
        for t, step in enumerate(r["cases"][f"experts_only/{key}"]["stats"]):
            assert _kinds(step) <= allowed, (key, t, step)


@pytest.mark.slow
def test_row_split_experts_talk_only_within_efsdp(spawned):
    """The refresh and RowNorm's column sums stay in the efsdp group (2 ranks); ep carries no expert traffic;
    MuonBP's block steps send nothing."""
    for r in spawned:
        cases = r["cases"]
        assert set(cases["efsdp2xep2/gather"]["stats"][0]["efsdp"]) == {"all_gather"}
        assert set(cases["efsdp2xep2/owner"]["stats"][0]["efsdp"]) == {"all_to_all"}
        assert set(cases["efsdp2xep2/prm"]["stats"][1]["efsdp"]) == {"all_reduce"}  # w2 is tall
        for key in ("gather", "owner", "prm", "bp"):
            for step in cases[f"efsdp2xep2/{key}"]["stats"]:
                assert set(step.get("ep", {})) <= {CHECK}, (key, step)
        for step in cases["efsdp2xep2/bp"]["stats"][1::2]:
            assert _kinds(step) == {CHECK}, step


@pytest.mark.slow
def test_expert_layouts_still_refused_name_the_parameter(spawned):
    errors = spawned[0]["refusals"]
    assert "AdaptiveRowMuon" in errors["adaptive_uneven_rows"] and "'w1'" in errors["adaptive_uneven_rows"]
    assert "5 rows 2 ways unevenly" in errors["adaptive_uneven_rows"]
    assert "(Shard(dim=2), Shard(dim=0))" in errors["shard2"] and "Shard(d) for d > 1" in errors["shard2"]


@pytest.mark.slow
def test_hsdp_over_row_split_experts_matches_one_process():
    """8 ranks, experts on (dp_replicate, efsdp, ep) as torchtitan's HSDP lays them out: every optimizer, and the
    refresh split across replicas (each expert refreshed by one replica, handed over dp_replicate)."""
    ranks = run_gloo(es.cases, 8, es.HSDP_CASES, timeout_s=900)
    assert ranks[0]["hsdp/gather"]["placements"]["experts.w1"] == "(Replicate(), Shard(dim=1), Shard(dim=0))"
    for key, _, optimizer, opts, experts_only in es.HSDP_CASES:
        expect, refreshes = es.reference(optimizer, opts, experts_only, world=8)
        for r in ranks:
            got = r[key]
            for name, ref in expect.items():
                assert (got["params"][name] - ref).abs().max().item() <= TOLERANCE, (key, name)
            assert got["refreshes"] == refreshes, key
            assert set(got["stats"][0].get("ep", {})) <= {CHECK}, key  # nothing crosses ep
    split = ranks[0]["hsdp/owner_split"]["stats"][0]
    assert set(split["dp_replicate"]) == {"all_gather"} and set(split["efsdp"]) == {"all_to_all"}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["efsdp2xep2", "ep4"])
def test_dcp_save_of_experts_resumes_in_one_process(layout, tmp_path):
    """AdaptiveRowMuon (momenta, references and per-row sums laid out as the experts) saved mid-run on 4 ranks,
    loaded into one process: the rest of the run as one process trains it throughout."""
    path, steps = str(tmp_path / "dcp"), 3
    params = run_gloo(es.dcp_save, WORLD, path, layout, "adaptive_row_muon", es.ARM, steps, timeout_s=300)[0]
    resumed = es.resume_in_one_process(path, params, "adaptive_row_muon", es.ARM, steps)
    expect, _ = es.reference("adaptive_row_muon", es.ARM)
    for name, ref in expect.items():
        assert (resumed[name] - ref).abs().max().item() <= TOLERANCE, name
