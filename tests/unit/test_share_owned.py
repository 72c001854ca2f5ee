"""The exchange of the owners' directions (dimuon.optim.distributed.owners): its plan cuts what arrives into every
job's direction on either path (padded all-gather, broadcasts), and the replicas' split and the whole matrices'
refresh take the same Python calls per step at any world size (torch's fake process group)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from tests.unit.test_piece_classes import _sharded

from dimuon.bench.host_probe import accelerator_form, dimuon_calls
from dimuon.optim import build
from dimuon.optim.distributed.owners import _unpack, share_plan


def _arrived(plans, mine) -> torch.Tensor:
    """What every rank's segment makes of the buffer on rank 0: padded slots, or the segments back to back."""
    segments = []
    for plan, flats in zip(plans, mine):
        segment = torch.cat(flats) if flats else torch.zeros(0, dtype=plan.dtype)
        if plan.padded:
            segment = torch.cat([segment, torch.zeros(plan.own[1] - segment.numel(), dtype=plan.dtype)])
        segments.append(segment.to(plan.dtype))
    return torch.cat(segments)


@pytest.mark.parametrize(
    ("world", "owners", "padded"),
    [(4, [0, 2, 2, 3, 0], True), (8, [5, 1, 5, 0, 6], False), (3, [1, 1, 1, 1, 1], False), (2, [1, 0, 1, 0, 1], True)],
)
@pytest.mark.parametrize("scaled", [False, True])
def test_the_plan_cuts_every_owners_directions_out_of_what_arrives(world, owners, padded, scaled):
    shapes = [(3, 4), (2, 5), (0, 4), (6, 2), (1, 7)]  # an empty piece among them
    dtypes = [torch.float32, torch.float32, torch.float32, torch.float64, torch.bfloat16]
    g = torch.Generator().manual_seed(0)
    dirs = [torch.randn(s, generator=g).to(d) for s, d in zip(shapes, dtypes)]
    placed = [(SimpleNamespace(update=d), None) for d in dirs]
    idx = list(range(len(dirs)))
    scales = {i: 0.5 + i for i in idx} if scaled else None
    plans = [
        share_plan(SimpleNamespace(world=world, rank=r), placed, idx, owners, torch.float64, scales)
        for r in range(world)
    ]
    assert {p.padded for p in plans} == {padded} and len({p.cuts for p in plans}) == 1
    mine = [[dirs[i].reshape(-1).to(torch.float64) for i in p.mine] for p in plans]
    assert [i for p in plans for i in p.mine] == sorted(idx, key=lambda i: owners[i])
    recv = _arrived(plans, mine)
    assert recv.numel() == plans[0].length == sum(plans[0].cuts)
    out = _unpack(plans[0], recv)
    for i, d in enumerate(dirs):
        want = d.to(torch.promote_types(d.dtype, torch.float32)) * (scales[i] if scaled else 1.0)
        assert out[i].dtype == want.dtype and torch.equal(out[i], want), i


def _split_step_calls(world: int) -> int:
    """Python calls of Muon's spectral step with ``replica_refresh="split"`` on HSDP (world / 4 replicas of 4 ranks),
    with matrices held whole beside: eight sharded (a padded all-gather over the replicas at both sizes) and two
    whole (a broadcast per owner over the world at both sizes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from dimuon.bench.census import fake_collectives, fake_rank

    with fake_rank(0, world), fake_collectives(), accelerator_form():
        mesh = init_device_mesh("cpu", (world // 4, 4), mesh_dim_names=("rep", "shard"))
        params = [_sharded((32, 16), mesh, [Replicate(), Shard(0)], seed) for seed in range(8)]
        params += [_sharded((8, 12), mesh, [Replicate(), Replicate()], 100 + seed) for seed in range(2)]
        opt = build("muon", [{"params": params}], lr=0.05, nonfinite="skip", replica_refresh="split")
        for _ in range(3):  # the per-job step, the plan made, its memo made
            opt.step()
        calls = dimuon_calls(opt.step)
        del opt, params, mesh
    return calls


def test_the_replica_split_takes_the_same_calls_at_any_world_size():
    """What is static about the exchanges (each rank's segment, sizes, padding, the path, the cuts) is planned once
    and kept with the plan: a step's Python does not loop over the ranks (16 and 64 of them)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        counts = [_split_step_calls(world) for world in (16, 64)]
    assert counts[0] == counts[1], counts
