"""Rank-side programs of the context-parallel tests on 8 gloo ranks: the bag of layers of :mod:`mesh_scenarios`
under tensor parallelism with FSDP2 over the data x context ranks, in torchtitan's form (``mesh["dp_shard", "cp"]``
flattened, FSDP over it) and in torch's SPMD form (every parameter a DTensor on the full mesh, then
``fully_shard(..., dp_mesh_dims=DataParallelMeshDims(shard=("dp_shard", "cp")))``), on 3-D and 4-D meshes.

Context parallelism splits the sequence, so every rank of the data x context group sees other tokens and FSDP's
reduce-scatter over the flattened group averages their gradients: to the optimizer it is one more FSDP shard
dimension. The seeded full gradients of :func:`mesh_scenarios.set_grads` stand for that averaged gradient."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dimuon.optim import build

from . import mesh_scenarios as ms

# name: (mesh dimension names, shape, FSDP's shard dimensions, its replicate dimension, how the model is laid out)
FORMS = {
    "titan": (("dp_shard", "cp", "tp"), (2, 2, 2), ("dp_shard", "cp"), None, "titan"),
    "spmd": (("dp_shard", "cp", "tp"), (2, 2, 2), ("dp_shard", "cp"), None, "spmd"),
    "spmd4_tp1": (("dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 2, 1), ("dp_shard", "cp"), "dp_replicate", "spmd"),
    "spmd4_dp1": (("dp_replicate", "dp_shard", "cp", "tp"), (2, 1, 2, 2), ("dp_shard", "cp"), "dp_replicate", "spmd"),
    # cp left out of FSDP's dimensions: parameters stay on the 4-D mesh, replicated over dp_replicate and cp.
    "spmd4_cp_rep": (("dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 2, 1), ("dp_shard",), "dp_replicate", "spmd"),
}

# MuonBP's one-process blocks that reproduce each form's pieces (FSDP's row chunks inside TP's, per layer style).
ms.BLOCKS.setdefault("titan", {"col": 8, "row": (4, 2)})
ms.BLOCKS.setdefault("spmd", {"col": 8, "row": (4, 2)})
ms.BLOCKS.setdefault("spmd4_tp1", {"col": 4, "row": (4, 1)})
ms.BLOCKS.setdefault("spmd4_dp1", ms.BLOCKS["fsdp2xtp2"])
ms.BLOCKS.setdefault("spmd4_cp_rep", {"col": 2, "row": (2, 1)})
# Where FSDP's four row chunks inside TP's two are not torch.chunk(rows, 8): 20 rows give 3, 3, 3, 1 per half.
BP_SKIP = {"titan": {"wide_c.weight"}, "spmd": {"wide_c.weight"}}


def meshes() -> dict:
    """One device mesh per (names, shape), built once per job: torch 2.13 takes a second mesh equal to the first as
    the first, and SPMD ``fully_shard`` then finds a parameter's mesh is not the one it was given."""
    from torch.distributed.device_mesh import init_device_mesh

    built: dict = {}
    for names, shape, *_ in FORMS.values():
        if (names, shape) not in built:
            built[(names, shape)] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return built


def shard(model: nn.Module, form: str, built: dict) -> nn.Module:
    """Lay the model out as ``form`` says: Colwise/RowwiseParallel over ``tp``, FSDP2 over the data x context ranks,
    every layer and then the root."""
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names, shape, shard_dims, replicate, how = FORMS[form]
    mesh = built[(names, shape)]
    if how == "titan":
        plan = {n: ColwiseParallel() if s == "col" else RowwiseParallel() for n, (_, _, s) in ms.LAYERS.items()}
        parallelize_module(model, mesh["tp"], plan)
        dp = mesh[shard_dims]._flatten("_".join(shard_dims))
        for name in ms.LAYERS:
            fully_shard(getattr(model, name), mesh=dp)
        fully_shard(model, mesh=dp)
        return model
    tp = names.index("tp")
    for name, (_, _, style) in ms.LAYERS.items():
        layer = getattr(model, name)
        for pname, dim in (("weight", 0 if style == "col" else 1), ("bias", 0 if style == "col" else None)):
            placements = [Replicate()] * len(names)
            if dim is not None:
                placements[tp] = Shard(dim)
            value = getattr(layer, pname).detach()
            setattr(layer, pname, nn.Parameter(distribute_tensor(value, mesh, placements)))
    dims = DataParallelMeshDims(shard=shard_dims, replicate=replicate)
    for name in ms.LAYERS:
        fully_shard(getattr(model, name), mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    return model


def make(form: str, built: dict, optimizer: str, opts: dict):
    model = shard(ms._model(), form, built)
    opt = build(
        optimizer, ms.groups(model, form, optimizer), lr=ms.LR, weight_decay=0.05, ns_dtype=torch.float32, **opts
    )
    return model, opt


def parity(rank: int, world: int, cases: list[tuple[str, str, str, dict]]) -> dict:
    """Each ``(name, form, optimizer, options)`` trained ``ms.STEPS`` steps: full parameters, placements, meshes
    and the collectives per mesh dimension of every step."""
    built = meshes()
    out = {}
    for name, form, optimizer, opts in cases:
        model, opt = make(form, built, optimizer, opts)
        weights = {n: p for n, p in model.named_parameters() if n.endswith("weight")}
        placements = {n: str(tuple(p.placements)) for n, p in weights.items()}
        mesh_names = {n: p.device_mesh.mesh_dim_names for n, p in weights.items()}
        log = ms.train(model, opt, 0, ms.STEPS)
        out[name] = {"params": ms.full_params(model), "log": log, "placements": placements, "meshes": mesh_names}
    dist.barrier()
    return out


def dcp_save(rank: int, world: int, root: str, form: str, steps: int) -> dict:
    """PeriodicRowMuon on ``form`` trained ``steps`` steps, model and optimizer saved with DCP to ``root``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = make(form, meshes(), "periodic_row_muon", {"k": 3})
    ms.train(model, opt, 0, steps)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
    dist.barrier()
    return {"phase": [g["step"] for g in opt.param_groups]}


def _period(optimizer: str) -> dict:
    return {"k": 2} if optimizer == "periodic_row_muon" else {}


MATRIX = (22, 38)  # uneven pieces: rows 6, 5, 6, 5 over dp_shard x cp, columns 19 over tp


def three_sharding_dims(rank: int, world: int, optimizer: str, refresh: str) -> torch.Tensor:
    """A matrix outside any plan with every mesh dimension sharding it, ``(Shard(0), Shard(0), Shard(1))`` on
    ``(dp_shard, cp, tp)``: its values after 4 steps (the refresh over the three dimensions flattened)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    names, shape, *_ = FORMS["spmd"]
    mesh = meshes()[(names, shape)]
    placements = [Shard(0), Shard(0), Shard(1)]
    torch.manual_seed(0)
    p = nn.Parameter(distribute_tensor(torch.randn(MATRIX), mesh, placements))
    opt = build(
        optimizer, [{"params": [("w", p)]}], lr=ms.LR, ns_dtype=torch.float32, refresh=refresh, **_period(optimizer)
    )
    for t in range(4):
        gen = torch.Generator().manual_seed(50 + t)
        p.grad = distribute_tensor(torch.randn(MATRIX, generator=gen), mesh, placements, src_data_rank=None)
        opt.step()
    out = p.full_tensor().detach().clone()
    dist.barrier()
    return out


def three_sharding_dims_reference(optimizer: str) -> torch.Tensor:
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(MATRIX))
    opt = build(optimizer, [{"params": [("w", p)]}], lr=ms.LR, ns_dtype=torch.float32, **_period(optimizer))
    for t in range(4):
        p.grad = torch.randn(MATRIX, generator=torch.Generator().manual_seed(50 + t))
        opt.step()
    return p.detach().clone()


THREE = [("muon", "gather"), ("muon", "owner"), ("periodic_row_muon", "owner")]


def everything(rank: int, world: int, cases: list[tuple[str, str, str, dict]], root: str) -> dict:
    """One spawn (8 gloo ranks cost seconds each to start): every parity case, the matrix sharded by all three
    dimensions, and the DCP save."""
    return {
        "parity": parity(rank, world, cases),
        "three": {case: three_sharding_dims(rank, world, *case) for case in THREE},
        "dcp": dcp_save(rank, world, root, "titan", 3),
    }
