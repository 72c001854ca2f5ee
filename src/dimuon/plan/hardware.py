"""GPU profiles and the efficiencies that turn counted work into seconds, each number with its source.

A profile holds what a vendor states for one GPU of its reference 8-GPU server: peak dense bf16 tensor-core
FLOP/s, HBM bandwidth, NVLink bandwidth per direction and the inter-node NIC per GPU. The efficiencies say
what fraction of those peaks a kind of work reaches; each is a named field with its default's source, and
``--calibrate RECORD`` replaces the compute and memory ones with what ``scripts/gpu-check`` measured.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from dimuon.io import read_json_object

# Ops per step of the H200 demo runs' step (PeriodicRowMuon K=3 on DiT-XS/4: a spectral step's 158 and two RowNorm
# steps' 48, as the census counted them for the code that ran), over which ``host_op_us`` was fitted. A step of
# today's code dispatches fewer (the refresh cuts whole classes by index): the fit stays with the code it measured
# until a GPU measures today's.
HOST_OP_FIT_OPS = (158 + 2 * 48) / 3

__all__ = ["EFFICIENCY_SOURCES", "GPUS", "Efficiency", "GpuProfile", "calibrate", "gpu_profile"]


@dataclass(frozen=True)
class GpuProfile:
    """One GPU as its vendor states it: peaks, not what a kernel reaches (that is :class:`Efficiency`)."""

    name: str
    bf16_tflops: float
    """Peak dense bf16 tensor-core TFLOP/s (datasheets also print twice this, "with sparsity")."""
    hbm_tbs: float
    """HBM bandwidth, TB/s."""
    nvlink_gbs: float
    """NVLink bandwidth per GPU per direction, GB/s (half the bidirectional figure datasheets print)."""
    nic_gbs: float
    """Inter-node network per GPU per direction, GB/s (one NIC per GPU in the reference server)."""
    gpus_per_node: int
    """GPUs of the reference server, joined by NVLink."""
    sources: tuple[str, ...]
    """Where the numbers are stated."""


GPUS: dict[str, GpuProfile] = {
    "h100": GpuProfile(
        "NVIDIA H100 SXM5 80GB",
        bf16_tflops=989.4,
        hbm_tbs=3.35,
        nvlink_gbs=450.0,
        nic_gbs=50.0,
        gpus_per_node=8,
        sources=(
            "H100 datasheet (nvidia.com/en-us/data-center/h100): BF16 Tensor Core 1,979 TFLOPS with sparsity "
            "(989 dense), GPU memory bandwidth 3.35 TB/s, NVLink 900 GB/s",
            "DGX H100 datasheet: 8x NVIDIA ConnectX-7 400 Gb/s InfiniBand/Ethernet for the compute fabric, one per GPU",
        ),
    ),
    "h200": GpuProfile(
        "NVIDIA H200 SXM 141GB",
        bf16_tflops=989.4,
        hbm_tbs=4.8,
        nvlink_gbs=450.0,
        nic_gbs=50.0,
        gpus_per_node=8,
        sources=(
            "H200 datasheet (nvidia.com/en-us/data-center/h200): BF16 Tensor Core 1,979 TFLOPS with sparsity "
            "(989 dense), GPU memory bandwidth 4.8 TB/s, NVLink 900 GB/s",
            "HGX H200 reference: 400 Gb/s ConnectX-7 per GPU, as HGX H100",
        ),
    ),
    "b200": GpuProfile(
        "NVIDIA B200 (HGX B200)",
        bf16_tflops=2250.0,
        hbm_tbs=8.0,
        nvlink_gbs=900.0,
        nic_gbs=50.0,
        gpus_per_node=8,
        sources=(
            "HGX B200 datasheet (nvidia.com/en-us/data-center/hgx): per GPU FP16/BF16 Tensor Core 4.5 PFLOPS with "
            "sparsity (2.25 dense), HBM3e 8 TB/s, fifth-generation NVLink 1.8 TB/s",
            "DGX B200 datasheet: 8x single-port ConnectX-7 400 Gb/s for the compute fabric",
        ),
    ),
    "a100": GpuProfile(
        "NVIDIA A100 SXM4 80GB",
        bf16_tflops=312.0,
        hbm_tbs=2.039,
        nvlink_gbs=300.0,
        nic_gbs=25.0,
        gpus_per_node=8,
        sources=(
            "A100 datasheet (nvidia.com/en-us/data-center/a100): BF16 Tensor Core 312 TFLOPS (624 with sparsity), "
            "GPU memory bandwidth 2,039 GB/s (80GB SXM), NVLink 600 GB/s",
            "DGX A100 datasheet: 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand for the compute fabric",
        ),
    ),
}


def gpu_profile(name: str) -> GpuProfile:
    """The profile named ``name`` (``h100``, ``h200``, ``b200``, ``a100``); a ValueError lists them."""
    key = name.lower().replace("-", "").replace(" ", "")
    if key not in GPUS:
        raise ValueError(f"--gpu must be one of {sorted(GPUS)}, got {name!r}")
    return GPUS[key]


@dataclass(frozen=True)
class Efficiency:
    """Fractions of a profile's peaks that each kind of work reaches, and the fixed costs of a call."""

    model_mfu: float = 0.40
    """The DiT's forward and backward: model FLOPs over peak bf16 (MFU)."""
    newton_schulz: float = 0.70
    """Newton-Schulz's batched bf16 products: FLOPs over peak bf16."""
    hbm: float = 0.85
    """Memory-bound optimizer kernels (RowNorm, block, AdamW): counted bytes over peak HBM bandwidth."""
    nvlink: float = 0.82
    """Collectives inside a node: bus bandwidth over NVLink's per-direction peak."""
    network: float = 0.94
    """Collectives across nodes: bus bandwidth over the NIC's per-direction peak."""
    latency_nvlink_us: float = 8.4
    """Fixed cost of one collective call inside a node, microseconds."""
    latency_network_us: float = 25.0
    """Fixed cost of one collective call across nodes, microseconds."""
    hop_nvlink_us: float = 0.6
    """Added per member of a ring inside a node (a ring's latency grows with its length), microseconds."""
    hop_network_us: float = 2.7
    """Added per member of a ring across nodes, microseconds."""
    host_op_us: float = 76.0
    """Host time per dispatched op of dimuon's eager optimizer step (Python, dispatch and launch), microseconds:
    the GPU waits where the host is slower than the kernels it launches (fitted over :data:`HOST_OP_FIT_OPS`)."""
    host_read_us: float = 50.0
    """One host read (``item()``, ``tolist()``): the pipeline drains and refills, microseconds."""
    overlap_fsdp: float = 0.9
    """Fraction of the forward and backward compute that FSDP2's prefetched all-gathers and reduce-scatters
    can hide behind."""

    def checked(self) -> Efficiency:
        """Every fraction in (0, 1], every cost >= 0; a ValueError names the field."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_us"):
                if value < 0:
                    raise ValueError(f"efficiency {f.name} must be >= 0, got {value}")
            elif not 0 < value <= 1:
                raise ValueError(f"efficiency {f.name} must be in (0, 1], got {value}")
        return self


EFFICIENCY_SOURCES: dict[str, str] = {
    "model_mfu": "measured bf16 training on H100: 39.4% MFU (torchtitan, Qwen3-32B on 8 GPUs, pytorch/torchtitan "
    "#1690), 43-53.5% (a 5120-wide model on 1-4 H100, microsoft/dion #96); DiT blocks are the same matmuls and "
    "attention; no DiT figure is published",
    "newton_schulz": "the best bf16 matmul measured on H100 SXM reaches 794.5 TFLOP/s, 80.3% of peak (stas00/"
    "ml-engineering, maximum achievable matmul FLOPS table; A100 86.9%, B200 77.6%); Newton-Schulz's batched "
    "products of 1-4k sides reach less than the best shape: 0.70",
    "hbm": "streaming copies reach 90-91% of the rated HBM bandwidth on a Hopper card (a 4 GiB copy, 3.57 of "
    "3.94 TB/s); 0.85 leaves room for the optimizer's mixed reads and writes",
    "nvlink": "NCCL on 8 H100: about 370 GB/s bus bandwidth for all-gather and reduce-scatter (480 for all-reduce "
    "with NVLink SHARP) of the 450 GB/s line rate (NVIDIA/nccl-tests #212)",
    "network": "a 400 Gb/s NDR NIC gives 46-49 GB/s of its 50 in NCCL (NVIDIA/nccl-tests #290, #267)",
    "latency_nvlink_us": "NCCL's latency model (src/graph/tuning.cc, NCCL 2.30): ring base latency 6.6 us (LL) "
    "to 8.4 (Simple); a small all-reduce on 2 H100 measured about 6 us (NVIDIA/nccl #1259)",
    "latency_network_us": "NCCL's base latency plus the proxy's network path: a small all-reduce across 2 nodes of 8 "
    "H20 measured 47 us (NVIDIA/nccl #1244); 25 sits between the model's ~20 and that",
    "hop_nvlink_us": "NCCL's per-step NVLink latency of a ring, LL protocol (src/graph/tuning.cc, hwLat): 0.6 us",
    "hop_network_us": "NCCL's per-step network latency of a ring, LL protocol (src/graph/tuning.cc, hwLat): 2.7 us",
    "host_op_us": "fitted to the one GPU measurement of dimuon's optimizer step (docs/results/gpu-check/, the "
    "H200 demo runs of 2026-12-04: PeriodicRowMuon K=3 on DiT-XS/4, 7.2 and 5.8 ms per step, host-bound): "
    "(time - host reads) / counted ops (84.7 per step, the code that ran), 83 and 68 us, mean 76; a raw CUDA "
    "launch alone costs 3-5 us",
    "host_read_us": "assumed: a device-to-host read synchronizes the stream and the queue refills from empty, tens of "
    "microseconds (no published measurement; its sensitivity is shown)",
    "overlap_fsdp": "FSDP2 prefetches the next block's all-gather during the current block's compute and "
    "reduce-scatters during the previous block's backward (torch.distributed.fsdp docs)",
}


def calibrate(base: Efficiency, profile: GpuProfile, record_path: Path | str) -> tuple[Efficiency, dict[str, Any]]:
    """``base`` with ``newton_schulz`` and ``hbm`` from what one GPU measured: a ``scripts/gpu-check`` record
    (its optimizer benchmark part) or an optimizer benchmark record (``dimuon bench optimizer --device cuda``).
    Newton-Schulz: the record's bf16 TFLOP/s over the profile's peak; memory: fused AdamW's counted bytes
    (28 per fp32 parameter: 4 tensors read, 3 written) over its median time, over the profile's HBM peak."""
    record = read_json_object(record_path, "--calibrate", "a gpu-check or dimuon bench optimizer record")
    bench = record
    if record.get("benchmark") == "gpu-check":
        bench = record.get("parts", {}).get("bench", {}).get("results") or {}
        if not (bench.get("ns_flop_rate") or bench.get("optimizers")):
            raise ValueError(
                f"--calibrate {record_path}: its optimizer benchmark kept no result (the part's status: "
                f"{record.get('parts', {}).get('bench', {}).get('status')!r}); nothing to calibrate from"
            )
    device = str(bench.get("config", {}).get("device", ""))
    if not device.startswith("cuda"):
        raise ValueError(f"--calibrate {record_path}: a GPU record is needed, this one ran on {device or 'unknown'!r}")
    rates = bench.get("ns_flop_rate") or {}
    standard = rates.get("standard") or {}
    ns_gflops = standard.get("ns_gflops")
    adamw = (bench.get("optimizers") or {}).get("adamw_fused") or {}
    numel = (bench.get("model") or {}).get("params")
    found: dict[str, Any] = {"record": str(record_path)}
    updates: dict[str, float] = {}
    if ns_gflops:
        updates["newton_schulz"] = min(1.0, ns_gflops / 1e3 / profile.bf16_tflops)
        found["ns_tflops"] = ns_gflops / 1e3
    if adamw.get("median_ms") and numel:
        gbs = 28.0 * numel / (adamw["median_ms"] / 1e3) / 1e9
        updates["hbm"] = min(1.0, gbs / (profile.hbm_tbs * 1e3))
        found["adamw_fused_gbs"] = gbs
    if not updates:
        raise ValueError(f"--calibrate {record_path}: no Newton-Schulz rate and no fused AdamW time in the record")
    found["replaced"] = updates
    return replace(base, **updates).checked(), found
