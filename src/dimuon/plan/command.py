"""``dimuon plan``: a training step of your DiT on your cluster, predicted for every optimizer from the census.

The step is counted at its real shapes on torch's fake process group (:mod:`dimuon.plan.counts`) and turned into
seconds by the model of :mod:`dimuon.plan.step_time` on a GPU profile (:mod:`dimuon.plan.hardware`). These are
predictions, not measurements: docs/plan.md holds the rules, the validation against published measurements, and
how far each conclusion moves when an efficiency does. Run ``dimuon plan --help``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dimuon.bench.report import format_table, machine_info, parse_bench_flags, parse_or_none
from dimuon.dit.model import dit_arch
from dimuon.dit.parallel import Parallelism
from dimuon.io import write_json_atomic
from dimuon.plan.counts import StepCounts, count_step
from dimuon.plan.hardware import Efficiency, calibrate, gpu_profile
from dimuon.plan.host import PUBLISHED_HOST, HostModel, host_model, load_host_record
from dimuon.plan.step_time import Breakdown, Cluster, step_breakdowns, summary_row

PROG = "dimuon plan"
ADAPTIVE_RATE = 0.346
"""AdaptiveRowMuon's measured refresh rate at threshold 0.35 (docs/results/bench-quality-adaptive-frontier.json)."""

# Standard DiT scaling for the sizes the papers train (hidden = 64 x depth, 64-wide heads, as SD3's MMDiT scales):
# 18 D^2 parameters per block (attention 4, MLP 8, adaLN 6).
PAPER_SIZES: dict[str, tuple[int, int, int]] = {
    # name: (hidden_size, depth, num_heads)
    "DiT-1.3B": (1664, 26, 26),
    "DiT-4B": (2432, 38, 38),
    "DiT-9B": (3200, 50, 50),
    "DiT-15B": (3776, 59, 59),
}


def model_arch(model: str, patch_size: int = 2) -> dict[str, int]:
    """A registry DiT (``DiT-XL/2``) or one of the paper-scale sizes (``DiT-1.3B`` ... ``DiT-15B``, patch 2)."""
    if model in PAPER_SIZES:
        hidden, depth, heads = PAPER_SIZES[model]
        return {"hidden_size": hidden, "depth": depth, "num_heads": heads, "patch_size": patch_size}
    try:
        return dit_arch(model)
    except ValueError as err:
        raise ValueError(f"--model: {err}; or one of {sorted(PAPER_SIZES)}") from None


@dataclass
class Config:
    """Predict one training step of a DiT on a GPU cluster for every optimizer (a model: predictions)."""

    model: str = "DiT-1.3B"
    """A registry DiT (DiT-XL/2 ...) or a paper-scale size: DiT-1.3B, DiT-4B, DiT-9B, DiT-15B."""
    diffusers: str | None = None
    """Instead of --model: a diffusers transformer class, e.g. FluxTransformer2DModel (--config-file, --config);
    FSDP2 goes over its block lists, and its forward FLOPs are estimated (2 per matrix weight per token)."""
    builder: str | None = None
    """Instead of --model: module:callable returning an nn.Module (--config entries are its keyword arguments)."""
    config_file: Path | None = None
    """With --diffusers or --builder: a JSON file of constructor arguments (a diffusers config.json as it is)."""
    config: tuple[str, ...] = ()
    """With --diffusers or --builder: constructor arguments as key=value [key=value ...]."""
    tokens: int | None = None
    """Tokens per sample (default: (image_size / 16)^2, a VAE of 8 and patches of 2)."""
    hidden_size: int | None = None
    """Override the model's hidden size (with --depth and --heads: your own DiT's shape)."""
    depth: int | None = None
    """Override the model's number of blocks."""
    heads: int | None = None
    """Override the model's attention heads."""
    gpus: int = 256
    """GPUs in all (the world size)."""
    gpus_per_node: int = 8
    """GPUs per node, joined by NVLink."""
    gpu: Literal["h100", "h200", "b200", "a100"] = "h100"
    """GPU profile: peaks from the vendor's datasheet (docs/plan.md, "GPU profiles")."""
    layout: Literal["fsdp", "hsdp", "fsdp_tp", "hsdp_tp", "tp", "replicated"] = "fsdp"
    """fsdp: FSDP2 over every GPU; hsdp: replicas of FSDP groups (--dp-shard per group); fsdp_tp: FSDP over
    tensor parallelism (--tp); hsdp_tp: replicas of FSDP x TP groups (--dp-shard x --tp, a 3-D mesh); tp: tensor
    parallelism over every GPU; replicated: DDP (with --gpus 1, one GPU)."""
    dp_shard: int | None = None
    """FSDP group size for hsdp (default: GPUs per node) and hsdp_tp (default: 8)."""
    tp: int | None = None
    """Tensor-parallel degree for fsdp_tp and hsdp_tp (default: GPUs per node)."""
    global_batch: int = 256
    """Samples per optimizer step, over all GPUs."""
    image_size: int = 512
    """Image side in pixels; the latent is image_size / 8 (an SD-style VAE) and tokens are (latent / patch)^2."""
    bucket_mb: float = 16.0
    """The refresh's communication bucket size, MiB."""
    calibrate: Path | None = None
    """A scripts/gpu-check record (or a GPU optimizer-benchmark record): its Newton-Schulz TFLOP/s and fused AdamW
    GB/s replace the default efficiencies, and the host term is fitted from its host part where it has one."""
    host: Literal["ops", "published", "measure"] = "ops"
    """The host term of the optimizer step: ops (counted ops x host_op_us); published (per step kind a constant, a
    cost per Muon matrix and one per op, fitted from the published per-matrix dimuon bench host record,
    docs/results/host/baseline/); measure (the same fit from dimuon bench host run now on this machine, eager,
    about 30 s)."""
    json: Path | None = None
    """Write the prediction (inputs, counts, every optimizer's breakdown) to this JSON file."""


def check_config(cfg: Config) -> None:
    """One clear error per bad option, before anything is counted."""
    for flag, value in (
        ("--gpus", cfg.gpus),
        ("--gpus-per-node", cfg.gpus_per_node),
        ("--global-batch", cfg.global_batch),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if cfg.gpus > 1024:
        raise ValueError(f"--gpus must be <= 1024 (what the counting is checked at), got {cfg.gpus}")
    if cfg.image_size < 8 or cfg.image_size % 8:
        raise ValueError(
            f"--image-size must be a positive multiple of 8 (the latent is image_size / 8), got {cfg.image_size}"
        )
    for flag, value in (("--hidden-size", cfg.hidden_size), ("--depth", cfg.depth), ("--heads", cfg.heads)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if cfg.tokens is not None and cfg.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {cfg.tokens}")
    if not cfg.bucket_mb > 0:
        raise ValueError(f"--bucket-mb must be > 0, got {cfg.bucket_mb}")
    if cfg.calibrate is not None and not cfg.calibrate.is_file():
        raise ValueError(f"--calibrate {cfg.calibrate}: no such file")
    arch = None if cfg.diffusers or cfg.builder else check_dit(cfg)
    if arch is None:
        check_other_model(cfg)
    par = degrees(cfg)
    if par is not None and arch is not None:
        try:
            par.check_model(arch["hidden_size"], arch["num_heads"], 4 * arch["hidden_size"])
        except ValueError as err:  # the training flag's name, as this command spells it
            raise ValueError(str(err).replace("--parallel.tp", "--tp")) from None
    if cfg.global_batch % data_parallel(cfg, par):
        raise ValueError(
            f"--global-batch ({cfg.global_batch}) must be a multiple of the data-parallel degree "
            f"{data_parallel(cfg, par)}"
        )


def check_dit(cfg: Config) -> dict[str, int]:
    """dimuon's DiT: no other model's flag, a shape whose heads divide its width, a latent its patch divides."""
    if cfg.config or cfg.config_file or cfg.tokens is not None:
        raise ValueError(
            "--config, --config-file and --tokens go with --diffusers or --builder; dimuon's DiT takes --hidden-size, "
            "--depth and --heads, and its tokens follow from --image-size and its patch"
        )
    arch = resolved_arch(cfg)
    if arch["hidden_size"] % arch["num_heads"]:
        raise ValueError(f"--heads ({arch['num_heads']}) must divide --hidden-size ({arch['hidden_size']})")
    if (cfg.image_size // 8) % arch["patch_size"]:
        raise ValueError(f"--image-size / 8 must be a multiple of the patch size {arch['patch_size']}")
    return arch


def _groups_config(cfg: Config) -> Any:
    from dimuon.groups import GroupsConfig

    return GroupsConfig(diffusers=cfg.diffusers, builder=cfg.builder, config_file=cfg.config_file, config=cfg.config)


def check_other_model(cfg: Config) -> None:
    """A --diffusers or --builder model: one source, no DiT-only flag, a layout FSDP2 can take (whether it builds
    is the first thing the counting finds: it builds the model before anything else)."""
    if cfg.diffusers and cfg.builder:
        raise ValueError("give one of --diffusers and --builder, not both")
    for flag, value in (("--hidden-size", cfg.hidden_size), ("--depth", cfg.depth), ("--heads", cfg.heads)):
        if value is not None:
            raise ValueError(f"{flag} shapes dimuon's DiT; with --diffusers or --builder use --config")
    if cfg.layout in ("tp", "fsdp_tp", "hsdp_tp"):
        raise ValueError(
            f"--layout {cfg.layout} needs the model's tensor-parallel plan, which only dimuon's DiT has here: "
            "use fsdp, hsdp or replicated"
        )


def model_source(cfg: Config) -> tuple[str, dict[str, int], Any]:
    """What the flags name: its words, the DiT shape (or a stub for another model) and a builder (None: DiT)."""
    if cfg.diffusers or cfg.builder:
        from dimuon.groups import build_model

        groups = _groups_config(cfg)
        words = f"diffusers {cfg.diffusers}" if cfg.diffusers else cfg.builder
        return words, {"patch_size": 2}, lambda: build_model(groups)[0]
    return cfg.model, resolved_arch(cfg), None


def resolved_arch(cfg: Config) -> dict[str, int]:
    arch = model_arch(cfg.model)
    for key, value in (("hidden_size", cfg.hidden_size), ("depth", cfg.depth), ("num_heads", cfg.heads)):
        if value is not None:
            arch[key] = value
    return arch


def degrees(cfg: Config) -> Parallelism | None:
    """The layout's degrees on ``--gpus`` (None: replicated); a ValueError names the flag."""
    w, node = cfg.gpus, cfg.gpus_per_node
    if cfg.layout == "replicated":
        return None
    if w == 1:
        raise ValueError(
            f"--layout {cfg.layout} shards over 2 GPUs or more (--gpus 1); one GPU's step is --layout replicated"
        )
    if cfg.layout == "fsdp":
        return Parallelism(1, w, 1).resolve(w)
    if cfg.layout == "tp":
        return Parallelism(1, 1, w).resolve(w)
    if cfg.layout == "hsdp":
        shard = cfg.dp_shard or min(node, w)
        if w % shard or w == shard:
            raise ValueError(f"--layout hsdp needs --dp-shard ({shard}) to divide --gpus ({w}) with 2 replicas or more")
        return Parallelism(w // shard, shard, 1).resolve(w)
    tp = cfg.tp or min(node, w)
    if cfg.layout == "hsdp_tp":
        shard = cfg.dp_shard or 8
        if w % (shard * tp) or w < 2 * shard * tp:
            raise ValueError(
                f"--layout hsdp_tp needs --dp-shard ({shard}) x --tp ({tp}) to divide --gpus ({w}) with 2 replicas "
                "or more"
            )
        return Parallelism(w // (shard * tp), shard, tp).resolve(w)
    if w % tp or w == tp:
        raise ValueError(f"--layout fsdp_tp needs --tp ({tp}) to divide --gpus ({w}) with 2 FSDP ranks or more")
    return Parallelism(1, w // tp, tp).resolve(w)


def data_parallel(cfg: Config, par: Parallelism | None) -> int:
    return cfg.gpus if par is None else par.dp_replicate * par.dp_shard


def predict(cfg: Config, counts: StepCounts | None = None, eff: Efficiency | None = None) -> dict[str, Any]:
    """Count (unless ``counts`` is given) and predict: the record ``--json`` writes."""
    words, arch, builder = model_source(cfg)
    par = degrees(cfg)
    gpu = gpu_profile(cfg.gpu)
    eff = (eff or Efficiency()).checked()
    calibration = None
    if cfg.calibrate is not None:
        eff, calibration = calibrate(eff, gpu, cfg.calibrate)
    host, host_note = host_term(cfg)
    start = time.perf_counter()
    if counts is None:
        counts = count_step(
            arch,
            cfg.gpus,
            par,
            cfg.image_size // 8,
            bucket_mb=cfg.bucket_mb,
            builder=builder,
            tokens_per_sample=(cfg.tokens or (cfg.image_size // 16) ** 2) if builder is not None else None,
        )
    count_s = time.perf_counter() - start
    cluster = Cluster(gpu, cfg.gpus_per_node, eff, host)
    breakdowns = step_breakdowns(counts, cluster, cfg.global_batch, adaptive_rate=ADAPTIVE_RATE)
    rows = [summary_row(name, b, breakdowns["adamw"]) for name, b in breakdowns.items()]
    return {
        "benchmark": "plan",
        "kind": "prediction (a model of the step, not a measurement)",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "model": words,
        "arch": arch if builder is None else None,
        "forward_flops_per_sample": counts.forward_flops_per_sample,
        "forward_flops": "counted (torch's FlopCounterMode)"
        if counts.forward_flops_counted
        else "estimated: 2 per hidden-matrix weight per token, attention left out",
        "params": counts.params,
        "muon_params": counts.muon_params,
        "mesh": [list(d) for d in counts.dims],
        "tokens_per_sample": counts.tokens_per_sample,
        "gpu": asdict(gpu),
        "efficiency": asdict(eff),
        "calibration": calibration,
        "host_term": host.as_dict() if host is not None else {"source": host_note},
        "muon_matrices": counts.muon_matrices,
        "adaptive_rate": ADAPTIVE_RATE,
        "rows": rows,
        "recommendation": recommend(breakdowns),
        "refused": counts.refused,
        "count_s": count_s,
    }


def host_term(cfg: Config) -> tuple[HostModel | None, str]:
    """The host term --host and --calibrate ask for: a fitted :class:`HostModel` (from the --calibrate record's
    host part where it has one), or None for ops x host_op_us; and a line saying where it came from."""
    if cfg.calibrate is not None:
        try:
            record = load_host_record(cfg.calibrate)
        except ValueError:
            record = None  # a record without a host part calibrates the efficiencies only
        if record is not None:
            return host_model(record, str(cfg.calibrate)), f"fitted from {cfg.calibrate}'s host part"
    if cfg.host == "published":
        return PUBLISHED_HOST, f"fitted from {PUBLISHED_HOST.source}"
    if cfg.host == "measure":
        from dimuon.bench import host as host_bench

        bench = host_bench.Config(
            baselines=("adamw_fused",), compile_modes=(), sharded_world=(), repeats=5, progress=False
        )
        return host_model(host_bench.run(bench), "dimuon bench host on this machine"), "measured on this machine"
    return None, "counted ops x host_op_us"


def recommend(b: dict[str, Breakdown]) -> str:
    """Which K of PeriodicRowMuon is worth it with the owner refresh. K=4 is not recommended at any speed: it costs
    quality (the paper's K study: best FD-DINO +8.2% against K=2's +2.8%; here +0.44% loss over K=3). K=3 where it
    saves 1% of Muon's step or more and K=2 does not come within 1% of it; K=2 where it does; Muon where no K
    saves 1%."""
    muon = b["muon_owner"].step_s
    steps = {k: b[f"prm_k{k}_owner"].step_s for k in (2, 3, 4)}
    saving = {k: 1 - s / muon for k, s in steps.items()}
    over = 100 * (muon / b["adamw"].step_s - 1)
    if saving[3] < 0.01:
        return (
            f"Muon (owner refresh): it costs {over:+.1f}% over AdamW here and periodic refresh saves under 1% of "
            f"the step (K=3: {100 * saving[3]:.1f}%)"
        )
    best = 2 if steps[2] <= 1.01 * steps[3] else 3
    return (
        f"PeriodicRowMuon K={best} (owner refresh): {100 * saving[best]:.1f}% faster steps than Muon "
        f"(K=2 {100 * saving[2]:.1f}%, K=3 {100 * saving[3]:.1f}%; K=4 would add {100 * (saving[4] - saving[3]):.1f}% "
        f"at a quality cost), {100 * (steps[best] / b['adamw'].step_s - 1):+.1f}% over AdamW"
    )


TABLE_HEAD = ["optimizer", "step ms", "optimizer ms", "exposed comm ms", "over AdamW"]


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Each optimizer's :func:`summary_row` as a table row under :data:`TABLE_HEAD`."""
    return [
        [r["label"], f"{r['step_ms']:.1f}", f"{r['optimizer_ms']:.1f}", f"{r['exposed_comm_ms']:.1f}",
         f"{100 * r['overhead_over_adamw']:+.1f}%"]
        for r in rows
    ]  # fmt: skip


def render(record: dict[str, Any]) -> str:
    head, rows = TABLE_HEAD, table_rows(record["rows"])
    c = record["config"]
    mesh = " x ".join(f"{n} {s}" for n, s in record["mesh"]) or "replicated"
    title = (
        f"{record['model']} ({record['params'] / 1e9:.2f}B parameters), {c['gpus']} x {record['gpu']['name']} "
        f"({c['gpus_per_node']} per node), {mesh}, global batch {c['global_batch']}, "
        f"{record['tokens_per_sample']} tokens per sample. Predicted, not measured."
    )
    refused = "".join(f"\nnot shown ({kind} refuses this layout): {why}" for kind, why in record["refused"].items())
    cal = record.get("calibration")
    note = f"\ncalibrated from {cal['record']}: {cal['replaced']}" if cal else ""
    note += f"\nhost term: {record['host_term']['source']}"
    table = format_table(head, rows)
    if not record["forward_flops"].startswith("counted"):
        refused += f"\nforward and backward FLOPs {record['forward_flops']}"
    return f"{title}\n\n{table}\n\nrecommendation: {record['recommendation']}{refused}{note}"


def parse(argv: Sequence[str]) -> Config:
    """The flags parsed and checked, nothing counted: SystemExit(2) for a flag the parser refuses, ValueError for
    a value the check refuses."""
    return parse_bench_flags(Config, argv, PROG, check_config)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dimuon plan`` and ``python -m dimuon.plan.command``."""
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_or_none(parse, args, PROG)
    if cfg is None:
        return 2
    try:
        record = predict(cfg)
    except ValueError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    record["machine"] = machine_info(args)
    print(render(record))
    if cfg.json is not None:
        write_json_atomic(cfg.json, record)
        print(f"\nwrote {cfg.json}")
    return 0


__all__ = [
    "PAPER_SIZES",
    "TABLE_HEAD",
    "Config",
    "degrees",
    "main",
    "model_arch",
    "parse",
    "predict",
    "recommend",
    "render",
    "table_rows",
]

if __name__ == "__main__":
    sys.exit(main())
