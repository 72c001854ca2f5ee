"""The sharded rows of ``dimuon bench host``: rank 0's step of an FSDP2 layout of W ranks, in this one process.

At scale every rank steps DTensor parameters through the sharded engine, whose host side is not the single
process's. This builds the same tiny blocks, lays them out with FSDP2 (``fully_shard`` on every block, then the
root: ``Shard(0)`` pieces, rank 0 holding the first rows of each) on torch's fake process group (collectives move
no data between ranks), gives rank 0 the gradient rows the one-process rows get, and measures dimuon's optimizers
and torch's AdamW there as the other rows are measured. The fake group is made for each size and torn down after
it. Values are real arithmetic on rank 0's pieces: the refresh's Newton-Schulz runs on the matrices rank 0
refreshes (all of them with the gather refresh, its own with the owner refresh), on what the fake collectives
left in the buffers (finite, deterministic, not a cluster's values); at tiny widths that is a small part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from dimuon.bench import host
from dimuon.bench.host_report import LAYOUT, sharded_name

# torch's optimizers that take DTensor parameters (torch_muon runs in one process only)
BASELINES = ("adamw_foreach", "adamw_fused")


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    """``model`` under FSDP2 on ``mesh`` as rank 0, each parameter's gradient the first rows of its one-process
    gradient (what rank 0's piece holds)."""
    from torch.distributed.tensor import DTensor

    from dimuon.dit.parallel import shard_block_lists

    grads = {name: p.grad for name, p in model.named_parameters()}
    shard_block_lists(model, mesh)
    for name, p in model.named_parameters():
        local = p.to_local()
        piece = grads[name][: local.shape[0]].contiguous().to(local.device)
        p.grad = DTensor.from_local(
            piece, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
        )
    return model


def fake_sharded_parameter(
    shape: tuple[int, ...], mesh: Any, placements: Any, generator: torch.Generator
) -> nn.Parameter:
    """A parameter of ``shape`` laid out by ``placements`` on ``mesh`` of torch's fake process group, with a gradient
    laid out alike: this rank's pieces of both drawn from ``generator`` (the fake group scatters nothing)."""
    from torch.distributed.tensor import distribute_tensor

    p = nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, placements))
    p.grad = distribute_tensor(torch.zeros(shape), mesh, placements)
    with torch.no_grad():
        for t in (p, p.grad):
            t.to_local().copy_(torch.randn(t.to_local().shape, generator=generator))
    return p


@contextlib.contextmanager
def fake_world(world: int, device: str = "cpu") -> Iterator[Any]:
    """This process as rank 0 of ``world`` on torch's fake process group, the owner refresh's all-to-all shimmed
    (the backend refuses an empty input beside a non-empty output); yields the 1-D mesh. Torn down after."""
    from torch.distributed.device_mesh import init_device_mesh

    from dimuon.bench.census import fake_all_to_all, fake_rank

    with fake_rank(0, world), fake_all_to_all():
        yield init_device_mesh(device, (world,))


def make_rows(cfg: host.Config, matrices: int, mesh: Any) -> list[host.Row]:
    """dimuon's optimizers (``cfg.sharded_refresh``) and torch's AdamW on the sharded model, named for the mesh's
    world."""
    model = shard(host.make_model(matrices, cfg), mesh)
    world = mesh.size()
    picked = replace(cfg, baselines=tuple(b for b in cfg.baselines if b in BASELINES))
    rows = host.make_rows(picked, matrices, model, options={"refresh": cfg.sharded_refresh})
    for row in rows:
        row.name, row.label = sharded_name(row.name, world), sharded_name(row.label, world)
    return rows


def measure_size(cfg: host.Config, matrices: int, world: int, bar: tqdm) -> list[dict[str, Any]]:
    """The sharded rows at one size as records (the host record's rows, with the layout's world, rank and
    refresh), measured on a fake group of ``world`` ranks made for them and torn down after."""
    extra = {"layout": LAYOUT, "world": world, "rank": 0, "backend": "fake"}
    with fake_world(world, cfg.device) as mesh:
        rows = host.measure_rows(cfg, make_rows(cfg, matrices, mesh), matrices, bar)
        records = [{**host.row_record(r), **extra, "refresh": cfg.sharded_refresh if r.dimuon else None} for r in rows]
        del rows  # the optimizers and the model hold the mesh: let them go before its groups do
    return records
