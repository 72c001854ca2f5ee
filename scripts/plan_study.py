"""The papers' scale on paper: every optimizer's predicted step for DiTs of 1.3B-15B on 32 x 8 H100 and across 8-1024
GPUs, the validation against published measurements, and the sensitivity of the conclusions (docs/plan.md).

    python scripts/plan_study.py --out docs/results/plan

Counts every layout once (dimuon.plan.counts, about 5-15 s each), caches them in OUT/counts.json (a rerun reuses
them; --recount counts again), then writes OUT/study.json, OUT/study.md and OUT/study.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from dimuon.bench.report import format_markdown_table, machine_info
from dimuon.io import write_json_atomic, write_text_atomic
from dimuon.plan.command import (
    ADAPTIVE_RATE,
    PAPER_SIZES,
    TABLE_HEAD,
    Config,
    degrees,
    model_arch,
    recommend,
    table_rows,
)
from dimuon.plan.counts import KindCounts, StepCounts, count_step
from dimuon.plan.hardware import EFFICIENCY_SOURCES, Efficiency, gpu_profile
from dimuon.plan.host import PUBLISHED_HOST
from dimuon.plan.step_time import OPTIMIZERS, Cluster, optimizer_mix, step_breakdowns, summary_row

IMAGE = 512  # the paper's resolution: 64 x 64 latents, 1024 tokens with patch 2
SCALE_GPUS = 256
SWEEP = (8, 16, 32, 64, 128, 256, 512, 1024)
SWEEP_MODELS = ("DiT-1.3B", "DiT-15B")
# Scaling Muon for DiTs (arXiv 2608.20818), profiler traces, 32 x 8 H100, 1.3B AdamW's mean step = 1.
PAPER_NORMALIZED = {"DiT-1.3B": (5.59, 4.20), "DiT-4B": (7.26, 5.68), "DiT-9B": (12.47, 10.26)}
SAMPLES_PER_GPU = 4  # the study's batch: 1,024 samples (1M tokens) per step at 256 GPUs, weak scaling across GPUs
VALIDATION_SAMPLES = (1, 2, 4)  # per GPU at 256 GPUs: the paper's global batch is not stated
# MuonBP (arXiv 2510.16981): an 8B model, 8-way tensor parallelism and ZeRO; its GPU count, sequence and batch are
# not in its abstract: assumed 64 GPUs (8 nodes), 4,096 tokens per sample, 512 samples (2M tokens) per step.
MUONBP = {"model": "8B", "arch": (4096, 32, 32), "gpus": 64, "tp": 8, "image": 1024, "batch": 512}
# The DiT families the paper's sizes could be (its widths and depths are not stated): hidden = 64 x depth (the
# default), DiT-XL's depth 28 kept, and twice as wide for the depth (hidden = 128 x depth).
FAMILIES = {
    "64xdepth": PAPER_SIZES,
    "depth28": {"DiT-1.3B": (1536, 28, 24), "DiT-4B": (2688, 28, 42), "DiT-9B": (4032, 28, 63)},
    "128xdepth": {"DiT-1.3B": (2304, 14, 36), "DiT-4B": (3328, 20, 52), "DiT-9B": (4352, 26, 68)},
}


SWEEP_LAYOUTS = ("hsdp", "fsdp")  # HSDP: FSDP groups of 8 (a node), replicas across nodes; FSDP: one group


def layout_for(gpus: int, layout: str = "hsdp") -> str:
    """HSDP needs two replicas: on one node it is FSDP."""
    return "fsdp" if gpus <= 8 else layout


def counts_key(model: str, arch: dict[str, int], gpus: int, layout: str) -> str:
    return f"{model}|{arch['hidden_size']}x{arch['depth']}h{arch['num_heads']}|{gpus}|{layout}"


def load_counts(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def to_counts(d: dict[str, Any]) -> StepCounts:
    d = dict(d)
    d["kinds"] = {k: KindCounts(**v) for k, v in d["kinds"].items()}
    d["adamw"] = KindCounts(**d["adamw"])
    d["dims"] = tuple(tuple(x) for x in d["dims"])
    return StepCounts(**d)


def counted(cache: dict[str, Any], path: Path, model: str, arch: dict[str, int], gpus: int, layout: str) -> StepCounts:
    key = counts_key(model, arch, gpus, layout)
    if key not in cache:
        cfg = Config(model=model, gpus=gpus, layout=layout, global_batch=gpus)
        cache[key] = dataclasses.asdict(count_step(arch, gpus, degrees(cfg), IMAGE // 8))
        write_json_atomic(path, cache)  # resumable: each layout is kept as soon as it is counted
    return to_counts(cache[key])


def cluster(eff: Efficiency | None = None, gpu: str = "h100") -> Cluster:
    return Cluster(gpu_profile(gpu), 8, (eff or Efficiency()).checked())


def predict(counts: StepCounts, batch: float, c: Cluster) -> dict[str, Any]:
    return step_breakdowns(counts, c, batch, adaptive_rate=ADAPTIVE_RATE)


def validation(counts: dict[str, StepCounts], c: Cluster, samples_per_gpu: int) -> dict[str, Any]:
    """The paper's normalized step times (1.3B AdamW = 1) against the model's at ``samples_per_gpu``: nothing
    fitted; the batch the paper does not state is varied instead."""
    batch = samples_per_gpu * SCALE_GPUS
    unit = predict(counts["DiT-1.3B"], batch, c)["adamw"].step_s
    rows = []
    for model, (muon, prm) in PAPER_NORMALIZED.items():
        n = counts[model]
        b = predict(n, batch, c)
        got_muon, got_prm = b["muon_gather"].step_s / unit, b["prm_k3_gather"].step_s / unit
        rows.append({
            "model": model,
            "adamw_model": b["adamw"].step_s / unit,
            "muon_paper": muon, "muon_model": got_muon,
            "prm_paper": prm, "prm_model": got_prm,
            "step_cut_paper": 1 - prm / muon, "step_cut_model": 1 - got_prm / got_muon,
            "optimizer_cut_model": 1 - b["prm_k3_gather"].optimizer_s / b["muon_gather"].optimizer_s,
            "comm_cut_model": 1 - period_bytes(n, "prm_k3_gather") / period_bytes(n, "muon_gather"),
        })  # fmt: skip
    return {"samples_per_gpu": samples_per_gpu, "global_batch": batch, "unit_ms": 1e3 * unit, "rows": rows}


def period_bytes(n: StepCounts, name: str) -> float:
    """Logical bytes a rank receives per step, the period's mean (the census's count)."""
    total = {k: sum(x["bytes"] for x in v.collectives) for k, v in n.kinds.items()}
    return sum(share * total[kind] for kind, share in optimizer_mix(name, ADAPTIVE_RATE) if kind in total)


def muonbp_case(cache: dict[str, Any], path: Path, c: Cluster) -> dict[str, Any]:
    """The MuonBP paper's setting as far as it is stated: throughput ratios of Muon, MuonBP and AdamW."""
    hidden, depth, heads = MUONBP["arch"]
    arch = {"hidden_size": hidden, "depth": depth, "num_heads": heads, "patch_size": 2}
    key = counts_key("8B-tp8", arch, MUONBP["gpus"], "fsdp_tp")
    if key not in cache:
        par = degrees(Config(model="DiT-XL/2", gpus=MUONBP["gpus"], layout="fsdp_tp", tp=MUONBP["tp"]))
        cache[key] = dataclasses.asdict(count_step(arch, MUONBP["gpus"], par, MUONBP["image"] // 8))
        write_json_atomic(path, cache)
    b = predict(to_counts(cache[key]), MUONBP["batch"], c)
    through = {name: b["adamw"].step_s / b[name].step_s for name in ("muon_gather", "muon_owner", "muon_bp_p5")}
    return {
        **MUONBP,
        "throughput_vs_adamw": through,
        "muonbp_over_muon_gather": b["muon_gather"].step_s / b["muon_bp_p5"].step_s - 1,
        "muonbp_over_muon_owner": b["muon_owner"].step_s / b["muon_bp_p5"].step_s - 1,
    }


def conclusions(counts: dict[str, StepCounts], batch: float, c: Cluster) -> dict[str, Any]:
    """What the study concludes at 32 x 8: per model the recommended K and whether owner Muon beats gather PRM K=3."""
    out = {}
    for model, n in counts.items():
        b = predict(n, batch, c)
        out[model] = {
            "recommended": recommend(b).split(":")[0],
            "owner_muon_beats_gather_prm3": b["muon_owner"].step_s < b["prm_k3_gather"].step_s,
            "prm3_owner_saves_over_1pct": b["prm_k3_owner"].step_s < 0.99 * b["muon_owner"].step_s,
            "muon_owner_over_adamw": b["muon_owner"].step_s / b["adamw"].step_s - 1,
            "prm3_owner_saving": 1 - b["prm_k3_owner"].step_s / b["muon_owner"].step_s,
        }
    return out


NUMERIC = ("muon_owner_over_adamw", "prm3_owner_saving")
HOST_ROWS = ("muon_owner", "prm_k3_owner", "muon_bp_p5", "adaptive")
ROOT = Path(__file__).resolve().parents[1]
DEMO_RUNS = ("docs/results/gpu-check/h200-2026-12-04-run1.json", "docs/results/gpu-check/h200-2026-12-04-run2.json")


def host_terms(counts: dict[str, StepCounts], batch: float) -> dict[str, Any]:
    """The model with its host term from the published ``dimuon bench host`` fit beside ops x host_op_us: at 32 x 8
    per model, and on the one GPU measurement of the optimizer step (the H200 demo runs, PeriodicRowMuon K=3 on
    DiT-XS/4), which host_op_us was fitted to."""
    ops_c, fit_c = cluster(), dataclasses.replace(cluster(), host=PUBLISHED_HOST)
    rows = []
    for model, n in counts.items():
        a, b = predict(n, batch, ops_c), predict(n, batch, fit_c)
        row: dict[str, Any] = {"model": model, "muon_matrices": n.muon_matrices}
        for name in HOST_ROWS:
            row[name] = {
                "host_ms": [1e3 * a[name].optimizer_host_s, 1e3 * b[name].optimizer_host_s],
                "optimizer_ms": [1e3 * a[name].optimizer_s, 1e3 * b[name].optimizer_s],
                "overhead_over_adamw": [
                    a[name].step_s / a["adamw"].step_s - 1,
                    b[name].step_s / b["adamw"].step_s - 1,
                ],
            }
        rows.append(row)
    demo = count_step(model_arch("DiT-XS/4"), 1, None, 28)
    measured = [json.loads((ROOT / p).read_text())["parts"]["train"]["results"]["opt_ms"] for p in DEMO_RUNS]
    one = {c: Cluster(gpu_profile("h200"), 8, x.eff, x.host) for c, x in (("ops", ops_c), ("fit", fit_c))}
    demo_ms = {c: 1e3 * predict(demo, 32, x)["prm_k3_owner"].optimizer_s for c, x in one.items()}
    return {
        "terms": PUBLISHED_HOST.as_dict(),
        "columns": ["ops x host_op_us", "fitted from dimuon bench host"],
        "rows": rows,
        "demo": {"measured_ms": measured, "model_ms": [demo_ms["ops"], demo_ms["fit"]], "matrices": demo.muon_matrices},
    }


def host_markdown(h: dict[str, Any]) -> list[str]:
    """The host-term comparison as study.md shows it."""
    out = ["\n## Host term: measured per step kind against ops x host_op_us, 32 x 8 H100\n"]
    out.append(
        f"Each cell: with `ops x host_op_us` / with the terms fitted from [{h['terms']['source']}]"
        f"(../{h['terms']['source'].removeprefix('docs/results/')}) (`dimuon plan --host published`). Exposed host "
        "ms: the host's time past the GPU's work "
        "on the step, plus its host reads (the period's mean).\n"
    )
    head = ["model", "Muon matrices", *(f"{OPTIMIZERS[n]}: exposed host ms, over AdamW" for n in HOST_ROWS)]
    rows = [
        [r["model"], r["muon_matrices"]]
        + [
            "{:.1f} / {:.1f}, {:+.1f}% / {:+.1f}%".format(
                *r[n]["host_ms"], *(100 * x for x in r[n]["overhead_over_adamw"])
            )
            for n in HOST_ROWS
        ]
        for r in h["rows"]
    ]
    out.append(format_markdown_table(head, rows))
    d = h["demo"]
    out.append(
        f"\nThe one GPU measurement of the optimizer step (PeriodicRowMuon K=3 on DiT-XS/4, {d['matrices']} Muon "
        f"matrices, one H200): measured {d['measured_ms'][0]:.1f} and {d['measured_ms'][1]:.1f} ms; the model "
        f"{d['model_ms'][0]:.1f} ms with ops x host_op_us (fitted to these runs), {d['model_ms'][1]:.1f} ms with "
        "the terms fitted on a CPU.\n"
    )
    return out


def sensitivity(counts: dict[str, StepCounts], batch: float) -> list[dict[str, Any]]:
    """Each efficiency and each bandwidth of the profile at 0.7x and 1.3x (fractions capped at 1): which flip."""
    base = conclusions(counts, batch, cluster())
    rows = [{
        "knob": "none", "factor": 1.0, "flips": [],
        "ranges": {key: [min(g[key] for g in base.values()), max(g[key] for g in base.values())] for key in NUMERIC},
    }]  # fmt: skip
    gpu = gpu_profile("h100")
    knobs = [("eff", f.name) for f in dataclasses.fields(Efficiency)] + [
        ("gpu", name) for name in ("bf16_tflops", "hbm_tbs", "nvlink_gbs", "nic_gbs")
    ]
    for where, name in knobs:
        for factor in (0.7, 1.3):
            if where == "eff":
                value = getattr(Efficiency(), name) * factor
                eff = dataclasses.replace(Efficiency(), **{name: value if name.endswith("_us") else min(1.0, value)})
                c = Cluster(gpu, 8, eff)
            else:
                c = Cluster(dataclasses.replace(gpu, **{name: getattr(gpu, name) * factor}), 8, Efficiency())
            got = conclusions(counts, batch, c)
            flips = [
                f"{model}: {key} {base[model][key]} -> {got[model][key]}"
                for model in base
                for key in base[model]
                if key not in NUMERIC and got[model][key] != base[model][key]
            ]
            ranges = {key: [min(g[key] for g in got.values()), max(g[key] for g in got.values())] for key in NUMERIC}
            rows.append({"knob": f"{where}.{name}", "factor": factor, "flips": flips, "ranges": ranges})
    return rows


def family_spread(cache: dict[str, Any], path: Path, c: Cluster) -> list[dict[str, Any]]:
    """The validated ratios under each DiT family the paper's sizes could be, at one sample per GPU."""
    out = []
    for family, sizes in FAMILIES.items():
        counts = {}
        for model, (hidden, depth, heads) in sizes.items():
            arch = {"hidden_size": hidden, "depth": depth, "num_heads": heads, "patch_size": 2}
            counts[model] = counted(cache, path, model, arch, SCALE_GPUS, "hsdp")
        out.append({"family": family, **validation(counts, c, 1)})
    return out


def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ("adamw", "muon_gather", "muon_owner", "prm_k3_gather", "prm_k3_owner", "muon_bp_p5")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    scale = record["scale"]
    models = list(scale)
    for i, name in enumerate(shown):
        axes[0].bar(
            [j + i * 0.13 for j in range(len(models))],
            [next(r["step_ms"] for r in scale[m]["rows"] if r["optimizer"] == name) for m in models],
            width=0.13,
            label=OPTIMIZERS[name],
        )
    axes[0].set_xticks([j + 0.33 for j in range(len(models))], models)
    axes[0].set_ylabel("predicted step, ms")
    axes[0].set_title(f"32 x 8 H100, HSDP (8 per group), global batch {record['global_batch']}")
    axes[0].legend(fontsize=7)
    colors = {name: f"C{i}" for i, name in enumerate(shown)}
    for ax, model in zip(axes[1:], SWEEP_MODELS):
        for lay, style in zip(SWEEP_LAYOUTS, ("-", "--")):
            sweep = record["sweep"][model][lay]
            gpus = [int(g) for g in sweep]
            for name in shown[1:]:
                over = [
                    100 * next(r["overhead_over_adamw"] for r in sweep[str(g)]["rows"] if r["optimizer"] == name)
                    for g in gpus
                ]
                label = f"{OPTIMIZERS[name]}, {lay.upper()}"
                ax.plot(gpus, over, style, marker="o", markersize=3, color=colors[name], label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_ylim(bottom=0.1)
        ax.set_xlabel("GPUs, 8 per node")
        ax.set_ylabel("step time over AdamW, %")
        ax.set_title(f"{model}, {record['samples_per_gpu']} samples per GPU: HSDP (solid), FSDP (dashed)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6, ncol=2)
    fig.suptitle("Predicted by dimuon's step-time model (not measured): docs/plan.md", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(record: dict[str, Any]) -> str:
    """The study as docs/results/plan/study.md shows it."""
    out = [
        "# Predicted training steps (a model, not a measurement)\n",
        f"Made by `{record['command']}`; the model and its rules: [docs/plan.md](../../plan.md).\n",
        "## Validation: Scaling Muon for DiTs, 32 x 8 H100, 1.3B AdamW's step = 1\n",
    ]
    head = ["per GPU", "model", "AdamW model", "Muon paper", "Muon model", "PRM K=3 paper", "PRM K=3 model",
            "step cut paper", "step cut model", "opt. cut model", "comm cut model"]  # fmt: skip
    rows = []
    for v in record["validation"]:
        for r in v["rows"]:
            rows.append([v["samples_per_gpu"], r["model"], f"{r['adamw_model']:.2f}",
                         f"{r['muon_paper']:.2f}", f"{r['muon_model']:.2f}",
                         f"{r['prm_paper']:.2f}", f"{r['prm_model']:.2f}", f"{100 * r['step_cut_paper']:.1f}%",
                         f"{100 * r['step_cut_model']:.1f}%", f"{100 * r['optimizer_cut_model']:.1f}%",
                         f"{100 * r['comm_cut_model']:.1f}%"])  # fmt: skip
    out.append(format_markdown_table(head, rows))
    out.append("\n## The families the paper's sizes could be (one sample per GPU)\n")
    head = ["family", "1.3B Muon", "4B Muon", "9B Muon", "1.3B PRM", "4B PRM", "9B PRM"]
    rows = []
    for f in record["families"]:
        r = {x["model"]: x for x in f["rows"]}
        sizes = ("DiT-1.3B", "DiT-4B", "DiT-9B")
        rows.append([f["family"], *(f"{r[m]['muon_model']:.2f}" for m in sizes),
                     *(f"{r[m]['prm_model']:.2f}" for m in sizes)])  # fmt: skip
    out.append(format_markdown_table(head, rows))
    bp = record["muonbp"]
    t = bp["throughput_vs_adamw"]
    out.append(
        f"\n## MuonBP's setting (8B, TP 8, {bp['gpus']} GPUs assumed)\n\nThroughput against AdamW: Muon gather "
        f"{t['muon_gather']:.3f}, Muon owner {t['muon_owner']:.3f}, MuonBP P=5 {t['muon_bp_p5']:.3f}; MuonBP over "
        f"Muon: {100 * bp['muonbp_over_muon_gather']:+.1f}% (gather), {100 * bp['muonbp_over_muon_owner']:+.1f}% "
        "(owner). The paper: Muon 5-10% below AdamW, MuonBP +8% over Muon.\n"
    )
    out.append(f"## 32 x 8 H100, HSDP (groups of 8), global batch {record['global_batch']}\n")
    for model, s in record["scale"].items():
        out.append(f"### {model} ({s['params'] / 1e9:.2f}B)\n")
        out.append(format_markdown_table(TABLE_HEAD, table_rows(s["rows"])))
        out.append(f"\nRecommended: {s['recommendation']}.\n")
    out.append(f"## Across 8 to 1024 GPUs, {record['samples_per_gpu']} samples per GPU: step time over AdamW\n")
    names = ("muon_gather", "muon_owner", "prm_k3_gather", "prm_k3_owner", "prm_k4_owner", "muon_bp_p5", "adaptive")
    for model, layouts in record["sweep"].items():
        head = ["GPUs", "layout", "AdamW step ms", *(OPTIMIZERS[n] for n in names), "recommended (owner)"]
        rows, seen = [], set()
        for sweep in layouts.values():
            for g, s in sweep.items():
                if (g, s["layout"]) in seen:  # 8 GPUs: one node, FSDP under either name
                    continue
                seen.add((g, s["layout"]))
                over = {r["optimizer"]: r["overhead_over_adamw"] for r in s["rows"]}
                adamw = next(r["step_ms"] for r in s["rows"] if r["optimizer"] == "adamw")
                words = s["recommendation"].split(":")[0]
                rows.append([g, s["layout"], f"{adamw:.1f}", *(f"{100 * over[n]:+.1f}%" for n in names), words])
        out.append(f"### {model}\n")
        out.append(format_markdown_table(head, rows) + "\n")
    out += host_markdown(record["host_term"])
    out.append("## Sensitivity: each efficiency and bandwidth at 0.7x and 1.3x, at 32 x 8\n")
    rows = [
        [s["knob"], s["factor"],
         "{:+.1f}% to {:+.1f}%".format(*(100 * x for x in s["ranges"]["muon_owner_over_adamw"])),
         "{:.1f}% to {:.1f}%".format(*(100 * x for x in s["ranges"]["prm3_owner_saving"])),
         "; ".join(s["flips"]) or "none"]
        for s in record["sensitivity"]
    ]  # fmt: skip
    head = ["knob", "factor", "Muon (owner) over AdamW", "K=3 saving over Muon (owner)", "conclusions that flip"]
    out.append(format_markdown_table(head, rows))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results/plan"))
    parser.add_argument("--recount", action="store_true", help="count every layout again")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cache_path = args.out / "counts.json"
    cache = {} if args.recount else load_counts(cache_path)
    jobs = [(m, SCALE_GPUS, "hsdp") for m in PAPER_SIZES]
    jobs += [(m, g, layout_for(g, lay)) for m in SWEEP_MODELS for lay in SWEEP_LAYOUTS for g in SWEEP]
    counts: dict[tuple[str, int, str], StepCounts] = {}
    for model, gpus, layout in tqdm(list(dict.fromkeys(jobs)), desc="counting layouts", unit="layout"):
        counts[model, gpus, layout] = counted(cache, cache_path, model, model_arch(model), gpus, layout)
    c = cluster()
    scale_counts = {m: counts[m, SCALE_GPUS, "hsdp"] for m in PAPER_SIZES}
    batch = SAMPLES_PER_GPU * SCALE_GPUS
    record: dict[str, Any] = {
        "benchmark": "plan-study",
        "kind": "prediction (a model of the step, not a measurement)",
        "command": "python scripts/plan_study.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(argv),
        "gpu": dataclasses.asdict(gpu_profile("h100")),
        "efficiency": dataclasses.asdict(Efficiency()),
        "efficiency_sources": EFFICIENCY_SOURCES,
        "image_size": IMAGE,
        "adaptive_rate": ADAPTIVE_RATE,
        "sizes": {m: dict(zip(("hidden_size", "depth", "num_heads"), v)) for m, v in PAPER_SIZES.items()},
        "validation": [validation(scale_counts, c, k) for k in VALIDATION_SAMPLES],
        "families": family_spread(cache, cache_path, c),
        "muonbp": muonbp_case(cache, cache_path, c),
        "global_batch": batch,
        "samples_per_gpu": SAMPLES_PER_GPU,
    }
    record["scale"] = {}
    for model, n in scale_counts.items():
        b = predict(n, batch, c)
        record["scale"][model] = {
            "params": n.params,
            "rows": [summary_row(k, v, b["adamw"]) for k, v in b.items()],
            "recommendation": recommend(b),
        }
    record["sweep"] = {}
    for model in SWEEP_MODELS:
        record["sweep"][model] = {}
        for lay in SWEEP_LAYOUTS:
            record["sweep"][model][lay] = {}
            for gpus in SWEEP:
                b = predict(counts[model, gpus, layout_for(gpus, lay)], SAMPLES_PER_GPU * gpus, c)
                record["sweep"][model][lay][str(gpus)] = {
                    "layout": layout_for(gpus, lay),
                    "rows": [summary_row(k, v, b["adamw"]) for k, v in b.items()],
                    "recommendation": recommend(b),
                }
    record["host_term"] = host_terms(scale_counts, batch)
    record["sensitivity"] = sensitivity(scale_counts, batch)
    write_json_atomic(args.out / "study.json", record)
    write_text_atomic(args.out / "study.md", markdown(record))
    plot(record, args.out / "study.png")
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
