"""What one training step does at the real shapes, counted by the census's own machinery: no count by hand.

The model is built on the meta device and laid out on its mesh in this one process, on torch's fake process
group at the real world size; rank 0 takes one step of every optimizer configuration with the census's plan
tracing (:func:`dimuon.bench.census.trace_job`: collectives at the ``torch.distributed`` boundary, Newton-Schulz
batches, dispatched ops and host reads) and the traffic count of :mod:`dimuon.bench.traffic` (bytes every op reads
and writes). Every rank's Newton-Schulz work under the owner refresh comes from rank 0's owner plans, as in the
census (:func:`dimuon.bench.census.plan_work`). The forward's FLOPs come from torch's ``FlopCounterMode`` on one
meta sample, and FSDP2's and tensor parallelism's own collectives from the laid-out parameters' local pieces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dimuon.bench import census
from dimuon.bench.peers import CallCounter, count_collectives
from dimuon.bench.traffic import booking
from dimuon.bench.variants import Variant
from dimuon.dit.model import DiT
from dimuon.dit.parallel import Parallelism
from dimuon.optim import DEFAULT_BUCKET_MB, fused, param_groups
from dimuon.optim.core import local_tensor

__all__ = ["TRACED", "StepCounts", "count_step", "forward_flops", "layout_comm"]

# The step kinds the model needs, as (census configuration, step index): the spectral step under each refresh,
# the RowNorm step, MuonBP's block step, and AdaptiveRowMuon's second step (its staleness signal's collectives).
TRACED: dict[str, tuple[str, int]] = {
    "spectral_gather": ("muon_gather", 0),
    "spectral_owner": ("muon_owner", 0),
    "spectral_split": ("muon_owner_split", 0),  # HSDP: each matrix refreshed by one replica's shard group
    "rownorm": ("prm_k3", 1),
    "block": ("muon_bp_p5", 1),
    "adaptive": ("adaptive", 1),
}


VARIANTS: dict[str, Variant] = {
    **census.VARIANTS,
    "muon_owner_split": Variant(
        "Muon (owner, split over replicas)", "muon", {"refresh": "owner", "replica_refresh": "split"}
    ),
}


@dataclass
class KindCounts:
    """One optimizer step of one kind on rank 0, with every rank's Newton-Schulz maximum."""

    collectives: list[dict[str, Any]]  # per (group, kind, dtype): {"group", "kind", "dtype", "calls", "bytes"}
    ns_flops_max: float  # the most Newton-Schulz FLOPs any rank does (the step waits for it)
    ns_flops_mean: float
    ns_flops_rank0: float
    traffic_bytes: int  # bytes read and written by the step's ops on rank 0 (Newton-Schulz's stubbed)
    launches: int
    host_reads: int
    refresh_calls: int  # the bucketed refresh's collectives (all-gathers or all-to-alls of the payload)


@dataclass
class StepCounts:
    """Everything counted for one model on one layout and world size."""

    world: int
    dims: tuple[tuple[str, int], ...]
    params: int
    muon_params: int
    forward_flops_per_sample: float
    tokens_per_sample: int
    kinds: dict[str, KindCounts]
    adamw: KindCounts
    layout: dict[str, Any] = field(default_factory=dict)  # the forward/backward collectives' byte counts
    refused: dict[str, str] = field(default_factory=dict)  # step kind -> why the layout refuses its optimizer
    forward_flops_counted: bool = True  # False: estimated (a model from a builder: 2 per matrix weight per token)
    muon_matrices: int = 0  # parameters in Muon groups (the measured host term's per-matrix cost; 0: not counted)


def forward_flops(arch: dict[str, int], input_size: int, in_channels: int = 4, num_classes: int = 1000) -> float:
    """FLOPs of one sample's forward pass (torch's ``FlopCounterMode`` on the meta device: matmuls, attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = DiT(**arch, input_size=input_size, in_channels=in_channels, num_classes=num_classes)
        x = torch.zeros(1, in_channels, input_size, input_size)
        t = torch.zeros(1)
        y = torch.zeros(1, dtype=torch.long)
    model.eval()
    with FlopCounterMode(display=False) as counter:
        model(x, t, y)
    return float(counter.get_total_flops())


def layout_comm(model: nn.Module, par: Parallelism | None) -> dict[str, Any]:
    """The forward/backward collectives' inputs from the laid-out model: per mesh dimension the parameter
    elements a rank holds that the dimension shards (FSDP2 gathers them, reduce-scatters their gradients) and
    the number of tensor-parallel blocks (their activations are all-reduced)."""
    from torch.distributed.tensor import DTensor, Replicate

    sharded: dict[str, int] = {}
    replicated_over: dict[str, int] = {}
    for p in model.parameters():
        if not isinstance(p, DTensor):
            continue
        names = p.device_mesh.mesh_dim_names or ()
        local = local_tensor(p).numel()
        for name, placement in zip(names, p.placements):
            if isinstance(placement, Replicate):
                replicated_over[name] = replicated_over.get(name, 0) + local
            else:
                sharded[name] = sharded.get(name, 0) + local
    from torch.distributed.fsdp import FSDPModule

    units = sum(isinstance(m, FSDPModule) for m in model.modules())  # FSDP2's units: the blocks, then the root
    tp = par is not None and par.tp > 1
    return {
        "sharded_local_numel": sharded,
        "replicated_local_numel": replicated_over,
        "blocks": max(0, units - 1),
        "tp_blocks": len(model.blocks) if tp else 0,  # dimuon's DiT: the one model with a tensor-parallel plan
        "hidden_size": model.blocks[0].attn.qkv.in_features if tp else None,
    }


@contextlib.contextmanager
def _gpu_kernels() -> Iterator[None]:
    """The step as it runs on a GPU with Triton (``kernels="auto"``): the fused momentum and update kernels taken,
    booked by the traffic count from the tensors they load and store, and not run (meta tensors hold no data)."""
    saved = fused.fuses, fused.momentum_, fused.update_
    fused.fuses = lambda kernels, device: kernels != "torch"
    fused.momentum_ = fused.update_ = lambda *args, **kwargs: None
    try:
        yield
    finally:
        fused.fuses, fused.momentum_, fused.update_ = saved


def _book_bytes(book: Any) -> int:
    """Every byte a booked step read and wrote, its AdamW group's included."""
    return book.read + book.written + book.adamw_read + book.adamw_written


@contextlib.contextmanager
def _traffic_probe() -> Iterator[dict[str, Any]]:
    found: dict[str, Any] = {}
    with booking() as book:
        yield found
    found["traffic_bytes"] = _book_bytes(book)
    found["traffic_launches"] = book.launches


def _kind_counts(step: dict[str, Any], work: dict[str, Any] | None) -> KindCounts:
    by_call: dict[tuple[str, str, str], dict[str, Any]] = {}
    for group, kind, dtype, *_, nbytes, _buffer in step["collectives"]:
        entry = by_call.setdefault((group, kind, dtype), {"group": group, "kind": kind, "dtype": dtype, "calls": 0})
        entry["calls"] += 1
        entry["bytes"] = entry.get("bytes", 0) + nbytes
    collectives = list(by_call.values())
    refresh = sum(c["calls"] for c in collectives if c["kind"] in ("all_gather", "all_to_all"))
    rank0 = step["ns_flops"]
    return KindCounts(
        collectives=collectives,
        ns_flops_max=work["max"] if work else rank0,
        ns_flops_mean=work["mean"] if work else rank0,
        ns_flops_rank0=rank0,
        traffic_bytes=int(step.get("traffic_bytes", 0)),
        launches=int(step.get("traffic_launches", step.get("launches", 0))),
        host_reads=sum(step.get("host_reads", {}).values()),
        refresh_calls=refresh,
    )


def _adamw_counts(model: nn.Module) -> KindCounts:
    """torch's fused AdamW (what a GPU user runs) on every parameter's local piece: its op on meta tensors of
    those shapes, booked by the traffic count (4 tensors read, 3 written)."""
    params = [torch.empty(local_tensor(p).shape, device="meta") for p in model.parameters()]
    grads, exp_avgs, exp_avg_sqs = ([torch.empty_like(p) for p in params] for _ in range(3))
    steps = [torch.empty((), device="meta") for _ in params]
    with booking() as book:
        torch._fused_adamw_(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip
    return KindCounts([], 0.0, 0.0, 0.0, _book_bytes(book), book.launches, 0, 0)


def count_step(
    arch: dict[str, int],
    world: int,
    par: Parallelism | None,
    input_size: int,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    ns_dtype: str = "bfloat16",
    fused_kernels: bool = True,
    builder: Callable[[], nn.Module] | None = None,
    tokens_per_sample: int | None = None,
) -> StepCounts:
    """Count one step of every traced kind for a DiT of ``arch`` on ``world`` ranks laid out as ``par``
    (None: replicated), rank 0 traced on the fake group; every rank's Newton-Schulz work from the owner plans.
    ``fused_kernels``: the step as a GPU with Triton runs it (dimuon's fused kernels), else torch's kernels.
    ``builder``: another model than dimuon's DiT (built on the meta device, FSDP2 over its block lists; ``arch``
    then only names it), whose forward FLOPs are estimated as two per hidden-matrix weight per token
    (``tokens_per_sample`` of them), attention left out."""
    cfg = census.Config(
        gloo_worlds=(),
        fake_worlds=(world,),
        input_size=input_size,
        bucket_mb=bucket_mb,
        ns_dtype=ns_dtype,
        progress=False,
    )
    replicated = par is not None and par.dp_replicate > 1
    traced_kinds = {k: v for k, v in TRACED.items() if replicated or k != "spectral_split"}
    keys = tuple(dict.fromkeys(k for k, _ in traced_kinds.values()))
    job = census.Job("plan", world, "custom", dict(arch), par, keys, True, builder=builder)
    with (
        census.fake_collectives(),
        count_collectives(CallCounter()) as counter,
        census.fake_rank(0, world),
        _gpu_kernels() if fused_kernels else contextlib.nullcontext(),
    ):
        traced = census.trace_job(
            cfg,
            job,
            counter,
            "plan",
            keys=keys,
            probe=_traffic_probe,
            ops=True,
            warmup=True,
            variants=VARIANTS,
            inspect=lambda model: {
                "layout": layout_comm(model, par),
                "adamw": _adamw_counts(model),
                "muon_params": sum(
                    p.numel() for g in param_groups(model) if g["algorithm"] == "muon" for _, p in g["params"]
                ),
                "muon_matrices": sum(len(g["params"]) for g in param_groups(model) if g["algorithm"] == "muon"),
            },
        )
    info, records = traced["info"], traced["records"]
    layout, adamw, muon_params, matrices = (
        info["inspected"][k] for k in ("layout", "adamw", "muon_params", "muon_matrices")
    )
    tokens = tokens_per_sample or (input_size // arch["patch_size"]) ** 2
    kinds, refused = {}, {}
    for kind, (key, index) in traced_kinds.items():
        if "refused" in records[key]:  # an optimizer that refuses the layout (AdaptiveRowMuon on column shards)
            refused[kind] = records[key]["refused"]
            continue
        step = records[key]["steps"][index]
        work = census.plan_work(step, {0: step}, info["model_ns_flops"], world, info.get("mesh_ranks"))
        kinds[kind] = _kind_counts(step, work if work and work["ranks"] == world else None)
    kinds.setdefault("spectral_split", kinds["spectral_owner"])  # no replicas: the split is the owner refresh
    return StepCounts(
        world=world,
        dims=() if par is None else par.dims,
        params=info["params"],
        muon_params=muon_params,
        muon_matrices=matrices,
        forward_flops_per_sample=forward_flops(arch, input_size) if builder is None else 2.0 * muon_params * tokens,
        tokens_per_sample=tokens,
        forward_flops_counted=builder is None,
        kinds=kinds,
        adamw=adamw,
        layout=layout,
        refused=refused,
    )
