"""A training script's order of building, as a user writes it: the optimizer built before ``fully_shard``."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn


def built_before_fully_shard(rank: int, world: int) -> dict[str, Any]:
    """Build the optimizer, then ``fully_shard`` the model (its parameters replaced by DTensors), then train: the
    optimizer's tensors get no gradient; report the warnings of three steps and whether its tensors moved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dimuon.optim import NoGradientWarning, PeriodicRowMuon, param_groups

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Linear(16, 4))
    opt = PeriodicRowMuon(param_groups(model), lr=0.02, k=3)
    held = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for t in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(t))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    now = [p.detach() for g in opt.param_groups for p in g["params"]]
    return {
        "warnings": [str(w.message) for w in seen if issubclass(w.category, NoGradientWarning)],
        "unchanged": all(torch.equal(a, b) for a, b in zip(held, now)),
        "replaced": type(next(model.parameters())).__name__,
    }
