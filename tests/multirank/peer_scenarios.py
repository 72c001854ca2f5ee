"""Rank-side programs of the call-boundary and peer tests (importable, so spawned ranks can run them)."""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dimuon.bench.peers import (
    PEERS,
    GradientSnapshot,
    build_peer,
    count_collectives,
    first_step,
    fold_kinds,
    muon_and_rest,
    probe,
)
from dimuon.optim import build, param_groups

from . import scenarios as sc


def _count(fn) -> dict[str, dict[str, int]]:
    with count_collectives() as counter:
        fn()
    return counter.stats()


def collectives(rank: int, world: int) -> dict[str, Any]:
    """Real gloo collectives of every kind gloo has, and DTensor redistributions, each counted alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    prev, nxt = (rank - 1) % world, (rank + 1) % world
    out: dict[str, Any] = {}
    out["all_gather_single"] = _count(lambda: dist.all_gather_single(torch.empty(world * 5), torch.ones(5)))
    out["all_reduce"] = _count(lambda: dist.all_reduce(torch.ones(7)))
    # Source s sends s + 1 elements to every rank.
    out["all_to_all_single"] = _count(
        lambda: dist.all_to_all_single(
            torch.empty(sum(s + 1 for s in range(world))),
            torch.ones(world * (rank + 1)),
            [s + 1 for s in range(world)],
            [rank + 1] * world,
        )
    )
    out["broadcast"] = _count(lambda: dist.broadcast(torch.ones(6), src=2))
    out["gather"] = _count(
        lambda: dist.gather(torch.ones(3), [torch.empty(3) for _ in range(world)] if rank == 1 else None, dst=1)
    )
    out["scatter"] = _count(
        lambda: dist.scatter(torch.empty(3), [torch.ones(3) for _ in range(world)] if rank == 3 else None, src=3)
    )

    def ring() -> None:
        works = [dist.isend(torch.ones(4), nxt), dist.irecv(torch.empty(4), prev)]
        for w in works:
            w.wait()

    out["isend_irecv"] = _count(ring)
    sub = dist.new_group([0, 2])  # global rank 2 is rank 1 of the subgroup
    out["broadcast_subgroup"] = _count(
        lambda: dist.broadcast(torch.ones(5), src=2, group=sub) if rank in (0, 2) else None
    )
    obj = {"rank": "same on every rank"}
    out["all_gather_object"] = _count(lambda: dist.all_gather_object([None] * world, obj))
    out["object_bytes"] = len(pickle.dumps(obj))
    shard = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
    out["full_tensor"] = _count(lambda: shard.full_tensor())
    out["replicate_to_shard"] = _count(
        lambda: DTensor.from_local(torch.ones(8, 3), mesh, [Replicate()]).redistribute(mesh, [Shard(0)]).to_local()
    )
    out["shard0_to_shard1"] = _count(
        lambda: DTensor.from_local(torch.ones(2, 8), mesh, [Shard(0)]).redistribute(mesh, [Shard(1)]).to_local()
    )
    out["partial_to_replicate"] = _count(
        lambda: DTensor.from_local(torch.ones(4), mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()
    )
    dist.barrier()
    return out


DIMUON_CASES = [
    ("muon_gather", "muon", {"refresh": "gather", "bucket_mb": 0.001}),
    ("muon_owner", "muon", {"refresh": "owner", "bucket_mb": 0.001}),
    ("prm_k2", "periodic_row_muon", {"k": 2}),
    ("prm_k3_owner", "periodic_row_muon", {"k": 3, "refresh": "owner"}),
    ("muon_bp_p2", "muon_bp", {"period": 2}),
    ("muon_gather_bf16_comm", "muon", {"comm_dtype": torch.bfloat16}),
]


def _steps(model_name: str, opt, model, steps: int) -> list[tuple[dict, dict]]:
    """Per step: (the optimizer's own comm_stats folded by kind, the call-boundary count)."""
    out = []
    for t in range(steps):
        x, y = sc.batch(model_name, t)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.reset_comm_stats()
        with count_collectives() as counter:
            opt.step()
        out.append((fold_kinds(opt.comm_stats()), counter.stats()))
    return out


def dimuon_counts(rank: int, world: int, steps: int = 3) -> dict[str, list[tuple[dict, dict]]]:
    """dimuon's optimizers on uneven and empty shards (and on replicated parameters): own vs boundary count."""
    out = {}
    for key, optimizer, opts in DIMUON_CASES:
        model, opt = sc.make("odd", optimizer, opts, world)
        out[key] = _steps("odd", opt, model, steps)
    model, _ = sc.make("odd", "adamw", {}, None)
    opt = build(
        "muon",
        param_groups(model, split_sizes=sc.MODELS["odd"][2]),
        lr=sc.LR,
        ns_dtype=torch.float32,
        process_group=dist.group.WORLD,
    )
    out["muon_replicated_broadcast"] = _steps("odd", opt, model, steps)
    dist.barrier()
    return out


def small(world: int | None, replicas: int = 1) -> nn.Module:
    """Two 32 x 32 hidden matrices (rows divide by 2 and 4), biases and a LayerNorm, with seeded gradients;
    FSDP2 on a 1-D mesh of ``world`` ranks (HSDP on ``replicas`` x ``world / replicas`` when ``replicas`` > 1)
    unless ``world`` is None (the same values either way)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32))
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
    if world is None:
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    mesh = (
        init_device_mesh("cpu", (world,))
        if replicas == 1
        else init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    )
    fully_shard(model, mesh=mesh)
    for p, g in zip(model.parameters(), grads):
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
    return model


def first_update(key: str, model: nn.Module) -> list[torch.Tensor]:
    """The change of every hidden matrix (whole, on every rank) in peer ``key``'s first step."""
    muon, rest = muon_and_rest(model)
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in muon]
    before = [t.clone() for t in full]
    build_peer(key, muon, rest, lr=1e-2).step()
    after = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in muon]
    return [a - b for a, b in zip(after, before)]


def peers_on_hsdp(rank: int, world: int) -> dict[str, Any]:
    """Every peer on the small model under HSDP (2 replicas): its status and first update, or why it failed."""
    out: dict[str, Any] = {}
    for key in PEERS:
        status = probe(key, "cpu", "hsdp")
        entry: dict[str, Any] = {"status": status.to_dict()}
        if status.runnable:
            try:
                entry["update"] = first_update(key, small(world, replicas=2))
            except Exception as err:  # the test reads why
                entry["error"] = f"{type(err).__name__}: {err}"
        out[key] = entry
    dist.barrier()
    return out


def peer_traffic(rank: int, world: int) -> dict[str, Any]:
    """Every peer on a small FSDP2 model: its status, and one step's call-boundary count after a first step."""
    out_update = first_update("torch_muon", small(world))
    model = small(world)
    muon, rest = muon_and_rest(model)
    snapshot = GradientSnapshot(model.parameters())
    out: dict[str, Any] = {"shard_bytes": [p.to_local().numel() * 4 for p in muon], "torch_muon_update": out_update}
    for key in PEERS:
        status = probe(key, "cpu", "fsdp2")
        entry: dict[str, Any] = {"status": status.to_dict()}
        if status.runnable:
            before = [p.full_tensor().clone() for p in model.parameters()]
            opt = build_peer(key, muon, rest, lr=1e-2)
            entry["first_step"] = first_step(opt, snapshot)
            with count_collectives() as counter:
                opt.step()
            entry["stats"] = counter.stats()
            entry["moved"] = [not torch.equal(p.full_tensor(), b) for p, b in zip(model.parameters(), before)]
            snapshot.restore()
        out[key] = entry
    dist.barrier()
    return out
