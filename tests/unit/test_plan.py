"""The step-time model: hand-computable cases, monotonicity, and its wiring to the census's counts."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from dimuon.bench import census
from dimuon.plan import command
from dimuon.plan.counts import KindCounts, StepCounts, count_step, forward_flops
from dimuon.plan.hardware import GPUS, Efficiency, calibrate, gpu_profile
from dimuon.plan.network import collective_seconds, group_span, latency_seconds, mesh_spans
from dimuon.plan.step_time import OPTIMIZERS, Cluster, kind_seconds, optimizer_mix, step_breakdowns

H100 = GPUS["h100"]
ROOT = Path(__file__).resolve().parents[2]
SMALL = {"hidden_size": 384, "depth": 2, "num_heads": 8, "patch_size": 2}


@pytest.fixture(scope="module")
def small_counts() -> dict[int, StepCounts]:
    """DiT-S/2's width, 2 blocks, on 8, 16 and 32 fake ranks under FSDP2, and 32 under HSDP (groups of 8)."""
    out = {w: count_step(SMALL, w, census.layout_degrees("fsdp", w), 32) for w in (8, 16, 32)}
    out[-32] = count_step(SMALL, 32, census.layout_degrees("hsdp", 32), 32)
    return out


def test_all_gather_across_two_nodes_by_hand():
    eff = Efficiency()
    span = group_span(16, 1, 8)  # 16 consecutive ranks: two nodes of 8
    assert (span.per_node, span.nodes, span.crosses_nodes) == (8, 2, True)
    nbytes = 1 << 30
    # 15 ring steps, 1 of them between the nodes (NCCL's latency model), then the bytes over each GPU's NIC
    hops = 14 * eff.hop_nvlink_us + eff.hop_network_us
    want = (eff.latency_network_us + hops) * 1e-6 + nbytes / (50e9 * eff.network)
    assert collective_seconds("all_gather", nbytes, span, H100, eff) == pytest.approx(want)
    inside = group_span(8, 1, 8)
    want = eff.latency_nvlink_us * 1e-6 + 7 * eff.hop_nvlink_us * 1e-6 + nbytes / (450e9 * eff.nvlink)
    assert collective_seconds("all_gather", nbytes, inside, H100, eff) == pytest.approx(want)


def test_mesh_spans_place_the_last_dimension_fastest():
    spans = mesh_spans((("dp_replicate", 4), ("dp_shard", 8)), 8)
    assert spans["dp_shard"].nodes == 1 and spans["dp_replicate"].per_node == 1 and spans["dp_replicate"].nodes == 4
    spans = mesh_spans((("dp_shard", 8), ("tp", 4)), 8)
    assert spans["tp"].nodes == 1 and spans["dp_shard"].per_node == 2 and spans["dp_shard+tp"].nodes == 4


def test_small_all_reduce_takes_the_tree_at_scale():
    eff = Efficiency()
    span = group_span(256, 1, 8)  # 32 nodes
    tree = 2 * (7 * eff.hop_nvlink_us + 5 * eff.hop_network_us)
    assert latency_seconds("all_reduce", span, eff) == pytest.approx((eff.latency_network_us + tree) * 1e-6)
    two = group_span(2, 1, 8)  # a ring of two inside a node: 2 steps
    want = (eff.latency_nvlink_us + 2 * eff.hop_nvlink_us) * 1e-6
    assert latency_seconds("all_reduce", two, eff) == pytest.approx(want)


def test_all_to_all_sends_the_off_node_share_over_the_nic():
    eff = Efficiency(latency_network_us=0, hop_network_us=0, hop_nvlink_us=0)
    span = group_span(16, 1, 8)
    nbytes = 15e9  # 7 of 15 peers inside the node, 8 across
    want = max(7e9 / (450e9 * eff.nvlink), 8e9 / (50e9 * eff.network))
    assert collective_seconds("all_to_all", nbytes, span, H100, eff) == pytest.approx(want)


def test_one_gpu_step_by_hand():
    """No collectives: compute at the MFU, AdamW's bytes at the HBM efficiency (or its launches, if more)."""
    adamw = KindCounts([], 0.0, 0.0, 0.0, traffic_bytes=28 * 10**9, launches=3, host_reads=0, refresh_calls=0)
    spectral = KindCounts([], 2e12, 2e12, 2e12, traffic_bytes=10**9, launches=100, host_reads=1, refresh_calls=0)
    kinds = {k: spectral for k in ("spectral_gather", "spectral_owner", "rownorm", "block", "adaptive")}
    counts = StepCounts(1, (), 10**9, 9 * 10**8, 1e12, 256, kinds, adamw, {"blocks": 4})
    eff = Efficiency()
    got = step_breakdowns(counts, Cluster(H100, 8, eff), global_batch=8, optimizers=("adamw", "muon_owner"))
    compute = 3 * 1e12 * 8 / (989.4e12 * eff.model_mfu)
    assert got["adamw"].step_s == pytest.approx(compute + 28e9 / (3.35e12 * eff.hbm))
    device = 2e12 / (989.4e12 * eff.newton_schulz) + 1e9 / (3.35e12 * eff.hbm)
    host = 100 * eff.host_op_us * 1e-6  # the host launches ahead: the slower of the two sets the pace
    assert got["muon_owner"].step_s == pytest.approx(compute + max(device, host) + eff.host_read_us * 1e-6)


def test_periodic_mixes_are_the_period_means():
    for name in OPTIMIZERS:
        shares = [s for kind, s in optimizer_mix(name, 0.3) if kind != "signal"]
        assert math.isclose(sum(shares), 1.0)
    assert optimizer_mix("prm_k3_gather", 0.3) == [("spectral_gather", 1 / 3), ("rownorm", 2 / 3)]
    with pytest.raises(ValueError, match="unknown optimizer"):
        optimizer_mix("sgd", 0.3)


def test_forward_flops_are_the_blocks_matmuls_and_attention():
    tokens, d, depth = 256, 384, 2
    flops = forward_flops(SMALL, 32)
    blocks = depth * (2 * tokens * 12 * d * d + 4 * tokens * tokens * d)
    assert blocks < flops < 1.1 * blocks


def test_more_bandwidth_is_never_slower(small_counts):
    for counts in small_counts.values():
        base = step_breakdowns(counts, Cluster(H100, 8, Efficiency()), 64)
        for field in ("nic_gbs", "nvlink_gbs", "hbm_tbs", "bf16_tflops"):
            faster = dataclasses.replace(H100, **{field: 2 * getattr(H100, field)})
            got = step_breakdowns(counts, Cluster(faster, 8, Efficiency()), 64)
            for name in base:
                assert got[name].step_s <= base[name].step_s * (1 + 1e-12), (field, name)


def test_more_gpus_never_more_newton_schulz_per_rank_under_owner(small_counts):
    work = [small_counts[w].kinds["spectral_owner"].ns_flops_max for w in (8, 16, 32)]
    assert work[0] >= work[1] >= work[2] > 0
    gather = [small_counts[w].kinds["spectral_gather"].ns_flops_max for w in (8, 16, 32)]
    assert gather[0] == gather[1] == gather[2]  # every rank orthogonalizes every matrix


def test_the_model_reads_the_census_counts(small_counts):
    """The plan's counts are the census's: rank 0's collectives of the owner refresh and every rank's
    Newton-Schulz maximum, as ``dimuon bench census`` summarizes the same plan trace."""
    cfg = census.Config(gloo_worlds=(), fake_worlds=(16,), input_size=32, progress=False)
    job = census.Job("fsdp", 16, "custom", SMALL, census.layout_degrees("fsdp", 16), ("muon_owner", "prm_k3"), True)
    with (
        census.fake_collectives(),
        census.count_collectives(census.CallCounter()) as counter,
        census.fake_rank(0, 16),
    ):
        traced = census.trace_job(cfg, job, counter, "plan", keys=job.keys, warmup=True)
    step = traced["records"]["muon_owner"]["steps"][0]
    case = census.summarize_case("muon_owner", 0, step, {0: step}, traced["info"]["model_ns_flops"], 16, None,
                                 traced["info"]["mesh_ranks"])  # fmt: skip
    plan = small_counts[16].kinds["spectral_owner"]
    assert sum(c["calls"] for c in plan.collectives) == len(step["collectives"])
    for c in plan.collectives:
        calls = [x for x in step["collectives"] if (x[0], x[1], x[2]) == (c["group"], c["kind"], c["dtype"])]
        assert (c["calls"], c["bytes"]) == (len(calls), sum(x[4] for x in calls))
    assert plan.ns_flops_max == case["ns_flops_max"] and case["ns_flops_over"].startswith("all 16 ranks")
    rownorm = small_counts[16].kinds["rownorm"]
    assert rownorm.ns_flops_max == 0 and rownorm.traffic_bytes > small_counts[16].adamw.traffic_bytes


def test_kind_seconds_pipeline_the_refresh():
    """Transfer and Newton-Schulz overlap bucket by bucket: the first transfer is exposed, then the larger."""
    eff = Efficiency(latency_nvlink_us=0, hop_nvlink_us=0)
    spans = mesh_spans((("dp_shard", 8),), 8)
    calls = [{"group": "dp_shard", "kind": "all_gather", "calls": 4, "bytes": 4e9}]
    k = KindCounts(calls, 989.4e12 * eff.newton_schulz * 0.1, 0, 0, 0, 0, 0, refresh_calls=4)
    comm = 4 * 1e9 / (450e9 * eff.nvlink)
    got = kind_seconds(k, spans, Cluster(H100, 8, eff))
    assert got["total"] == pytest.approx(max(comm, 0.1) + comm / 4)
    assert got["comm_exposed"] == pytest.approx(max(comm, 0.1) + comm / 4 - 0.1)


def test_plan_flags_are_checked_before_counting():
    assert command.parse(["--gpus", "64", "--layout", "hsdp"]).gpus == 64
    assert command.parse(["--gpus", "1", "--layout", "replicated"]).gpus == 1
    for argv, words in (
        (["--gpus", "0"], "--gpus must be >= 1"),
        (["--gpus", "1", "--global-batch", "8"], "--layout fsdp shards over 2 GPUs or more (--gpus 1)"),
        (["--gpus", "1", "--layout", "tp"], "one GPU's step is --layout replicated"),
        (["--gpus", "2048"], "--gpus must be <= 1024"),
        (["--layout", "hsdp", "--gpus", "16", "--dp-shard", "3", "--global-batch", "48"], "--dp-shard (3)"),
        (["--global-batch", "100"], "--global-batch (100)"),
        (["--image-size", "100"], "--image-size"),
        (["--model", "DiT-2B"], "DiT-1.3B"),
    ):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            command.parse(argv)
    with pytest.raises(ValueError, match="--gpu must be one of"):
        gpu_profile("v100")


def test_plan_prints_and_writes_a_prediction(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["--model", "DiT-S/2", "--depth", "2", "--heads", "8", "--gpus", "16", "--global-batch", "32"]
    assert command.main([*argv, "--image-size", "256", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert {r["optimizer"] for r in record["rows"]} == set(OPTIMIZERS) - {"muon_split", "prm_k3_split"}
    assert record["kind"].startswith("prediction") and "recommendation" in record
    assert "Predicted, not measured" in capsys.readouterr().out


def test_calibrate_takes_a_gpu_record_and_refuses_a_cpu_one(tmp_path):
    record = {
        "config": {"device": "cuda"},
        "model": {"params": 10**9},
        "ns_flop_rate": {"standard": {"ns_gflops": 600e3}},
        "optimizers": {"adamw_fused": {"median_ms": 10.0}},
    }
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"benchmark": "gpu-check", "parts": {"bench": {"status": "ok", "results": record}}}))
    eff, found = calibrate(Efficiency(), H100, path)
    assert eff.newton_schulz == pytest.approx(600 / 989.4)
    assert eff.hbm == pytest.approx(2.8e12 / 3.35e12)
    assert found["ns_tflops"] == pytest.approx(600)
    record["config"]["device"] = "cpu"
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="a GPU record is needed"):
        calibrate(Efficiency(), H100, path)
    path.write_text(json.dumps({"benchmark": "gpu-check", "parts": {"bench": {"status": "timeout", "results": {}}}}))
    with pytest.raises(ValueError, match="kept no result"):
        calibrate(Efficiency(), H100, path)
    path.write_text("[]")  # refused where predict reads it first, for the efficiencies, before any counting
    with pytest.raises(ValueError, match=r"--calibrate .*gpu.json must hold a gpu-check or dimuon bench optimizer"):
        command.predict(command.parse(["--model", "DiT-T/2", "--gpus", "2", "--calibrate", str(path)]))


def test_efficiencies_are_checked():
    with pytest.raises(ValueError, match="efficiency hbm must be in"):
        Efficiency(hbm=1.5).checked()
    with pytest.raises(ValueError, match="host_op_us must be >= 0"):
        Efficiency(host_op_us=-1).checked()


def test_host_op_default_is_the_h200_demo_runs():
    """The default host time per op is what the two GPU demo runs measured over the ops their code dispatched
    (PeriodicRowMuon K=3 on DiT-XS/4, one GPU): recomputed here from the records. Today's step of theirs may
    dispatch fewer ops than the code that ran, never more (the model would then price a step at less host time
    than was measured for it)."""
    from dimuon.dit.model import dit_arch
    from dimuon.plan.hardware import HOST_OP_FIT_OPS

    counts = count_step(dit_arch("DiT-XS/4"), 1, None, 28)
    spectral, rownorm = counts.kinds["spectral_owner"], counts.kinds["rownorm"]
    assert (spectral.launches + 2 * rownorm.launches) / 3 <= HOST_OP_FIT_OPS
    ops = HOST_OP_FIT_OPS
    reads = (spectral.host_reads + 2 * rownorm.host_reads) / 3
    eff = Efficiency()
    fitted = []
    for run in ("run1", "run2"):
        path = ROOT / f"docs/results/gpu-check/h200-2026-12-04-{run}.json"
        train = json.loads(path.read_text())["parts"]["train"]
        assert "--optimizer" not in train["command"]  # the default: PeriodicRowMuon K=3
        fitted.append((train["results"]["opt_ms"] * 1e3 - reads * eff.host_read_us) / ops)
    assert eff.host_op_us == pytest.approx(sum(fitted) / 2, rel=0.02)


def test_a_builder_model_is_counted_with_fsdp_over_its_block_lists(capsys, tmp_path):
    """Any nn.Module from module:callable: FSDP2 over its block lists then the root, its forward FLOPs estimated
    (two per hidden-matrix weight per token), tensor parallelism refused with the layouts it can take."""
    argv = [
        "--builder", "dimuon.dit.model:DiT", "--config", "hidden_size=128", "depth=2", "num_heads=4",
        "input_size=8", "in_channels=4", "num_classes=10", "--gpus", "16", "--layout", "hsdp",
        "--global-batch", "32", "--tokens", "16",
    ]  # fmt: skip
    out = tmp_path / "plan.json"
    assert command.main([*argv, "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["model"] == "dimuon.dit.model:DiT" and record["forward_flops"].startswith("estimated")
    muon = record["muon_params"]
    assert record["forward_flops_per_sample"] == 2 * muon * 16
    assert "muon_split" in {r["optimizer"] for r in record["rows"]}  # HSDP: the split rows
    assert "estimated" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--layout fsdp_tp needs the model's tensor-parallel plan"):
        command.parse([*argv[:-8], "--gpus", "16", "--layout", "fsdp_tp", "--global-batch", "32"])
    with pytest.raises(ValueError, match="--tokens go with --diffusers or --builder"):
        command.parse(["--tokens", "16"])
    with pytest.raises(ValueError, match="--depth shapes dimuon's DiT"):
        command.parse([*argv, "--depth", "3"])


def test_shard_block_lists_shards_every_block_then_the_root():
    """Each child of the outermost module lists becomes an FSDP2 unit, nested lists inside a unit do not."""
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    from dimuon.dit.parallel import Parallelism, build_mesh, shard_block_lists

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.blocks = nn.ModuleList([Block() for _ in range(3)])
            self.single = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    with census.fake_rank(0, 4):
        with torch.device("meta"):
            model = Model()
        shard_block_lists(model, build_mesh(Parallelism(1, 4, 1).resolve(4), "cpu"))
        units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    assert units == ["", "blocks.0", "blocks.1", "blocks.2", "single.0", "single.1"]


def _study() -> dict:
    return json.loads((ROOT / "docs/results/plan/study.json").read_text())


def _over(study: dict, model: str, name: str) -> float:
    return next(r["overhead_over_adamw"] for r in study["scale"][model]["rows"] if r["optimizer"] == name)


def test_the_plan_page_table_is_the_study_record():
    """docs/plan.md's table at the papers' scale, cell by cell, against the published study record."""
    study = _study()
    page = (ROOT / "docs/plan.md").read_text()
    section = page.split("## The answer at the papers' scale", 1)[1].split("\n- ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    labels = {label: name for name, label in OPTIMIZERS.items()}
    labels.update({
        "Muon, gather refresh (the paper's design)": "muon_gather",
        "Muon, owner refresh (dimuon's default)": "muon_owner",
        "PeriodicRowMuon K=3, owner split over replicas": "prm_k3_split",
        "AdaptiveRowMuon (refresh rate 0.35)": "adaptive",
    })  # fmt: skip
    models = ("DiT-1.3B", "DiT-4B", "DiT-9B", "DiT-15B")
    assert len(rows) == 8
    for line in rows:
        label, *cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        if label == "AdamW (fused), step ms":
            want = [f"{next(r['step_ms'] for r in study['scale'][m]['rows'] if r['optimizer'] == 'adamw'):.1f}"
                    for m in models]  # fmt: skip
        else:
            want = [f"{100 * _over(study, m, labels[label]):+.1f}%" for m in models]
        assert cells == want, label


def test_the_readme_quotes_the_study():
    study = _study()
    readme = (ROOT / "README.md").read_text()
    models = ("DiT-1.3B", "DiT-4B", "DiT-9B", "DiT-15B")
    prm = [_over(study, m, "prm_k3_owner") for m in ("DiT-1.3B", "DiT-15B")]
    owner = [_over(study, m, "muon_owner") for m in models]
    gather = [_over(study, m, "muon_gather") for m in models]
    sentence = " ".join(readme.split("**At the papers' scale, predicted**", 1)[1].split("\n\n", 1)[0].split())
    assert f"K=3 adds {100 * prm[0]:+.1f}% (1.3B) to {100 * prm[1]:+.1f}% (15B)" in sentence
    assert f"Muon {100 * min(owner):+.1f}% to {100 * max(owner):+.1f}% with dimuon's owner refresh" in sentence
    assert f"{100 * min(gather):+.1f}% to {100 * max(gather):+.1f}% with the paper's gather refresh" in sentence
    assert study["samples_per_gpu"] == 4 and "4 samples per GPU" in sentence
    # the residuals live on docs/plan.md (checked below); the README says which way they went
    assert "matches the paper's communication cut, not its profiled step times" in sentence


def test_the_plan_page_validation_is_the_study_record():
    """docs/plan.md's rows against the paper's profiler, both sides, from the study record's validation."""
    validation = _study()["validation"][0]
    assert validation["samples_per_gpu"] == 1  # the paper's batch is unstated
    rows = [next(r for r in validation["rows"] if r["model"] == m) for m in ("DiT-1.3B", "DiT-4B", "DiT-9B")]
    section = (ROOT / "docs/plan.md").read_text().split("\n## Validation\n", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        if line.startswith("| "):
            label, published, predicted, _ = [c.strip() for c in line.strip().strip("|").split("|")]
            table[label.split(" (")[0]] = (published, predicted)

    def each(key: str, form: str) -> str:
        return " / ".join(form.format(r[key]) for r in rows)

    def span(key: str) -> str:
        return f"{100 * min(r[key] for r in rows):.1f}-{100 * max(r[key] for r in rows):.1f}%"

    muon = table["Scaling Muon for DiTs, 1.3B/4B/9B, Muon step in 1.3B-AdamW units"]
    assert muon[0] == each("muon_paper", "{:.2f}") and muon[1].startswith(each("muon_model", "{:.2f}") + " (")
    assert table["the same, PeriodicRowMuon K=3"] == (each("prm_paper", "{:.2f}"), each("prm_model", "{:.2f}"))
    cut = table["the same, step time cut by K=3"]
    assert cut == (each("step_cut_paper", "{:.1%}"), each("step_cut_model", "{:.1%}"))
    assert table["the same, optimizer time cut by K=3"][1] == span("optimizer_cut_model")
    assert table["the same, logical communication cut by K=3"][1].startswith(span("comm_cut_model") + " (")


def test_plan_takes_hsdp_over_tensor_parallelism():
    cfg = command.parse(["--model", "DiT-XL/2", "--gpus", "256", "--layout", "hsdp_tp", "--global-batch", "256"])
    assert command.degrees(cfg).dims == (("dp_replicate", 4), ("dp_shard", 8), ("tp", 8))
    with pytest.raises(ValueError, match=r"--layout hsdp_tp needs --dp-shard \(8\) x --tp \(8\)"):
        command.parse(["--model", "DiT-XL/2", "--gpus", "64", "--layout", "hsdp_tp", "--global-batch", "64"])
    with pytest.raises(ValueError, match=r"--tp \(8\) must divide the model's 59 attention heads"):
        command.parse(["--model", "DiT-15B", "--layout", "hsdp_tp", "--global-batch", "256"])


def test_a_model_that_does_not_build_or_a_missing_record_is_named(capsys, tmp_path):
    """A --builder that does not import ends the command with its flag named, before any counting; a --calibrate
    file that is not there, and a bad --bucket-mb under --builder, are refused when the flags are read."""
    assert command.main(["--builder", "no_such_module:make", "--gpus", "8", "--global-batch", "8"]) == 2
    assert "--builder no_such_module:make: No module named 'no_such_module'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--calibrate .*: no such file"):
        command.parse(["--calibrate", str(tmp_path / "missing.json")])
    with pytest.raises(ValueError, match="--bucket-mb must be > 0"):
        command.parse(["--builder", "dimuon.dit.model:DiT", "--bucket-mb", "0"])
