"""``dimuon bench census``: what one optimizer step costs on a GPU cluster, counted rather than timed.

The engine has to be right for NCCL on 8-256 GPUs, and what makes a step slow there can be counted on a CPU:
for one step of every optimizer configuration on every layout the census records, per rank,

- the collectives, by kind, process group (mesh dimension), payload dtype, calls and logical bytes, counted at
  the ``torch.distributed`` call boundary (:func:`dimuon.bench.peers.count_collectives`, the count of
  ``dimuon bench comm``), in the order the rank issued them, so the ranks' sequences can be compared; and the
  launches, where several collectives go out as one group launch (NCCL's grouped calls, which the fake backend
  takes too; gloo has none);
- host reads, each a pipeline stall on a GPU: ``aten._local_scalar_dense`` (``item()``, ``bool(t)``,
  ``float(t)``) seen by a ``TorchDispatchMode``, and calls of ``Tensor.tolist``, ``Tensor.cpu`` and
  ``Tensor.numpy`` (patched on the class for the step: a CPU ``tolist`` does not dispatch), each with where
  it was called from;
- dispatched ops that compute (a proxy for kernel launches; views apart, uninitialized allocations such as
  ``empty`` apart, counted as allocations, and ops that make or change no tensor, such as ``promote_types`` or the
  profiler's markers, left out) outside Newton-Schulz, in the accelerator's form
  of the step (:mod:`dimuon.optim.devices`: list ops where the CPU's form takes one op per tensor); ``c10d`` ops
  apart;
- Newton-Schulz FLOPs per rank (exact, from :func:`dimuon.optim.linalg.newton_schulz_products` for every batch
  the engine orthogonalizes), as max over ranks / mean over ranks (the load balance of the refresh) and the sum
  over ranks against one refresh of every matrix (the duplicated work); where the step has owners (the owner
  refresh, the replicated matrices' refresh), over every rank of the world, derived from rank 0's owner plans
  (the same on every rank: each rank's share, found through its copy of rank 0's groups on the mesh) and checked
  against every traced rank, else over the traced ranks;
- the largest buffer a collective of the step names (the gathered bucket, an all-to-all's buffers) and the
  largest batch handed to Newton-Schulz: the refresh buffers, without the allocator's own peak.

Scales: ``--gloo-worlds`` (4 and 8) are real gloo processes (:func:`~dimuon.bench.launch.run_gloo`)
on ``--gloo-model`` (DiT-S/2) shapes, every rank traced with the real Newton-Schulz. ``--fake-worlds`` (64 and
256) run in this one process on torch's fake process group (collectives do nothing, DeviceMesh and FSDP2 work
as on a cluster) on ``--fake-model`` (DiT-XL/2) shapes, built on the meta device and materialized with
``to_empty``, so each rank holds only its shard. There Newton-Schulz is replaced by a stub that records the
batch shapes (FLOPs from ``newton_schulz_products``) and returns zeros of the right shape and dtype: its ops are
not dispatched, and since the zeros become the staleness references, AdaptiveRowMuon's second step finds
every reference void and refreshes every matrix (its worst case). Rank 0 is traced in full (after a
warm-up step, as at every scale); every other rank of ``--flop-ranks`` (default: all) is traced for its
collective sequence and Newton-Schulz batches only, with the direction maps themselves replaced by zeros
(what each rank orthogonalizes is decided before that), the fake group re-initialized per rank.

Every recorded step follows one untimed warm-up step, after which the optimizer's initial state is loaded
back: the optimizer derives each sharded parameter's layout and process groups at its construction (host reads of
the device mesh; timed apart), and the first step's remaining setup is not a cost of the step either. Step 1 is
then the optimizer's first step, state for state. Gradients are the same on both recorded steps.

Run ``dimuon bench census --help`` (or ``python -m dimuon.bench.census --help``).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm.auto import tqdm

from dimuon.bench.peers import CallCounter, CallRecord, GradientSnapshot, count_collectives
from dimuon.bench.report import format_markdown_table, format_table, machine_info, parse_bench_flags, parse_or_none
from dimuon.bench.variants import Variant, check_lr
from dimuon.dit.model import DiT, dit_arch
from dimuon.dit.parallel import Parallelism, apply_parallelism, build_mesh, shard_block_lists, tp_process_group
from dimuon.io import write_json_atomic, write_text_atomic
from dimuon.optim import DEFAULT_BUCKET_MB, StepKind, build, param_groups
from dimuon.optim import adaptive as adaptive_module
from dimuon.optim import core as core_module
from dimuon.optim import devices as devices_module
from dimuon.optim.core import local_tensor
from dimuon.optim.distributed import engine as engine_module
from dimuon.optim.distributed import refresh as refresh_module
from dimuon.optim.distributed import sharded as sharded_module
from dimuon.optim.distributed.engine import col_split_sizes_to_ranges, split_sizes_to_ranges
from dimuon.optim.distributed.sharded import flattened_group, mesh_coordinates
from dimuon.optim.linalg import default_ns_dtype, newton_schulz_products

PROG = "dimuon bench census"


VARIANTS: dict[str, Variant] = {
    "adamw": Variant("AdamW", "adamw", {}, steps=(1, 2)),
    "muon_gather": Variant("Muon (gather)", "muon", {"refresh": "gather"}),
    "muon_owner": Variant("Muon (owner)", "muon", {"refresh": "owner"}),
    "prm_k3": Variant("PeriodicRowMuon K=3", "periodic_row_muon", {"k": 3}, steps=(1, 2)),
    "prm_k3_skip": Variant(
        "PeriodicRowMuon K=3, skip", "periodic_row_muon", {"k": 3, "nonfinite": "skip"}, steps=(1, 2)
    ),
    "muon_bp_p5": Variant("MuonBP P=5", "muon_bp", {"period": 5}, steps=(1, 2)),
    "adaptive": Variant("AdaptiveRowMuon", "adaptive_row_muon", {}, steps=(1, 2)),
    "adaptive_skip": Variant("AdaptiveRowMuon, skip", "adaptive_row_muon", {"nonfinite": "skip"}, steps=(1, 2)),
    # signal_lag=1: step 2 has no signal yet (its matrices were refreshed at step 1), step 3 reads step 2's copy.
    "adaptive_lag": Variant(
        "AdaptiveRowMuon lag 1, skip",
        "adaptive_row_muon",
        {"nonfinite": "skip", "signal_lag": 1},
        steps=(1, 2, 3),
    ),
}
# The configurations whose ops are also counted at the extra depths (--ops-depths): RowNorm and block steps.
DEPTH_VARIANTS = ("prm_k3", "muon_bp_p5")
# The configurations a fake group's plan pass traces on every rank of --flop-ranks. AdamW issues no collective
# and no Newton-Schulz; the nonfinite="skip" twins differ from theirs only on the host (rank 0 traces them).
PLAN_VARIANTS = ("muon_gather", "muon_owner", "prm_k3", "muon_bp_p5", "adaptive")

LAYOUTS: dict[str, str] = {
    "fsdp": "FSDP2, 1-D mesh: Shard(0)",
    "hsdp": "HSDP: (Replicate(), Shard(0)), shard groups of min(8, W/2)",
    "tp": "tensor parallel over every rank (dimuon.dit.parallel's plan), plain tensors outside it",
    "fsdp_tp": "FSDP over tensor parallel, tp = 2 up to 8 ranks, 8 beyond",
    "replicated": "plain tensors on every rank, process_group = the world (DDP)",
    "hsdp_tp": "HSDP over tensor parallel (3-D): tp and shard groups of 2 up to 8 ranks, 8 beyond, replicas the rest",
    "hsdp_tp_s4": "HSDP over tensor parallel (3-D): tp 2 up to 8 ranks, 8 beyond; shard groups of 2, 4 beyond",
    "fsdp_cp_tp": "FSDP over data x context (dp_shard x cp flattened) under tensor parallel: cp 2, tp 2 up to 8 "
    "ranks, 8 beyond",
}
# The layouts a census takes unless --layouts names others (the 3-D ones on request: 8 gloo ranks each).
DEFAULT_LAYOUTS = ("fsdp", "hsdp", "tp", "fsdp_tp", "replicated")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
SHORT = {"all_gather": "ag", "all_reduce": "ar", "all_to_all": "a2a", "broadcast": "bc", "reduce_scatter": "rs"}
DTYPE_SHORT = {
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
    "bool": "b",
}


@dataclass
class Config:
    """Collectives, host reads, dispatched ops and Newton-Schulz FLOPs of one optimizer step, per layout and
    world size: real gloo ranks on DiT-S/2 shapes, torch's fake process group on DiT-XL/2 shapes."""

    gloo_worlds: tuple[int, ...] = (4, 8)
    """World sizes run as real gloo processes on this machine (each >= 2; () for none)."""
    fake_worlds: tuple[int, ...] = (64, 256)
    """World sizes traced in this process on torch's fake process group (each >= 2; () for none)."""
    gloo_model: str = "DiT-S/2"
    """Registry DiT of the gloo runs."""
    fake_model: str = "DiT-XL/2"
    """Registry DiT of the fake-group runs."""
    gloo_depth: int | None = None
    """Blocks of the gloo model (default: the registry's)."""
    fake_depth: int | None = None
    """Blocks of the fake-group model (default: the registry's)."""
    gloo_heads: int | None = 8
    """Attention heads of the gloo model (None: the registry's). Heads change no matrix's shape; 8 lets tensor
    parallelism split DiT-S/2 (6 heads) over 4 and 8 ranks."""
    fake_heads: int | None = None
    """Attention heads of the fake-group model (None: the registry's)."""
    fake_replicated_depth: int = 4
    """Blocks of the fake-group model on the replicated layout, where every rank holds the whole model in this
    one process (DiT-XL/2's 28 blocks would need ~13 GB); the counts of the other blocks repeat these."""
    ops_depths: tuple[int, ...] = (6,)
    """Further depths of the gloo model at the smallest gloo world, for the ops of RowNorm and block steps
    (PeriodicRowMuon and MuonBP) against the number of parameters; () for none."""
    layouts: tuple[str, ...] = DEFAULT_LAYOUTS
    """Layouts, from: fsdp hsdp tp fsdp_tp replicated hsdp_tp hsdp_tp_s4 fsdp_cp_tp (one a world size or model cannot
    take gets a reason)."""
    optimizers: tuple[str, ...] = tuple(VARIANTS)
    """Configurations, from: adamw muon_gather muon_owner prm_k3 prm_k3_skip muon_bp_p5 adaptive adaptive_skip
    adaptive_lag."""
    flop_ranks: int | None = None
    """Fake-group ranks traced for their collective sequence and Newton-Schulz FLOPs: None for every rank, else
    this many, spread evenly over the ranks (rank 0 and the last included). Work split among owners is derived for
    every rank from the owner plan whatever this is (the traced ranks check it)."""
    ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Newton-Schulz dtype of the Muon family (bfloat16: what CUDA runs by default)."""
    bucket_mb: float = DEFAULT_BUCKET_MB
    """Communication bucket size of the Muon family."""
    input_size: int = 32
    """Latent side length (only the embeddings depend on it)."""
    num_classes: int = 1000
    """Label-embedding rows (an AdamW parameter)."""
    lr: float = 1e-4
    """Learning rate of every optimizer (changes no count)."""
    seed: int = 0
    """Seed of the gloo model and its gradients."""
    threads: int = 1
    """Intra-op threads per gloo rank."""
    timeout_s: float = 3600.0
    """A gloo rank still running after this many seconds dumps its stacks and fails the run."""
    out: Path = Path("bench-census")
    """Output directory: census.json and census.md."""
    progress: bool = True
    """Show tqdm progress bars on stderr."""


# ----------------------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Job:
    """One model laid out one way at one world size: what a rank builds and which configurations it steps."""

    layout: str
    world: int
    model: str
    arch: dict[str, int]
    par: Parallelism | None  # None: replicated plain tensors
    keys: tuple[str, ...]
    fake: bool
    tag: str = ""  # "depth=6" for the extra depths
    builder: Callable[[], nn.Module] | None = None  # another model than dimuon's DiT (fake groups only, no TP)


def layout_degrees(layout: str, world: int) -> Parallelism | None:
    """The degrees of ``layout`` on ``world`` ranks (None: replicated); a ValueError says why it cannot be."""
    if layout == "fsdp":
        return Parallelism(1, world, 1).resolve(world)
    if layout == "tp":
        return Parallelism(1, 1, world).resolve(world)
    if layout == "hsdp":
        if world < 4 or world % 2:
            raise ValueError(f"HSDP needs an even world of at least 4 ranks, got {world}")
        shard = min(8, world // 2)
        return Parallelism(world // shard, shard, 1).resolve(world)
    if layout == "fsdp_tp":
        tp = 2 if world <= 8 else 8
        if world < 4 or world % tp:
            raise ValueError(f"FSDP x TP needs {tp} | world and world >= 4, got {world}")
        return Parallelism(1, world // tp, tp).resolve(world)
    if layout == "replicated":
        return None
    if layout in ("hsdp_tp", "hsdp_tp_s4"):
        tp = 2 if world <= 8 else 8
        shard = 2 if world <= 8 else (8 if layout == "hsdp_tp" else 4)
        if world % (tp * shard) or world < 2 * tp * shard:
            raise ValueError(f"HSDP x TP needs two replicas of {shard} x {tp} ranks or more, got {world}")
        return Parallelism(world // (tp * shard), shard, tp).resolve(world)
    if layout == "fsdp_cp_tp":
        tp, cp = (2 if world <= 8 else 8), 2
        if world % (tp * cp) or world < 2 * tp * cp:
            raise ValueError(f"FSDP over data x context under TP needs 2 x {cp} x {tp} ranks or more, got {world}")
        return Parallelism(1, world // (tp * cp), tp, cp).resolve(world)
    raise ValueError(f"unknown layout {layout!r}")


def mesh_words(par: Parallelism | None) -> str:
    """``8x8 (dp_replicate x dp_shard)``; ``replicated`` for plain tensors."""
    if par is None:
        return "replicated"
    names, sizes = zip(*par.dims)
    return f"{'x'.join(map(str, sizes))} ({' x '.join(names)})"


def model_arch(model: str, depth: int | None, heads: int | None) -> dict[str, int]:
    arch = dit_arch(model)
    if depth is not None:
        arch["depth"] = depth
    if heads is not None:
        arch["num_heads"] = heads
    return arch


def plan_jobs(cfg: Config) -> tuple[list[Job], list[dict[str, Any]]]:
    """Every (layout, world size, model) to trace, and a row per one that cannot be (with the reason)."""
    jobs, refused = [], []

    def add(
        layout: str, world: int, model: str, arch: dict[str, int], keys: Sequence[str], fake: bool, tag: str = ""
    ) -> None:
        try:
            par = layout_degrees(layout, world)
            if par is not None:
                par.check_model(arch["hidden_size"], arch["num_heads"], 4 * arch["hidden_size"])
        except ValueError as err:
            if not tag:
                refused.append({"layout": layout, "world": world, "model": model, "reason": str(err)})
            return
        jobs.append(Job(layout, world, model, arch, par, tuple(keys), fake, tag))

    gloo_arch = model_arch(cfg.gloo_model, cfg.gloo_depth, cfg.gloo_heads)
    for world in cfg.gloo_worlds:
        for layout in cfg.layouts:
            add(layout, world, cfg.gloo_model, gloo_arch, cfg.optimizers, False)
    if cfg.gloo_worlds:
        depth_keys = [k for k in cfg.optimizers if k in DEPTH_VARIANTS]
        for depth in cfg.ops_depths:
            for layout in cfg.layouts:
                add(
                    layout,
                    min(cfg.gloo_worlds),
                    cfg.gloo_model,
                    {**gloo_arch, "depth": depth},
                    depth_keys,
                    False,
                    f"depth={depth}",
                )
    fake_arch = model_arch(cfg.fake_model, cfg.fake_depth, cfg.fake_heads)
    for world in cfg.fake_worlds:
        for layout in cfg.layouts:
            arch = (
                {**fake_arch, "depth": min(fake_arch["depth"], cfg.fake_replicated_depth)}
                if layout == "replicated"
                else fake_arch
            )
            add(layout, world, cfg.fake_model, arch, cfg.optimizers, True)
    return jobs, refused


def check_config(cfg: Config) -> None:
    """One clear error per bad option, before anything starts."""
    for flag, values in (("--optimizers", cfg.optimizers), ("--layouts", cfg.layouts)):
        allowed = list(VARIANTS if flag == "--optimizers" else LAYOUTS)
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            raise ValueError(f"{flag} must name some of {allowed}, got {list(values)}")
    for flag, worlds in (("--gloo-worlds", cfg.gloo_worlds), ("--fake-worlds", cfg.fake_worlds)):
        if any(w < 2 for w in worlds):
            raise ValueError(f"{flag} must be world sizes >= 2, got {list(worlds)}")
    if not cfg.gloo_worlds and not cfg.fake_worlds:
        raise ValueError("--gloo-worlds and --fake-worlds are both empty: nothing to count")
    for flag, value in (
        ("--gloo-depth", cfg.gloo_depth),
        ("--fake-depth", cfg.fake_depth),
        ("--gloo-heads", cfg.gloo_heads),
        ("--fake-heads", cfg.fake_heads),
        ("--fake-replicated-depth", cfg.fake_replicated_depth),
        ("--flop-ranks", cfg.flop_ranks),
        ("--threads", cfg.threads),
        *((f"--ops-depths {d}", d) for d in cfg.ops_depths),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not cfg.bucket_mb > 0:
        raise ValueError(f"--bucket-mb must be > 0, got {cfg.bucket_mb}")
    check_lr(cfg.lr)
    for flag, model, heads in (
        ("--gloo-model", cfg.gloo_model, cfg.gloo_heads),
        ("--fake-model", cfg.fake_model, cfg.fake_heads),
    ):
        try:
            arch = model_arch(model, None, heads)
        except ValueError as err:
            raise ValueError(f"{flag}: {err}") from None
        if arch["hidden_size"] % arch["num_heads"]:
            raise ValueError(
                f"{flag} {model}: {arch['num_heads']} heads must divide the hidden size {arch['hidden_size']}"
            )
    if cfg.gloo_worlds and dist.is_available() and dist.is_initialized():
        raise ValueError("--gloo-worlds starts its own ranks: run the census outside a process group")


# -------------------------------------------------------------------------------------- counting


# torch's own wrappers between a caller and the read, skipped when naming where a read comes from.
_PLUMBING = (
    "/torch/utils/",
    "/torch/_dynamo/",
    "/torch/_tensor.py",
    "/torch/_compile.py",
    "/torch/overrides.py",
    "/torch/optim/optimizer.py",
)


def _site() -> str:
    """Where a host read was called from: the innermost frame of dimuon (the census left out), else of torch."""
    frame = sys._getframe(2)
    fallback = None
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if path.endswith("bench/census.py") or any(part in path for part in _PLUMBING):
            frame = frame.f_back
            continue
        for root in ("/dimuon/", "/torch/"):
            if root in path:
                where = f"{root.strip('/')}/{path.rsplit(root, 1)[1]}:{frame.f_code.co_name}"
                if root == "/dimuon/":
                    return where
                fallback = fallback or where
        frame = frame.f_back
    return fallback or "?"


@dataclass
class Tally:
    """What one rank did in one step (filled by :func:`tracing`)."""

    ops: int = 0
    views: int = 0
    allocs: int = 0  # uninitialized allocations (empty, new_empty...): the caching allocator, no kernel
    ns_ops: int = 0
    c10d_ops: int = 0
    inside_ns: int = 0
    host_reads: Counter = field(default_factory=Counter)  # kind -> count
    read_sites: Counter = field(default_factory=Counter)  # "kind at site" -> count
    ns_batches: list[tuple[int, int, int, str, float]] = field(default_factory=list)  # (B, r, c, dtype, FLOPs)
    collectives: list[CallRecord] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)  # collectives per group launch (NCCL's grouped calls)
    # The owners' plans as this rank holds them (the same on every rank: the owner refresh's buckets per shard group,
    # the replicated matrices' owners per replica group): per group (its global ranks), every member's Newton-Schulz
    # FLOPs of the step, whichever rank's trace this is.
    owner_work: dict[tuple[int, ...], list[float]] = field(default_factory=dict)

    def read(self, kind: str) -> None:
        self.host_reads[kind] += 1
        self.read_sites[f"{kind} at {_site()}"] += 1

    def orthogonalized(self, batch: int, rows: int, cols: int, steps: int, algorithm: str, dtype: torch.dtype) -> None:
        flops = batch * ns_flops(rows, cols, steps, algorithm)
        self.ns_batches.append((batch, rows, cols, str(dtype).removeprefix("torch."), flops))


def ns_flops(rows: int, cols: int, steps: int, algorithm: str) -> float:
    """Newton-Schulz FLOPs of one ``(rows, cols)`` matrix: two per multiply-add of every product."""
    return sum(2.0 * m * k * n for m, k, n in newton_schulz_products(rows, cols, steps, algorithm))


# Ops that only take memory (a GPU's caching allocator serves them without a kernel); a zero-filled tensor is one of
# these and a fill, which is counted.
ALLOCATIONS = frozenset(
    getattr(torch.ops.aten, name) for name in ("empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like")
)


class _OpCounter(TorchDispatchMode):
    """Counts the dispatched ops that make or change a tensor (inside and outside Newton-Schulz apart, views and
    uninitialized allocations apart) and the host reads (``_local_scalar_dense``)."""

    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tally = self.tally
        out = func(*args, **(kwargs or {}))
        read = func is torch.ops.aten._local_scalar_dense.default  # a copy to the host: an op and a read
        if read:
            tally.read("item")
        if func.namespace in ("c10d", "_c10d_functional"):
            tally.c10d_ops += 1
        elif not read and not _writes_tensor(func, out):
            pass  # metadata only (promote_types, the profiler's markers): no kernel
        elif tally.inside_ns:
            tally.ns_ops += 1
        elif func.is_view:
            tally.views += 1
        elif func.overloadpacket in ALLOCATIONS:
            tally.allocs += 1
        else:
            tally.ops += 1
        return out


def _grouping_probe(tally: Tally, counter: CallCounter, original: Callable[..., Any]) -> Callable[..., Any]:
    """``dist._coalescing_manager`` that books how many collectives each group launch carried."""

    @contextlib.contextmanager
    def grouped(*args: Any, **kwargs: Any) -> Iterator[Any]:
        before = len(counter.log)
        with original(*args, **kwargs) as manager:
            yield manager
        tally.groups.append(len(counter.log) - before)

    return grouped


def _writes_tensor(func: Any, out: Any) -> bool:
    """Whether an op makes or changes a tensor (a kernel on an accelerator): it returns one, or writes its inputs."""
    if any(isinstance(t, Tensor) for t in pytree.tree_leaves(out)):
        return True
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _host_method(tally: Tally, name: str) -> Callable[..., Any]:
    original = getattr(torch.Tensor, name)

    def counted(self: Tensor, *args: Any, **kwargs: Any) -> Any:
        tally.read(name)
        return original(self, *args, **kwargs)

    return counted


def _newton_schulz_probe(tally: Tally, stub: bool) -> Callable[..., Tensor]:
    """Newton-Schulz as the engine calls it, recording every batch; ``stub``: zeros of the result's shape and
    dtype instead of the iteration."""
    real = engine_module.newton_schulz

    def probe(
        x: Tensor,
        steps: int = 5,
        coefficients: str = "quintic",
        algorithm: str = "standard",
        dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> Tensor:
        batch, rows, cols = (1, *x.shape) if x.ndim == 2 else tuple(x.shape)
        compute = dtype if dtype is not None else default_ns_dtype(x.device)
        tally.orthogonalized(batch, rows, cols, steps, algorithm, compute)
        tally.inside_ns += 1
        try:
            if stub:
                return torch.zeros(x.shape, dtype=compute, device=x.device)
            return real(x, steps=steps, coefficients=coefficients, algorithm=algorithm, dtype=dtype, **kwargs)
        finally:
            tally.inside_ns -= 1

    return probe


def _book_owners(
    tally: Tally, comm: Any, placed: Sequence[Any], jobs: Sequence[int], owners: Sequence[int], config: Any
) -> None:
    """Each job's Newton-Schulz FLOPs (every region of it) to its owner, a member of ``comm``'s group."""
    ranks = tuple(dist.get_process_group_ranks(comm.group) if comm.group is not None else range(comm.world))
    loads = tally.owner_work.setdefault(ranks, [0.0] * len(ranks))
    for i, owner in zip(jobs, owners):
        regions = placed[i][0].regions()
        loads[owner] += sum(ns_flops(b - a, e - c, config.ns_steps, config.ns_algorithm) for a, b, c, e in regions)


def _owner_plan_probe(tally: Tally) -> Callable[..., Any]:
    """``SpectralRefresh._owner_plan`` that books, per shard group, every member's Newton-Schulz FLOPs of the plan
    it returns: the plan is the same on every rank, so one rank's trace holds every member's work."""
    real = refresh_module.SpectralRefresh._owner_plan

    def probe(self: Any, placed: Sequence[Any], config: Any) -> Any:
        plan = real(self, placed, config)
        for bucket in plan:
            _book_owners(tally, bucket.comm, placed, bucket.jobs, bucket.owners, config)
        return plan

    return probe


def _whole_refresh_probe(tally: Tally) -> Callable[..., Any]:
    """``SpectralRefresh._whole_refresh`` that books, per replica group, every member's Newton-Schulz FLOPs of the
    whole matrices it owns (replicated parameters: owners split them, the same way on every rank)."""
    real = refresh_module.SpectralRefresh._whole_refresh

    def probe(self: Any, placed: Sequence[Any], config: Any, *rest: Any) -> Any:
        for comm, idx, owners in self._whole_owners(placed):
            _book_owners(tally, comm, placed, idx, owners, config)
        return real(self, placed, config, *rest)

    return probe


def _map_plan(tally: Tally) -> Callable[..., list[Tensor]]:
    """``apply_map_batched`` that records the Newton-Schulz batches it would run and returns zero directions
    (RowNorm runs as it is): what each rank orthogonalizes is decided before this call."""
    real = engine_module.apply_map_batched

    def plan(pieces: Sequence[Tensor], kind: StepKind, config: Any, *args: Any, **kwargs: Any) -> list[Tensor]:
        if kind is StepKind.ROWNORM or not pieces:
            return real(pieces, kind, config, *args, **kwargs)
        by_shape: Counter = Counter(tuple(p.shape) for p in pieces)
        ns_dtype = config.ns_dtype if config.ns_dtype is not None else default_ns_dtype(pieces[0].device)
        for (rows, cols), batch in by_shape.items():
            tally.orthogonalized(batch, rows, cols, config.ns_steps, config.ns_algorithm, ns_dtype)
        scaled = kwargs.get("scaled", args[0] if args else True)  # unscaled: Newton-Schulz's own dtype
        return [
            torch.zeros(
                (), dtype=torch.promote_types(p.dtype, torch.float32) if scaled else ns_dtype, device=p.device
            ).expand(p.shape)
            for p in pieces
        ]

    return plan


def _orthogonalize_plan(tally: Tally) -> Callable[..., Tensor]:
    """``orthogonalize_batch`` (the Newton-Schulz of the class paths' batches) that records the batch it would run
    and returns zeros of its result's shape and dtype, as :func:`_map_plan` does for the per-job maps."""

    def plan(batch: Tensor, config: Any, scale: float | None) -> Tensor:
        ns_dtype = config.ns_dtype if config.ns_dtype is not None else default_ns_dtype(batch.device)
        tally.orthogonalized(*batch.shape, config.ns_steps, config.ns_algorithm, ns_dtype)
        dtype = torch.promote_types(ns_dtype, torch.float32) if scale is not None else ns_dtype
        return torch.zeros((), dtype=dtype, device=batch.device).expand(batch.shape)

    return plan


NsMode = Literal["real", "stub", "plan"]

_PIECES: dict[tuple[Any, ...], Any] = {}


def _memo_piece_at(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Layout.piece_at`` remembered across optimizers and ranks: a pure function of the matrix's shape, the
    placements, the mesh's shape and the coordinate (what the engine's first step derives for every member of
    every shard group, O(parameters x W) host work)."""

    def piece_at(self: Any, coord: Sequence[int]) -> Any:
        key = (
            self.rows,
            self.cols,
            self.col_unit,
            tuple(map(repr, self.placements)),
            tuple(self.mesh.shape),
            tuple(coord),
        )
        found = _PIECES.get(key)
        if found is None:
            found = _PIECES[key] = original(self, coord)
        return found

    return piece_at


def _meta_read_flag(original: Callable[[Tensor], bool]) -> Callable[[Tensor], bool]:
    def read_flag(flag: Tensor) -> bool:
        return True if flag.is_meta else original(flag)

    return read_flag


def _meta_tolist(original: Callable[..., Any]) -> Callable[..., Any]:
    def tolist(self: Tensor) -> Any:
        return torch.full(self.shape, math.inf).tolist() if self.is_meta else original(self)

    return tolist


def _void_staleness(sums: Tensor) -> Tensor:
    """``staleness_from_sums`` of references that hold no direction: ``inf`` for every matrix."""
    return torch.full(sums.shape[:-1], math.inf, dtype=sums.dtype, device=sums.device)


@contextlib.contextmanager
def tracing(counter: CallCounter, ns: NsMode = "real", ops: bool = True, memo_layouts: bool = False) -> Iterator[Tally]:
    """Count what the body does on this rank: the collectives (``counter`` must be inside an active
    :func:`count_collectives` block), and with ``ops`` the dispatched ops and host reads; Newton-Schulz
    batches always. ``ns``: the real iteration (its ops counted apart), a stub returning zeros (its ops not
    dispatched), or ``plan``: the direction maps replaced by zeros and the gathered matrices not assembled
    (collectives and batches only). ``memo_layouts`` (plan passes set it): every shard-group member's piece
    remembered across optimizers and ranks (what the engine derives at its first step), for speed."""
    tally = Tally()
    counter.reset()
    with contextlib.ExitStack() as stack:
        if ns != "real":
            # Stubbed directions are zeros, references of no direction: AdaptiveRowMuon's signal is void (inf,
            # every matrix refreshes) on every rank, whatever the fake backend left in its receive buffers.
            stack.enter_context(_patched(adaptive_module, "staleness_from_sums", _void_staleness))
        if ns == "plan":
            plan = _map_plan(tally)
            stack.enter_context(_patched(engine_module, "apply_map_batched", plan))
            stack.enter_context(_patched(sharded_module, "apply_map_batched", plan))
            stack.enter_context(_patched(refresh_module, "apply_map_batched", plan))
            stack.enter_context(_patched(engine_module, "orthogonalize_batch", _orthogonalize_plan(tally)))
            # On the meta device (fake groups) the step's host reads get the answers every rank of a cluster
            # agrees on: every gradient finite; the adaptive signal void, as the stub's zero references make it.
            for module in (engine_module, sharded_module, core_module):
                if hasattr(module, "read_flag"):
                    stack.enter_context(_patched(module, "read_flag", _meta_read_flag(module.read_flag)))
            stack.enter_context(_patched(torch.Tensor, "tolist", _meta_tolist(torch.Tensor.tolist)))
        if memo_layouts and hasattr(sharded_module.Layout, "piece_at"):
            layout = sharded_module.Layout
            stack.enter_context(_patched(layout, "piece_at", _memo_piece_at(layout.piece_at)))
        else:
            stack.enter_context(_patched(engine_module, "newton_schulz", _newton_schulz_probe(tally, ns == "stub")))
        if ops:  # what an accelerator dispatches: the step's list-op form (the CPU's takes one op per tensor)
            stack.enter_context(_patched(devices_module, "cpu_path", lambda device: False))
            for name in ("tolist", "cpu", "numpy"):
                stack.enter_context(_patched(torch.Tensor, name, _host_method(tally, name)))
            stack.enter_context(_OpCounter(tally))
        refresh_class = refresh_module.SpectralRefresh
        stack.enter_context(_patched(refresh_class, "_owner_plan", _owner_plan_probe(tally)))
        stack.enter_context(_patched(refresh_class, "_whole_refresh", _whole_refresh_probe(tally)))
        grouping = _grouping_probe(tally, counter, dist._coalescing_manager)
        stack.enter_context(_patched(dist, "_coalescing_manager", grouping))
        yield tally
    tally.collectives = list(counter.log)


# ------------------------------------------------------------------------------------ one rank


def build_job_model(cfg: Config, job: Job, materialize: bool = True) -> tuple[nn.Module, Any, Any]:
    """The job's DiT laid out on its mesh: the model, its mesh (None when replicated) and the ``process_group``
    of its plain parameters. Fake groups build on the meta device, then (``materialize``) give each rank its
    pieces on the CPU with ``to_empty`` (zeros), so a rank holds only its shard."""
    kwargs = dict(**job.arch, input_size=cfg.input_size, in_channels=4, num_classes=cfg.num_classes)
    _forget_meshes()  # a mesh built before (here, or as another fake rank) must not leak into this model's specs
    if job.builder is not None:
        return _build_other_model(job, materialize)
    if job.fake:
        with torch.device("meta"):
            model = DiT(**kwargs)
    else:
        torch.manual_seed(cfg.seed)
        model = DiT(**kwargs)
    mesh = group = None
    if job.par is not None:
        mesh = build_mesh(job.par, "cpu")
        apply_parallelism(model, job.par, mesh)
        group = tp_process_group(job.par, mesh)
    else:
        group = dist.group.WORLD
    if job.fake and materialize:
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                local_tensor(p).zero_()
    return model, mesh, group


def _build_other_model(job: Job, materialize: bool) -> tuple[nn.Module, Any, Any]:
    """``job.builder``'s model on the meta device, FSDP2 over its block lists then the root
    (:func:`dimuon.dit.parallel.shard_block_lists`); tensor parallelism needs a model's own plan, which only
    dimuon's DiT has here."""
    if not job.fake or materialize:
        raise ValueError("a model from a builder is counted on fake process groups only, on the meta device")
    with torch.device("meta"):
        model = job.builder()
    if job.par is None:
        return model, None, dist.group.WORLD
    if job.par.tp > 1:
        raise ValueError(
            "tensor parallelism needs the model's own plan, which only dimuon's DiT has here: use the fsdp, hsdp "
            "or replicated layout for this model"
        )
    mesh = build_mesh(job.par, "cpu")
    shard_block_lists(model, mesh)
    return model, mesh, None


def set_gradients(model: nn.Module, job: Job, seed: int) -> None:
    """Seeded N(0, 1) gradients (the same full tensor on every gloo rank, cut like the parameter); on fake groups
    a constant on each rank's piece (values change no count)."""
    if not job.fake:
        from dimuon.bench.comm import seed_gradients

        seed_gradients(model, seed, torch.device("cpu"))
        return
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        local = torch.full(local_tensor(p).shape, 1e-2, dtype=p.dtype, device=local_tensor(p).device)
        p.grad = (
            DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)
            if hasattr(p, "device_mesh")
            else local
        )


def make_optimizer(
    cfg: Config,
    key: str,
    model: nn.Module,
    group: Any,
    engines: dict[str, Any] | None = None,
    variant: Variant | None = None,
) -> torch.optim.Optimizer:
    """Configuration ``key`` over ``model`` (``group``: the process group of its plain parameters). With
    ``engines`` (a plan pass) over the Muon groups alone (the AdamW group issues no collective and no
    Newton-Schulz), on one sharded engine per refresh strategy kept in ``engines``, so each parameter's layout
    is derived once per rank, not once per configuration."""
    v = VARIANTS[key] if variant is None else variant
    opts = {**v.options, "lr": cfg.lr}
    if v.name == "adamw":
        return build(v.name, model, **opts)
    opts.update(bucket_mb=cfg.bucket_mb, ns_dtype=DTYPES[cfg.ns_dtype], process_group=group)
    if engines is None:
        return build(v.name, model, **opts)
    from dimuon.optim.distributed.engine import DEFAULT_REFRESH
    from dimuon.optim.distributed.sharded import ShardedEngine

    groups = [g for g in param_groups(model) if g["algorithm"] == "muon"]
    refresh = opts.get("refresh", DEFAULT_REFRESH)
    replicas = opts.get("replica_refresh", "repeat")
    if (refresh, replicas) not in engines:
        engines[refresh, replicas] = ShardedEngine(
            refresh=refresh,
            replica_refresh=replicas,
            bucket_mb=cfg.bucket_mb,
            process_group=group,
            params=[p for g in groups for _, p in g["params"]],
        )
    return build(v.name, groups, engine=engines[refresh, replicas], **opts)


def group_labels(mesh: Any, layout: str) -> dict[str, str]:
    """Process-group name -> the mesh dimension it spans (``dp_shard+tp`` for the flattened one, ``world`` for
    the default group where no mesh dimension is it)."""
    labels: dict[str, str] = {}
    if mesh is not None:
        names = mesh.mesh_dim_names
        for d in range(mesh.ndim):
            labels[mesh.get_group(d).group_name] = names[d]
        for name, flat in mesh._get_root_mesh()._flatten_mapping.items():  # data x context: FSDP's dp_shard_cp
            labels.setdefault(flat.get_group(0).group_name, name)
        shard = [d for d in range(mesh.ndim) if names[d] != "dp_replicate"]
        if len(shard) > 1:  # the group the sharding dimensions make: the engine's own, the mesh left as it was
            label = "+".join(names[d] for d in shard).replace("dp_shard+cp", "dp_shard_cp")  # as the engine names it
            labels.setdefault(flattened_group(mesh, shard).group_name, label)
    labels.setdefault(dist.group.WORLD.group_name, "world")
    return labels


def model_ns_flops(model: nn.Module, cfg_steps: int = 5, algorithm: str = "standard") -> float:
    """Newton-Schulz FLOPs of one spectral refresh of every logical Muon matrix, once."""
    total = 0.0
    for g in param_groups(model):
        if g["algorithm"] != "muon":
            continue
        for name, p in g["params"]:
            rows, cols = p.shape[0], math.prod(p.shape[1:])
            row_ranges = split_sizes_to_ranges(rows, g.get("split_sizes"), name) or ((0, rows),)
            col_ranges = col_split_sizes_to_ranges(cols, g.get("col_split_sizes"), name) or ((0, cols),)
            for a, b in row_ranges:
                for c, d in col_ranges:
                    total += ns_flops(b - a, d - c, cfg_steps, algorithm)
    return total


def _step_kind(opt: Any) -> str:
    """The kind of the coming step of the first Muon group ("" for AdamW; "per matrix" for the adaptive one)."""
    kinds = getattr(opt, "step_kinds", None)
    if kinds is None:
        return ""
    found = [k for k in kinds() if k is not None]
    if found:
        return found[0].value
    return "per matrix" if any(g.get("algorithm") == "muon" for g in opt.param_groups) else ""


def _record(tally: Tally, opt: Any, kind: str) -> dict[str, Any]:
    """One step of one rank, JSON-ready."""
    refresh = opt.refresh_stats() if hasattr(opt, "refresh_stats") else None
    own = opt.comm_stats(by_mesh_dim=True) if hasattr(opt, "comm_stats") else {}
    return {
        "kind": kind,
        "spectral": None if refresh is None else [refresh["spectral"], refresh["steps"]],
        "collectives": [[c.group, c.kind, c.dtype, c.world, c.bytes, c.buffer_bytes] for c in tally.collectives],
        # a group launch of n collectives is one launch (NCCL's grouped calls): calls less what rode along
        "launches": len(tally.collectives) - sum(n - 1 for n in tally.groups if n),
        "own": {
            dim: {k: {"calls": v["calls"], "bytes": v["bytes"]} for k, v in kinds.items()} for dim, kinds in own.items()
        },
        "host_reads": dict(tally.host_reads),
        "read_sites": dict(tally.read_sites),
        "ops": tally.ops,
        "allocs": tally.allocs,
        "views": tally.views,
        "ns_ops": tally.ns_ops,
        "c10d_ops": tally.c10d_ops,
        "ns_batches": [list(b) for b in tally.ns_batches],
        "ns_flops": sum(b[4] for b in tally.ns_batches),
        "owner_work": [[list(ranks), loads] for ranks, loads in tally.owner_work.items()],
    }


def trace_job(
    cfg: Config,
    job: Job,
    counter: CallCounter,
    mode: NsMode,
    advance: Callable[[], None] = lambda: None,
    keys: Sequence[str] | None = None,
    probe: Callable[[], contextlib.AbstractContextManager[dict[str, Any]]] | None = None,
    ops: bool | None = None,
    warmup: bool | None = None,
    variants: dict[str, Variant] | None = None,
    inspect: Callable[[nn.Module], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """This rank's records of every configuration of ``job`` (``counter`` must be counting): with ``mode``
    ``real`` or ``stub`` a full pass (warm-up step, then the recorded steps with their ops and host reads);
    with ``plan`` the configurations of :data:`PLAN_VARIANTS` (or ``keys``), for their collective sequences and
    Newton-Schulz batches only (:func:`tracing`). ``probe``, where given, is entered around every recorded step
    and the dict it yields (filled when it exits) is merged into that step's record; ``ops`` (default: not in a
    plan pass) counts the dispatched ops and host reads too; ``warmup`` (default: not in a plan pass) takes the
    untimed first step before the recorded ones, so they hold no one-time setup; ``variants`` (default
    :data:`VARIANTS`) names the configurations ``job.keys`` and ``keys`` refer to; ``inspect``, where given, is called
    with the laid-out model once every configuration is traced, its dict kept as ``info["inspected"]``."""
    table = VARIANTS if variants is None else variants
    plan = mode == "plan"
    plan_keys = PLAN_VARIANTS if keys is None else tuple(keys)
    model, mesh, group = build_job_model(cfg, job, materialize=not (plan and job.fake))
    set_gradients(model, job, cfg.seed)
    snapshot = GradientSnapshot(model.parameters())
    records: dict[str, Any] = {}
    engines: dict[str, Any] = {}
    setup_s: float | None = None
    construction_s: float | None = None
    for key in job.keys:
        v = table[key]
        if plan and key not in plan_keys:
            continue
        try:
            start = time.perf_counter()
            opt = make_optimizer(cfg, key, model, group, engines if plan else None, v)
            if construction_s is None and v.name != "adamw" and not plan:
                construction_s = time.perf_counter() - start  # layouts and process groups, made at construction
        except ValueError as err:  # a layout the optimizer refuses, with its reason
            records[key] = {"refused": str(err).splitlines()[0]}
            advance()
            continue
        _meta_state(opt)
        if (not plan) if warmup is None else warmup:  # the engine's one-time setup, then back to the initial state
            initial = copy.deepcopy(opt.state_dict())
            snapshot.restore()
            start = time.perf_counter()
            # A plan step (its directions are dropped); layouts derived for real at the job's first warm-up only
            # (timed: the setup every rank pays at its first step), remembered after that.
            with tracing(counter, ns="plan", ops=False, memo_layouts=setup_s is not None):
                opt.step()
            if setup_s is None and v.name != "adamw":
                setup_s = time.perf_counter() - start
            opt.load_state_dict(initial)
            del initial
        steps = []
        for t in range(1, max(v.steps) + 1):
            snapshot.restore()
            if hasattr(opt, "reset_comm_stats"):
                opt.reset_comm_stats()
                opt.reset_refresh_stats()
            kind = _step_kind(opt)
            with (
                tracing(counter, ns=mode, ops=not plan if ops is None else ops, memo_layouts=plan) as tally,
                probe() if probe is not None else contextlib.nullcontext({}) as extra,
            ):
                opt.step()
            if t in v.steps:
                steps.append({"step": t, **_record(tally, opt, kind), **extra})
        records[key] = {"steps": steps}
        del opt
        advance()
    labels = group_labels(mesh, job.layout)
    for record in records.values():
        for s in record.get("steps", ()):
            for c in s["collectives"]:
                c[0] = labels.get(c[0], f"group {c[0]}")
    muon = [p for g in param_groups(model) if g["algorithm"] == "muon" for _, p in g["params"]]
    shapes = {(p.shape[0], math.prod(p.shape[1:])) for p in muon}
    info = {
        "muon_params": len(muon),
        "muon_shapes": len(shapes),
        "params": sum(p.numel() for p in model.parameters()),
        "model_ns_flops": model_ns_flops(model),
        "local_numel": sum(local_tensor(p).numel() for p in model.parameters()),
        "first_step_setup_s": setup_s,
        "mesh_ranks": None if mesh is None else mesh.mesh.tolist(),
        "construction_s": construction_s,
    }
    if inspect is not None:
        info["inspected"] = inspect(model)
    del model, snapshot, engines
    gc.collect()
    return {"records": records, "info": info}


def _meta_state(opt: Any) -> None:
    """The Muon state of parameters on the meta device, made as the core makes it on any other device (it
    leaves meta parameters without state until they are moved): a plan pass's tensors hold shapes only."""
    for group in opt.param_groups:
        if group.get("algorithm") != "muon":
            continue
        for p in group["params"]:
            state = opt.state[p]
            if not local_tensor(p).is_meta or "momentum_buffer" in state:
                continue
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
            opt.schedule.init_state(p, group, state)


def _gloo_rank(rank: int, world: int, cfg: Config, jobs: list[Job]) -> list[dict[str, Any]]:
    """Entry point of a gloo rank (importable, so spawned processes find it): every job of this world size."""
    bar = tqdm(
        total=sum(len(j.keys) for j in jobs),
        desc=f"census, {world} gloo ranks",
        unit="config",
        disable=not cfg.progress or rank != 0,
        leave=False,
    )
    out = []
    with bar, count_collectives(CallCounter()) as counter:
        for job in jobs:
            out.append(trace_job(cfg, job, counter, "real", bar.update))
    return out


# ------------------------------------------------------------------------------------ fake groups


def ranks_to_trace(world: int, count: int | None) -> list[int]:
    """Every rank, or ``count`` of them spread evenly (0 and ``world - 1`` included)."""
    if count is None or count >= world:
        return list(range(world))
    if count == 1:
        return [0]
    return sorted({round(i * (world - 1) / (count - 1)) for i in range(count)})


@contextlib.contextmanager
def fake_rank(rank: int, world: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world`` on torch's fake backend (collectives move no data between
    ranks). ``init_process_group`` chains an excepthook that prefixes ``[rankN]`` per call: put back after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
        _forget_meshes()


def _forget_meshes() -> None:
    """Clear DTensor's caches of sharding decisions: they key on meshes by layout only (a ``DeviceMesh`` equals
    another of the same shape and names), so the next fake rank would get specs holding the last rank's mesh,
    whose process groups are gone."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()


def _fake_all_to_all_single(
    output: Tensor,
    input: Tensor,
    output_split_sizes: Any = None,
    input_split_sizes: Any = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """``dist.all_to_all_single`` for torch's fake backend, which refuses an empty input beside a non-empty
    output (what a rank that sends nothing but receives passes; a real backend takes it): the input is then a
    zero tensor of the output's size, which changes neither the call nor its counted bytes (both read the
    output and its splits)."""
    import torch.distributed.distributed_c10d as c10d

    if input.numel() == 0 and output.numel() > 0:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # the census's stand-in, not an op of the step: not counted
            input, input_split_sizes = torch.zeros_like(output), output_split_sizes
    return c10d.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


class _Done:
    """The handle of a collective that has completed."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _fake_all_gather(output_tensor: Tensor, input_tensor: Tensor, group: Any = None, async_op: bool = False) -> Any:
    """The all-gathers for torch's fake backend, moving nothing: the backend would copy the input into every
    chunk of the output (the whole model per gather refresh, W times the largest share for the replicated
    layout's refresh), values no count depends on. The sizes are checked as a real backend checks them."""
    world = dist.get_world_size(group)
    if output_tensor.numel() != world * input_tensor.numel():
        raise ValueError(f"all-gather of {input_tensor.numel()} elements into {output_tensor.numel()} on {world} ranks")
    return _Done() if async_op else None


@contextlib.contextmanager
def fake_all_to_all() -> Iterator[None]:
    """The all-to-all shim alone (:func:`_fake_all_to_all_single`): the owner refresh runs on the fake backend,
    every other collective as the backend does it (``dimuon bench host``'s sharded rows, which time the step)."""
    with _patched(dist, "all_to_all_single", _fake_all_to_all_single):
        yield


@contextlib.contextmanager
def fake_collectives() -> Iterator[None]:
    """The fake backend's shims (:func:`_fake_all_to_all_single`, :func:`_fake_all_gather`), installed before
    :func:`count_collectives` so that it books them (or the c10d function they call) once."""
    import torch.distributed.distributed_c10d as c10d

    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_all_to_all())
        for name in ("all_gather_single", "all_gather_into_tensor"):
            for module in (c10d, dist):
                if hasattr(module, name):
                    stack.enter_context(_patched(module, name, _fake_all_gather))
        yield


def trace_fake(cfg: Config, job: Job, counter: CallCounter, bar: Any) -> dict[str, Any]:
    """Rank 0 in full (Newton-Schulz stubbed), then a plan pass on every rank of ``--flop-ranks``, the fake group
    re-initialized as that rank each time."""
    plans: dict[int, dict[str, Any]] = {}
    full = info = None
    for rank in ranks_to_trace(job.world, cfg.flop_ranks):
        with fake_rank(rank, job.world):
            if rank == 0:
                traced = trace_job(cfg, job, counter, "stub")
                full, info = traced["records"], traced["info"]
            plans[rank] = trace_job(cfg, job, counter, "plan")["records"]
        bar.update(1)
    return {"full": full, "plans": plans, "info": info}


# ----------------------------------------------------------------------------------------- summary


def _sequence(step: dict[str, Any]) -> list[tuple[Any, ...]]:
    """A step's collectives as (group, kind, dtype, group size): what every rank must issue alike."""
    return [tuple(c[:4]) for c in step["collectives"]]


def member_index(
    ranks: Tensor | None, where: dict[int, tuple[int, ...]], group: Sequence[int], rank: int
) -> int | None:
    """Where ``rank`` sits in its own copy of ``group``, a group of rank 0's spanning some dimensions of the mesh
    (``ranks``: the mesh's global ranks, ``where``: their coordinates, :func:`mesh_coordinates`): the copy through
    ``rank`` holds the same pieces in the same order, so the member at that index does the same work. None where
    ``group`` spans no set of dimensions."""
    if rank not in where or any(r not in where for r in group):
        return None
    origin = where[group[0]]
    dims = [d for d in range(ranks.ndim) if any(where[r][d] != origin[d] for r in group)]
    if len(group) != math.prod(ranks.shape[d] for d in dims):  # not a whole sub-mesh
        return None
    coords = list(origin)
    for d in dims:
        coords[d] = where[rank][d]
    twin = int(ranks[tuple(coords)])
    return group.index(twin) if twin in group else None


def plan_work(
    full: dict[str, Any],
    per_rank: dict[int, dict[str, Any]],
    model_flops: float,
    world: int,
    mesh_ranks: Any = None,
) -> dict[str, Any] | None:
    """Every rank's Newton-Schulz work of the step, derived from rank 0's owner plans (the same on every rank)
    rather than traced: each rank's share of every group's plan (the owner refresh's shard groups, the replicated
    matrices' replica groups; a group rank 0 is not in through its twin on the mesh, :func:`member_index`) plus
    rank 0's work outside them, the same on every rank. Checked against every traced rank. None without owners."""
    groups = full.get("owner_work") or []
    if not groups:
        return None
    rest = full["ns_flops"] - sum(loads[ranks.index(0)] for ranks, loads in groups)
    mesh = None if mesh_ranks is None else torch.tensor(mesh_ranks)
    where = {} if mesh is None else mesh_coordinates(mesh)  # once: every rank's coordinate
    work = {}
    for q in range(world):
        at = [ranks.index(q) if q in ranks else member_index(mesh, where, ranks, q) for ranks, _ in groups]
        if None not in at:
            work[q] = rest + sum(loads[i] for (_, loads), i in zip(groups, at))
    checked = sorted(q for q in per_rank if q in work)
    mean = statistics.fmean(work.values())
    return {
        "ranks": len(work),
        "max": max(work.values()),
        "mean": mean,
        "max_over_mean": max(work.values()) / mean if mean else None,
        # Every rank's work summed against one refresh of every matrix.
        "sum_over_model": mean * world / model_flops if model_flops and len(work) == world else None,
        "ranks_checked": len(checked),
        "matches_traced": all(math.isclose(work[q], per_rank[q]["ns_flops"], rel_tol=1e-9) for q in checked),
    }


def summarize_case(
    key: str,
    index: int,
    full: dict[str, Any],
    per_rank: dict[int, dict[str, Any]],
    model_flops: float,
    world: int,
    plan_of_full: dict[str, Any] | None = None,
    mesh_ranks: Any = None,
) -> dict[str, Any]:
    """One configuration x step x layout x world: rank 0's counts (``full``) and, over ``per_rank`` (rank ->
    that rank's record of the same step), the collective sequences and the Newton-Schulz FLOPs."""
    by_group: dict[tuple[str, str, str], dict[str, int]] = {}
    for group, kind, dtype, size, nbytes, _ in full["collectives"]:
        entry = by_group.setdefault((group, kind, dtype), {"calls": 0, "bytes": 0, "world": size})
        entry["calls"] += 1
        entry["bytes"] += nbytes
    flops = [r["ns_flops"] for r in per_rank.values()]
    mean = statistics.fmean(flops) if flops else 0.0
    spread = len(per_rank) > 1  # balance and duplication need more ranks than rank 0
    seq0 = _sequence(full)
    same = all(_sequence(r) == seq0 for r in per_rank.values())
    payload = sorted({c[2] for c in full["collectives"] if not (c[1] == "all_reduce" and c[4] <= 8)})
    out = {
        "optimizer": key,
        "label": VARIANTS[key].label,
        "step": full["step"],
        "kind": full["kind"],
        "spectral": full["spectral"],
        "collectives": [{"group": g, "kind": k, "dtype": d, **v} for (g, k, d), v in by_group.items()],
        "calls": len(full["collectives"]),
        "launches": full.get("launches", len(full["collectives"])),
        "bytes": sum(c[4] for c in full["collectives"]),
        "payload_dtypes": payload,
        "own": full["own"],
        "host_reads": sum(full["host_reads"].values()),
        "host_reads_by_kind": full["host_reads"],
        "read_sites": full["read_sites"],
        "ops": full["ops"],
        "allocs": full.get("allocs"),
        "ns_ops": full["ns_ops"],
        "c10d_ops": full["c10d_ops"],
        "ns_calls": len(full["ns_batches"]),
        "ns_matrices": sum(b[0] for b in full["ns_batches"]),
        "ns_dtypes": sorted({b[3] for b in full["ns_batches"]}),
        "ns_flops_rank0": full["ns_flops"],
        "ns_flops_max": max(flops, default=0.0),
        "ns_flops_mean": mean,
        "ns_flops_max_over_mean": max(flops) / mean if mean and spread else None,
        # Over the ranks traced, scaled to the world: the Newton-Schulz work of all ranks against one refresh.
        "ns_flops_sum_over_model": mean * world / model_flops if model_flops and spread else None,
        "ns_flops_by_rank": {str(r): int(rec["ns_flops"]) for r, rec in sorted(per_rank.items())},
        "ranks_traced": len(per_rank),
        "same_sequence_on_all_ranks": same,
        "peak_comm_buffer_bytes": max((c[5] for c in full["collectives"]), default=0),
        "peak_ns_batch_bytes": max(
            (b[0] * b[1] * b[2] * DTYPES.get(b[3], torch.float32).itemsize for b in full["ns_batches"]), default=0
        ),
    }
    derived = out["ns_flops_plan"] = plan_work(full, per_rank, model_flops, world, mesh_ranks)
    out["ns_flops_over"] = f"{len(per_rank)} traced rank{'s' * (len(per_rank) > 1)}"
    if derived is not None and derived["matches_traced"] and derived["ranks"] == world:
        # Every rank's work from the owner plan: exact at any world, where traced ranks are a sample.
        out.update(
            ns_flops_max=derived["max"],
            ns_flops_mean=derived["mean"],
            ns_flops_max_over_mean=derived["max_over_mean"],
            ns_flops_sum_over_model=derived["sum_over_model"],
            ns_flops_over=f"all {world} ranks, from the owner plan",
        )
    if plan_of_full is not None:  # the light per-rank trace of rank 0 against its full trace
        out["plan_matches_full"] = plan_of_full["ns_flops"] == full["ns_flops"] and _sequence(plan_of_full) == seq0
    return out


def summarize_job(
    job: Job,
    full: dict[str, dict[str, Any]],
    per_rank: dict[int, dict[str, dict[str, Any]]],
    info: dict[str, Any],
    plan_of_full: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A job's cases from its records (configuration -> ``{"steps": [...]}`` or ``{"refused": why}``); a
    configuration missing from ``per_rank`` (a plan pass leaves some out) is summarized over rank 0 alone."""
    cases, refused = [], {}
    for key in job.keys:
        if "refused" in full[key]:
            refused[key] = full[key]["refused"]
            continue
        for i, step in enumerate(full[key]["steps"]):
            ranks = {r: rec[key]["steps"][i] for r, rec in per_rank.items() if "steps" in rec.get(key, {})}
            plan = plan_of_full.get(key, {}).get("steps", [None] * (i + 1))[i] if plan_of_full is not None else None
            case = summarize_case(
                key, i, step, ranks or {0: step}, info["model_ns_flops"], job.world, plan, info.get("mesh_ranks")
            )
            cases.append(case)
    return {
        "layout": job.layout,
        "world": job.world,
        "model": job.model,
        "depth": job.arch["depth"],
        "heads": job.arch["num_heads"],
        "mesh": mesh_words(job.par),
        "backend": "fake" if job.fake else "gloo",
        "tag": job.tag,
        **info,
        "cases": cases,
        "refused_optimizers": refused,
    }


# ----------------------------------------------------------------------------------------- tables


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def collective_words(case: dict[str, Any]) -> str:
    """``dp_shard: ag 9 f32, ar 1 i32`` per group."""
    per_group: dict[str, list[str]] = {}
    for c in case["collectives"]:
        per_group.setdefault(c["group"], []).append(
            f"{SHORT.get(c['kind'], c['kind'])} {c['calls']} {DTYPE_SHORT.get(c['dtype'], c['dtype'])}"
        )
    words = "; ".join(f"{g}: {', '.join(v)}" for g, v in per_group.items()) or "-"
    launches = case.get("launches", case["calls"])
    return words if launches == case["calls"] else f"{words} ({launches} launches: grouped)"


def _gflops(value: float) -> str:
    return f"{value / 1e9:.1f}" if value else "0"


def table_rows(jobs: Sequence[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for job in jobs:
        for c in job["cases"]:
            balance = c["ns_flops_max_over_mean"]
            dup = c["ns_flops_sum_over_model"]
            rows.append(
                [
                    f"{c['label']}",
                    f"{c['step']} {c['kind']}".strip(),
                    f"{job['layout']} {job['mesh']}",
                    collective_words(c),
                    _mib(c["bytes"]),
                    ",".join(DTYPE_SHORT.get(d, d) for d in c["payload_dtypes"]) or "-",
                    c["host_reads"],
                    c["ops"],
                    _gflops(c["ns_flops_max"]),
                    "-" if balance is None else f"{balance:.2f}",
                    "-" if dup is None else f"{dup:.2f}",
                    "- (rank 0 only)"
                    if c["ranks_traced"] == 1
                    else f"{'yes' if c['same_sequence_on_all_ranks'] else 'NO'} ({c['ranks_traced']})",
                ]
            )
    return rows


HEADERS = [
    "optimizer",
    "step",
    "layout (mesh)",
    "collectives (group: kind calls dtype)",
    "MiB",
    "payload",
    "host reads",
    "ops",
    "NS GFLOP max",
    "max/mean",
    "sum/model",
    "same seq (ranks)",
]
RIGHT = [False, False, False, False, True, False, True, True, True, True, True, False]


def depth_rows(record: dict[str, Any]) -> list[list[Any]]:
    """Ops of RowNorm and block steps at each depth of the gloo model, smallest gloo world."""
    world = min((j["world"] for j in record["jobs"] if j["backend"] == "gloo"), default=None)
    by: dict[tuple[str, str, int], dict[int, dict[str, Any]]] = {}
    for job in record["jobs"]:
        if job["backend"] != "gloo" or job["world"] != world:
            continue
        for c in job["cases"]:
            if c["optimizer"] in DEPTH_VARIANTS and c["step"] == 2:
                by.setdefault((job["layout"], c["optimizer"], c["step"]), {})[job["depth"]] = {**c, **job}
    rows = []
    for (layout, key, _), depths in by.items():
        if len(depths) < 2:
            continue
        (d0, a), (d1, b) = sorted(depths.items())[0], sorted(depths.items())[-1]
        rows.append(
            [
                VARIANTS[key].label,
                a["kind"],
                layout,
                f"{d0} / {d1}",
                f"{a['muon_params']} / {b['muon_params']}",
                f"{a['muon_shapes']} / {b['muon_shapes']}",
                f"{a['ops']} / {b['ops']}",
                f"{b['ops'] / a['ops']:.2f}",
                f"{b['muon_params'] / a['muon_params']:.2f}",
            ]
        )
    return rows


DEPTH_HEADERS = [
    "optimizer",
    "step",
    "layout",
    "depth",
    "Muon params",
    "distinct shapes",
    "ops",
    "ops ratio",
    "params ratio",
]


def render(record: dict[str, Any], markdown: bool = False) -> str:
    table = format_markdown_table if markdown else format_table
    m = record["machine"]
    lines = [
        ("# " if markdown else "") + "Optimizer step census: collectives, host reads, ops, Newton-Schulz FLOPs",
        "",
        f"Produced by `{record['command']}` on torch {m['torch']}, {m['cpu_model']} "
        f"({m['logical_cpus']} logical CPUs), "
        f"{m['date']}; wall time {record['wall_s']:.0f} s. Newton-Schulz dtype {record['config']['ns_dtype']}, "
        f"buckets of {record['config']['bucket_mb']} MiB.",
        "",
        "Per rank 0 and step: collectives counted at the torch.distributed call boundary (ag all-gather, ar "
        "all-reduce, a2a all-to-all, bc broadcast), MiB their logical bytes, payload the dtypes they carry (the "
        "4-byte votes left out), host reads (item/bool/tolist/cpu/numpy), ops the computing ops dispatched outside "
        "Newton-Schulz (views and uninitialized allocations left out) in the accelerator's form of the step; "
        "NS GFLOP max the largest rank's Newton-Schulz work, max/mean its balance over the ranks, sum/model the "
        "work of all ranks against one refresh of every matrix (where owners split it: every rank's, derived "
        "from the owner plan and checked against the traced ranks; else the traced ranks'); same seq: every "
        "traced rank issued rank 0's sequence of (group, kind, dtype).",
    ]
    for world in sorted({j["world"] for j in record["jobs"]}):
        jobs = [j for j in record["jobs"] if j["world"] == world and not j["tag"]]
        if not jobs:
            continue
        first = jobs[0]
        how = (
            "real gloo ranks, real Newton-Schulz"
            if first["backend"] == "gloo"
            else "fake process group, Newton-Schulz stubbed (FLOPs counted, ops not dispatched)"
        )
        depth = ", ".join(sorted({f"{j['layout']}: {j['depth']} blocks" for j in jobs if j["depth"] != first["depth"]}))
        lines += [
            "",
            ("## " if markdown else "")
            + f"W = {world}: {first['model']} ({first['depth']} blocks"
            + (f"; {depth}" if depth else "")
            + f", {first['heads']} heads), {how}",
            "",
        ]
        lines.append(table(HEADERS, table_rows(jobs), right=RIGHT))
    refused = [f"{r['layout']} at W = {r['world']} ({r['model']}): {r['reason']}" for r in record["refused"]]
    refused += [
        f"{VARIANTS[k].label} on {j['layout']} at W = {j['world']}: {why}"
        for j in record["jobs"]
        if not j["tag"]
        for k, why in j["refused_optimizers"].items()
    ]
    if refused:
        lines += ["", "Not traced: " + "; ".join(refused) + "."]
    lines += ["", ("## " if markdown else "") + "First step and refresh buffers (rank 0)", ""]
    lines.append(table(BUFFER_HEADERS, buffer_rows(record), right=[False, *[True] * 7]))
    rows = depth_rows(record)
    if rows:
        lines += ["", ("## " if markdown else "") + "Ops of RowNorm and block steps against the model's depth", ""]
        lines.append(table(DEPTH_HEADERS, rows, right=[False, False, False, *[True] * 6]))
    lines += ["", ("## " if markdown else "") + "Targets", ""]
    lines.append(
        table(["target", "measured"], [[t["target"], t["measured"]] for t in record["targets"]], right=[False, False])
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- targets


def _cases(
    record: dict[str, Any], key: str, step: int | None = None, world: int | None = None, layout: str | None = None
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [
        (j, c)
        for j in record["jobs"]
        if not j["tag"] and (world is None or j["world"] == world) and (layout is None or j["layout"] == layout)
        for c in j["cases"]
        if c["optimizer"] == key and (step is None or c["step"] == step)
    ]


SIGNAL_SITE = "core.py:read"  # where a schedule reads its signals (StepContext.read)
# Where AdaptiveRowMuon with signal_lag=1 reads the previous step's signals: a host copy made a step earlier
# (pinned memory, copied without waiting on a GPU), so no pipeline stall.
LAGGED_SITE = "adaptive.py:_previous_signals"


def signal_reads(case: dict[str, Any], site: str = SIGNAL_SITE) -> int:
    """The host reads of a case that read a per-matrix schedule's staleness signals (at ``site``)."""
    return sum(n for where, n in case["read_sites"].items() if site in where)


def targets(record: dict[str, Any]) -> list[dict[str, str]]:
    """Each target of the engine beside what this census measured (no pass/fail: the numbers)."""
    out = []

    def add(target: str, measured: str) -> None:
        out.append({"target": target, "measured": measured})

    owner, gather = (
        _cases(record, "muon_owner"),
        {(j["world"], j["layout"]): c for j, c in _cases(record, "muon_gather")},
    )

    def calls(case: dict[str, Any], kind: str) -> int:
        return sum(x["calls"] for x in case["collectives"] if x["kind"] == kind)

    parts = []
    for j, c in owner:
        g = gather.get((j["world"], j["layout"]))
        # Sharded buckets of the gather refresh: its all-gathers less those both share (matrices held whole).
        gathers = calls(g, "all_gather") - calls(c, "all_gather") if g else 0
        if calls(c, "all_to_all"):
            parts.append(
                f"{j['layout']} W={j['world']}: {calls(c, 'all_to_all')} all-to-alls for {j['muon_params']} "
                f"matrices of {j['muon_shapes']} shapes (gather: {gathers} all-gathers)"
            )
    add(
        "owner refresh: one exchange each way per bucket of up to W same-shape matrices, not two per matrix",
        "; ".join(parts) or "-",
    )
    parts = []
    for j, c in owner:
        if c["ns_flops_max_over_mean"] is not None:
            parts.append(f"{j['layout']} W={j['world']}: {c['ns_flops_max_over_mean']:.2f}")
    add("owner refresh: Newton-Schulz FLOPs max/mean per rank <= 1.15 at W = 8", "; ".join(parts) or "-")
    derived = [(j, c) for j in record["jobs"] for c in j["cases"] if c.get("ns_flops_plan")]
    wrong = [
        f"{c['label']} step {c['step']} {j['layout']} W={j['world']}"
        for j, c in derived
        if not c["ns_flops_plan"]["matches_traced"]
    ]
    add(
        "every rank's Newton-Schulz work derived from the owner plan = what each traced rank ran",
        (f"{len(derived) - len(wrong)} of {len(derived)} cases" + (f"; differs: {', '.join(wrong)}" if wrong else ""))
        if derived
        else "-",
    )
    for policy, keys, goal in (
        ("skip", ("prm_k3_skip", "adaptive_skip", "adaptive_lag"), "0"),
        ("raise", ("muon_gather", "prm_k3", "muon_bp_p5", "adaptive"), "<= 1"),
    ):
        parts = []
        for key in keys:
            for step in VARIANTS[key].steps:
                cases = [c for _, c in _cases(record, key, step)]
                # With "skip" the schedule's own read of its staleness signals (AdaptiveRowMuon) is not the vote's;
                # with signal_lag=1 that read is of the previous step's host copy.
                skip = policy == "skip"
                found = sorted(
                    {c["host_reads"] - (signal_reads(c) + signal_reads(c, LAGGED_SITE) if skip else 0) for c in cases}
                )
                signals = sorted({signal_reads(c) for c in cases}) if skip else [0]
                lagged = sorted({signal_reads(c, LAGGED_SITE) for c in cases}) if skip else [0]
                if found:
                    extra = f" (+{'/'.join(map(str, signals))} signal read)" if any(signals) else ""
                    extra += f" (+{'/'.join(map(str, lagged))} read of a host copy)" if any(lagged) else ""
                    parts.append(f"{VARIANTS[key].label} step {step}: {'/'.join(map(str, found))}{extra}")
        target = (
            goal
            if policy == "raise"
            else f"{goal} (AdaptiveRowMuon's staleness signals apart: one read, of a host copy made a step earlier "
            "with signal_lag=1)"
        )
        add(f"host reads per optimizer step with nonfinite={policy!r}: {target}", "; ".join(parts) or "-")
    rows = depth_rows(record)
    add(
        "ops per RowNorm or block step grow with distinct shapes, not parameters (ops ratio at two depths vs "
        "params ratio)",
        "; ".join(f"{r[0]} {r[2]}: ops x{r[7]} for params x{r[8]} ({r[3]} blocks)" for r in rows) or "-",
    )
    parts = []
    for key in ("muon_gather", "muon_owner"):
        for what, kinds in (("sharded refresh", ("all_gather", "all_to_all")), ("whole matrices", ("all_gather",))):
            whole = what == "whole matrices"
            found = sorted(
                {
                    x["dtype"]
                    for j, c in _cases(record, key)
                    if (j["layout"] == "replicated") == whole
                    for x in c["collectives"]
                    if x["kind"] in kinds
                }
            )
            ns = sorted(
                {d for j, c in _cases(record, key) if (j["layout"] == "replicated") == whole for d in c["ns_dtypes"]}
            )
            if found:
                parts.append(f"{VARIANTS[key].label}, {what}: sends {'/'.join(found)}, Newton-Schulz in {'/'.join(ns)}")
    add("payload dtype = Newton-Schulz dtype where chosen", "; ".join(parts) or "-")
    return out


BUFFER_HEADERS = [
    "layout (mesh)",
    "W",
    "construction s",
    "first step setup s",
    "gather: largest collective MiB",
    "gather: largest NS batch MiB",
    "owner: largest collective MiB",
    "owner: largest NS batch MiB",
]


def buffer_rows(record: dict[str, Any]) -> list[list[Any]]:
    """Per layout and world: the optimizer's construction (layouts, process groups) and the engine's first-step setup
    on rank 0 (this CPU's seconds), and each spectral
    refresh's largest collective buffer and Newton-Schulz batch (the refresh buffers it assembles)."""
    rows = []
    for job in record["jobs"]:
        if job["tag"]:
            continue
        found = {c["optimizer"]: c for c in job["cases"] if c["optimizer"] in ("muon_gather", "muon_owner")}
        cells = [
            f"{_mib(found[k][field])}" if k in found else "-"
            for k in ("muon_gather", "muon_owner")
            for field in ("peak_comm_buffer_bytes", "peak_ns_batch_bytes")
        ]
        timed = [job.get("construction_s"), job["first_step_setup_s"]]
        rows.append(
            [f"{job['layout']} {job['mesh']}", job["world"], *("-" if t is None else f"{t:.1f}" for t in timed), *cells]
        )
    return rows


# ----------------------------------------------------------------------------------------- main


def source_state() -> dict[str, Any]:
    """The dimuon version and, from a git checkout, the commit and whether the tree differed from it: the engine
    the counts describe."""
    import subprocess

    import dimuon

    out: dict[str, Any] = {"dimuon": dimuon.__version__, "commit": None, "modified": None}
    root = Path(dimuon.__file__).resolve().parents[2]
    try:
        git = ["git", "-C", str(root)]
        out["commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
        out["modified"] = bool(
            subprocess.run(
                [*git, "status", "--porcelain", "--", "src"], capture_output=True, text=True, check=True, timeout=30
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def run(cfg: Config, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Trace every job, write ``census.json`` and ``census.md`` under ``cfg.out``; returns the record."""
    check_config(cfg)
    start = time.perf_counter()
    jobs, refused = plan_jobs(cfg)
    summaries: list[dict[str, Any]] = []
    gloo = [j for j in jobs if not j.fake]
    from dimuon.bench.launch import run_gloo

    for world in sorted({j.world for j in gloo}):
        mine = [j for j in gloo if j.world == world]
        per_rank = run_gloo(_gloo_rank, world, cfg, mine, threads=cfg.threads, timeout_s=cfg.timeout_s)
        for i, job in enumerate(mine):
            ranks = {r: per_rank[r][i]["records"] for r in range(world)}
            summaries.append(summarize_job(job, ranks[0], ranks, per_rank[0][i]["info"]))
    fake = [j for j in jobs if j.fake]
    if fake:
        total = sum(len(ranks_to_trace(j.world, cfg.flop_ranks)) for j in fake)
        with (
            tqdm(total=total, desc="census, fake groups", unit="rank", disable=not cfg.progress) as bar,
            fake_collectives(),
            count_collectives(CallCounter()) as counter,
        ):
            for job in fake:
                bar.set_postfix_str(f"W={job.world} {job.layout}")
                traced = trace_fake(cfg, job, counter, bar)
                summaries.append(
                    summarize_job(job, traced["full"], traced["plans"], traced["info"], traced["plans"][0])
                )
    record: dict[str, Any] = {
        "benchmark": "census",
        "command": "dimuon bench census" + ("" if not argv else " " + " ".join(argv)),
        "machine": machine_info(argv),
        "source": source_state(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "layouts": LAYOUTS,
        "variants": {
            k: {"label": v.label, "build": {"name": v.name, **v.options}, "steps": list(v.steps)}
            for k, v in VARIANTS.items()
            if k in cfg.optimizers
        },
        "notes": {
            "warm_up": "each recorded step follows one warm-up step and a reload of the initial optimizer state",
            "fake_newton_schulz": "fake-group runs stub Newton-Schulz (zeros of the result's shape and dtype); "
            "FLOPs are counted from newton_schulz_products, its ops are not dispatched",
            "fake_ranks": "rank 0 traced in full; FLOPs and sequences over the ranks of --flop-ranks, each with "
            "the fake group re-initialized and the direction maps replaced by zeros; work split among owners "
            "derived for every rank from rank 0's owner plans and checked against the traced ranks",
            "buffers": "largest tensor named by one collective, and largest Newton-Schulz input batch; two buckets "
            "can be in flight at once, the allocator's peak is not measured",
        },
        "jobs": summaries,
        "refused": refused,
        "wall_s": time.perf_counter() - start,
    }
    record["targets"] = targets(record)
    cfg.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(cfg.out / "census.json", record)
    write_text_atomic(cfg.out / "census.md", render(record, markdown=True) + "\n")
    return record


def parse(argv: Sequence[str]) -> Config:
    """The flags parsed and checked by :func:`check_config`, nothing counted: SystemExit(2) for a flag the parser
    refuses, ValueError for a value the check refuses."""
    return parse_bench_flags(Config, argv, PROG, check_config)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dimuon bench census`` and ``python -m dimuon.bench.census``."""
    args = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_or_none(parse, args, PROG)
    if cfg is None:
        return 2
    record = run(cfg, args)
    print(render(record))
    print(f"\nwrote {cfg.out / 'census.json'} and {cfg.out / 'census.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
