"""Rank-side programs of the expert-parallel tests on 4 (and 8) gloo ranks: a small mixture-of-experts layer (three
stacked expert weights, wide and tall, 3 experts: uneven over the ranks; a router gate in AdamW; a dense projection in
Muon) with its experts laid out as torchtitan lays them out, and one process with the same gradients as the oracle.

torchtitan (0.3.0, ``distributed/fsdp.py``) puts routed experts on the mesh ``(efsdp, ep)``: ``Shard(0)`` over
``ep``, then FSDP2 in its SPMD form over ``efsdp`` with ``Shard(1)`` where ``efsdp * ep`` exceeds the experts (else
``Shard(0)``, which torch makes a ``_StridedShard(0, sf=ep)``); it keeps ``efsdp`` of size 1 under expert
parallelism alone. ``LAYOUTS``: ``ep4`` (``efsdp=1, ep=4``: one rank holds no expert), ``efsdp2xep2`` (each expert's
rows split over ``efsdp``) and ``efsdp2xep2_rows0`` (FSDP's ``Shard(0)``: whole experts); on 8 ranks, HSDP over
them (``dp_replicate=2, efsdp=2, ep=2``). The dense parameters are ``Shard(0)`` over a mesh ``(dp_shard=W,)`` of
the same ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dimuon.optim import build

STEPS = 6
LR = 0.02
EXPERTS = 3
LAYOUTS = {"ep4": ((1, 4), 1), "efsdp2xep2": ((2, 2), 1), "efsdp2xep2_rows0": ((2, 2), 0)}  # mesh, FSDP's dim
# HSDP on 8 ranks: the experts' mesh (dp_replicate, efsdp, ep), each expert's rows split over efsdp.
HSDP_LAYOUTS = {"hsdp2xefsdp2xep2": ((2, 2, 2), 1)}
# MuonBP's one-process row blocks of each expert that reproduce each rank's rows under efsdp=2 (whole experts cut the
# same grid locally); the dense projection's are its ranks.
EXPERT_BLOCKS = 2
EXPERT_NAMES = ("experts.w1", "experts.w2", "experts.w3")


class GroupedExperts(nn.Module):
    """torchtitan's names and shapes: ``w1``, ``w3`` ``(E, hidden, dim)``, ``w2`` ``(E, dim, hidden)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, 12, 16) / 4)  # wide experts: RowNorm local
        self.w2 = nn.Parameter(torch.randn(EXPERTS, 16, 12) / 4)  # tall: RowNorm sums its columns over the row split
        self.w3 = nn.Parameter(torch.randn(EXPERTS, 12, 16) / 4)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, EXPERTS, bias=False)  # the router
        self.proj = nn.Linear(16, 16, bias=False)
        self.experts = GroupedExperts()


def _model() -> MoE:
    torch.manual_seed(0)
    return MoE()


def groups(model: MoE, optimizer: str, experts_only: bool = False, world: int = 4) -> list[dict]:
    """The experts stacked, the projection a plain Muon group (AdamW with ``experts_only``), the router in AdamW;
    MuonBP's blocks as ``world`` ranks cut them."""
    named = dict(model.named_parameters())
    experts = {"params": [(n, named[n]) for n in EXPERT_NAMES], "stacked": True}
    dense = {"params": [("proj.weight", model.proj.weight)]}
    if optimizer == "muon_bp":
        experts["blocks"], dense["blocks"] = EXPERT_BLOCKS, world
    adamw = {"params": [("gate.weight", model.gate.weight)], "algorithm": "adamw"}
    if experts_only:
        return [experts, {**adamw, "params": [*adamw["params"], *dense["params"]]}]
    return [experts, dense, adamw]


_MESHES: dict = {}


def shard(model: MoE, layout: str) -> MoE:
    """torchtitan's layout: the experts ``Shard(0)`` over ``ep``, then FSDP2 (SPMD form) over ``efsdp`` on the
    dimension ``LAYOUTS`` gives; the dense parameters cut from the same full values on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    shape, fsdp_dim = {**LAYOUTS, **HSDP_LAYOUTS}[layout]
    hsdp = len(shape) == 3
    names = ("dp_replicate", "efsdp", "ep") if hsdp else ("efsdp", "ep")
    if shape not in _MESHES:  # once per process: FSDP2 would see a second mesh of one layout as another mesh
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if "dense" not in _MESHES:
        _MESHES["dense"] = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    sparse, dense = _MESHES[shape], _MESHES["dense"]
    for name, p in list(model.experts.named_parameters()):
        full = p.detach()
        where = (Replicate(),) * (len(shape) - 1) + (Shard(0),)
        setattr(model.experts, name, nn.Parameter(distribute_tensor(full, sparse, where, src_data_rank=None)))
    fully_shard(
        model.experts,
        mesh=sparse,
        dp_mesh_dims=DataParallelMeshDims(shard="efsdp", replicate="dp_replicate" if hsdp else None),
        shard_placement_fn=lambda _: Shard(fsdp_dim),
    )
    for module in (model.gate, model.proj):
        module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), dense, (Shard(0),), src_data_rank=None))
    return model


def set_grads(model: nn.Module, step: int) -> None:
    """Seeded full gradients (a fixed direction per parameter plus noise, so the adaptive schedule takes both kinds),
    each rank keeping its piece."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    base, gen = torch.Generator().manual_seed(7), torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=base) + 0.5 * torch.randn(p.shape, generator=gen)
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            local = p.to_local()
            if p.grad.to_local().shape != local.shape:  # FSDP2 shapes an empty shard its own way, as its gradient
                p.grad = DTensor.from_local(
                    local.new_zeros(local.shape), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
        else:
            p.grad = full


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (an FSDP2 shard of its own empty shape first given DTensor's, so the gather fits)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for n, p in model.named_parameters():
        if isinstance(p, DTensor):
            local = p.to_local()
            shape, _ = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            if tuple(local.shape) != tuple(shape):
                local = local.new_zeros(shape)
            p = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            p = p.full_tensor()
        out[n] = p.detach().clone()
    return out


def train(model: nn.Module, opt) -> tuple[list[dict], list[dict]]:
    """Per step: the collectives by mesh dimension, and which matrices refreshed."""
    stats, refreshes = [], []
    for t in range(STEPS):
        set_grads(model, t)
        opt.reset_comm_stats()
        opt.reset_refresh_stats()
        opt.step()
        stats.append(opt.comm_stats(by_mesh_dim=True))
        refreshes.append({k: m["spectral"] for k, m in opt.refresh_stats()["matrices"].items()})
    return stats, refreshes


def run(layout: str, optimizer: str, opts: dict, experts_only: bool = False) -> dict:
    model = shard(_model(), layout)
    opt = build(
        optimizer,
        groups(model, optimizer, experts_only, dist.get_world_size()),
        lr=LR,
        weight_decay=0.05,
        ns_dtype=torch.float32,
        **opts,
    )
    placements = {n: str(tuple(p.placements)) for n, p in model.named_parameters()}
    stats, refreshes = train(model, opt)
    return {"params": full_params(model), "stats": stats, "refreshes": refreshes, "placements": placements}


def reference(optimizer: str, opts: dict, experts_only: bool = False, world: int = 4) -> tuple[dict, list[dict]]:
    model = _model()
    local = {k: v for k, v in opts.items() if k not in ("refresh", "replica_refresh")}
    opt = build(
        optimizer,
        groups(model, optimizer, experts_only, world),
        lr=LR,
        weight_decay=0.05,
        ns_dtype=torch.float32,
        **local,
    )
    _, refreshes = train(model, opt)
    return full_params(model), refreshes


def cases(rank: int, world: int, todo: list[tuple[str, str, str, dict, bool]]) -> dict:
    """Each ``(key, layout, optimizer, opts, experts_only)`` trained for ``STEPS`` steps, in one spawn."""
    out = {key: run(layout, optimizer, opts, only) for key, layout, optimizer, opts, only in todo}
    dist.barrier()
    return out


def refusals(rank: int, world: int) -> dict[str, str]:
    """The construction errors for the expert layouts that stay unsupported."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    uneven = torch.randn(EXPERTS, 5, 16)  # 5 rows over efsdp=2
    cols = torch.randn(EXPERTS, 12, 16)
    tried = {
        "adaptive_uneven_rows": (
            "adaptive_row_muon",
            distribute_tensor(uneven, mesh, (Shard(1), Shard(0)), src_data_rank=None),
        ),
        "shard2": ("muon", distribute_tensor(cols, mesh, (Shard(2), Shard(0)), src_data_rank=None)),
    }
    out = {}
    for key, (optimizer, tensor) in tried.items():
        try:
            build(optimizer, [{"params": [("w1", nn.Parameter(tensor))], "stacked": True}], lr=LR)
            out[key] = "built"
        except ValueError as e:
            out[key] = str(e)
    dist.barrier()
    return out


ARM = {"threshold": 0.3, "k_min": 1, "k_max": 3}
OPTIMIZERS = [
    ("gather", "muon", {"refresh": "gather"}),
    ("owner", "muon", {"refresh": "owner"}),
    ("prm", "periodic_row_muon", {"k": 2, "gamma": 0.5, "refresh": "gather"}),
    ("prm_owner", "periodic_row_muon", {"k": 2, "gamma": 0.5, "refresh": "owner"}),
    ("bp", "muon_bp", {"period": 2}),
    ("arm", "adaptive_row_muon", ARM),
]
# Every optimizer on every layout with the dense projection, then the experts alone over ep (what they send).
CASES = [
    (f"{layout}/{key}", layout, optimizer, opts, False) for layout in LAYOUTS for key, optimizer, opts in OPTIMIZERS
]
CASES += [(f"experts_only/{key}", "ep4", optimizer, opts, True) for key, optimizer, opts in OPTIMIZERS]
# The default run's one spawn: each expert's rows split over efsdp (assembly, RowNorm's column sums), and the
# experts alone over ep (nothing but the vote).
SMOKE = [
    ("rows", "efsdp2xep2", "periodic_row_muon", {"k": 2, "gamma": 0.5}, False),
    ("ep_alone", "ep4", "muon", {}, True),
]


def everything(rank: int, world: int) -> dict:
    """The slow tests' one spawn: every case, and the refusals."""
    return {"cases": cases(rank, world, CASES), "refusals": refusals(rank, world)}


# On 8 ranks (slow): HSDP over the experts, every optimizer, both ways of sharing the refresh across replicas.
HSDP_CASES = [
    (f"hsdp/{key}", "hsdp2xefsdp2xep2", optimizer, opts, False)
    for key, optimizer, opts in [
        *OPTIMIZERS,
        ("owner_split", "muon", {"refresh": "owner", "replica_refresh": "split"}),
        (
            "prm_gather_split",
            "periodic_row_muon",
            {"k": 2, "gamma": 0.5, "refresh": "gather", "replica_refresh": "split"},
        ),
    ]
]


def dcp_save(rank: int, world: int, path: str, layout: str, optimizer: str, opts: dict, steps: int) -> dict:
    """``steps`` steps, then the optimizer's state saved with DCP (sharded as the parameters are, AdaptiveRowMuon's
    row sums split with each expert's rows); the whole parameters then."""
    import torch.distributed.checkpoint as dcp

    model = shard(_model(), layout)
    opt = build(
        optimizer, groups(model, optimizer, False, world), lr=LR, weight_decay=0.05, ns_dtype=torch.float32, **opts
    )
    for t in range(steps):
        set_grads(model, t)
        opt.step()
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)
    params = full_params(model)
    dist.barrier()
    return params


def resume_in_one_process(path: str, params: dict, optimizer: str, opts: dict, steps: int) -> dict:
    """One process loads the saved parameters and optimizer state and trains the remaining steps."""
    import torch.distributed.checkpoint as dcp

    model = _model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    opt = build(optimizer, groups(model, optimizer), lr=LR, weight_decay=0.05, ns_dtype=torch.float32, **opts)
    state = {"optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    opt.load_state_dict(state["optim"])
    for t in range(steps, STEPS):
        set_grads(model, t)
        opt.step()
    return full_params(model)
