"""Rank-side programs of the device-vote tests: host reads and collectives of one step of every Muon-family
optimizer on FSDP2 (a 1-D mesh, and a 2-D HSDP mesh whose two groups together cover the world), with gradients
finite or NaN on the last rank only, counted by the census's own tracer."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dimuon.bench.census import tracing
from dimuon.bench.peers import CallCounter, count_collectives
from dimuon.optim import build, param_groups

from .scenarios import MODELS, batch

SCHEDULES = {
    "muon": {},
    "periodic_row_muon": {"k": 3},
    "muon_bp": {"period": 2},
    "adaptive_row_muon": {"k_min": 1, "k_max": 3, "threshold": 0.0},
}
SIGNAL_SITE = "core.py:read"


def _model(mesh_shape: tuple[int, ...], world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cls, _, splits = MODELS["odd"]
    torch.manual_seed(0)
    model = cls()
    names = ("dp_shard",) if len(mesh_shape) == 1 else ("dp_replicate", "dp_shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, splits


def _local_snapshot(model, opt) -> list[torch.Tensor]:
    out = [p.to_local().detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                out.append((v.to_local() if hasattr(v, "to_local") else v).detach().clone())
    return out


def step_reads(rank: int, world: int) -> dict:
    """Per (mesh, optimizer, policy, gradients): the host reads of the traced step by site, its collectives
    (kind, group name, group size, dtype), whether it raised, and whether a skipped step left every local
    tensor bitwise as it was."""
    out = {}
    for mesh_shape in ((world,), (1, world)):
        for name, schedule in SCHEDULES.items():
            for policy in ("skip", "raise"):
                for bad in (False, True):
                    model, splits = _model(mesh_shape, world)
                    opt = build(
                        name,
                        param_groups(model, split_sizes=splits),
                        lr=0.02,
                        weight_decay=0.05,
                        ns_dtype=torch.float32,
                        nonfinite=policy,
                        **schedule,
                    )
                    for t in range(3):
                        x, y = batch("odd", t)
                        opt.zero_grad()
                        nn.functional.mse_loss(model(x), y).backward()
                        if t == 2 and bad and rank == world - 1:
                            model.b.weight.grad.to_local().view(-1)[0] = float("nan")
                        before = _local_snapshot(model, opt) if t == 2 else None
                        if t < 2:  # the engine is built, AdaptiveRowMuon's ages come to need a signal
                            opt.step()
                            continue
                        raised = False
                        with count_collectives(CallCounter()) as counter, tracing(counter) as tally:
                            try:
                                opt.step()
                            except FloatingPointError:
                                raised = True
                        after = _local_snapshot(model, opt)
                        unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
                    out[(len(mesh_shape), name, policy, bad)] = {
                        "sites": dict(tally.read_sites),
                        "raised": raised,
                        "unchanged": unchanged,
                        "votes": [
                            (c.kind, c.group, c.world, c.dtype)
                            for c in tally.collectives
                            if (c.kind, c.dtype) == ("all_reduce", "uint8")
                        ],
                        "world_group": dist.group.WORLD.group_name,
                        "skipped": opt.skipped_steps,
                    }
    return out
