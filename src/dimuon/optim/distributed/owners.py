"""Owners of matrices within a group of ranks, and the exchange of what the owners computed.

:func:`assign_owners` picks each matrix's owner among a group's ranks, balanced by Newton-Schulz FLOPs and the same
on every rank: the owner refresh's within a shard group, the replicas' split, the matrices held whole.
:func:`_share_owned` sends every owner's directions to every rank of its group: one all-gather of the owners'
segments padded to the largest, or, where that would move more than :data:`PADDED_GATHER_LIMIT` times their bytes
(more ranks than matrices), one broadcast per owner, issued as one group launch where the backend groups (NCCL). The
spectral refresh (:mod:`dimuon.optim.distributed.refresh`) shares this way the directions of the matrices held whole
and the pieces the replicas refreshed (``replica_refresh="split"``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dimuon.optim.distributed.collectives import Collectives
from dimuon.optim.distributed.placement import Placed
from dimuon.optim.linalg import oriented_shape


@functools.lru_cache(maxsize=4096)
def _ns_cost(rows: int, cols: int) -> float:
    """Relative Newton-Schulz FLOPs of one matrix (oriented ``r <= c``): 5 x (2 r^2 c + r^3); kept per shape (a
    plan of owners asks it of every matrix, of a few shapes)."""
    r, c = oriented_shape(rows, cols)
    return 5.0 * (2.0 * r * r * c + r**3)


def assign_owners(
    shapes: Sequence[tuple[int, int]], world: int, classes: Sequence[Hashable] | None = None
) -> list[int]:
    """Owner rank per matrix, balanced by Newton-Schulz FLOPs and the same on every rank: the matrices of each class
    (default: one shape; of one cost) taken ``world`` at a time, the costliest class first, each chunk's matrices
    to as many of the least-loaded ranks, one each. A class of ``n`` matrices then has at most ``ceil(n / world)``
    on any rank, the fewest owner-refresh buckets it can take, and the load stays within one matrix of even."""
    keys = list(classes) if classes is not None else [tuple(s) for s in shapes]
    members: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        members.setdefault(key, []).append(i)
    load = [0.0] * world
    owners = [0] * len(shapes)
    costs = [_ns_cost(*shape) for shape in shapes]
    for idx in sorted(members.values(), key=lambda idx: (-max([costs[i] for i in idx]), idx[0])):
        for start in range(0, len(idx), world):
            chunk = idx[start : start + world]
            # the least-loaded ranks, ties to the lowest: pairs sorted in C, no Python call per rank
            for i, (_, rank) in zip(chunk, sorted(zip(load, range(world)))):
                owners[i] = rank
                load[rank] += costs[i]
    return owners


# The padded all-gather of :func:`share_plan` moves W times the largest segment; past this many times the segments'
# real bytes (more ranks than matrices, at large W) the owners broadcast their segments instead.
PADDED_GATHER_LIMIT = 2.0


@dataclass(frozen=True)
class SharePlan:
    """What is static about one group's exchange of its owners' directions (:func:`share_plan`), so that a step only
    fills the buffers, launches and cuts what arrived: nothing in it loops over the group's ranks."""

    comm: Collectives
    mine: tuple[int, ...]  # the jobs this rank owns, in its segment's order
    dtype: torch.dtype  # the payload dtype
    scales: dict[int, float] | None  # per job the lr scale the receivers apply (None: the directions are scaled)
    device: torch.device
    padded: bool  # one all-gather of the segments padded to the largest, else one broadcast per owner
    own: tuple[int, int]  # this rank's segment: in the send buffer (padded) or in the one every segment lands in
    length: int  # the buffer every segment lands in: W slots of the largest segment, or the segments back to back
    senders: tuple[tuple[int, ...], tuple[int, ...]]  # broadcasts: the segments' sizes and their owners (group ranks)
    cuts: tuple[int, ...]  # that buffer cut into the jobs' directions and the gaps between them
    picks: tuple[tuple[int, int, torch.Size, torch.dtype], ...]  # per job: its index, its cut, shape and wide dtype
    cast: torch.dtype | None  # the wide dtype every job shares: one cast of the whole buffer (else one per job)
    factors: tuple[float, ...] | None  # per pick, the lr scale the receivers apply


def share_plan(
    comm: Collectives,
    placed: Sequence[Placed],
    idx: Sequence[int],
    owners: Sequence[int],
    dtype: torch.dtype,
    scales: dict[int, float] | None = None,
) -> SharePlan:
    """The exchange of one group's jobs ``idx`` (each one's owner, a group rank) in ``dtype``: one all-gather of the
    owners' segments padded to the largest, while that moves at most :data:`PADDED_GATHER_LIMIT` times their real
    bytes; else (more ranks than matrices: most segments empty) one broadcast per rank owning something, each of
    its real bytes, into one buffer holding the segments back to back (one group launch on NCCL). Made once per set
    of jobs: the segments, sizes and cuts of every rank, the same on every rank of the group."""
    owned: list[list[int]] = [[] for _ in range(comm.world)]
    for i, owner in zip(idx, owners):
        owned[owner].append(i)
    numel = {i: placed[i][0].update.numel() for i in idx}
    sizes = [sum(numel[i] for i in jobs) for jobs in owned]
    pad, total = max(sizes), sum(sizes)
    padded = comm.world * pad <= PADDED_GATHER_LIMIT * total
    starts = [r * pad for r in range(comm.world)] if padded else list(itertools.accumulate(sizes, initial=0))
    cuts, picks, at = [], [], 0
    for start, jobs in zip(starts, owned):
        if jobs and start > at:  # the gap up to this segment: padding, and the slots of ranks owning nothing
            cuts.append(start - at)
            at = start
        for i in jobs:
            update = placed[i][0].update
            picks.append((i, len(cuts), update.shape, torch.promote_types(update.dtype, torch.float32)))
            cuts.append(numel[i])
            at += numel[i]
    length = comm.world * pad if padded else total
    cuts += [length - at] if length > at else []
    wides = {wide for *_, wide in picks}
    senders = tuple(zip(*[(size, r) for r, size in enumerate(sizes) if size])) or ((), ())
    return SharePlan(
        comm=comm,
        mine=tuple(owned[comm.rank]),
        dtype=dtype,
        scales=scales,
        device=placed[picks[0][0]][0].update.device,  # every job of the group is owned by some rank
        padded=padded,
        own=(0, pad) if padded else (starts[comm.rank], starts[comm.rank] + sizes[comm.rank]),
        length=length,
        senders=senders,  # type: ignore[arg-type]
        cuts=tuple(cuts),
        picks=tuple(picks),
        cast=wides.pop() if len(wides) == 1 else None,
        factors=None if scales is None else tuple(scales[i] for i, *_ in picks),
    )


def _launch(plan: SharePlan, mine: Sequence[Tensor]) -> tuple[Tensor, Any]:
    """This rank's segment (the flat directions ``mine`` of the jobs it owns) to every rank of the group and every
    other rank's here, async: the buffer they land in and the work to wait for."""
    if plan.padded:
        send = torch.zeros(plan.own[1], dtype=plan.dtype, device=plan.device)
        if mine:
            flat = torch.cat(list(mine))
            send[: flat.numel()] = flat
        recv = send.new_empty(plan.length)
        return recv, plan.comm.all_gather(recv, send, async_op=True)
    recv = torch.empty(plan.length, dtype=plan.dtype, device=plan.device)
    if mine:
        torch.cat(list(mine), out=recv[plan.own[0] : plan.own[1]])
    sizes, sources = plan.senders
    return recv, plan.comm.broadcasts(list(zip(recv.split(sizes), sources)))


def _unpack(plan: SharePlan, recv: Tensor) -> dict[int, Tensor]:
    """Every job's direction from what arrived, in its wide dtype, times its lr scale where the receivers apply it:
    one cast of the whole buffer where the jobs share a dtype, one cut, and one list multiply, not ops per rank."""
    if plan.cast is not None:
        parts = recv.to(plan.cast).split(plan.cuts)
        out = {i: parts[k].view(shape) for i, k, shape, _ in plan.picks}
    else:
        parts = recv.split(plan.cuts)
        out = {i: parts[k].view(shape).to(wide) for i, k, shape, wide in plan.picks}
    if plan.factors is not None and out:
        torch._foreach_mul_(list(out.values()), list(plan.factors))
    return out


def _share_owned(plans: Sequence[SharePlan], share: Callable[[SharePlan], Sequence[Tensor]]) -> dict[int, Tensor]:
    """Every owner's directions to every rank of its group, per group one exchange (``plans``, made once:
    :func:`share_plan`), all launched before any wait: ``share`` gives this rank's flat directions of the jobs it
    owns (``plan.mine``), in the plan's dtype."""
    launched = [(plan, *_launch(plan, share(plan))) for plan in plans]
    out: dict[int, Tensor] = {}
    for plan, recv, work in launched:
        work.wait()
        out.update(_unpack(plan, recv))
    return out
