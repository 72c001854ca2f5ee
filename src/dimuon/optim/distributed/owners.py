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

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from dimuon.optim.distributed.collectives import Collectives
from dimuon.optim.distributed.placement import Placed, _wide
from dimuon.optim.linalg import oriented_shape


def _ns_cost(rows: int, cols: int) -> float:
    """Relative Newton-Schulz FLOPs of one matrix (oriented ``r <= c``): 5 x (2 r^2 c + r^3)."""
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
    for idx in sorted(members.values(), key=lambda idx: (-max(_ns_cost(*shapes[i]) for i in idx), idx[0])):
        for start in range(0, len(idx), world):
            chunk = idx[start : start + world]
            for i, rank in zip(chunk, sorted(range(world), key=lambda r: (load[r], r))):
                owners[i] = rank
                load[rank] += _ns_cost(*shapes[i])
    return owners


# The padded all-gather of :func:`_gather_segments` moves W times the largest segment; past this many times the
# segments' real bytes (more ranks than matrices, at large W) the owners broadcast their segments instead.
PADDED_GATHER_LIMIT = 2.0


@dataclass
class _Segments:
    """Every rank's segment of one exchange, in flight: rank ``r``'s at ``recv[offsets[r]:]``."""

    recv: Tensor
    offsets: list[int]
    works: list[Any]

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _gather_segments(
    comm: Collectives,
    placed: Sequence[Placed],
    owned: Sequence[Sequence[int]],
    mine: Sequence[Tensor],
    dtype: torch.dtype,
) -> _Segments:
    """Every rank's segment (the flat tensors ``mine`` of the jobs it owns, ``owned[rank]``) to every rank, async.

    One all-gather of the segments padded to the largest, while that moves at most :data:`PADDED_GATHER_LIMIT`
    times their real bytes; else (more ranks than matrices: most segments empty) one broadcast per rank that
    owns something, each of its real bytes, into one buffer holding the segments back to back: one group launch
    on NCCL (:meth:`Collectives.broadcasts`)."""
    sizes = [sum(placed[i][0].update.numel() for i in jobs) for jobs in owned]
    pad, total = max(sizes), sum(sizes)
    first = next(i for jobs in owned for i in jobs)  # every job of the group is owned by some rank
    device = placed[first][0].update.device
    if comm.world * pad <= PADDED_GATHER_LIMIT * total:
        send = torch.zeros(pad, dtype=dtype, device=device)
        if mine:
            flat = torch.cat(list(mine))
            send[: flat.numel()] = flat
        recv = send.new_empty(comm.world * pad)
        return _Segments(recv, [r * pad for r in range(comm.world)], [comm.all_gather(recv, send, async_op=True)])
    offsets = [sum(sizes[:r]) for r in range(comm.world)]
    recv = torch.empty(total, dtype=dtype, device=device)
    if mine:
        torch.cat(list(mine), out=recv[offsets[comm.rank] : offsets[comm.rank] + sizes[comm.rank]])
    pieces = [(recv[offsets[r] : offsets[r] + sizes[r]], r) for r in range(comm.world) if sizes[r]]
    return _Segments(recv, offsets, [comm.broadcasts(pieces)])


def _share_owned(
    placed: Sequence[Placed],
    groups: Sequence[tuple[Collectives, list[int], list[int]]],
    share: Callable[[Collectives, list[int], list[int]], tuple[list[Tensor], torch.dtype, dict[int, float] | None]],
) -> dict[int, Tensor]:
    """Every owner's directions to every rank of its group (``groups``: the group, its jobs, each one's owner):
    ``share`` gives this rank's flat directions, their dtype and the lr scales receivers apply; per group one
    exchange of the owners' segments, all launched before any wait."""
    pending = []
    for comm, idx, owners in groups:
        owned = [[i for i, o in zip(idx, owners) if o == r] for r in range(comm.world)]
        flats, dtype, scales = share(comm, idx, owned[comm.rank])
        pending.append((owned, scales, _gather_segments(comm, placed, owned, flats, dtype)))
    out: dict[int, Tensor] = {}
    for owned, scales, segments in pending:
        segments.wait()
        out.update(_unpack_segments(segments, placed, owned, scales))
    return out


def _segment_parts(segments: _Segments, rank: int, placed: Sequence[Placed], jobs: Sequence[int]) -> list[Tensor]:
    """Rank ``rank``'s segment of a :func:`_gather_segments` exchange, cut into its jobs' flat directions."""
    sizes = [placed[i][0].update.numel() for i in jobs]
    start = segments.offsets[rank]
    return list(segments.recv[start : start + sum(sizes)].split(sizes)) if jobs else []


def _unpack_segments(
    segments: _Segments,
    placed: Sequence[Placed],
    owned: Sequence[Sequence[int]],
    scales: dict[int, float] | None = None,
) -> dict[int, Tensor]:
    """Every job's direction from a :func:`_gather_segments` exchange, in its wide dtype, times its lr scale where
    ``scales`` are given: one cast of the whole buffer where the jobs share a dtype and one list multiply, not two
    ops per matrix."""
    jobs = [i for rank_jobs in owned for i in rank_jobs]
    wides = {_wide(placed[i][0].update) for i in jobs}
    whole = replace(segments, recv=segments.recv.to(wides.pop())) if len(wides) == 1 else None
    out: dict[int, Tensor] = {}
    for r, rank_jobs in enumerate(owned):
        for i, part in zip(rank_jobs, _segment_parts(segments if whole is None else whole, r, placed, rank_jobs)):
            update = placed[i][0].update
            out[i] = part.view(update.shape) if whole is not None else part.view(update.shape).to(_wide(update))
    if scales is not None and out:
        torch._foreach_mul_(list(out.values()), [scales[i] for i in out])
    return out
