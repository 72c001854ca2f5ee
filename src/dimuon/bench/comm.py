"""``dimuon bench comm``: logical communication, step time and exposed communication of the optimizers.

A registry DiT is sharded with FSDP2 (each block, then the root, on a 1-D mesh) and every
parameter gets a seeded random gradient (the same full tensor on every rank, each rank keeps its
rows). AdamW, Muon (gather and owner refresh), PeriodicRowMuon (K = 2, 3, 4) and MuonBP (P = 5)
then step on it in turns. Per step and rank the benchmark records the wall time of ``opt.step()``
(after a barrier) and the optimizer's own counters: logical bytes and calls per collective kind,
and the seconds the rank sat blocked on each (communication that Newton-Schulz did not hide).
Periodic optimizers are timed over whole periods and reported per step.

Two ways to launch it:

- ``dimuon bench comm`` starts ``--world`` local gloo ranks itself (CPU);
- ``torchrun --nproc-per-node N -m dimuon.cli bench comm --device cuda`` uses the process group
  torchrun describes (NCCL on CUDA, gloo on CPU); rank 0 prints and writes the JSON.

Run ``dimuon bench comm --help`` (or ``python -m dimuon.bench.comm --help``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import tyro
from torch import nn

from dimuon.bench.report import format_table, machine_info
from dimuon.bench.timing import Candidate, interleave
from dimuon.dit.model import DiT, dit_arch
from dimuon.io import write_json_atomic
from dimuon.optim import build, param_groups

CHECK = "all_reduce[check]"  # the 4-byte non-finite-gradient vote of every Muon-family step
BASELINE = "muon_gather"


@dataclass(frozen=True)
class Variant:
    """One benchmarked optimizer: table label, ``build`` name and options, steps per period."""

    label: str
    name: str
    options: dict[str, Any]
    period: int = 1


VARIANTS: dict[str, Variant] = {
    "adamw": Variant("AdamW", "adamw", {}),
    "muon_gather": Variant("Muon (gather)", "muon", {"refresh": "gather"}),
    "muon_owner": Variant("Muon (owner)", "muon", {"refresh": "owner"}),
    "prm_k2": Variant("PeriodicRowMuon K=2", "periodic_row_muon", {"k": 2}, 2),
    "prm_k3": Variant("PeriodicRowMuon K=3", "periodic_row_muon", {"k": 3}, 3),
    "prm_k4": Variant("PeriodicRowMuon K=4", "periodic_row_muon", {"k": 4}, 4),
    "muon_bp_p5": Variant("MuonBP P=5", "muon_bp", {"period": 5}, 5),
}

PAPER = {
    "setting": "Periodic Row-wise Muon vs Muon, DiT 1.3B-15B on 32 H100 nodes",
    "logical_comm_change_k3": -0.667,
    "optimizer_time_change": [-0.469, -0.543],
}

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Config:
    """Logical communication, step time and exposed communication of the optimizers under FSDP2."""

    model: str = "DiT-S/2"
    """Registry name of the DiT (e.g. DiT-S/2, DiT-XL/2)."""
    depth: int | None = None
    """Number of transformer blocks (default: the registry's; fewer for a quick run)."""
    input_size: int = 32
    """Latent side length."""
    in_channels: int = 4
    """Latent channels."""
    num_classes: int = 1000
    """Label-embedding rows (an AdamW parameter)."""
    optimizers: tuple[str, ...] = tuple(VARIANTS)
    """Which optimizers to run, from: adamw muon_gather muon_owner prm_k2 prm_k3 prm_k4 muon_bp_p5."""
    world: int = 4
    """Number of local gloo ranks to start (ignored under torchrun, which sets the world size)."""
    launcher: Literal["auto", "spawn", "torchrun"] = "auto"
    """spawn: start --world local gloo ranks; torchrun: join the process group from the environment;
    auto: torchrun when WORLD_SIZE and RANK are set, else spawn."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device under torchrun (auto: cuda if available); spawned ranks always use the CPU."""
    threads: int | None = None
    """Intra-op threads per rank (default: 1 for spawned ranks, torch's choice under torchrun)."""
    warmup: int = 1
    """Untimed periods per optimizer first (state allocation, first collectives)."""
    repeats: int = 3
    """Timed periods per optimizer (taken round-robin over the optimizers); medians are reported."""
    bucket_mb: float = 16.0
    """Communication bucket size of the Muon-family optimizers."""
    comm_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the communicated momentum/directions (auto: the momentum's dtype)."""
    ns_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Newton-Schulz compute dtype (auto: fp32 on CPU, bf16 on accelerators)."""
    lr: float = 1e-4
    """Learning rate of every optimizer (irrelevant for bytes and time; small so weights stay finite)."""
    seed: int = 0
    """Seed of the model initialization and the random gradients."""
    timeout_s: float = 3600.0
    """A spawned rank still running after this many seconds dumps its stacks and fails the run."""
    out: Path = Path("runs/bench/comm.json")
    """Where the JSON record goes (written atomically)."""
    trace_dir: Path | None = None
    """Also run one untimed period per optimizer under torch.profiler and write a Chrome trace per rank
    here (on GPUs, where host timers cannot see how much communication the streams overlap)."""
    progress: bool = True
    """Show a tqdm progress bar (rank 0) on stderr."""


# ----------------------------------------------------------------------------------------- setup


def check_config(cfg: Config) -> None:
    """One clear error per bad option, before any rank starts."""
    unknown = [n for n in cfg.optimizers if n not in VARIANTS]
    if unknown or not cfg.optimizers:
        raise ValueError(f"--optimizers must name some of {list(VARIANTS)}, got {list(cfg.optimizers)}")
    dit_arch(cfg.model)  # raises on an unknown registry name
    for flag, value, low in (("--world", cfg.world, 1), ("--repeats", cfg.repeats, 1), ("--warmup", cfg.warmup, 0)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if cfg.depth is not None and cfg.depth < 1:
        raise ValueError(f"--depth must be >= 1, got {cfg.depth}")


def build_model(cfg: Config) -> DiT:
    """The registry DiT with the requested overrides (identical on every rank: same seed)."""
    arch = dit_arch(cfg.model)
    if cfg.depth is not None:
        arch["depth"] = cfg.depth
    torch.manual_seed(cfg.seed)
    return DiT(**arch, input_size=cfg.input_size, in_channels=cfg.in_channels, num_classes=cfg.num_classes)


def shard(model: DiT, device: torch.device, world: int) -> DiT:
    """FSDP2 as in training: every transformer block, then the root, on a 1-D mesh of ``world`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    model.to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def seed_gradients(model: nn.Module, seed: int, device: torch.device) -> None:
    """A seeded N(0, 1) gradient on every parameter: the same full tensor on every rank, sharded like it."""
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator(device=device).manual_seed(seed + 1)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype)
        # src_data_rank=None: every rank already holds the full tensor, so no scatter is needed.
        p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)


def make_optimizer(cfg: Config, key: str, model: nn.Module) -> torch.optim.Optimizer:
    """Optimizer ``key`` of :data:`VARIANTS` over ``model``, grouped by ``build``'s defaults."""
    v = VARIANTS[key]
    opts = {**v.options, "lr": cfg.lr}
    if v.name != "adamw":
        opts.update(bucket_mb=cfg.bucket_mb, comm_dtype=DTYPES[cfg.comm_dtype], ns_dtype=DTYPES[cfg.ns_dtype])
    return build(v.name, model, **opts)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_period(opt: torch.optim.Optimizer, period: int, device: torch.device,
                 log: list[dict[str, Any]]) -> Callable[[], None]:
    """One whole period of ``opt``: per step a barrier, then ``step()`` timed, with its comm counters."""

    def run() -> None:
        for _ in range(period):
            _sync(device)
            dist.barrier()
            if hasattr(opt, "reset_comm_stats"):
                opt.reset_comm_stats()
            start = time.perf_counter()
            opt.step()
            _sync(device)
            elapsed = time.perf_counter() - start
            stats = opt.comm_stats() if hasattr(opt, "comm_stats") else {}  # torch's AdamW issues none
            log.append({"time_s": elapsed, "stats": stats})

    return run


def measure(cfg: Config, device: torch.device) -> dict[str, Any]:
    """This rank's part: per optimizer, the time and comm counters of every timed step (warm-up dropped)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard(build_model(cfg), device, world)
    seed_gradients(model, cfg.seed, device)
    # All optimizers step the same model: values do not change the work, and memory stays one model.
    logs: dict[str, list[dict[str, Any]]] = {key: [] for key in cfg.optimizers}
    candidates = []
    for key in cfg.optimizers:
        opt = make_optimizer(cfg, key, model)
        fn = timed_period(opt, VARIANTS[key].period, device, logs[key])
        candidates.append(Candidate(key, fn, repeats=cfg.repeats, warmup=cfg.warmup))
    # interleave gives the round-robin order; its own rank-local times include the barriers and are unused.
    interleave(candidates, progress=cfg.progress and rank == 0, desc=f"comm bench, {world} ranks")
    steps = {key: log[cfg.warmup * VARIANTS[key].period :] for key, log in logs.items()}
    if cfg.trace_dir is not None:
        for c in candidates:
            trace(c, cfg.trace_dir / f"{c.name}-rank{rank}.json", device)
    muon = [p for g in param_groups(model) if g["algorithm"] == "muon" for _, p in g["params"]]
    return {
        "rank": rank,
        "steps": steps,
        "params": sum(p.numel() for p in model.parameters()),
        "muon_params": sum(p.numel() for p in muon),
        "muon_matrices": len(muon),
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
    }


def trace(candidate: Candidate, path: Path, device: torch.device) -> None:
    """One more period of ``candidate`` under ``torch.profiler``, exported as a Chrome trace (not timed)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        candidate.fn()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))


def _spawned_rank(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    """Entry point of a rank started by :func:`run_gloo` (importable, so spawned processes find it)."""
    return measure(cfg, torch.device("cpu"))


# ----------------------------------------------------------------------------------- summarizing


def per_step(per_rank: Sequence[list[dict[str, Any]]], field: str, kinds: Callable[[str], bool]) -> list[float]:
    """Per rank: ``field`` of the collective kinds selected by ``kinds``, summed and averaged over its steps."""
    return [
        sum(v[field] for s in steps for k, v in s["stats"].items() if kinds(k)) / len(steps) for steps in per_rank
    ]


def summarize_variant(key: str, per_rank: Sequence[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per-step averages over whole periods (bytes, calls, exposed time) and median period time."""
    v = VARIANTS[key]
    n = len(per_rank[0])
    if any(len(steps) != n for steps in per_rank) or n % v.period:
        raise RuntimeError(f"{key}: ranks recorded different or partial periods ({[len(s) for s in per_rank]})")
    # Step time: the slowest rank bounds every step; a sample is the mean step of one whole period.
    step_max = [max(steps[i]["time_s"] for steps in per_rank) for i in range(n)]
    samples = [statistics.fmean(step_max[i : i + v.period]) for i in range(0, n, v.period)]

    def mean(field: str, kinds: Callable[[str], bool]) -> float:
        return statistics.fmean(per_step(per_rank, field, kinds))

    optimizer, check = (lambda k: k != CHECK), (lambda k: k == CHECK)
    exposed_r = per_step(per_rank, "exposed_s", optimizer)
    time_r = [sum(s["time_s"] for s in steps) / n for steps in per_rank]
    by_kind = {}
    for kind in sorted({k for steps in per_rank for s in steps for k in s["stats"]} - {CHECK}):
        def this(k: str, kind: str = kind) -> bool:
            return k == kind

        by_kind[kind] = {"bytes_per_step": mean("bytes", this), "calls_per_step": mean("calls", this),
                         "exposed_ms_per_step": 1e3 * mean("exposed_s", this)}
    return {
        "label": v.label,
        "build": {"name": v.name, **v.options},
        "period": v.period,
        "steps_timed": n,
        "bytes_per_step": mean("bytes", optimizer),
        "bytes_per_step_by_rank": per_step(per_rank, "bytes", optimizer),
        "calls_per_step": mean("calls", optimizer),
        "step_ms": 1e3 * statistics.median(samples),
        "step_ms_min": 1e3 * min(samples),
        "step_ms_samples": [1e3 * s for s in samples],
        "exposed_ms_per_step": 1e3 * statistics.fmean(exposed_r),
        # Share of the step this rank sat blocked on the optimizer's collectives (mean over ranks).
        "exposed_share": statistics.fmean(e / t for e, t in zip(exposed_r, time_r)),
        "check": {
            "bytes_per_step": mean("bytes", check),
            "calls_per_step": mean("calls", check),
            "exposed_ms_per_step": 1e3 * mean("exposed_s", check),
        },
        "by_kind": by_kind,
    }


def ideal_ratio(key: str, world: int) -> tuple[float, str]:
    """Logical bytes relative to Muon-gather under ALGORITHMS.md section 7, as a number and a formula."""
    v = VARIANTS[key]
    if v.name == "adamw":
        return 0.0, "0"
    if v.options.get("refresh") == "owner":
        return 2 / world, f"2/W = {2 / world:.3f}"
    if v.name == "periodic_row_muon":
        return 1 / v.period, f"1/{v.period} + all-reduce"
    if v.name == "muon_bp":
        return 1 / v.period, f"1/{v.period}"
    return 1.0, "1"


def summarize(cfg: Config, results: Sequence[dict[str, Any]], launcher: str,
              argv: Sequence[str] | None) -> dict[str, Any]:
    """The JSON record: provenance, model, and per optimizer the numbers and ratios to Muon-gather."""
    world = len(results)
    optimizers = {key: summarize_variant(key, [r["steps"][key] for r in results]) for key in cfg.optimizers}
    base = optimizers.get(BASELINE)
    for key, o in optimizers.items():
        o["ideal_bytes_ratio"], o["ideal_bytes_formula"] = ideal_ratio(key, world)
        o["bytes_ratio_to_gather"] = o["bytes_per_step"] / base["bytes_per_step"] if base and base["bytes_per_step"] else None
        o["time_ratio_to_gather"] = o["step_ms"] / base["step_ms"] if base else None
    arch = dit_arch(cfg.model)
    first = results[0]
    return {
        "benchmark": "comm",
        "machine": machine_info(argv),
        "launcher": launcher,
        "world": world,
        "backend": first["backend"],
        "threads_per_rank": first["threads"],
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "model": {
            "name": cfg.model,
            "depth": cfg.depth if cfg.depth is not None else arch["depth"],
            "hidden_size": arch["hidden_size"],
            "input_size": cfg.input_size,
            "in_channels": cfg.in_channels,
            "params": first["params"],
            "muon_params": first["muon_params"],
            "muon_matrices": first["muon_matrices"],
            "fsdp": "fully_shard per block, then root; 1-D mesh",
        },
        "optimizers": optimizers,
        "paper": PAPER,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(record: dict[str, Any]) -> str:
    """The human-readable report: one row per optimizer, the non-finite check apart, the paper's claims."""
    m, mach = record["model"], record["machine"]
    lines = [
        f"{m['name']} with {m['depth']} blocks: {m['params'] / 1e6:.1f}M parameters, {m['muon_params'] / 1e6:.1f}M "
        f"in {m['muon_matrices']} Muon matrices; FSDP2 over {record['world']} {record['backend']} ranks "
        f"({record['launcher']}), {record['threads_per_rank']} thread(s) per rank; torch {mach['torch']}, "
        f"{mach['cuda'] or mach['cpu_model']} ({mach['logical_cpus']} logical CPUs)",
        "Per rank and step, averaged over whole periods; step time: slowest rank per step, median over periods.",
        "",
    ]
    rows = []
    for o in record["optimizers"].values():
        rows.append([
            o["label"],
            f"{o['bytes_per_step'] / 2**20:.2f}",
            _fmt(o["bytes_ratio_to_gather"], ".3f"),
            o["ideal_bytes_formula"],
            f"{o['calls_per_step']:.2f}",
            f"{o['step_ms']:.1f}",
            _fmt(o["time_ratio_to_gather"], ".3f"),
            f"{o['exposed_ms_per_step']:.1f}",
            f"{100 * o['exposed_share']:.1f}%",
        ])
    lines.append(format_table(
        ["optimizer", "MiB/step", "x gather", "ideal", "calls/step", "step ms", "x gather", "exposed ms",
         "exposed share"],
        rows,
    ))
    checks = [o["check"] for o in record["optimizers"].values() if o["check"]["calls_per_step"]]
    if checks:
        c = checks[0]
        lines.append(
            f"\nNot counted above: the non-finite-gradient check, {c['calls_per_step']:.0f} all-reduce of 4 bytes "
            f"per Muon-family step ({c['bytes_per_step']:.0f} logical bytes), exposed "
            + ", ".join(f"{o['check']['exposed_ms_per_step']:.1f}" for o in record["optimizers"].values()
                        if o["check"]["calls_per_step"])
            + " ms per step (in table order)."
        )
    p = record["paper"]
    lo, hi = (100 * x for x in p["optimizer_time_change"])
    lines += [
        f"Paper ({p['setting']}): logical optimizer communication {100 * p['logical_comm_change_k3']:.1f}% at K=3; "
        f"optimizer time {lo:.1f}% .. {hi:.1f}%.",
        "Ideal logical bytes vs Muon-gather (W ranks): PeriodicRowMuon K -> 1/K plus the small all-reduce of "
        "column norms on RowNorm steps; owner refresh -> 2/W; MuonBP P -> 1/P; AdamW -> 0.",
    ]
    if record["backend"] == "nccl":
        lines.append("Exposed ms is host time blocked in the optimizer's collectives; NCCL's wait() only orders "
                     "CUDA streams, so it understates exposure on GPUs: read the --trace-dir traces instead.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- main


def _torchrun_device(flag: str) -> torch.device:
    if flag == "cuda" or (flag == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def run_torchrun(cfg: Config) -> list[dict[str, Any]] | None:
    """Measure inside the process group torchrun set up; every rank's results on rank 0, None elsewhere."""
    device = _torchrun_device(cfg.device)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    created = not dist.is_initialized()
    if created:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        mine = measure(cfg, device)
        results: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(results, mine)
        return results if dist.get_rank() == 0 else None
    finally:
        if created:
            dist.destroy_process_group()


def resolve_launcher(cfg: Config) -> str:
    """``spawn`` or ``torchrun`` (auto: torchrun when its environment variables are set)."""
    launcher = cfg.launcher
    if launcher == "auto":
        launcher = "torchrun" if "WORLD_SIZE" in os.environ and "RANK" in os.environ else "spawn"
    if launcher == "spawn" and cfg.device == "cuda":
        raise ValueError("--device cuda needs torchrun: spawned ranks run gloo on the CPU")
    return launcher


def run(cfg: Config, argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Run the benchmark; returns the JSON record (also written to ``cfg.out``), None on ranks other than 0."""
    check_config(cfg)
    launcher = resolve_launcher(cfg)
    if launcher == "torchrun":
        results = run_torchrun(cfg)
        if results is None:
            return None
    else:
        from dimuon.optim.distributed.launch import run_gloo

        results = run_gloo(_spawned_rank, cfg.world, cfg, threads=cfg.threads or 1, timeout_s=cfg.timeout_s)
    record = summarize(cfg, results, launcher, argv)
    write_json_atomic(cfg.out, record)
    return record


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dimuon bench comm`` and ``python -m dimuon.bench.comm``."""
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = tyro.cli(Config, args=args, prog="dimuon bench comm")
    try:
        check_config(cfg)
        resolve_launcher(cfg)
    except ValueError as err:
        print(f"dimuon bench comm: {err}", file=sys.stderr)
        return 2
    record = run(cfg, args)
    if record is not None:
        print(render(record))
        print(f"\nwrote {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
