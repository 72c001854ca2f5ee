"""The communication benchmark end to end on 2 gloo ranks and a one-block tiny DiT (no timing asserts)."""

import json

import pytest
import torch

from dimuon.bench import comm
from dimuon.optim import param_groups

WORLD = 2
TINY = [
    "--world",
    str(WORLD),
    "--model",
    "DiT-T/2",
    "--depth",
    "1",
    "--input-size",
    "8",
    "--num-classes",
    "10",
    "--repeats",
    "1",
    "--warmup",
    "1",
    "--no-progress",
    # torch.optim.Muon runs everywhere; dtensor-muon never on a CPU (not installed, no Triton, or no CUDA).
    "--peers",
    "torch_muon",
    "dtensor_muon",
]


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "comm.json"
    assert comm.main([*TINY, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _gather_bytes_per_step() -> int:
    """Muon-gather's exact logical bytes: (W-1) padded row shards of every Muon matrix arrive per step."""
    cfg = comm.Config(model="DiT-T/2", depth=1, input_size=8, num_classes=10)
    model = comm.build_model(cfg)
    total = 0
    for group in param_groups(model):
        if group["algorithm"] == "muon":
            for _, p in group["params"]:
                rows, cols = p.shape[0], p[0].numel()
                total += -(-rows // WORLD) * cols * 4
    return (WORLD - 1) * total


@pytest.mark.multirank
def test_every_optimizer_reported_with_bytes_calls_and_ratios(record):
    opts = record["optimizers"]
    assert list(opts) == [*(k for k in comm.VARIANTS if k not in comm.REPLICA_VARIANTS), "torch_muon"]
    assert record["world"] == WORLD and record["backend"] == "gloo" and record["threads_per_rank"] == 1
    assert record["launcher"] == "spawn" and record["machine"]["torch"] and record["machine"]["date"]
    for key in (k for k in comm.VARIANTS if k not in comm.REPLICA_VARIANTS):
        o = opts[key]
        assert o["own_matches_boundary"] is True, key  # dimuon's own counters = the call-boundary count
        assert o["boundary_bytes_per_step"] == o["bytes_per_step"] + o["check"]["bytes_per_step"], key
        assert o["steps_timed"] == o["period"] == comm.VARIANTS[key].period, key
        assert o["step_ms"] > 0 and len(o["step_ms_samples"]) == 1, key
        assert o["bytes_ratio_to_gather"] is not None and o["time_ratio_to_gather"] is not None, key
        assert o["exposed_share"] >= 0, key
        assert "all_reduce[check]" not in o["by_kind"], key
        if key == "adamw":
            assert o["bytes_per_step"] == 0 and o["calls_per_step"] == 0 and o["check"]["calls_per_step"] == 0
        else:
            assert o["bytes_per_step"] > 0 and o["calls_per_step"] > 0, key
            assert o["check"]["calls_per_step"] == 1, key  # one 4-byte vote per step, reported apart
    gather = opts["muon_gather"]["bytes_per_step"]
    assert gather == _gather_bytes_per_step()
    assert opts["muon_gather"]["bytes_ratio_to_gather"] == 1.0
    assert opts["prm_k3"]["bytes_per_step"] < gather
    assert opts["prm_k4"]["bytes_per_step"] < opts["prm_k3"]["bytes_per_step"] < opts["prm_k2"]["bytes_per_step"]
    # K = 3: one gather in three steps, plus the all-reduce of column norms on the two RowNorm steps.
    k3 = opts["prm_k3"]["by_kind"]
    assert k3["all_gather"]["bytes_per_step"] == pytest.approx(gather / 3)
    assert k3["all_reduce"]["calls_per_step"] == pytest.approx(2 / 3)
    assert opts["muon_bp_p5"]["bytes_per_step"] == pytest.approx(gather / 5)  # block steps are local
    assert opts["prm_k3"]["ideal_bytes_ratio"] == pytest.approx(1 / 3)
    assert opts["muon_owner"]["ideal_bytes_ratio"] == pytest.approx(2 / WORLD)


@pytest.mark.multirank
def test_peers_are_rows_with_version_ns_dtype_and_counted_bytes(record):
    tm = record["optimizers"]["torch_muon"]
    assert tm["peer"] and tm["version"] == f"torch {torch.__version__}" and tm["ns_dtype"] == "bfloat16"
    assert tm["boundary_bytes_per_step"] > 0 and tm["boundary_by_kind"]["all_gather"]["calls_per_step"] > 0
    assert tm["own_matches_boundary"] is None and tm["exposed_ms_per_step"] is None and tm["step_ms"] > 0
    assert tm["boundary_bytes_ratio_to_gather"] > 0 and tm["ideal_bytes_formula"] == "-"
    dm = record["peers"]["dtensor_muon"]
    assert (
        not dm["runnable"]
        and dm["reason"].startswith("cannot run here: ")
        and "dtensor_muon" not in record["optimizers"]
    )
    assert record["config"]["peers"] == ["torch_muon", "dtensor_muon"]


def test_summary_takes_slowest_rank_per_step_and_median_over_periods():
    def step(t, nbytes):
        stats = {
            "all_gather": {"calls": 1, "bytes": nbytes, "exposed_s": t / 4},
            "all_reduce[check]": {"calls": 1, "bytes": 4, "exposed_s": 0.0},
        }
        boundary = {"all_gather": {"calls": 1, "bytes": nbytes}, "all_reduce": {"calls": 1, "bytes": 4}}
        return {"time_s": t, "stats": stats, "boundary": boundary}

    # Two periods of K = 2 on two ranks; rank 1 is slower on the first step of each period.
    rank0 = [step(1.0, 10), step(1.0, 0), step(1.0, 10), step(3.0, 0)]
    rank1 = [step(2.0, 30), step(1.0, 0), step(2.0, 30), step(1.0, 0)]
    s = comm.summarize_variant("prm_k2", [rank0, rank1])
    assert s["step_ms_samples"] == [1500.0, 2500.0] and s["step_ms"] == 2000.0
    assert s["bytes_per_step"] == 10.0  # mean over ranks of (20 / 4, 60 / 4)
    assert s["check"]["bytes_per_step"] == 4.0 and s["check"]["calls_per_step"] == 1.0
    assert s["exposed_share"] == pytest.approx(0.25)  # every rank blocked a quarter of each step
    assert s["own_matches_boundary"] is True and s["boundary_bytes_per_step"] == 14.0  # votes included: 36/4, 76/4
    rank1[3]["boundary"] = {}  # a step the two counts disagree on
    assert comm.summarize_variant("prm_k2", [rank0, rank1])["own_matches_boundary"] is False
    # A peer has no counters of its own: bytes from the boundary only, no exposed time.
    peer = [[{**st, "stats": None} for st in steps] for steps in (rank0, rank1)]
    p = comm.summarize_steps("peer", 1, peer)
    assert p["own_matches_boundary"] is None and p["exposed_share"] is None and p["boundary_calls_per_step"] == 1.75


@pytest.mark.multirank
def test_hsdp_mesh_reports_bytes_per_mesh_dimension_and_both_replica_refreshes(tmp_path):
    out = tmp_path / "hsdp.json"
    args = ["--world", "4", *TINY[2:]]
    assert (
        comm.main(
            [
                *args,
                "--mesh",
                "hsdp2x2",
                "--optimizers",
                "muon_gather",
                "muon_gather_split",
                "prm_k3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    record = json.loads(out.read_text())
    assert record["mesh"] == {"spec": "hsdp2x2", "dims": {"dp_replicate": 2, "dp_shard": 2}}
    opts = record["optimizers"]
    repeat, split = opts["muon_gather"]["by_mesh_dim"], opts["muon_gather_split"]["by_mesh_dim"]
    # Repeat: nothing crosses replicas (the one vote runs over the world, reported apart).
    assert "dp_replicate" not in repeat and repeat["dp_shard"]["bytes_per_step"] > 0
    assert split["dp_replicate"]["bytes_per_step"] > 0
    assert split["dp_shard"]["bytes_per_step"] == pytest.approx(repeat["dp_shard"]["bytes_per_step"] / 2, rel=0.05)
    for o in (o for o in opts.values() if not o.get("peer")):  # per-dimension bytes add up to the total
        assert sum(d["bytes_per_step"] for d in o["by_mesh_dim"].values()) == pytest.approx(o["bytes_per_step"])
    # Peers are tried on every mesh: torch.optim.Muon's DTensor ops run on HSDP, its traffic counted at the boundary
    assert record["peers"]["torch_muon"]["runnable"] and opts["torch_muon"]["boundary_bytes_per_step"] > 0


def test_bad_options_are_refused_before_any_rank_starts(capsys):
    assert comm.main(["--optimizers", "sgd"]) == 2
    assert "--optimizers must name" in capsys.readouterr().err
    assert comm.main(["--peers", "heavyball", "sgd"]) == 2
    assert "--peers got unknown peer(s) ['sgd']" in capsys.readouterr().err
    assert comm.main(["--device", "cuda", "--launcher", "spawn"]) == 2
    assert "needs torchrun" in capsys.readouterr().err
    assert comm.main(["--mesh", "hsdp2x3", "--world", "4"]) == 2
    assert "--mesh hsdp2x3 on 4 ranks" in capsys.readouterr().err
    assert comm.main(["--mesh", "ring4"]) == 2
    assert "--mesh must be fsdp, fsdpS, hsdpRxS, tpT or fsdpSxtpT" in capsys.readouterr().err
    assert comm.main(["--mesh", "tp4", "--model", "DiT-T/2"]) == 2
    assert "--parallel.tp (4) must divide the model's 2 attention heads" in capsys.readouterr().err
    assert comm.main(["--world", "1"]) == 2
    assert "--world must be >= 2 (ranks that communicate), got 1\n" in capsys.readouterr().err


def test_a_torchrun_world_of_one_is_refused_before_it_joins(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(comm, "run_torchrun", lambda cfg: pytest.fail("joined a process group"))
    assert comm.main(["--world", "4"]) == 2  # --world is ignored under torchrun
    assert "--world must be >= 2 (ranks that communicate), got 1 (torchrun's world size)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--threads", "-1"], "--threads must be >= 1 (or left out: 1 per spawned rank), got -1"),
        (["--threads", "0"], "--threads must be >= 1 (or left out: 1 per spawned rank), got 0"),  # ran 1, said 0
        (["--bucket-mb", "-1"], "--bucket-mb must be a positive number of MiB, got -1.0"),
        (["--bucket-mb", "0"], "--bucket-mb must be a positive number of MiB, got 0.0"),
        (["--timeout-s", "-5"], "--timeout-s must be >= 0 seconds (0: no limit), got -5.0"),
        (["--lr", "-1"], "--lr must be a finite number >= 0, got -1.0"),
    ],
)
def test_threads_bucket_and_timeout_are_checked_before_any_rank_starts(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.setattr("dimuon.bench.launch.run_gloo", lambda *a, **k: pytest.fail("started ranks"))
    out = tmp_path / "c.json"
    assert comm.main([*flags, "--model", "DiT-T/2", "--world", "2", "--no-peers", "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
