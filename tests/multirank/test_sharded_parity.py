"""Sharded (FSDP2, gloo) against single-process: parameters, logical bytes, no hangs on empty shards."""

import pytest
import torch

from dimuon.bench.launch import run_gloo
from dimuon.optim.distributed.owners import assign_owners
from dimuon.optim.distributed.refresh import make_buckets, owner_buckets
from dimuon.optim.fused import triton_available

from . import scenarios as sc

pytestmark = pytest.mark.multirank

# Weight shapes of scenarios.DiTShaped (D = 64), in parameter order.
DIT_SHAPES = [(192, 64), (64, 192), (256, 64), (64, 256), (384, 64)] * 2

CASES = [
    ("muon_gather", "odd", "muon", {"refresh": "gather"}),
    ("muon_owner", "odd", "muon", {"refresh": "owner"}),
    ("prm_k3", "odd", "periodic_row_muon", {"k": 3, "gamma": 0.15, "refresh": "gather"}),
    ("prm_k3_owner", "odd", "periodic_row_muon", {"k": 3, "gamma": 0.5, "refresh": "owner"}),
    ("muon_bp_p5", "odd", "muon_bp", {"period": 5, "block_lr_ratio": 0.8}),
    ("adamw", "odd", "adamw", {}),
    ("muon_adamw_only", "odd", "muon_adamw_only", {}),
    ("bytes_muon_gather", "dit", "muon", {"refresh": "gather", "bucket_mb": 0.05}),
    ("bytes_muon_owner", "dit", "muon", {"refresh": "owner", "bucket_mb": 0.05}),
    ("bytes_prm_k3", "dit", "periodic_row_muon", {"k": 3, "bucket_mb": 0.05, "refresh": "gather"}),
    ("bytes_muon_gather_bf16", "dit", "muon", {"refresh": "gather", "bucket_mb": 0.05, "comm_dtype": torch.bfloat16}),
    # Thresholds that leave kinds to the staleness on these batches (no signal within 1e-3 of them).
    ("arm", "odd", "adaptive_row_muon", {"threshold": 0.5, "k_min": 1, "k_max": 4}),
    ("arm_owner", "odd", "adaptive_row_muon", {"threshold": 0.3, "k_min": 2, "k_max": 4, "refresh": "owner"}),
    (
        "bytes_arm",
        "dit",
        "adaptive_row_muon",
        {"threshold": 0.55, "k_min": 1, "k_max": 3, "bucket_mb": 0.05, "refresh": "gather"},
    ),
]
# The fused step kernels (Triton's interpreter on these CPU ranks) on local shards, held to the eager reference.
FUSED = [
    ("prm_k3_fused", "odd", "periodic_row_muon", {"k": 3, "gamma": 0.5, "kernels": "triton"}),
    ("muon_bp_p5_fused", "odd", "muon_bp", {"period": 5, "block_lr_ratio": 0.8, "kernels": "triton"}),
]
CASES += FUSED if triton_available() else []
NEEDS_TRITON = pytest.mark.skipif(not triton_available(), reason="needs triton")
ADAPTIVE = ["arm", "arm_owner", "bytes_arm"]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def sharded(request):
    world = request.param
    results = run_gloo(sc.parity, world, CASES, timeout_s=300)
    return world, results


def _reference(key, world, refreshes=None):
    _, model, optimizer, opts = next(c for c in CASES if c[0] == key)
    opts = dict(opts)
    if optimizer == "muon_bp":
        opts["blocks"] = world  # the single-process blocks that match the shard layout
    if optimizer == "muon_adamw_only":
        return sc.reference(model, "adamw", opts)  # the family's AdamW group is torch's AdamW
    opts.pop("refresh", None)
    opts.pop("bucket_mb", None)
    opts.pop("kernels", None)  # the reference takes the eager ops
    return sc.reference(model, optimizer, opts, refreshes=refreshes)


@pytest.mark.parametrize(
    "key",
    [
        "muon_gather",
        "muon_owner",
        "prm_k3",
        "prm_k3_owner",
        "muon_bp_p5",
        *[pytest.param(key, marks=NEEDS_TRITON) for key, *_ in FUSED],
        "adamw",
        "muon_adamw_only",
        "arm",
        "arm_owner",
        "bytes_arm",
    ],
)
def test_parameters_match_single_process(sharded, key):
    world, results = sharded
    expect = _reference(key, world)
    for rank_result in results:  # every rank holds the same full parameters
        got = rank_result[key]["params"]
        for name, ref in expect.items():
            diff = (got[name] - ref).abs().max().item()
            assert diff <= 1e-5, (key, name, diff)


@NEEDS_TRITON
def test_fused_cases_launched_their_kernels_on_the_shards(sharded):
    _, results = sharded
    for rank_result in results:
        for key, *_ in FUSED:
            assert rank_result[key]["fused_tables"] > 0, key
        assert rank_result["prm_k3"]["fused_tables"] == 0  # "auto" on a CPU: the eager ops


def _bytes(stats):
    return sum(v["bytes"] for s in stats for k, v in s.items() if k != "all_reduce[check]")


def test_rownorm_and_block_steps_are_local_except_norm_stats(sharded):
    _, results = sharded
    stats = results[0]["prm_k3"]["stats"]
    for t, s in enumerate(stats):
        kinds = set(s) - {"all_reduce[check]"}
        if t % 3 == 0:
            assert kinds == {"all_gather"}
        else:  # RowNorm: only the one bucketed all-reduce of column norms (tall matrices exist here)
            assert kinds == {"all_reduce"} and s["all_reduce"]["calls"] == 1
    bp = results[0]["muon_bp_p5"]["stats"]
    for t, s in enumerate(bp):
        if t % 5:
            assert set(s) - {"all_reduce[check]"} == set()


def test_adamw_groups_communicate_only_the_vote(sharded):
    # Sharded AdamW is elementwise on each shard: every step issues exactly the 4-byte non-finite vote.
    world, results = sharded
    for r in results:
        stats = r["muon_adamw_only"]["stats"]
        assert len(stats) == sc.STEPS
        for s in stats:
            assert set(s) == {"all_reduce[check]"}
            assert (s["all_reduce[check]"]["calls"], s["all_reduce[check]"]["bytes"]) == (
                1,
                2 * 4 * (world - 1) // world,
            )


def test_logical_bytes_ratios(sharded):
    world, results = sharded
    per_rank = [
        (
            _bytes(r["bytes_muon_gather"]["stats"][:6]),
            _bytes(r["bytes_muon_owner"]["stats"][:6]),
            _bytes(r["bytes_prm_k3"]["stats"][:6]),
        )
        for r in results
    ]
    gather, owner, prm = (sum(col) / world for col in zip(*per_rank))
    # Exact gather volume: per bucket, (W-1)/W of the all-gathered (padded) shards, every step.
    shard_bytes = [-(-m // world) * n * 4 for m, n in DIT_SHAPES]
    buckets = make_buckets([world * b for b in shard_bytes], int(0.05 * 2**20))
    per_step = sum(world * sum(shard_bytes[i] for i in b) * (world - 1) // world for b in buckets)
    assert all(p[0] == 6 * per_step for p in per_rank)
    # K = 3: one refresh per period plus the small all-reduce of column norms on RowNorm steps.
    assert prm / gather <= 0.34
    if world == 4:
        assert owner / gather <= 0.52
    assert owner / gather <= 2 / world + 0.02


def test_owner_moves_exactly_the_shards(sharded):
    world, results = sharded
    # Every row of every matrix leaves its rank once (unless its owner holds it) and comes back once.
    total = sum(m * n * 4 for m, n in DIT_SHAPES)
    moved = sum(_bytes(r["bytes_muon_owner"]["stats"][:1]) for r in results)
    owners = assign_owners(DIT_SHAPES, world)
    kept = 0
    for (m, n), o in zip(DIT_SHAPES, owners):
        chunk = -(-m // world)
        kept += max(0, min(chunk, m - o * chunk)) * n * 4
    assert moved == 2 * (total - kept)


def test_owner_exchanges_once_each_way_per_bucket_of_same_shape_matrices(sharded):
    world, results = sharded
    # The plan from shapes alone: owners balanced per shape class, at most per_owner matrices of an owner per bucket.
    owners = assign_owners(DIT_SHAPES, world)
    buckets = 0
    for shape in dict.fromkeys(DIT_SHAPES):
        idx = [i for i, s in enumerate(DIT_SHAPES) if s == shape]
        pad = -(-shape[0] // world) * shape[1]
        per_owner = max(1, int(0.05 * 2**20) // (world * pad * 4))
        buckets += len(owner_buckets(idx, [owners[i] for i in idx], per_owner))
    assert buckets < len(DIT_SHAPES)  # same-shape matrices share their exchanges
    for r in results:
        step = r["bytes_muon_owner"]["stats"][0]
        assert set(step) == {"all_to_all", "all_reduce[check]"}
        assert step["all_to_all"]["calls"] == 2 * buckets


def test_every_rank_issues_the_same_collectives(sharded):
    _, results = sharded
    for key in results[0]:
        calls = [[{k: v["calls"] for k, v in s.items()} for s in r[key]["stats"]] for r in results]
        assert all(c == calls[0] for c in calls), key


@pytest.mark.parametrize("optimizer", ["muon", "periodic_row_muon", "adaptive_row_muon"])
def test_replicated_parameters_split_the_work(optimizer):
    world = 2
    results = run_gloo(sc.replicated, world, optimizer, {}, timeout_s=300)
    refreshes: list = []
    expect = sc.reference("odd", optimizer, {}, refreshes=refreshes)
    for r in results:
        for name, ref in expect.items():
            assert (r["params"][name] - ref).abs().max() <= 1e-5, name
        assert r["refreshes"] == refreshes  # every rank decides as one process does
    first = results[0]["stats"][0]
    # A spectral step: per parameter group one all-gather of every owner's directions (padded to the largest
    # share), whatever the number of owners; nothing else.
    groups = [[(13, 12), (40, 13), (16, 40), (16, 16), (3, 48)], [(48, 16)]]  # plain and split matrices
    shares = [
        max(sum(m * n for (m, n), o in zip(shapes, assign_owners(shapes, world)) if o == r) for r in range(world))
        for shapes in groups
    ]
    assert set(first) - {"all_reduce[check]"} == {"all_gather"} and first["all_gather"]["calls"] == len(groups)
    assert first["all_gather"]["bytes"] == sum(4 * pad * (world - 1) for pad in shares)  # fp32 on the CPU
    if optimizer == "periodic_row_muon":
        assert set(results[0]["stats"][1]) <= {"all_reduce[check]"}  # RowNorm is local


def test_more_ranks_than_matrices_take_one_broadcast_per_owner_not_a_padded_all_gather():
    """On 4 ranks the split group's one (48, 16) matrix has one owner: a padded all-gather would move 4 times its
    bytes to every rank, so its owner broadcasts it; the other group's 5 matrices spread over the 4 ranks keep the
    all-gather. The weights are the one-process run's."""
    world = 4
    results = run_gloo(sc.replicated, world, "muon", {}, timeout_s=300)
    expect = sc.reference("odd", "muon", {})
    for r in results:
        for name, ref in expect.items():
            assert (r["params"][name] - ref).abs().max() <= 1e-5, name
    shapes = [(13, 12), (40, 13), (16, 40), (16, 16), (3, 48)]
    owners = assign_owners(shapes, world)
    pad = max(sum(m * n for (m, n), o in zip(shapes, owners) if o == r) for r in range(world))
    assert world * pad <= 2 * sum(m * n for m, n in shapes)  # padding within the limit: the all-gather
    for rank, r in enumerate(results):
        first = r["stats"][0]
        assert set(first) - {"all_reduce[check]"} == {"all_gather", "broadcast"}
        assert first["all_gather"]["calls"] == 1 and first["all_gather"]["bytes"] == 4 * pad * (world - 1)
        owner = assign_owners([(48, 16)], world)[0]
        assert first["broadcast"]["calls"] == 1  # one owner: one broadcast, its real bytes to the others
        assert first["broadcast"]["bytes"] == (0 if rank == owner else 4 * 48 * 16)


def test_replicate_placement_dtensors():
    from torch import nn

    from dimuon.optim import build

    world = 2
    results = run_gloo(sc.replicate_dtensor, world, timeout_s=300)
    torch.manual_seed(0)
    shapes = [(13, 12), (40, 13), (16, 40), (16, 16), (3, 48)]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    opt = build("periodic_row_muon", params, lr=sc.LR, weight_decay=0.05, ns_dtype=torch.float32, k=2)
    for t in range(4):
        g = torch.Generator().manual_seed(500 + t)
        for p, s in zip(params, shapes):
            p.grad = torch.randn(s, generator=g)
        opt.step()
    for r in results:
        for got, ref in zip(r["params"], params):
            assert (got - ref.detach()).abs().max() <= 1e-5
    assert set(results[0]["stats"][0]) - {"all_reduce[check]"} == {"all_gather"}  # spectral: split, then one all-gather
    assert set(results[0]["stats"][1]) <= {"all_reduce[check]"}  # RowNorm: local


def test_bf16_payloads_halve_the_bytes(sharded):
    world, results = sharded
    fp32 = _bytes(results[0]["bytes_muon_gather"]["stats"][:1])
    bf16 = _bytes(results[0]["bytes_muon_gather_bf16"]["stats"][:1])
    assert bf16 * 2 == fp32 or abs(bf16 * 2 - fp32) <= 2 * world  # integer rounding per bucket
    expect = results[0]["bytes_muon_gather"]["params"]
    got = results[0]["bytes_muon_gather_bf16"]["params"]
    for name, ref in expect.items():
        # The momentum travels in bf16 (8 mantissa bits); after 8 steps the weights stay within 2%.
        assert (got[name] - ref).norm() <= 2e-2 * ref.norm(), name


@pytest.mark.parametrize("key", ADAPTIVE)
def test_adaptive_decisions_are_those_of_one_process_on_every_rank(sharded, key):
    _, results = sharded
    expect: list = []
    _reference(key, None, refreshes=expect)
    kinds = {flag for step in expect for flag in step.values()}
    assert kinds == {0, 1}  # the staleness chose both kinds somewhere
    for r in results:
        assert r[key]["refreshes"] == expect


def test_adaptive_signals_of_every_group_take_one_small_all_reduce(sharded):
    _, results = sharded
    for r in results:  # two Muon groups here (plain and split matrices): one reduction for both
        calls = [s.get("all_reduce[signal]", {"calls": 0})["calls"] for s in r["arm"]["stats"]]
        assert max(calls) == 1 and calls.count(1) >= sc.STEPS // 2, calls
        assert calls[0] == 0  # the first step refreshes every matrix: nothing to measure


def test_adaptive_moves_the_signal_sums_and_only_the_chosen_refreshes(sharded):
    # Exact logical bytes per step: the 4 signal sums of the matrices whose bounds leave the choice open (and their
    # signals, agreed on by the world), the
    # all-gather of the chosen matrices only (bucketed among themselves), the column norms of tall RowNorm ones.
    world, results = sharded
    k_min, k_max, bucket = 1, 3, int(0.05 * 2**20)
    shard_bytes = [-(-m // world) * n * 4 for m, n in DIT_SHAPES]
    for r in results:
        last: list[int | None] = [None] * len(DIT_SHAPES)
        # The matrices in the parameters' order, as the first step (never by class) counts them; later steps count
        # them in the order of their classes.
        order = list(r["bytes_arm"]["refreshes"][0])
        for t, (stats, chosen) in enumerate(zip(r["bytes_arm"]["stats"], r["bytes_arm"]["refreshes"])):
            spectral = [i for i, key in enumerate(order) if chosen[key]]
            expect: dict[str, int] = {"all_reduce[check]": 2 * 4 * (world - 1) // world}
            open_ = [i for i in range(len(DIT_SHAPES)) if last[i] is not None and k_min <= t - last[i] < k_max]
            if open_:
                expect["all_reduce[signal]"] = 2 * (len(open_) * 4 * 4) * (world - 1) // world
                # one decision for the world: each open matrix's signal (fp32), its maximum over the ranks
                expect["all_reduce[agree]"] = 2 * (len(open_) * 4) * (world - 1) // world
            if spectral:
                buckets = make_buckets([world * shard_bytes[i] for i in spectral], bucket)
                expect["all_gather"] = sum(
                    world * sum(shard_bytes[spectral[j]] for j in b) * (world - 1) // world for b in buckets
                )
            tall_rownorm = [
                i for i in range(len(DIT_SHAPES)) if i not in spectral and DIT_SHAPES[i][0] > DIT_SHAPES[i][1]
            ]
            if tall_rownorm:
                expect["all_reduce"] = 2 * sum(DIT_SHAPES[i][1] * 4 for i in tall_rownorm) * (world - 1) // world
            assert {k: v["bytes"] for k, v in stats.items()} == expect, (t, stats)
            for i in spectral:
                last[i] = t
    quiet = [t for t, chosen in enumerate(results[0]["bytes_arm"]["refreshes"]) if not any(chosen.values())]
    assert quiet, "some step refreshed no matrix"
    assert all("all_gather" not in results[0]["bytes_arm"]["stats"][t] for t in quiet)  # no bulk bytes then
