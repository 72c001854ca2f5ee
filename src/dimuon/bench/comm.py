"""``dimuon bench comm``: logical communication, step time and exposed communication of the optimizers.

A registry DiT is laid out on the ``--mesh`` (FSDP2 on a 1-D mesh by default; HSDP, tensor parallel or
FSDP over tensor parallel with :mod:`dimuon.dit.parallel`, as ``dimuon train`` does) and every
parameter gets a seeded random gradient (the same full tensor on every rank, each rank keeps its
piece). AdamW, Muon (gather and owner refresh), PeriodicRowMuon (K = 2, 3, 4) and MuonBP (P = 5),
and the peers (other installable Muon packages, :mod:`dimuon.bench.peers`, built over the same
sharded matrices) then step on it in turns, each step from the same gradients. Per step and rank
the benchmark records the wall time of ``opt.step()`` (after a barrier), the calls and logical bytes
per collective kind counted at the ``torch.distributed`` call boundary (the same count for dimuon
and the peers), and dimuon's own counters, which add the seconds the rank sat blocked on each kind
(communication that Newton-Schulz did not hide). Periodic optimizers are timed over whole periods
and reported per step. A peer that cannot run here gets a row saying why.

Two ways to launch it:

- ``dimuon bench comm`` starts ``--world`` local gloo ranks itself (CPU);
- ``torchrun --nproc-per-node N -m dimuon.cli bench comm --device cuda`` uses the process group
  torchrun describes (NCCL on CUDA, gloo on CPU); rank 0 prints and writes the JSON.

Bytes and time are also reported per mesh dimension (the optimizer's own counters,
``comm_stats(by_mesh_dim=True)``). On meshes with replicas the HSDP refresh is measured both ways
(``replica_refresh`` repeat and split).

Run ``dimuon bench comm --help`` (or ``python -m dimuon.bench.comm --help``).
"""

from __future__ import annotations

import math
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

import dimuon
from dimuon.bench.peers import (
    PEERS,
    CallCounter,
    GradientSnapshot,
    PeerStatus,
    bf16_note,
    check_names,
    count_collectives,
    fold_kinds,
    muon_and_rest,
    start_peer,
)
from dimuon.bench.report import format_table, machine_info
from dimuon.bench.timing import Candidate, interleave, synchronizer
from dimuon.bench.variants import Variant, check_lr
from dimuon.dit.model import DiT, dit_arch
from dimuon.dit.parallel import Parallelism, apply_parallelism, build_mesh, tp_process_group
from dimuon.io import write_json_atomic
from dimuon.optim import DEFAULT_BUCKET_MB, build, linalg, param_groups
from dimuon.optim.distributed.layout import is_dtensor

CHECK = "all_reduce[check]"  # the 4-byte non-finite-gradient vote of every Muon-family step
BASELINE = "muon_gather"


VARIANTS: dict[str, Variant] = {
    "adamw": Variant("AdamW", "adamw", {}),
    "muon_gather": Variant("Muon (gather)", "muon", {"refresh": "gather"}),
    "muon_owner": Variant("Muon (owner)", "muon", {"refresh": "owner"}),
    # Refreshed as Muon (gather) is, the basis of every ratio: K -> 1/K, P -> 1/P of its bytes.
    "prm_k2": Variant("PeriodicRowMuon K=2", "periodic_row_muon", {"k": 2, "refresh": "gather"}, period=2),
    "prm_k3": Variant("PeriodicRowMuon K=3", "periodic_row_muon", {"k": 3, "refresh": "gather"}, period=3),
    "prm_k4": Variant("PeriodicRowMuon K=4", "periodic_row_muon", {"k": 4, "refresh": "gather"}, period=4),
    "muon_bp_p5": Variant("MuonBP P=5", "muon_bp", {"period": 5, "refresh": "gather"}, period=5),
    "muon_gather_split": Variant(
        "Muon (gather, replicas split)", "muon", {"refresh": "gather", "replica_refresh": "split"}
    ),
    "muon_owner_split": Variant(
        "Muon (owner, replicas split)", "muon", {"refresh": "owner", "replica_refresh": "split"}
    ),
}
# Rows that differ from their "repeat" twin only on meshes with a replicate dimension.
REPLICA_VARIANTS = ("muon_gather_split", "muon_owner_split")

MESH_PATTERNS = {  # --mesh spelling -> degrees (dp_replicate, dp_shard, tp); -1: the rest of the world
    r"fsdp": lambda: (1, -1, 1),
    r"fsdp(\d+)": lambda s: (1, int(s), 1),
    r"hsdp(\d+)x(\d+)": lambda r, s: (int(r), int(s), 1),
    r"tp(\d+)": lambda t: (1, 1, int(t)),
    r"fsdp(\d+)xtp(\d+)": lambda s, t: (1, int(s), int(t)),
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
    mesh: str = "fsdp"
    """Device mesh: fsdp (FSDP2 over all ranks), fsdpS, hsdpRxS (R replicas of S shards), tpT (tensor
    parallel), fsdpSxtpT (FSDP over tensor parallel); the degrees multiply to the world size."""
    depth: int | None = None
    """Number of transformer blocks (default: the registry's; fewer for a quick run)."""
    num_heads: int | None = None
    """Attention heads (default: the registry's). The matrices keep their shapes; tensor parallelism needs
    a head count the tp degree divides (DiT-S/2's 6 heads and --mesh tp4: --num-heads 8)."""
    input_size: int = 32
    """Latent side length."""
    in_channels: int = 4
    """Latent channels."""
    num_classes: int = 1000
    """Label-embedding rows (an AdamW parameter)."""
    optimizers: tuple[str, ...] = tuple(VARIANTS)
    """Which optimizers to run, from: adamw muon_gather muon_owner prm_k2 prm_k3 prm_k4 muon_bp_p5
    muon_gather_split muon_owner_split (the last two only on meshes with replicas)."""
    peers: tuple[str, ...] = tuple(PEERS)
    """Peers to run beside them, from: torch_muon muon_fsdp2 dtensor_muon heavyball (default: all; one
    that is not installed or cannot run here gets a row saying why)."""
    no_peers: bool = False
    """Leave every peer out."""
    world: int = 4
    """Number of local gloo ranks to start, 2 or more (ignored under torchrun, which sets the world size)."""
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
    bucket_mb: float = DEFAULT_BUCKET_MB
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
    """A spawned rank still running after this many seconds dumps its stacks and fails the run (0: no limit)."""
    out: Path = Path("runs/bench/comm.json")
    """Where the JSON record goes (written atomically)."""
    trace_dir: Path | None = None
    """Also run one untimed period per optimizer under torch.profiler and write a Chrome trace per rank
    here (on GPUs, where host timers cannot see how much communication the streams overlap)."""
    progress: bool = True
    """Show a tqdm progress bar (rank 0) on stderr."""


# ----------------------------------------------------------------------------------------- setup


def parse_mesh(spec: str, world: int) -> Parallelism:
    """The degrees ``--mesh`` names, resolved for ``world`` ranks; a ValueError names --mesh."""
    import re

    for pattern, degrees in MESH_PATTERNS.items():
        found = re.fullmatch(pattern, spec)
        if found:
            try:
                return Parallelism(*degrees(*found.groups())).resolve(world)
            except ValueError as err:
                raise ValueError(f"--mesh {spec} on {world} ranks: {err}") from None
    raise ValueError(
        f"--mesh must be fsdp, fsdpS, hsdpRxS, tpT or fsdpSxtpT (e.g. hsdp2x2, tp4, fsdp2xtp2), got {spec!r}"
    )


def world_size(cfg: Config) -> int:
    """The ranks the benchmark will run on: torchrun's world, or --world spawned ranks."""
    if resolve_launcher(cfg) == "torchrun":
        return int(os.environ.get("WORLD_SIZE", cfg.world))
    return cfg.world


def selected_optimizers(cfg: Config, par: Parallelism) -> list[str]:
    """--optimizers, less the replica-split rows on meshes without replicas (they equal their twins there)."""
    return [k for k in cfg.optimizers if k not in REPLICA_VARIANTS or par.dp_replicate > 1]


def check_config(cfg: Config) -> None:
    """One clear error per bad option, before any rank starts."""
    unknown = [n for n in cfg.optimizers if n not in VARIANTS]
    if unknown or not cfg.optimizers:
        raise ValueError(f"--optimizers must name some of {list(VARIANTS)}, got {list(cfg.optimizers)}")
    check_names(cfg.peers)
    world = world_size(cfg)
    if world < 2:  # one rank communicates nothing: every ratio to Muon-gather's bytes would be 0 / 0
        raise ValueError(
            f"--world must be >= 2 (ranks that communicate), got {world}"
            + (" (torchrun's world size)" if resolve_launcher(cfg) == "torchrun" else "")
        )
    for flag, value, low in (
        ("--repeats", cfg.repeats, 1),
        ("--warmup", cfg.warmup, 0),
        *(
            (f"--{k.replace('_', '-')}", v, 1)
            for k, v in (("num_heads", cfg.num_heads), ("depth", cfg.depth))
            if v is not None
        ),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if cfg.threads is not None and cfg.threads < 1:
        raise ValueError(f"--threads must be >= 1 (or left out: 1 per spawned rank), got {cfg.threads}")
    check_lr(cfg.lr)
    if not (math.isfinite(cfg.bucket_mb) and cfg.bucket_mb > 0):
        raise ValueError(f"--bucket-mb must be a positive number of MiB, got {cfg.bucket_mb}")
    if not (cfg.timeout_s >= 0):  # NaN too
        raise ValueError(f"--timeout-s must be >= 0 seconds (0: no limit), got {cfg.timeout_s}")
    arch = build_arch(cfg)  # raises on an unknown registry name
    if arch["hidden_size"] % arch["num_heads"]:
        raise ValueError(f"--num-heads {arch['num_heads']} must divide the hidden size {arch['hidden_size']}")
    par = parse_mesh(cfg.mesh, world)
    try:
        par.check_model(arch["hidden_size"], arch["num_heads"], int(arch["hidden_size"] * 4.0))
    except ValueError as err:
        raise ValueError(f"--mesh {cfg.mesh}: {err}") from None


def build_arch(cfg: Config) -> dict[str, int]:
    """The registry architecture with --depth and --num-heads applied."""
    arch = dit_arch(cfg.model)
    for key in ("depth", "num_heads"):
        if getattr(cfg, key) is not None:
            arch[key] = getattr(cfg, key)
    return arch


def build_model(cfg: Config) -> DiT:
    """The registry DiT with the requested overrides (identical on every rank: same seed)."""
    arch = build_arch(cfg)
    torch.manual_seed(cfg.seed)
    return DiT(**arch, input_size=cfg.input_size, in_channels=cfg.in_channels, num_classes=cfg.num_classes)


def shard(model: DiT, device: torch.device, par: Parallelism) -> tuple[DiT, Any]:
    """Lay the model out as training does (tensor parallel plan, then FSDP2 per block and root); the mesh."""
    mesh = build_mesh(par, device.type)
    model.to(device)
    return apply_parallelism(model, par, mesh), mesh


def seed_gradients(model: nn.Module, seed: int, device: torch.device) -> None:
    """A seeded N(0, 1) gradient on every parameter: the same full tensor on every rank, cut like the parameter."""
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator(device=device).manual_seed(seed + 1)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype)
        # src_data_rank=None: every rank already holds the full tensor, so no scatter is needed.
        p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None) if is_dtensor(p) else full


def make_optimizer(cfg: Config, key: str, model: nn.Module, process_group: Any = None) -> torch.optim.Optimizer:
    """Optimizer ``key`` of :data:`VARIANTS` over ``model``, grouped by ``build``'s defaults (``process_group``:
    the group that shares the plain parameters outside a tensor-parallel plan)."""
    v = VARIANTS[key]
    opts = {**v.options, "lr": cfg.lr}
    if v.name != "adamw":
        opts.update(
            bucket_mb=cfg.bucket_mb,
            comm_dtype=DTYPES[cfg.comm_dtype],
            ns_dtype=DTYPES[cfg.ns_dtype],
            process_group=process_group,
        )
    return build(v.name, model, **opts)


def timed_period(
    opt: Any,
    period: int,
    device: torch.device,
    log: list[dict[str, Any]],
    snapshot: GradientSnapshot,
    counter: CallCounter,
    own: bool = True,
) -> Callable[[], None]:
    """One whole period of ``opt``: per step the saved gradients back and a barrier, then ``step()`` timed,
    with the call-boundary count (``counter``) and, if ``own``, the optimizer's own counters (None else)."""

    sync = synchronizer(device)

    def run() -> None:
        for _ in range(period):
            snapshot.restore()
            sync()
            dist.barrier()
            if hasattr(opt, "reset_comm_stats"):
                opt.reset_comm_stats()
            counter.reset()
            start = time.perf_counter()
            opt.step()
            sync()
            elapsed = time.perf_counter() - start
            boundary = counter.stats()
            stats = by_dim = None
            if own:  # dimuon's own counters; torch's AdamW issues none
                stats = opt.comm_stats() if hasattr(opt, "comm_stats") else {}
                by_dim = opt.comm_stats(by_mesh_dim=True) if hasattr(opt, "comm_stats") else {}
            log.append({"time_s": elapsed, "stats": stats, "by_dim": by_dim, "boundary": boundary})

    return run


def peer_optimizers(
    cfg: Config, model: nn.Module, device: torch.device, snapshot: GradientSnapshot, par: Parallelism
) -> tuple[dict[str, Any], dict[str, PeerStatus]]:
    """The peers that run here (after one untimed first step on every rank), and every named peer's status.

    The ranks agree: a peer whose first step failed on any rank is left out on all of them. On HSDP and
    tensor-parallel meshes every peer is tried too: one that refuses the layout, or that the registry knows
    would compute a different update on it, gets a row saying why.
    """
    names = [] if cfg.no_peers else list(cfg.peers)
    muon, rest = muon_and_rest(model)
    opts: dict[str, Any] = {}
    statuses: dict[str, PeerStatus] = {}
    setting = "tp" if par.tp > 1 else "hsdp" if par.dp_replicate > 1 else "fsdp2"
    for name in names:
        opt, status, error = start_peer(name, muon, rest, cfg.lr, snapshot, device, setting)
        if opt is not None:
            opts[name] = opt
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)
        if error is not None:
            opts.pop(name, None)
            status = status.failed(error)
        statuses[name] = status
    return opts, statuses


def measure(cfg: Config, device: torch.device) -> dict[str, Any]:
    """This rank's part: per optimizer and peer, the time and comm counts of every timed step (warm-up
    dropped), and every peer's status."""
    rank, world = dist.get_rank(), dist.get_world_size()
    par = parse_mesh(cfg.mesh, world)
    model, mesh = shard(build_model(cfg), device, par)
    seed_gradients(model, cfg.seed, device)
    snapshot = GradientSnapshot(model.parameters())
    # All optimizers step the same model: values do not change the work, and memory stays one model.
    group = tp_process_group(par, mesh)
    opts: dict[str, Any] = {key: make_optimizer(cfg, key, model, group) for key in selected_optimizers(cfg, par)}
    peers, statuses = peer_optimizers(cfg, model, device, snapshot, par)
    periods = {**{key: VARIANTS[key].period for key in opts}, **dict.fromkeys(peers, 1)}
    logs: dict[str, list[dict[str, Any]]] = {key: [] for key in periods}
    counter = CallCounter()
    candidates = [
        Candidate(
            key,
            timed_period(opt, periods[key], device, logs[key], snapshot, counter, own=key not in peers),
            repeats=cfg.repeats,
            warmup=cfg.warmup,
        )
        for key, opt in {**opts, **peers}.items()
    ]
    # interleave gives the round-robin order; its own rank-local times include the barriers and are unused.
    with count_collectives(counter):
        interleave(candidates, progress=cfg.progress and rank == 0, desc=f"comm bench, {world} ranks")
    steps = {key: log[cfg.warmup * periods[key] :] for key, log in logs.items()}
    if cfg.trace_dir is not None:
        for c in candidates:
            trace(c, cfg.trace_dir / f"{c.name}-rank{rank}.json", device)
    muon = [p for g in param_groups(model) if g["algorithm"] == "muon" for _, p in g["params"]]
    return {
        "rank": rank,
        "steps": steps,
        "peers": {name: status.to_dict() for name, status in statuses.items()},
        "params": sum(p.numel() for p in model.parameters()),
        "muon_params": sum(p.numel() for p in muon),
        "muon_matrices": len(muon),
        "mesh": {"spec": cfg.mesh, "dims": dict(par.dims)},
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
        "device": device.type,
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


def per_step(
    per_rank: Sequence[list[dict[str, Any]]], field: str, kinds: Callable[[str], bool], source: str = "stats"
) -> list[float]:
    """Per rank: ``field`` of the collective kinds selected by ``kinds`` in the steps' ``source`` counts
    (``stats``: the optimizer's own, ``boundary``: the call-boundary count), summed and averaged over its steps."""
    return [
        sum(v[field] for s in steps for k, v in (s[source] or {}).items() if kinds(k)) / len(steps)
        for steps in per_rank
    ]


def summarize_steps(name: str, period: int, per_rank: Sequence[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per-step averages over whole periods (bytes, calls, exposed time) and median period time.

    Bytes and calls come twice: counted at the call boundary (``boundary_*``, every collective of the
    step, for every row) and from the optimizer's own counters (dimuon's rows only: the non-finite
    vote apart under ``check``, and the exposed time). ``own_matches_boundary`` says whether the two
    agreed on every step of every rank (None where there are no own counters).
    """
    n = len(per_rank[0])
    if any(len(steps) != n for steps in per_rank) or n % period:
        raise RuntimeError(f"{name}: ranks recorded different or partial periods ({[len(s) for s in per_rank]})")
    # Step time: the slowest rank bounds every step; a sample is the mean step of one whole period.
    step_max = [max(steps[i]["time_s"] for steps in per_rank) for i in range(n)]
    samples = [statistics.fmean(step_max[i : i + period]) for i in range(0, n, period)]

    def mean(field: str, kinds: Callable[[str], bool], source: str = "stats") -> float:
        return statistics.fmean(per_step(per_rank, field, kinds, source))

    def by_kind(source: str, kinds: set[str]) -> dict[str, dict[str, float]]:
        out = {}
        for kind in sorted(kinds):

            def this(k: str, kind: str = kind) -> bool:
                return k == kind

            out[kind] = {"bytes_per_step": mean("bytes", this, source), "calls_per_step": mean("calls", this, source)}
            if source == "stats":
                out[kind]["exposed_ms_per_step"] = 1e3 * mean("exposed_s", this)
        return out

    def every(kind: str) -> bool:
        return True

    summary: dict[str, Any] = {
        "period": period,
        "steps_timed": n,
        "step_ms": 1e3 * statistics.median(samples),
        "step_ms_min": 1e3 * min(samples),
        "step_ms_samples": [1e3 * s for s in samples],
        "boundary_bytes_per_step": mean("bytes", every, "boundary"),
        "boundary_bytes_per_step_by_rank": per_step(per_rank, "bytes", every, "boundary"),
        "boundary_calls_per_step": mean("calls", every, "boundary"),
        "boundary_by_kind": by_kind("boundary", {k for steps in per_rank for s in steps for k in s["boundary"]}),
    }
    if any(s["stats"] is None for steps in per_rank for s in steps):
        return {
            **summary,
            "own_matches_boundary": None,
            "bytes_per_step": None,
            "calls_per_step": None,
            "exposed_ms_per_step": None,
            "exposed_share": None,
            "check": None,
            "by_kind": None,
        }
    optimizer, check = (lambda k: k != CHECK), (lambda k: k == CHECK)
    exposed_r = per_step(per_rank, "exposed_s", optimizer)
    dims = sorted({d for steps in per_rank for s in steps for d in (s.get("by_dim") or {})})

    def dim_mean(dim: str, field: str) -> float:
        return statistics.fmean(
            sum(v[field] for s in steps for k, v in (s.get("by_dim") or {}).get(dim, {}).items() if k != CHECK)
            / len(steps)
            for steps in per_rank
        )

    time_r = [sum(s["time_s"] for s in steps) / n for steps in per_rank]
    return {
        **summary,
        "own_matches_boundary": all(fold_kinds(s["stats"]) == s["boundary"] for steps in per_rank for s in steps),
        "bytes_per_step": mean("bytes", optimizer),
        "bytes_per_step_by_rank": per_step(per_rank, "bytes", optimizer),
        "calls_per_step": mean("calls", optimizer),
        "exposed_ms_per_step": 1e3 * statistics.fmean(exposed_r),
        # Share of the step this rank sat blocked on the optimizer's collectives (mean over ranks).
        "exposed_share": statistics.fmean(e / t for e, t in zip(exposed_r, time_r)),
        "check": {
            "bytes_per_step": mean("bytes", check),
            "calls_per_step": mean("calls", check),
            "exposed_ms_per_step": 1e3 * mean("exposed_s", check),
        },
        "by_kind": by_kind("stats", {k for steps in per_rank for s in steps for k in s["stats"]} - {CHECK}),
        # The optimizer's own bytes, calls and exposed time per mesh dimension (the vote left out).
        "by_mesh_dim": {
            d: {
                "bytes_per_step": dim_mean(d, "bytes"),
                "calls_per_step": dim_mean(d, "calls"),
                "exposed_ms_per_step": 1e3 * dim_mean(d, "exposed_s"),
            }
            for d in dims
        },
    }


def summarize_variant(key: str, per_rank: Sequence[list[dict[str, Any]]]) -> dict[str, Any]:
    """One of dimuon's rows (or AdamW): :func:`summarize_steps` with its label and build options."""
    v = VARIANTS[key]
    version = f"torch {torch.__version__}" if v.name == "adamw" else f"dimuon {dimuon.__version__}"
    return {
        "label": v.label,
        "build": {"name": v.name, **v.options},
        "version": version,
        **summarize_steps(key, v.period, per_rank),
    }


def summarize_peer(status: dict[str, Any], per_rank: Sequence[list[dict[str, Any]]]) -> dict[str, Any]:
    """A peer's row: :func:`summarize_steps` with the peer's identity."""
    return {
        "label": status["label"],
        "peer": True,
        "version": f"{status['package']} {status['version']}",
        "ns_dtype": status["ns_dtype"],
        "sharded": status["sharded"],
        **summarize_steps(status["key"], 1, per_rank),
    }


def dimuon_ns_dtype(cfg: Config, device_type: str) -> str:
    """The dtype dimuon's Newton-Schulz ran in: --ns-dtype, or the default for the device."""
    dtype = DTYPES[cfg.ns_dtype] or linalg.default_ns_dtype(torch.device(device_type))
    return str(dtype).removeprefix("torch.")


def ideal_ratio(key: str, shard: int, replicas: int = 1) -> tuple[float | None, str]:
    """Logical bytes relative to Muon-gather (docs/algorithms.md, "Sharded execution"), as a number and a
    formula, for a shard group of ``shard`` ranks (W) and ``replicas`` replicas of it (R)."""
    if key not in VARIANTS:
        return None, "-"
    v = VARIANTS[key]
    if v.name == "adamw":
        return 0.0, "0"
    split = v.options.get("replica_refresh") == "split"
    if split and shard > 1:
        across = (replicas - 1) / (replicas * (shard - 1))  # pieces broadcast over the replicate dimension
        if v.options.get("refresh") == "owner":
            return 2 / (shard * replicas) + across, f"2/(WR) + (R-1)/(R(W-1)) = {2 / (shard * replicas) + across:.3f}"
        return 1 / replicas + across, f"1/R + (R-1)/(R(W-1)) = {1 / replicas + across:.3f}"
    if v.options.get("refresh") == "owner":
        return 2 / shard, f"2/W = {2 / shard:.3f}"
    if v.name == "periodic_row_muon":
        return 1 / v.period, f"1/{v.period} + all-reduce"
    if v.name == "muon_bp":
        return 1 / v.period, f"1/{v.period}"
    return 1.0, "1"


def summarize(
    cfg: Config, results: Sequence[dict[str, Any]], launcher: str, argv: Sequence[str] | None
) -> dict[str, Any]:
    """The JSON record: provenance, model, and per optimizer the numbers and ratios to Muon-gather."""
    world = len(results)
    first = results[0]
    machine = machine_info(argv)
    dims = first["mesh"]["dims"]
    shard_ranks = dims.get("dp_shard", 1) * dims.get("tp", 1)
    optimizers = {
        key: summarize_variant(key, [r["steps"][key] for r in results])
        for key in cfg.optimizers
        if key in first["steps"]
    }
    for name, status in first["peers"].items():
        if status["runnable"]:
            optimizers[name] = summarize_peer(status, [r["steps"][name] for r in results])
    base = optimizers.get(BASELINE)
    for key, o in optimizers.items():
        o.setdefault("ns_dtype", "-" if key == "adamw" else dimuon_ns_dtype(cfg, first["device"]))
        o["note"] = bf16_note(machine["cpu_flags"], first["device"]) if o["ns_dtype"] == "bfloat16" else ""
        o["ideal_bytes_ratio"], o["ideal_bytes_formula"] = ideal_ratio(key, shard_ranks, dims.get("dp_replicate", 1))
        own, base_own = o["bytes_per_step"], base and base["bytes_per_step"]
        o["bytes_ratio_to_gather"] = own / base_own if own is not None and base_own else None
        o["boundary_bytes_ratio_to_gather"] = (
            o["boundary_bytes_per_step"] / base["boundary_bytes_per_step"]
            if base and base["boundary_bytes_per_step"]
            else None
        )
        o["time_ratio_to_gather"] = o["step_ms"] / base["step_ms"] if base else None
    arch = build_arch(cfg)
    return {
        "benchmark": "comm",
        "machine": machine,
        "launcher": launcher,
        "world": world,
        "backend": first["backend"],
        "threads_per_rank": first["threads"],
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "model": {
            "name": cfg.model,
            "depth": cfg.depth if cfg.depth is not None else arch["depth"],
            "hidden_size": arch["hidden_size"],
            "num_heads": arch["num_heads"],
            "input_size": cfg.input_size,
            "in_channels": cfg.in_channels,
            "params": first["params"],
            "muon_params": first["muon_params"],
            "muon_matrices": first["muon_matrices"],
            "layout": "tensor-parallel plan (dimuon.dit.parallel), then fully_shard per block, then root",
        },
        "mesh": first["mesh"],
        "optimizers": optimizers,
        "peers": first["peers"],
        "paper": PAPER,
    }


def render_mesh_dims(record: dict[str, Any]) -> str:
    """dimuon's rows per mesh dimension: MiB and exposed ms per step (the optimizer's own counters, no vote)."""
    dims = sorted({d for o in record["optimizers"].values() for d in (o.get("by_mesh_dim") or {})})
    rows = []
    for o in record["optimizers"].values():
        if not o.get("by_mesh_dim") and o.get("peer"):
            continue
        per = o.get("by_mesh_dim") or {}
        rows.append(
            [
                o["label"],
                *(f"{per[d]['bytes_per_step'] / 2**20:.2f}" if d in per else "0.00" for d in dims),
                *(f"{per[d]['exposed_ms_per_step']:.1f}" if d in per else "0.0" for d in dims),
            ]
        )
    header = ["optimizer", *(f"MiB/step {d}" for d in dims), *(f"exposed ms {d}" for d in dims)]
    return "Per mesh dimension (dimuon's own counters, vote left out):\n" + format_table(
        header, rows, right=[False, *[True] * (2 * len(dims))]
    )


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(record: dict[str, Any]) -> str:
    """The human-readable report: one row per optimizer and peer (bytes counted at the call boundary), the
    peers that cannot run here, the check of dimuon's own counters, the paper's claims."""
    m, mach = record["model"], record["machine"]
    lines = [
        f"{m['name']} with {m['depth']} blocks: {m['params'] / 1e6:.1f}M parameters, {m['muon_params'] / 1e6:.1f}M "
        f"in {m['muon_matrices']} Muon matrices; mesh {record['mesh']['spec']} "
        f"({' x '.join(f'{k}={v}' for k, v in record['mesh']['dims'].items())}) over {record['world']} "
        f"{record['backend']} ranks "
        f"({record['launcher']}), {record['threads_per_rank']} thread(s) per rank; torch {mach['torch']}, "
        f"{mach['cuda'] or mach['cpu_model']} ({mach['logical_cpus']} logical CPUs)",
        "Per rank and step, averaged over whole periods; bytes and calls counted at the torch.distributed call "
        "boundary (every collective of the step); step time: slowest rank per step, median over periods.",
        "",
    ]
    rows = []
    for o in record["optimizers"].values():
        exposed, share = o["exposed_ms_per_step"], o["exposed_share"]
        rows.append(
            [
                o["label"],
                o.get("version", ""),
                o.get("ns_dtype", ""),
                f"{o['boundary_bytes_per_step'] / 2**20:.2f}",
                _fmt(o["boundary_bytes_ratio_to_gather"], ".3f"),
                o["ideal_bytes_formula"],
                f"{o['boundary_calls_per_step']:.2f}",
                f"{o['step_ms']:.1f}",
                _fmt(o["time_ratio_to_gather"], ".3f"),
                _fmt(exposed, ".1f"),
                "-" if share is None else f"{100 * share:.1f}%",
                o.get("note", ""),
            ]
        )
    for p in record.get("peers", {}).values():
        if not p["runnable"]:
            rows.append([p["label"], f"{p['package']} {p['version'] or '-'}", p["ns_dtype"], *["-"] * 8, p["reason"]])
    lines.append(
        format_table(
            [
                "optimizer",
                "version",
                "NS dtype",
                "MiB/step",
                "x gather",
                "ideal",
                "calls/step",
                "step ms",
                "x gather",
                "exposed ms",
                "exposed share",
                "note",
            ],
            rows,
            right=[False, False, False, *[True] * 8, False],
        )
    )
    lines += ["", render_mesh_dims(record)]
    own = {
        o["label"]: o["own_matches_boundary"]
        for o in record["optimizers"].values()
        if o["own_matches_boundary"] is not None
    }
    if own:
        differ = [label for label, same in own.items() if not same]
        lines.append(
            "\ndimuon's own comm_stats() (the 4-byte non-finite vote of every Muon-family step included) "
            + (
                "equal the call-boundary count on every step and rank."
                if not differ
                else "differ from the call-boundary count for: " + ", ".join(differ) + "."
            )
        )
    checks = [o for o in record["optimizers"].values() if o["check"] and o["check"]["calls_per_step"]]
    if checks:
        c = checks[0]["check"]
        lines.append(
            f"The vote is {c['calls_per_step']:.0f} all-reduce of 4 bytes per step ({c['bytes_per_step']:.0f} logical "
            "bytes), exposed "
            + ", ".join(f"{o['check']['exposed_ms_per_step']:.1f}" for o in checks)
            + " ms per step (dimuon's rows in table order); exposed ms above leaves it out."
        )
    p = record["paper"]
    lo, hi = (100 * x for x in p["optimizer_time_change"])
    lines += [
        f"Paper ({p['setting']}): logical optimizer communication {100 * p['logical_comm_change_k3']:.1f}% at K=3; "
        f"optimizer time {lo:.1f}% .. {hi:.1f}%.",
        "Ideal logical bytes vs Muon-gather (W ranks): PeriodicRowMuon K -> 1/K plus the small all-reduce of "
        "column norms on RowNorm steps; owner refresh -> 2/W; MuonBP P -> 1/P; AdamW -> 0.",
        "Exposed ms comes from dimuon's own counters: '-' for the peers.",
    ]
    if record["backend"] == "nccl":
        lines.append(
            "Exposed ms is host time blocked in the optimizer's collectives; NCCL's wait() only orders "
            "CUDA streams, so it understates exposure on GPUs: read the --trace-dir traces instead."
        )
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
        from dimuon.bench.launch import run_gloo

        results = run_gloo(_spawned_rank, cfg.world, cfg, threads=cfg.threads or 1, timeout_s=cfg.timeout_s)
    record = summarize(cfg, results, launcher, argv)
    write_json_atomic(cfg.out, record)
    return record


def parse(argv: Sequence[str]) -> Config:
    """The flags parsed and checked by :func:`check_config` and :func:`resolve_launcher` (which reads torchrun's
    environment variables), no rank started: SystemExit(2) for a flag the parser refuses, ValueError for a value
    a check refuses."""
    cfg = tyro.cli(Config, args=list(argv), prog="dimuon bench comm")
    check_config(cfg)
    resolve_launcher(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dimuon bench comm`` and ``python -m dimuon.bench.comm``."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse(args)
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
