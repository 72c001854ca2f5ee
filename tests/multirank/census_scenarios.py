"""Rank-side programs of the census tests: a hand-made step whose counts are known, counted by the census's own
machinery on real gloo ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dimuon.bench.census import tracing
from dimuon.bench.peers import CallCounter, count_collectives
from dimuon.optim.distributed.engine import MapConfig, apply_map_batched
from dimuon.optim.schedules import StepKind

MATRICES = (2, 8, 16)  # a batch of two (8, 16) matrices for one Newton-Schulz call


def known_counts(rank: int, world: int) -> dict:
    """One all-reduce of 10 floats, one ``.item()``, one ``.tolist()``, one ``.cpu()``, five plain ops, two
    uninitialized allocations; then one
    Newton-Schulz call on a known batch, counted with the real iteration and with the stub."""
    out = {}
    with count_collectives(CallCounter()) as counter:
        with tracing(counter) as tally:
            x = torch.ones(10)  # 1 op
            dist.all_reduce(x)  # a c10d op, booked as a collective
            x.add_(1)  # 1 op
            total = x.sum()  # 1 op
            total.item()  # 1 op, 1 host read (item)
            x.tolist()  # 1 host read (tolist), no dispatch on CPU
            x.cpu()  # 1 host read (cpu), no op on a CPU tensor
            torch.empty(10)  # an allocation: no kernel
            x.new_empty(3)  # an allocation
            torch.zeros(4)  # memory and a fill: 1 op
        out["plain"] = {
            "ops": tally.ops,
            "allocs": tally.allocs,
            "c10d_ops": tally.c10d_ops,
            "host_reads": dict(tally.host_reads),
            "collectives": [(c.kind, c.world, c.dtype, c.bytes, c.buffer_bytes) for c in tally.collectives],
            "world_group": dist.group.WORLD.group_name,
            "groups": [c.group for c in tally.collectives],
        }
        batch = torch.randn(*MATRICES)
        config = MapConfig(ns_dtype=torch.float32)
        for mode in ("real", "stub"):
            with tracing(counter, ns=mode) as tally:
                apply_map_batched(list(batch), StepKind.SPECTRAL, config)
            out[mode] = {"ops": tally.ops, "ns_ops": tally.ns_ops, "batches": tally.ns_batches}
    return out
