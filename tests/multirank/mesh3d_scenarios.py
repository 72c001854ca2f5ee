"""Rank-side programs of the 3-D mesh tests: HSDP over tensor parallelism, ``dp_replicate x dp_shard x tp`` =
2 x 2 x 2 on 8 gloo ranks, on the bag of layers of :mod:`mesh_scenarios` (uneven and empty pieces, ``m < n`` and
``m > n`` both ways, a fused matrix), a matrix replicated over all three dimensions, and layouts judged by their
placements."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dimuon.optim import build

from . import mesh_scenarios as ms

KEY = "hsdp2x2xtp2"
NAMES, SHAPE = ("dp_replicate", "dp_shard", "tp"), (2, 2, 2)
# MuonBP's one-process blocks that reproduce each rank's pieces: the replicas hold the same pieces, so FSDP x TP's.
ms.BLOCKS.setdefault(KEY, ms.BLOCKS["fsdp2xtp2"])


def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", SHAPE, mesh_dim_names=NAMES)


def shard(model: nn.Module, mesh3) -> nn.Module:
    """torch's own plan, as a user writes it: Colwise/RowwiseParallel over ``tp``, then FSDP2 over the
    ``(dp_replicate, dp_shard)`` sub-mesh (HSDP), every layer and then the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {n: ColwiseParallel() if style == "col" else RowwiseParallel() for n, (_, _, style) in ms.LAYERS.items()}
    parallelize_module(model, mesh3["tp"], plan)
    dp = mesh3["dp_replicate", "dp_shard"]
    for name in ms.LAYERS:
        fully_shard(getattr(model, name), mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def parity(rank: int, world: int, cases: list[tuple[str, str, dict]]) -> dict:
    """Each case trained for ``ms.STEPS`` steps on the 3-D mesh: full parameters, placements, per-step comm."""
    mesh3 = mesh()
    out = {}
    for name, optimizer, opts in cases:
        model = shard(ms._model(), mesh3)
        opt = build(
            optimizer, ms.groups(model, KEY, optimizer), lr=ms.LR, weight_decay=0.05, ns_dtype=torch.float32, **opts
        )
        placements = {n: str(tuple(p.placements)) for n, p in model.named_parameters() if n.endswith("weight")}
        log = ms.train(model, opt, 0, ms.STEPS)
        out[name] = {"params": ms.full_params(model), "log": log, "placements": placements}
    dist.barrier()
    return out


def _period(optimizer: str) -> dict:
    return {"k": 2} if optimizer == "periodic_row_muon" else {}


def replicated_matrix(rank: int, world: int, optimizer: str) -> dict:
    """A matrix outside any plan, ``Replicate()`` over all three dimensions (owners split its refresh over the
    world): its values after 4 steps, and the collectives per mesh dimension."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh3 = mesh()
    torch.manual_seed(0)
    full = torch.randn(24, 40)
    p = nn.Parameter(distribute_tensor(full, mesh3, [Replicate()] * 3))
    opt = build(optimizer, [{"params": [("w", p)]}], lr=ms.LR, ns_dtype=torch.float32, **_period(optimizer))
    for t in range(4):
        gen = torch.Generator().manual_seed(50 + t)
        p.grad = distribute_tensor(torch.randn(full.shape, generator=gen), mesh3, [Replicate()] * 3)
        opt.step()
    result = {"w": p.full_tensor().detach().clone(), "by_dim": opt.comm_stats(by_mesh_dim=True)}
    dist.barrier()
    return result


def replicated_reference(optimizer: str) -> torch.Tensor:
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(24, 40))
    opt = build(optimizer, [{"params": [("w", p)]}], lr=ms.LR, ns_dtype=torch.float32, **_period(optimizer))
    for t in range(4):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(50 + t))
        opt.step()
    return p.detach().clone()


def refusals(rank: int, world: int) -> dict[str, str]:
    """The construction-time outcome for layouts judged by their placements: a 4-D mesh, a dimension named like
    context parallelism, three sharding dimensions (all accepted) and a ``Partial`` one (refused)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    four = init_device_mesh("cpu", (2, 2, 1, 2), mesh_dim_names=("a", "b", "c", "d"))
    cp = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard_cp", "tp"))
    three = mesh()
    cases = {
        "4d_mesh": lambda: distribute_tensor(torch.randn(8, 8), four, [Shard(0)] * 4),
        "cp_dim": lambda: distribute_tensor(torch.randn(8, 8), cp, [Replicate(), Shard(0), Shard(1)]),
        "three_shard": lambda: distribute_tensor(torch.randn(8, 8), three, [Shard(0), Shard(0), Shard(1)]),
        "partial": lambda: DTensor.from_local(torch.randn(8, 4), three, [Replicate(), Partial(), Shard(1)]),
    }
    out = {}
    for name, make_tensor in cases.items():
        try:
            build("muon", [("w", nn.Parameter(make_tensor()))], lr=ms.LR)
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    dist.barrier()
    return out


def everything(rank: int, world: int, cases: list[tuple[str, str, dict]]) -> dict:
    """One spawn (8 gloo ranks cost seconds each to start): parity, the replicated matrix, the refusals."""
    return {
        "parity": parity(rank, world, cases),
        "replicated": {o: replicated_matrix(rank, world, o) for o in ("muon", "periodic_row_muon")},
        "refusals": refusals(rank, world),
        "vote": vote(rank, world),
    }


def vote(rank: int, world: int) -> dict:
    """PeriodicRowMuon with ``nonfinite="skip"`` on the 3-D mesh: a NaN in one rank's gradient piece (step 1), then
    a gradient missing on two ranks (step 2): every rank skips both steps alike, and steps the others."""
    mesh3 = mesh()
    model = shard(ms._model(), mesh3)
    opt = build(
        "periodic_row_muon",
        ms.groups(model, KEY, "periodic_row_muon"),
        lr=ms.LR,
        k=3,
        nonfinite="skip",
        ns_dtype=torch.float32,
    )
    moved = []
    for t in range(4):
        ms.set_grads(model, t)
        if t == 1 and rank == 5:
            model.wide_c.weight.grad.to_local().view(-1)[:1] = float("nan")
        if t == 2 and rank in (2, 6):
            model.tall_r.weight.grad = None
        before = ms.full_params(model)
        opt.step()
        after = ms.full_params(model)
        moved.append(any(not after[n].equal(before[n]) for n in before))
    dist.barrier()
    return {"moved": moved, "skipped": opt.skipped_steps}
