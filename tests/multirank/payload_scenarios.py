"""Rank-side program of the payload-dtype test: spectral refreshes on FSDP2 with Newton-Schulz in bf16, the
momentum sent in bf16 by default against fp32 on the wire (``comm_dtype=torch.float32``)."""

from __future__ import annotations

import torch
from torch import nn

from dimuon.optim import build

SHAPES = {"wide": (12, 40), "tall": (36, 10), "fused": (24, 16)}


def run(rank: int, world: int, refresh: str, comm_dtype: torch.dtype | None, col_split: int | tuple | None) -> dict:
    """Three Muon steps from seeded gradients; the parameters (full) and the refreshes' bytes per kind."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    model = nn.ModuleDict({k: nn.Linear(n, m, bias=False) for k, (m, n) in SHAPES.items()})
    for layer in model.values():
        fully_shard(layer)
    fused = {"params": [model["fused"].weight], "split_sizes": 3, "col_split_sizes": col_split}
    opt = build(
        "muon",
        [{"params": [model["wide"].weight, model["tall"].weight]}, fused],
        lr=0.02,
        ns_dtype=torch.bfloat16,
        refresh=refresh,
        comm_dtype=comm_dtype,
    )
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = distribute_tensor(
                torch.randn(p.shape, generator=gen), p.device_mesh, p.placements, src_data_rank=None
            )
        opt.step()
    stats = {kind: entry["bytes"] for kind, entry in opt.comm_stats().items()}
    return {"params": {k: layer.weight.full_tensor() for k, layer in model.items()}, "bytes": stats}
