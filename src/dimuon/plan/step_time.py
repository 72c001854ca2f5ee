"""Counts into seconds: one training step of a DiT on a cluster, for every optimizer and refresh mode.

The rules (docs/plan.md, "The model"), each applied to what :mod:`dimuon.plan.counts` counted:

- compute: the forward's counted FLOPs x 3 (forward and backward) x the samples a data-parallel rank takes,
  split over tensor parallelism, at ``model_mfu`` of the peak;
- FSDP2: every block's parameters all-gathered in bf16 for the forward and again for the backward, gradients
  reduce-scattered in fp32 (HSDP: then all-reduced across replicas); these hide behind ``overlap_fsdp`` of the
  compute, what exceeds it is exposed, and one block's share (the first all-gather, the last reduce-scatter)
  never hides. Tensor parallelism's activation all-reduces (two per block forward, two backward) are exposed;
- the optimizer step runs after the backward, alone: Newton-Schulz at ``newton_schulz`` of the peak, on the
  busiest rank; the refresh is a pipeline of buckets in the shard group, its first transfer exposed and then
  transfer and Newton-Schulz overlapped (``max(C, N) + C / buckets``); the other collectives (statistics,
  checks, the exchange across replicas) are exposed; the memory-bound kernels move their counted bytes at
  ``hbm`` of the bandwidth; the host launches ahead of the GPU, so the step takes the longer of the GPU's work
  and the host's (``ops x host_op_us``, or with a measured host term, :mod:`dimuon.plan.host`, a constant + a cost
  per Muon matrix + a cost per op for each step kind), plus ``host_read_us`` per host read;
- a periodic optimizer's step is the period's mean: PeriodicRowMuon ``(spectral + (K-1) RowNorm) / K``, MuonBP
  ``(full + (P-1) block) / P``, AdaptiveRowMuon ``rate x spectral + (1 - rate) x RowNorm`` plus its staleness
  signal on every step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dimuon.plan.counts import KindCounts, StepCounts
from dimuon.plan.hardware import Efficiency, GpuProfile
from dimuon.plan.host import HostModel
from dimuon.plan.network import GroupSpan, collective_seconds, mesh_spans

__all__ = ["OPTIMIZERS", "Breakdown", "Cluster", "optimizer_mix", "optimizers_for", "step_breakdowns"]

FSDP_PARAM_BYTES = 2  # bf16 parameters gathered (FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16))
FSDP_REDUCE_BYTES = 4  # fp32 gradient reduction (reduce_dtype=float32, torchtitan's default)
ACTIVATION_BYTES = 2  # bf16 activations under tensor parallelism


@dataclass(frozen=True)
class Cluster:
    """The GPUs and how fast their work goes."""

    gpu: GpuProfile
    gpus_per_node: int
    eff: Efficiency
    host: HostModel | None = None  # the measured host term (None: ops x eff.host_op_us)


@dataclass
class Breakdown:
    """One optimizer's mean training step, in seconds, and its parts."""

    step_s: float
    compute_s: float
    layout_comm_exposed_s: float  # FSDP2/HSDP exposed share and tensor parallelism's all-reduces
    optimizer_s: float
    optimizer_ns_s: float  # Newton-Schulz of the busiest rank (period mean)
    optimizer_comm_exposed_s: float  # the optimizer's collectives not hidden behind Newton-Schulz
    optimizer_memory_s: float  # memory-bound kernels and launches
    optimizer_host_s: float

    @property
    def exposed_comm_s(self) -> float:
        return self.layout_comm_exposed_s + self.optimizer_comm_exposed_s

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "exposed_comm_s": self.exposed_comm_s}


def _span(spans: dict[str, GroupSpan], group: str) -> GroupSpan:
    if group not in spans:
        raise ValueError(f"collective on group {group!r}: not a dimension of the mesh {sorted(spans)}")
    return spans[group]


def host_seconds(k: KindCounts, cluster: Cluster, kind: str, matrices: int) -> float:
    """The host's time to launch one step of ``kind``: the measured term where the cluster has one, else its ops x
    ``host_op_us``."""
    if cluster.host is not None:
        return cluster.host.seconds(kind, matrices, k.launches)
    return k.launches * cluster.eff.host_op_us * 1e-6


def kind_seconds(
    k: KindCounts, spans: dict[str, GroupSpan], cluster: Cluster, kind: str = "spectral_owner", matrices: int = 0
) -> dict[str, float]:
    """One optimizer step of one kind (``kind``, on a model of ``matrices`` Muon matrices): Newton-Schulz, exposed
    collectives, memory-bound kernels, host reads."""
    gpu, eff = cluster.gpu, cluster.eff
    ns = k.ns_flops_max / (gpu.bf16_tflops * 1e12 * eff.newton_schulz)
    refresh = other = 0.0
    for c in k.collectives:  # the cost is linear in bytes: each call's latency, then the bytes of all of them
        per_call = collective_seconds(c["kind"], c["bytes"] / c["calls"], _span(spans, c["group"]), gpu, eff)
        t = c["calls"] * per_call
        if c["kind"] in ("all_gather", "all_to_all") and c["group"] != "dp_replicate":
            refresh += t  # the shard group's buckets, pipelined with Newton-Schulz (the replicas' exchange follows)
        else:
            other += t
    to_all = any(c["kind"] == "all_to_all" for c in k.collectives)
    buckets = max(1, k.refresh_calls // (2 if to_all else 1))
    pipelined = max(refresh, ns) + refresh / buckets if refresh else ns
    memory = k.traffic_bytes / (gpu.hbm_tbs * 1e12 * eff.hbm)
    device = pipelined + other + memory
    host = host_seconds(k, cluster, kind, matrices)  # the host launches ahead of the GPU: the slower sets the pace
    reads = k.host_reads * eff.host_read_us * 1e-6  # each read waits for the GPU, then the queue refills
    return {
        "ns": ns,
        "comm_exposed": pipelined - ns + other,
        "memory": memory,
        "host": max(0.0, host - device) + reads,
        "total": max(device, host) + reads,
    }


def layout_seconds(counts: StepCounts, samples_per_rank: float, spans: dict[str, GroupSpan], cluster: Cluster):
    """Forward and backward compute, and the exposed part of the layout's own collectives."""
    gpu, eff = cluster.gpu, cluster.eff
    dims = dict(counts.dims)
    tp = dims.get("tp", 1)
    flops = 3.0 * counts.forward_flops_per_sample * samples_per_rank / tp
    compute = flops / (gpu.bf16_tflops * 1e12 * eff.model_mfu)
    layout = counts.layout
    units = max(1, layout.get("blocks", 0) + 1)
    fsdp = 0.0
    shard = dims.get("dp_shard", 1)
    local = layout.get("sharded_local_numel", {}).get("dp_shard", 0)
    if shard > 1 and local:
        span = spans["dp_shard"]
        gather = local * FSDP_PARAM_BYTES * (shard - 1)
        reduce = local * FSDP_REDUCE_BYTES * (shard - 1)
        fsdp += 2 * units * collective_seconds("all_gather", gather / units, span, gpu, eff)
        fsdp += units * collective_seconds("reduce_scatter", reduce / units, span, gpu, eff)
    replicas = dims.get("dp_replicate", 1) if counts.dims else counts.world
    if replicas > 1:
        group = "dp_replicate" if counts.dims else "world"
        numel = layout.get("replicated_local_numel", {}).get("dp_replicate", 0) if counts.dims else counts.params
        ring = 2 * numel * FSDP_REDUCE_BYTES * (replicas - 1) / replicas
        fsdp += units * collective_seconds("all_reduce", ring / units, spans[group], gpu, eff)
    exposed = max(0.0, fsdp - eff.overlap_fsdp * compute) + fsdp / units if fsdp else 0.0
    tp_s = 0.0
    if tp > 1 and layout.get("tp_blocks"):
        activation = samples_per_rank * counts.tokens_per_sample * layout["hidden_size"] * ACTIVATION_BYTES
        ring = 2 * activation * (tp - 1) / tp
        tp_s = 4 * layout["tp_blocks"] * collective_seconds("all_reduce", ring, spans["tp"], gpu, eff)
    return compute, exposed + tp_s


OPTIMIZERS: dict[str, str] = {
    "adamw": "AdamW (fused)",
    "muon_gather": "Muon, gather refresh",
    "muon_owner": "Muon, owner refresh",
    **{f"prm_k{k}_{r}": f"PeriodicRowMuon K={k}, {r} refresh" for k in (2, 3, 4) for r in ("gather", "owner")},
    "muon_bp_p5": "MuonBP P=5",
    "adaptive": "AdaptiveRowMuon",
    "muon_split": "Muon, owner refresh split over replicas",
    "prm_k3_split": "PeriodicRowMuon K=3, owner refresh split over replicas",
}
# The rows that differ from the owner refresh only where a mesh dimension replicates (HSDP).
REPLICA_ROWS = ("muon_split", "prm_k3_split")


def optimizers_for(dims: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    """Every optimizer row, the split-over-replicas ones only where the mesh has replicas."""
    replicas = dict(dims).get("dp_replicate", 1) > 1
    return tuple(name for name in OPTIMIZERS if replicas or name not in REPLICA_ROWS)


def optimizer_mix(name: str, adaptive_rate: float) -> list[tuple[str, float]]:
    """The step kinds of optimizer ``name`` over its period, with their shares."""
    if name == "adamw":
        return [("adamw", 1.0)]
    if name in ("muon_gather", "muon_owner", "muon_split"):
        return [(f"spectral_{name.removeprefix('muon_')}", 1.0)]
    if name.startswith("prm_k"):
        k_text, refresh = name.removeprefix("prm_k").split("_")
        k = int(k_text)
        return [(f"spectral_{refresh}", 1.0 / k), ("rownorm", (k - 1) / k)]
    if name == "muon_bp_p5":
        return [("spectral_owner", 0.2), ("block", 0.8)]
    if name == "adaptive":
        return [("spectral_owner", adaptive_rate), ("rownorm", 1.0 - adaptive_rate), ("signal", 1.0)]
    raise ValueError(f"unknown optimizer {name!r}; one of {sorted(OPTIMIZERS)}")


def _signal(counts: StepCounts, spans: dict[str, GroupSpan], cluster: Cluster) -> dict[str, float]:
    """AdaptiveRowMuon's own cost on every step: its second step (which refreshes every matrix under the
    census's stub) less the owner refresh's spectral step: the staleness statistics and their all-reduces."""
    m = counts.muon_matrices
    adaptive = kind_seconds(counts.kinds["adaptive"], spans, cluster, "adaptive", m)
    owner = kind_seconds(counts.kinds["spectral_owner"], spans, cluster, "spectral_owner", m)
    return {key: max(0.0, adaptive[key] - owner[key]) for key in adaptive}


def step_breakdowns(
    counts: StepCounts,
    cluster: Cluster,
    global_batch: float,
    optimizers: tuple[str, ...] | None = None,
    adaptive_rate: float = 0.35,
) -> dict[str, Breakdown]:
    """Every optimizer's mean step (``optimizers``, default :func:`optimizers_for` the mesh) for ``global_batch``
    samples on the counted layout."""
    if optimizers is None:
        optimizers = optimizers_for(counts.dims)
    spans = mesh_spans(counts.dims or (("world", counts.world),), cluster.gpus_per_node)  # replicated: the world
    dims = dict(counts.dims)
    data_parallel = dims.get("dp_replicate", 1) * dims.get("dp_shard", 1) if counts.dims else counts.world
    samples = global_batch / data_parallel
    compute, layout_exposed = layout_seconds(counts, samples, spans, cluster)
    m = counts.muon_matrices
    per_kind = {k: kind_seconds(v, spans, cluster, k, m) for k, v in counts.kinds.items()}
    per_kind["adamw"] = kind_seconds(counts.adamw, spans, cluster, "adamw", m)
    if "adaptive" in per_kind:
        per_kind["signal"] = _signal(counts, spans, cluster)
    out = {}
    for name in optimizers:
        mix = optimizer_mix(name, adaptive_rate)
        if any(kind not in per_kind for kind, _ in mix):  # its optimizer refuses this layout (counts.refused)
            continue
        parts = {key: sum(share * per_kind[kind][key] for kind, share in mix) for key in per_kind["adamw"]}
        out[name] = Breakdown(
            step_s=compute + layout_exposed + parts["total"],
            compute_s=compute,
            layout_comm_exposed_s=layout_exposed,
            optimizer_s=parts["total"],
            optimizer_ns_s=parts["ns"],
            optimizer_comm_exposed_s=parts["comm_exposed"],
            optimizer_memory_s=parts["memory"],
            optimizer_host_s=parts["host"],
        )
    return out


def summary_row(name: str, b: Breakdown, adamw: Breakdown) -> dict[str, Any]:
    """One optimizer's step in milliseconds and its overhead over AdamW."""
    return {
        "optimizer": name,
        "label": OPTIMIZERS[name],
        "step_ms": 1e3 * b.step_s,
        "optimizer_ms": 1e3 * b.optimizer_s,
        "exposed_comm_ms": 1e3 * b.exposed_comm_s,
        "overhead_over_adamw": b.step_s / adamw.step_s - 1.0,
        "breakdown_ms": {k: 1e3 * v for k, v in b.as_dict().items()},
    }
