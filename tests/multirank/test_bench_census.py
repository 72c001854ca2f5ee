"""dimuon bench census on real gloo ranks: its own counting on a hand-made step with known counts, and bounds the
engine meets today on every layout, for every configuration (a tiny DiT on 4 ranks)."""

import json
import math

import pytest

from dimuon.bench import census
from dimuon.bench.launch import run_gloo
from dimuon.optim.linalg import newton_schulz_products

from . import census_scenarios as cs

pytestmark = pytest.mark.multirank

WORLD = 4
F32 = 4
# The 4-byte vote (non-finite gradients, and whether the sets of Muon gradients changed: four one-byte flags): one
# all-reduce over the world where the parameters span it.
VOTE = ("all_reduce", "uint8")


@pytest.fixture(scope="module")
def known():
    return run_gloo(cs.known_counts, 2, timeout_s=300)


def test_the_census_counts_a_hand_made_step_exactly(known):
    for rank_result in known:
        plain = rank_result["plain"]
        # ones, add_, sum, _local_scalar_dense, zeros: five aten ops; empty and new_empty allocations; the
        # all-reduce is a c10d op and a collective.
        assert plain["ops"] == 5 and plain["allocs"] == 2 and plain["c10d_ops"] == 1
        assert plain["host_reads"] == {"item": 1, "tolist": 1, "cpu": 1}
        # 10 floats all-reduced over 2 ranks: 2 (W-1)/W of 40 bytes arrive (ring), the buffer is the tensor.
        assert plain["collectives"] == [("all_reduce", 2, "float32", 40, 40)]
        assert plain["groups"] == [plain["world_group"]]


def test_newton_schulz_is_recorded_with_exact_flops_real_or_stubbed(known):
    batch, rows, cols = cs.MATRICES
    flops = batch * sum(2.0 * m * k * n for m, k, n in newton_schulz_products(rows, cols))
    for rank_result in known:
        real, stub = rank_result["real"], rank_result["stub"]
        for found in (real, stub):
            assert [tuple(b) for b in found["batches"]] == [(batch, rows, cols, "float32", flops)]
        # The iteration's ops are counted apart; the stub dispatches one (the zeros it returns).
        assert real["ns_ops"] > 10 and stub["ns_ops"] == 1
        assert real["ops"] == stub["ops"]  # what runs around Newton-Schulz is the same either way


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("census")
    args = [
        "--gloo-worlds",
        str(WORLD),
        "--fake-worlds",
        "--gloo-model",
        "DiT-T/2",
        "--gloo-depth",
        "1",
        "--gloo-heads",
        "4",
        "--ops-depths",
        "--input-size",
        "8",
        "--num-classes",
        "10",
        "--no-progress",
        "--out",
        str(out),
    ]
    assert census.main(args) == 0
    return json.loads((out / "census.json").read_text())


def _cases(record, key=None, step=None):
    return [
        (j, c)
        for j in record["jobs"]
        for c in j["cases"]
        if (key is None or c["optimizer"] == key) and (step is None or c["step"] == step)
    ]


def test_every_layout_and_configuration_is_traced_on_every_rank(record):
    layouts = {j["layout"] for j in record["jobs"]}
    assert layouts == set(census.DEFAULT_LAYOUTS) and not record["refused"]
    for job in record["jobs"]:
        traced = {c["optimizer"] for c in job["cases"]} | set(job["refused_optimizers"])
        assert traced == set(census.VARIANTS), job["layout"]
        # AdaptiveRowMuon refuses matrices split by columns, with a reason.
        assert set(job["refused_optimizers"]) <= (
            {"adaptive", "adaptive_skip", "adaptive_lag"} if job["layout"] in ("tp", "fsdp_tp") else set()
        )
    for job, case in _cases(record):
        assert case["ranks_traced"] == WORLD, (job["layout"], case["label"])


def test_every_rank_issues_the_same_collective_sequence(record):
    for job, case in _cases(record):  # adaptive included: its decisions are taken alike on every rank
        assert case["same_sequence_on_all_ranks"], (job["layout"], case["label"], case["step"])


def _non_votes(case):
    return [c for c in case["collectives"] if (c["kind"], c["dtype"]) != VOTE]


def test_block_steps_and_rownorm_on_whole_rows_issue_nothing_but_the_vote(record):
    for job, case in _cases(record, "muon_bp_p5", 2):
        assert case["kind"] == "block" and _non_votes(case) == [], job["layout"]
    for job, case in _cases(record, "prm_k3", 2):
        assert case["kind"] == "rownorm"
        if job["layout"] == "replicated":  # every oriented row is whole on every rank
            assert _non_votes(case) == []
        else:  # split oriented rows: one flat all-reduce of fp32 sums per process group at most
            others = _non_votes(case)
            assert all((c["kind"], c["dtype"]) == ("all_reduce", "float32") for c in others), job["layout"]
            assert all(c["calls"] == 1 for c in others), job["layout"]
    for job, case in _cases(record):
        votes = [c for c in case["collectives"] if (c["kind"], c["dtype"]) == VOTE]
        if case["optimizer"] != "adamw":  # one 4-byte vote over the world, every step
            assert len(votes) == 1 and votes[0]["calls"] == 1, (job["layout"], case["label"])


def test_payload_dtypes_are_the_documented_ones(record):
    # Spectral refreshes send Newton-Schulz's dtype where it is narrower than the momentum (bf16 here);
    # RowNorm sums and staleness sums travel in fp32, votes as four uint8 flags.
    for job, case in _cases(record):
        for c in case["collectives"]:
            if c["kind"] in ("all_gather", "all_to_all", "broadcast"):
                assert c["dtype"] == "bfloat16", (job["layout"], case["label"], c)
            elif (c["kind"], c["dtype"]) != VOTE:
                assert (c["kind"], c["dtype"]) == ("all_reduce", "float32"), (job["layout"], case["label"], c)
    assert {d for _, c in _cases(record, "muon_gather") for d in c["ns_dtypes"]} == {"bfloat16"}


def test_the_boundary_count_equals_the_engines_own_counters(record):
    for job, case in _cases(record):
        own_calls = sum(v["calls"] for kinds in case["own"].values() for v in kinds.values())
        own_bytes = sum(v["bytes"] for kinds in case["own"].values() for v in kinds.values())
        assert (own_calls, own_bytes) == (case["calls"], case["bytes"]), (job["layout"], case["label"])


def test_newton_schulz_work_per_rank(record):
    # Owner refresh: each matrix orthogonalized once per replica (HSDP's two repeat it); under FSDP x TP the
    # matrices on the dp sub-mesh only (adaLN, embedders) are refreshed by both tp ranks alike, as documented.
    for job, case in _cases(record, "muon_owner"):
        work = case["ns_flops_sum_over_model"]
        if job["layout"] == "fsdp_tp":
            assert 1 < work < 2
        else:
            assert work == pytest.approx(2 if job["layout"] == "hsdp" else 1), job["layout"]
    fsdp = next(c for j, c in _cases(record, "muon_gather") if j["layout"] == "fsdp")
    assert fsdp["ns_flops_sum_over_model"] == pytest.approx(WORLD)  # gather: every rank orthogonalizes everything
    assert fsdp["ns_flops_max_over_mean"] == pytest.approx(1.0)
    for _, case in _cases(record, "prm_k3", 2):
        assert case["ns_flops_max"] == 0 and case["ns_calls"] == 0


def test_host_reads_per_step_stay_at_todays_bounds(record):
    for job, case in _cases(record):
        if case["optimizer"] == "adamw":
            continue
        # "raise": the vote is read once per step (with the adaptive schedule's signals, where it reads them);
        # "skip": never, the adaptive schedule's own read of its signals apart; with signal_lag=1 that read is of
        # the previous step's host copy, none at step 2 (no signal since step 1's refresh) and one at step 3.
        if case["optimizer"] == "adaptive_lag":
            lagged = census.signal_reads(case, census.LAGGED_SITE)
            assert case["host_reads"] == lagged == (case["step"] == 3), (job["layout"], case["read_sites"])
        elif case["optimizer"].endswith("_skip"):
            assert case["host_reads"] == census.signal_reads(case) <= 1, (
                job["layout"],
                case["label"],
                case["read_sites"],
            )
        else:
            assert case["host_reads"] == 1, (job["layout"], case["label"], case["step"], case["read_sites"])


def test_the_record_renders_and_lists_the_targets(record):
    text = census.render(record, markdown=True)
    assert "## W = 4" in text and "## Targets" in text
    assert len(record["targets"]) == 7 and all(t["measured"] for t in record["targets"])
    derived = {t["target"]: t["measured"] for t in record["targets"]}[
        "every rank's Newton-Schulz work derived from the owner plan = what each traced rank ran"
    ]
    n = sum(1 for j in record["jobs"] for c in j["cases"] if c["ns_flops_plan"])
    assert n > 0 and derived == f"{n} of {n} cases"  # gloo ranks: every rank traced, every rank checked
    assert math.isfinite(record["wall_s"])


def test_a_fake_world_counts_what_the_same_gloo_world_counts(tmp_path):
    """The fake backend traces a world in one process; at W = 4 it must count the ops, collectives and bytes the 4
    gloo ranks do (its own stand-ins for what the backend refuses are not ops of the step)."""
    tiny = dict(depth=2, heads=8)
    cfg = census.Config(
        gloo_worlds=(WORLD,),
        fake_worlds=(WORLD,),
        gloo_model="DiT-T/2",
        fake_model="DiT-T/2",
        gloo_heads=tiny["heads"],
        fake_heads=tiny["heads"],
        gloo_depth=tiny["depth"],
        fake_depth=tiny["depth"],
        fake_replicated_depth=tiny["depth"],
        ops_depths=(),
        layouts=("fsdp", "fsdp_tp"),
        optimizers=("muon_owner",),
        out=tmp_path,
        progress=False,
        input_size=8,
        num_classes=10,
    )
    record = census.run(cfg, ["test"])
    by_backend: dict = {}
    for job in record["jobs"]:
        for case in job["cases"]:
            key = (job["layout"], case["label"], case["step"])
            by_backend.setdefault(job["backend"], {})[key] = (case["ops"], case["calls"], case["bytes"])
    assert set(by_backend) == {"gloo", "fake"} and by_backend["gloo"] == by_backend["fake"]
