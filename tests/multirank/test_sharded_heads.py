"""Column splits (per-head) and stacked matrices (experts) on 2 FSDP2 gloo ranks against one process: parameters,
the collectives each map issues (none for stacked experts, column sums only for tall chunks), the same decisions
on every rank, and the construction errors for the layouts they cannot run on."""

import pytest

from dimuon.bench.launch import run_gloo

from . import heads_scenarios as hs

pytestmark = pytest.mark.multirank

WORLD = 2
CHECK = "all_reduce[check]"


@pytest.fixture(scope="module")
def ranks():
    return run_gloo(hs.everything, WORLD, timeout_s=300)


def _close(got: dict, expect: dict, key: str) -> None:
    for name, ref in expect.items():
        diff = (got[name] - ref).abs().max().item()
        assert diff <= 1e-5, (key, name, diff)


def test_every_parameter_is_sharded_by_its_leading_dimension(ranks):
    placements = ranks[0]["muon_gather"]["placements"]
    assert placements["experts"] == placements["proj.weight"] == "(Shard(dim=0),)"


@pytest.mark.parametrize("case", hs.CASES, ids=lambda c: c[0])
def test_parameters_match_one_process(ranks, case):
    key, optimizer, opts = case
    expect, refreshes = hs.reference(optimizer, opts)
    for r in ranks:
        _close(r[key]["params"], expect, key)
        assert r[key]["refreshes"] == refreshes, key  # every rank decides as one process does
    if optimizer == "adaptive_row_muon":
        assert {flag for step in refreshes for flag in step.values()} == {0, 1}  # the staleness chose both kinds
        assert any("all_reduce[signal]" in step for step in ranks[0][key]["stats"])


@pytest.mark.parametrize("case", hs.STACKED_ONLY, ids=lambda c: c[0])
def test_stacked_experts_move_no_bytes_at_any_step_kind(ranks, case):
    key, optimizer, opts = case
    expect, _ = hs.reference(optimizer, opts, only_stacked=True)
    for r in ranks:
        _close(r[key]["params"], expect, key)
        for t, step in enumerate(r[key]["stats"]):
            assert set(step) == {CHECK}, (key, t, step)  # only the non-finite vote


def test_rownorm_reduces_only_the_column_sums_of_tall_chunks(ranks):
    # k = 2: RowNorm at odd steps. proj's (16, 8) chunks are tall: its 3 x 8 column sums, all-reduced over the
    # 2 ranks holding its rows (ring: 2(W-1)/W of 4 bytes each); the wide chunks of wide and qkv, and the
    # experts, are local. One all-reduce: one parameter group needs it.
    for r in ranks:
        for t, step in enumerate(r["prm"]["stats"]):
            kinds = set(step) - {CHECK}
            if t % 2 == 0:
                assert kinds == {"all_gather"}, (t, step)
            else:
                assert kinds == {"all_reduce"}, (t, step)
                assert step["all_reduce"]["calls"] == 1
                assert step["all_reduce"]["bytes"] == 2 * (WORLD - 1) // WORLD * 4 * 24


def test_block_steps_move_nothing(ranks):
    for r in ranks:
        for t, step in enumerate(r["bp"]["stats"]):
            if t % 2:
                assert set(step) == {CHECK}, (t, step)


def test_every_rank_issues_the_same_collectives(ranks):
    for key in [c[0] for c in hs.CASES]:
        calls = [[{k: v["calls"] for k, v in s.items()} for s in r[key]["stats"]] for r in ranks]
        assert all(c == calls[0] for c in calls), key


@pytest.mark.parametrize("case", hs.COLUMN_SHARDED, ids=lambda c: c[0])
def test_muon_assembles_column_sharded_matrices_whole(ranks, case):
    key, opts = case
    expect = hs.column_sharded_reference(opts)
    for r in ranks:
        assert (r[key]["proj"] - expect).abs().max().item() <= 1e-5, key


def test_layouts_that_cannot_cut_chunks_locally_are_refused_at_construction(ranks):
    refusals = ranks[0]["refusals"]
    for key, name in (("prm_col_split", "PeriodicRowMuon"), ("bp_col_split", "MuonBP")):
        message = refusals[key]
        assert f"col_split_sizes for parameter 'proj.weight' under {name}" in message, message
        assert "(Shard(dim=1),)" in message and "use muon for it" in message
    message = refusals["stacked_shard2"]  # each expert's columns split (each expert's rows may be: Shard(1))
    assert "parameter 'experts' has placements (Shard(dim=2),)" in message, message
    assert "Shard(d) for d > 1" in message
