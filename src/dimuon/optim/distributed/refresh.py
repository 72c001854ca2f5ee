"""The spectral refresh of sharded matrices: ``refresh="gather"`` and ``"owner"`` within a shard group, the
replicas' split, and the owners' refresh of matrices held whole.

:class:`SpectralRefresh` is what :class:`~dimuon.optim.distributed.sharded.ShardedEngine` runs for a spectral step
(docs/algorithms.md, "Sharded execution", states the communication). The gather and owner refreshes run one skeleton
(:meth:`SpectralRefresh._refresh`: plan the buckets, pack and send one while the previous is assembled and
orthogonalized, map, send the directions back, keep this rank's pieces), each supplying only its exchange
(:class:`_GatherExchange`, :class:`_OwnerExchange`) and its batch (:class:`_GatherBatch`, :class:`_OwnerBatch`);
the whole matrices and the replicas' split share one exchange of every owner's directions
(:func:`dimuon.optim.distributed.owners._share_owned`).

Every decision uses global shapes and the placements only, and each group's collectives are issued in the order the
parameters come, so every rank of a group issues the same sequence, empty pieces included.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

from dimuon.optim.distributed.collectives import Collectives
from dimuon.optim.distributed.engine import MapConfig, MatrixJob, Region, apply_map_batched, batch_view
from dimuon.optim.distributed.owners import SharePlan, _share_owned, assign_owners, share_plan
from dimuon.optim.distributed.placement import Placed, _by_comm, _empty_direction, _Placement, _wide
from dimuon.optim.linalg import default_ns_dtype, lr_scale_factor
from dimuon.optim.schedules import StepKind


@dataclass(frozen=True)
class _OwnerBucket:
    """One exchange each way of the owner refresh: matrices of one class, owner by owner."""

    comm: Collectives  # the shard group
    jobs: tuple[int, ...]  # the matrices (indices of the placed jobs), grouped by owner in group-rank order
    owners: tuple[int, ...]  # each matrix's owner (group rank)
    pad: int  # the slot of every piece: the class's largest piece
    dtype: torch.dtype  # the payload dtype


def owner_buckets(jobs: Sequence[int], owners: Sequence[int], per_owner: int) -> list[list[int]]:
    """The owner refresh's buckets of one class of matrices (one shape and layout): the ``t``-th matrix of every
    owner goes to bucket ``t // per_owner``, so a bucket holds at most ``per_owner`` matrices of each owner and
    every owner that has matrices left; within a bucket, owner by owner (the order its exchanges carry them)."""
    seen: dict[int, int] = {}  # matrices of each owner so far
    buckets: list[list[tuple[int, int]]] = []
    for job, owner in zip(jobs, owners):
        b = seen.get(owner, 0) // per_owner
        seen[owner] = seen.get(owner, 0) + 1
        if b == len(buckets):
            buckets.append([])
        buckets[b].append((owner, job))
    return [[job for _, job in sorted(bucket)] for bucket in buckets]  # by owner: each one's jobs came in order


def make_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive job indices grouped so each bucket carries at most ``bucket_bytes`` (>= 1 job)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, size in enumerate(sizes):
        if current and filled + size > bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
    if current:
        buckets.append(current)
    return buckets


# Owner plans kept for the sets of jobs refreshed last: a plan's own set recurs at every refresh; a schedule deciding
# per matrix refreshes other sets, of which only the recent are worth keeping.
OWNER_PLANS = 16


class SpectralRefresh:
    """The spectral directions of placed jobs, with what the refreshes keep between steps: the owner plans and the
    indices assembling and cutting pieces, made once per set of jobs or per layout."""

    def __init__(self, refresh: str, replica_refresh: str, bucket_bytes: int, comm_dtype: torch.dtype | None) -> None:
        self.refresh = refresh
        self.replica_refresh = replica_refresh
        self.bucket_bytes = bucket_bytes
        self.comm_dtype = comm_dtype
        self._assembly: dict[tuple, Tensor] = {}  # per layout and shape: the index assembling, or cutting, pieces
        self._owner_plans: dict[tuple, list[_OwnerBucket]] = {}  # the jobs' signature -> owner buckets (recent)
        self._member_keys: dict[int, tuple[tuple, int]] = {}  # id of a placement's members -> them, their class
        self._member_classes: dict[tuple, int] = {}  # members (a group's pieces) -> a number, equal for equal
        self._payloads: dict[tuple, torch.dtype] = {}  # (momentum dtype, device, ns dtype) -> payload dtype
        self._scales: dict[tuple, float | None] = {}  # (shape, splits, lr_scale) -> its logical matrices' one scale
        self._shape_regions: dict[tuple, tuple] = {}  # (shape, splits) -> its logical matrices

    def directions(self, placed: Sequence[Placed], config: MapConfig, memo: dict | None = None) -> list[Tensor]:
        """Every job's direction: sharded ones by the gather or owner refresh (the replicas' share of them, with
        ``replica_refresh="split"``), whole ones by their owners. ``memo`` keeps what is static about these jobs
        (their split, buckets, classes, regions and exchange counts) from step to step: a caller handing the same
        jobs at every step (a plan's) passes the same dict, so only the step's tensor work is done again."""
        memo = {} if memo is None else memo
        out: dict[int, Tensor] = {}
        sharded, mine, exchanges, mine_placed, whole, whole_placed = kept(memo, "split", lambda: self._split(placed))
        if sharded:
            run = _GatherExchange if self.refresh == "gather" else _OwnerExchange
            out.update(zip(mine, self._refresh(run(self, mine_placed, config, memo))))
            self._exchange_over_replicas(placed, exchanges, out, memo)
        if whole:
            out.update(zip(whole, self._whole_refresh(whole_placed, config, memo)))
        return [out[i] for i in range(len(placed))]

    def _split(self, placed: Sequence[Placed]) -> tuple[list[int], list[int], list, list[Placed], list[int], list]:
        """The sharded jobs, those this replica refreshes and the replicas' exchanges, and the whole jobs."""
        sharded = [i for i, (_, plc) in enumerate(placed) if plc.shard is not None]
        whole = [i for i, (_, plc) in enumerate(placed) if plc.shard is None]
        mine, exchanges = self._replica_shares(placed, sharded) if sharded else ([], [])
        return sharded, mine, exchanges, [placed[i] for i in mine], whole, [placed[i] for i in whole]

    def _payload_dtype(self, job: MatrixJob, config: MapConfig) -> torch.dtype:
        """What a spectral refresh sends of ``job``'s momentum: ``comm_dtype`` where set, else the Newton-Schulz
        compute dtype where it is narrower than the momentum (bf16 on CUDA): Newton-Schulz rounds the assembled
        matrix to it before anything else, so sending it rounded gives the same directions for half the bytes."""
        return self._payload_dtypes([job], config)[0]

    def _payload_dtypes(self, jobs: Sequence[MatrixJob], config: MapConfig) -> list[torch.dtype]:
        """Every job's :meth:`_payload_dtype` in one pass: worked out once per momentum dtype and device, then a
        lookup per job (a new set of jobs asks it of every matrix)."""
        if self.comm_dtype is not None:
            return [self.comm_dtype] * len(jobs)
        keys = [(job.update.dtype, job.update.device, config.ns_dtype) for job in jobs]
        found = self._payloads
        for momentum, device, ns_dtype in {key for key in keys if key not in found}:
            ns = ns_dtype or default_ns_dtype(device)
            found[(momentum, device, ns_dtype)] = ns if ns.itemsize < momentum.itemsize else momentum
        return [found[key] for key in keys]

    def _buckets(self, placed: Sequence[Placed], config: MapConfig) -> list[tuple[Collectives, list[int]]]:
        """Per shard group and payload dtype (each in first-appearance order), buckets sized by the full (padded)
        matrices they materialize on a rank, not by the pieces, so memory and overlap do not depend on the world
        size. A bucket travels as one buffer, so its jobs share one payload dtype (as the owner refresh's classes
        do): an fp64 momentum next to an fp32 one is not sent rounded to fp32."""
        out = []
        for comm, idx in _by_comm(range(len(placed)), [plc.shard for _, plc in placed]):
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i, dtype in zip(idx, self._payload_dtypes([placed[i][0] for i in idx], config)):
                by_dtype.setdefault(dtype, []).append(i)
            for dtype, members in by_dtype.items():
                sizes = [placed[i][1].pad * comm.world * dtype.itemsize for i in members]
                out += [(comm, [members[k] for k in bucket]) for bucket in make_buckets(sizes, self.bucket_bytes)]
        return out

    def _fulls(self, job: MatrixJob, plc: _Placement, tables: Tensor) -> Tensor:
        """The whole matrices of one class (``job``'s shape and placement) from their gathered pieces, ``(n, rows,
        cols)``: ``tables[t]`` holds matrix ``t``'s pieces, group rank ``g``'s in its ``g``-th slot. Layouts that
        are not consecutive row blocks (strided, column-split) are assembled by one gather for the whole class
        through an index precomputed per layout, not one per matrix or per piece. In the payload's dtype
        (Newton-Schulz casts to its own first: the same values without a round trip)."""
        n = tables.shape[0]
        flat = tables.reshape(n, -1)
        if plc.row_major:  # consecutive row blocks: each gathered row already is the padded matrix
            return flat[:, : job.rows * job.cols].view(n, job.rows, job.cols)
        index = self._assembly_index(job, plc, tables.device)
        return _columns(flat, index).view(n, job.rows, job.cols)

    def _assembly_index(self, job: MatrixJob, plc: _Placement, device: torch.device) -> Tensor:
        """For every element of the ``(rows, cols)`` matrix, its position in a ``(W, pad)`` table of the shard
        group's pieces; built once per layout and shape (matrices of one shape and placement share it), int32
        where it fits."""
        key = (job.rows, job.cols, plc.pad, self._members_class(plc.members), device)
        index = self._assembly.get(key)
        if index is None:
            positions = _positions(len(plc.members) * plc.pad, device).view(len(plc.members), plc.pad)
            full = torch.empty((job.rows, job.cols), dtype=positions.dtype, device=device)
            for g, member in enumerate(plc.members):
                member.place(full, positions[g, : member.numel].view(member.shape))
            index = self._assembly[key] = full.reshape(-1)
        return index

    def _regions_index(self, job: MatrixJob, plc: _Placement, kept: tuple, device: torch.device) -> tuple:
        """The indices of a class whose matrices have several regions, built once per layout and regions: per region
        shape (first-appearance order) the position of its regions' elements in a matrix's gathered pieces (row-major
        layouts: in the padded matrix), and for every element of this rank's piece its position among the regions'
        directions laid one after another, shape by shape (the order the class's regions go to Newton-Schulz)."""
        members = self._members_class(plc.members)
        key = ("regions", job.rows, job.cols, plc.pad, members, plc.mine, plc.row_major, kept, device)
        found = self._assembly.get(key)
        if found is None:
            by_shape: dict[tuple[int, int], list[tuple]] = {}
            for a, b, c, e in kept:
                by_shape.setdefault((b - a, e - c), []).append((a, b, c, e))
            positions = (
                _positions(job.rows * job.cols, device) if plc.row_major else self._assembly_index(job, plc, device)
            ).view(job.rows, job.cols)
            slots = torch.empty((job.rows, job.cols), dtype=torch.int64, device=device)
            sources, at = [], 0
            for regions in by_shape.values():
                sources.append(torch.cat([positions[a:b, c:e].reshape(-1) for a, b, c, e in regions]))
                for a, b, c, e in regions:
                    slots[a:b, c:e] = torch.arange(at, at + (b - a) * (e - c), device=device).view(b - a, e - c)
                    at += (b - a) * (e - c)
            piece = plc.mine.take(slots).reshape(-1).to(torch.int32 if at < 2**31 else torch.int64)
            groups = tuple((len(regions), *shape) for shape, regions in by_shape.items())
            found = self._assembly[key] = (groups, tuple(sources), piece)
        return found

    def _piece_index(self, job: MatrixJob, plc: _Placement, device: torch.device) -> Tensor:
        """For every element of this rank's piece (local order), its position in the flat ``(rows, cols)``
        matrix; built once per layout and shape, int32 where it fits."""
        key = ("piece", job.rows, job.cols, plc.mine, device)
        index = self._assembly.get(key)
        if index is None:
            positions = _positions(job.rows * job.cols, device).view(job.rows, job.cols)
            index = self._assembly[key] = plc.mine.take(positions).reshape(-1)
        return index

    # ----------------------------------------------------------------- the refresh skeleton
    def _refresh(self, exchange: _Exchange[Any, Any]) -> list[Tensor]:
        """The one loop of every sharded refresh: plan the buckets; pack and send bucket ``b+1`` while bucket ``b``
        is assembled and orthogonalized in one batch; map; send the directions back; return this rank's pieces.
        An exchange supplies what differs (how pieces travel and where directions go); the order is the same on
        every rank of a group, so every rank issues the same collectives."""
        buckets = exchange.plan()
        pending = exchange.send(buckets[0]) if buckets else None
        returning = []
        for b, bucket in enumerate(buckets):
            arrived = pending
            if b + 1 < len(buckets):
                pending = exchange.send(buckets[b + 1])  # in flight while this bucket is orthogonalized
            arrived.wait()
            batch = exchange.assemble(bucket, arrived)
            directions = apply_map_batched(batch.pieces, StepKind.SPECTRAL, exchange.config, scaled=batch.scaled)
            returning.append(exchange.send_back(bucket, batch, directions))
        exchange.receive(returning)
        return [o if o is not None else _empty_direction(job) for o, (job, _) in zip(exchange.outs, exchange.placed)]

    def _gather_refresh(self, placed: Sequence[Placed], config: MapConfig) -> list[Tensor]:
        """All-gather bucket ``i+1`` while Newton-Schulz runs on bucket ``i``; keep this rank's piece."""
        return self._refresh(_GatherExchange(self, placed, config, {}))

    def _owner_plan(self, placed: Sequence[Placed], config: MapConfig) -> list[_OwnerBucket]:
        """The owner refresh's buckets for these jobs, made once per set of jobs and payload dtypes (the same
        on every rank: shapes, placements and the group ranks decide)."""
        jobs = [job for job, _ in placed]
        key = tuple(
            [
                (id(job.meta.get("param")), job.rows, job.cols, job.splits, job.col_splits, dtype)
                for job, dtype in zip(jobs, self._payload_dtypes(jobs, config))
            ]
        )
        plan = self._owner_plans.pop(key, None)
        if plan is None:
            plan = self._make_owner_plan(placed, config)
            if len(self._owner_plans) >= OWNER_PLANS:  # a schedule deciding per matrix meets new sets all along
                self._owner_plans.pop(next(iter(self._owner_plans)))  # the one used longest ago
        self._owner_plans[key] = plan  # the most recent last
        return plan

    def _members_class(self, members: tuple) -> int:
        """A number for a placement's group pieces, equal for equal pieces: hashed once per tuple of pieces, not at
        every plan (a tuple of W pieces hashes in O(W)). A compiled step hashes them (it does not trace identity;
        its graph keeps what it found)."""
        if torch.compiler.is_compiling():
            return self._member_classes.setdefault(members, len(self._member_classes))
        found = self._member_keys.get(id(members))
        if found is None or found[0] is not members:
            found = self._member_keys[id(members)] = (
                members,
                self._member_classes.setdefault(members, len(self._member_classes)),
            )
        return found[1]

    def _classes(self, placed: Sequence[Placed], idx: Sequence[int]) -> list[list[int]]:
        """A gather bucket's jobs by class (those it assembles alike: one shape, placement and dtype), in order of
        first appearance (the same order on every rank)."""
        pairs = [placed[i] for i in idx]
        keys = [
            (job.rows, job.cols, plc.pad, members, plc.row_major, job.update.dtype)
            for (job, plc), members in zip(pairs, self._members_classes([plc for _, plc in pairs]))
        ]
        classes: dict[tuple, list[int]] = {}
        for i, key in zip(idx, keys):
            classes.setdefault(key, []).append(i)
        return list(classes.values())

    def _members_classes(self, placements: Sequence[_Placement]) -> list[int]:
        """Every placement's :meth:`_members_class`, a lookup each where its tuple of pieces was met before."""
        if torch.compiler.is_compiling():
            return [self._members_class(plc.members) for plc in placements]
        known = [self._member_keys.get(id(plc.members)) for plc in placements]
        return [
            found[1] if found is not None and found[0] is plc.members else self._members_class(plc.members)
            for found, plc in zip(known, placements)
        ]

    def _make_owner_plan(self, placed: Sequence[Placed], config: MapConfig) -> list[_OwnerBucket]:
        """Per shard group: owners by Newton-Schulz FLOPs over all its matrices, then the matrices of each class
        (one shape, layout and payload dtype) cut into buckets holding at most ``per_owner`` matrices of each
        owner, ``per_owner`` as many full matrices as fit the bucket size on the owner (at least one). Python per
        matrix is a few lookups in comprehensions: a schedule deciding per matrix plans a new set at most steps."""
        jobs, plcs = [job for job, _ in placed], [plc for _, plc in placed]
        keys = [
            (job.rows, job.cols, members, plc.pad, job.update.dtype, dtype, job.update.device)
            for job, plc, members, dtype in zip(
                jobs, plcs, self._members_classes(plcs), self._payload_dtypes(jobs, config)
            )
        ]
        plan = []
        for comm, idx in _by_comm(range(len(placed)), [plc.shard for plc in plcs]):
            owners = dict(zip(idx, assign_owners([keys[i][:2] for i in idx], comm.world, [keys[i] for i in idx])))
            classes: dict[tuple, list[int]] = {}
            for i in idx:
                classes.setdefault(keys[i], []).append(i)
            for key, members in classes.items():
                pad, itemsize = key[3], key[5].itemsize
                per_owner = max(1, self.bucket_bytes // max(1, comm.world * pad * itemsize))
                for bucket in owner_buckets(members, [owners[i] for i in members], per_owner):
                    plan.append(_OwnerBucket(comm, tuple(bucket), tuple([owners[i] for i in bucket]), pad, key[5]))
        return plan

    def _owner_refresh(self, placed: Sequence[Placed], config: MapConfig) -> list[Tensor]:
        """Each matrix to its owner and back: per bucket one all-to-all there (every rank's pieces of the
        bucket's matrices, each in a slot of the class's largest piece) and one back, the forward exchange of
        bucket ``b+1`` in flight while Newton-Schulz runs on bucket ``b``'s matrices, every owner orthogonalizing
        its matrices of the bucket in one batch."""
        return self._refresh(_OwnerExchange(self, placed, config, {}))

    def _return_dtype(
        self, placed: Sequence[Placed], idx: Sequence[int], config: MapConfig
    ) -> tuple[torch.dtype, dict[int, float] | None]:
        """The dtype an owner sends a bucket's directions back in, and per job the lr scale the receiver then
        applies: Newton-Schulz's own dtype, unscaled, where it is narrower than the directions and every job of
        the bucket has a single scale over its matrices (else the scaled directions, ``comm_dtype`` or the widest
        of the jobs' direction dtypes: one buffer carries them all, and an fp64 direction is not rounded to fp32)."""
        jobs = [placed[i][0] for i in idx]
        wide = _widest_direction(jobs)
        narrows = set(self._payload_dtypes(jobs, config))
        narrow = narrows.pop() if len(narrows) == 1 else wide
        if self.comm_dtype is None and narrow.itemsize < wide.itemsize:
            scales = self._single_scales(jobs, config.lr_scale)
            if None not in scales:
                return narrow, dict(zip(idx, scales))  # type: ignore[arg-type]
        return self.comm_dtype or wide, None

    def _single_scales(self, jobs: Sequence[MatrixJob], lr_scale: str) -> list[float | None]:
        """Each job's lr scale where all its logical matrices share one (None where they do not): worked out once
        per shape and split, then a lookup per job."""
        keys = [(job.rows, job.cols, job.splits, job.col_splits, lr_scale) for job in jobs]
        found = self._scales
        for key, regions in zip(keys, self._regions(jobs)):
            if key not in found:
                scales = {lr_scale_factor(lr_scale, b - a, e - c) for a, b, c, e in regions}
                found[key] = scales.pop() if len(scales) == 1 else None
        return [found[key] for key in keys]

    def _regions(self, jobs: Sequence[MatrixJob]) -> list[tuple[Region, ...]]:
        """Every job's logical matrices (:meth:`MatrixJob.regions`): worked out once per shape and split, then a
        lookup per job (a new set of jobs asks them of every matrix)."""
        keys = [(job.rows, job.cols, job.splits, job.col_splits) for job in jobs]
        found = self._shape_regions
        for key, job in {key: job for key, job in zip(keys, jobs) if key not in found}.items():
            found[key] = tuple(job.regions())
        return [found[key] for key in keys]

    def _replica_shares(
        self, placed: Sequence[Placed], sharded: Sequence[int]
    ) -> tuple[list[int], list[tuple[Collectives, list[int], list[int]]]]:
        """The sharded jobs this rank's replica refreshes, and per replicate group the owner replica of each
        job (``replica_refresh="split"``); with ``"repeat"`` every replica refreshes every job."""
        if self.replica_refresh == "repeat":
            return list(sharded), []
        mine = [i for i in sharded if placed[i][1].replicas is None]
        exchanges = []
        for comm, idx in _by_comm(sharded, [placed[i][1].replicas for i in sharded]):
            owners = assign_owners([(placed[i][0].rows, placed[i][0].cols) for i in idx], comm.world)
            mine += [i for i, o in zip(idx, owners) if o == comm.rank]
            exchanges.append((comm, idx, owners))
        return sorted(mine), exchanges

    def _exchange_over_replicas(self, placed: Sequence[Placed], exchanges, out: dict[int, Tensor], memo: dict) -> None:
        """The replicas swap the pieces they refreshed (same piece, same shape): per replicate group one exchange
        of every replica's pieces (:func:`~dimuon.optim.distributed.owners.share_plan`: made once per memo), all
        issued before any wait, in the widest direction dtype of the group's jobs (one buffer, none rounded)."""
        plans = kept(
            memo,
            "replica shares",
            lambda: [
                share_plan(comm, placed, idx, owners, self._widest(placed, idx)) for comm, idx, owners in exchanges
            ],
        )
        out.update(_share_owned(plans, lambda plan: [out[i].reshape(-1) for i in plan.mine]))

    def _widest(self, placed: Sequence[Placed], idx: Sequence[int]) -> torch.dtype:
        """``comm_dtype`` where set, else the widest direction dtype of the jobs ``idx``."""
        return self.comm_dtype or _widest_direction([placed[i][0] for i in idx])

    def _whole_owners(self, placed: Sequence[Placed]) -> list[tuple[Collectives, list[int], list[int]]]:
        """Per replica group of the whole matrices, its jobs and each one's owner (group rank), balanced by
        Newton-Schulz FLOPs: the same on every rank of the group."""
        return [
            (comm, idx, assign_owners([(placed[i][0].rows, placed[i][0].cols) for i in idx], comm.world))
            for comm, idx in _by_comm(range(len(placed)), [plc.replicas for _, plc in placed])
        ]

    def _whole_refresh(self, placed: Sequence[Placed], config: MapConfig, memo: dict) -> list[Tensor]:
        """Whole matrices on every rank: each owner orthogonalizes its share, then per replica group one exchange
        of every owner's directions (in Newton-Schulz's dtype, unscaled, where every matrix of the group has one lr
        scale: the receivers apply it, as the owner would have). The owners, exchanges and the regions of the
        matrices this rank owns are made once per memo: a step does no work per matrix it does not own."""
        plans, owned = kept(
            memo, ("whole shares", config.ns_dtype, config.lr_scale), lambda: self._whole_plans(placed, config)
        )

        def share(plan: SharePlan) -> list[Tensor]:
            return self._whole_directions(placed, owned[id(plan)], config, plan.dtype, plan.scales is None)

        shared = _share_owned(plans, share)
        return [shared[i] if i in shared else _empty_direction(job) for i, (job, _) in enumerate(placed)]

    def _whole_plans(self, placed: Sequence[Placed], config: MapConfig) -> tuple[list[SharePlan], dict[int, tuple]]:
        """Per replica group the exchange of its owners' directions, and per exchange (by id) the matrices this rank
        owns with their regions and whether a region is the whole matrix: static, made once per memo."""
        plans, owned = [], {}
        for comm, idx, owners in self._whole_owners(placed):
            plan = share_plan(comm, placed, idx, owners, *self._return_dtype(placed, idx, config))
            plans.append(plan)
            regions = zip(plan.mine, self._regions([placed[i][0] for i in plan.mine]))
            owned[id(plan)] = tuple([(i, r, r == ((0, placed[i][0].rows, 0, placed[i][0].cols),)) for i, r in regions])
        return plans, owned

    def _whole_directions(
        self, placed: Sequence[Placed], owned: tuple, config: MapConfig, dtype: torch.dtype, scaled: bool
    ) -> list[Tensor]:
        """The flat directions of the whole matrices this rank owns (``owned``: each with its regions), all regions
        in one batched map: scaled, or Newton-Schulz's output as it is where the receivers apply the lr scale; a
        matrix of one region its direction as it came, one of several a buffer in ``dtype`` written by one list
        copy for them all."""
        pieces = [placed[i][0].update[a:b, c:e] for i, regions, _ in owned for a, b, c, e in regions]
        results = iter(apply_map_batched(pieces, StepKind.SPECTRAL, config, scaled=scaled))
        out, targets, sources = [], [], []
        for i, regions, whole in owned:
            if whole:
                out.append(next(results).reshape(-1))
                continue
            update = placed[i][0].update
            buffer = torch.empty(update.shape, dtype=dtype, device=update.device)
            for a, b, c, e in regions:
                targets.append(buffer[a:b, c:e])
                sources.append(next(results))
            out.append(buffer.reshape(-1))
        if targets:
            torch._foreach_copy_(targets, sources)
        return out


@dataclass
class _InFlight:
    """One bucket's forward exchange, launched: the buffer it lands in and the work to wait for."""

    recv: Tensor
    work: Any

    def wait(self) -> None:
        self.work.wait()


@dataclass
class _Batch:
    """One bucket's matrices as Newton-Schulz takes them: the regions to map, and per region where it goes."""

    pieces: list[Tensor] = field(default_factory=list)
    where: list[Any] = field(default_factory=list)
    scaled: bool = True  # False: Newton-Schulz's output as it is, the receivers apply the lr scale


@dataclass(frozen=True)
class _GatherClass:
    """One class of a gather bucket (one shape, placement and dtype) as it is assembled and cut, static: its
    matrices' regions this rank keeps go to Newton-Schulz shape by shape, each matrix's in order, and its piece of
    each direction is a view of the direction's rows, or is cut out of them for the whole class by one index."""

    members: list[int]  # the class's jobs
    groups: tuple[tuple[int, int, int], ...]  # per region shape kept here: regions per matrix, rows, cols
    sources: tuple[Tensor, ...] | None  # per region shape, its regions in a matrix's gathered pieces (None: whole)
    piece: Tensor | None  # this rank's piece among a matrix's region directions (None: its own cut index, built once)
    rows: tuple[int, int] | None  # the rows of a whole direction that are this rank's piece, where a view
    shape: tuple[int, int]  # this rank's piece
    wide: torch.dtype  # the directions' dtype here
    count: int  # the class's directions: regions kept per matrix times matrices


@dataclass
class _GatherBatch(_Batch):
    """A gather bucket's batch: per class kept here, where its first region lies in ``pieces``."""

    classes: list[tuple[_GatherClass, int]] = field(default_factory=list)


@dataclass(kw_only=True)
class _OwnerBatch(_Batch):
    """An owner bucket's batch: every region of the matrices this rank owns (``where``: ``(job index, a, b, c, e)``),
    whose directions are written into the buffer they travel back in."""

    back: Tensor  # the (owned matrices, W * pad) buffer the directions travel back in
    owned: list[int]  # this rank's matrices of the bucket
    scales: dict[int, float] | None  # per job the lr scale the receiver applies (None: the directions are scaled)
    dirs: dict[int, Tensor] = field(default_factory=dict)  # each owned matrix's whole direction


_Bucket = TypeVar("_Bucket")
_BatchT = TypeVar("_BatchT", bound=_Batch)
_GatherBucket = tuple[Collectives, list[int]]  # a shard group and the jobs it gathers together
# A bucket with what is static about it: the gather's packing and assembly, the owner's counts and regions.
_GatherItem = tuple[_GatherBucket, tuple[int, torch.dtype, list[tuple[int, int, int]]], list[tuple[int, Any]]]
_OwnerItem = tuple["_OwnerBucket", tuple[list[int], bool, list[int], tuple, list]]


class _Exchange(Generic[_Bucket, _BatchT]):
    """What a refresh supplies to :meth:`SpectralRefresh._refresh`: its buckets and how pieces travel."""

    def __init__(self, refresher: SpectralRefresh, placed: Sequence[Placed], config: MapConfig, memo: dict) -> None:
        self.refresher, self.placed, self.config, self.memo = refresher, placed, config, memo
        self.outs: list[Tensor | None] = [None] * len(placed)

    def kept(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()`` once per memo: a static part of this exchange (``key`` names it; the options it depends on
        are part of the key)."""
        return kept(self.memo, (type(self).__name__, self.config.ns_dtype, self.config.lr_scale, key), make)

    def plan(self) -> list[_Bucket]:
        """The buckets, the same on every rank of a group."""
        raise NotImplementedError

    def send(self, bucket: _Bucket) -> _InFlight:
        """Pack the bucket's pieces into one buffer and launch its exchange (async)."""
        raise NotImplementedError

    def assemble(self, bucket: _Bucket, arrived: _InFlight) -> _BatchT:
        """The arrived pieces as whole matrices, cut into the regions Newton-Schulz maps here."""
        raise NotImplementedError

    def send_back(self, bucket: _Bucket, batch: _BatchT, directions: list[Tensor]) -> Any:
        """Place the bucket's directions: kept here, or launched back to the ranks holding the pieces."""
        return None

    def receive(self, returning: list[Any]) -> None:
        """Wait for what :meth:`send_back` launched and write each rank's pieces into ``outs``."""


class _GatherExchange(_Exchange[_GatherItem, _GatherBatch]):
    """``refresh="gather"``: every rank gathers every piece of a bucket, orthogonalizes and keeps its own piece."""

    def plan(self) -> list[_GatherItem]:
        """The buckets, each with its packing and assembly (static: kept with a plan's memo)."""
        return self.kept(
            "buckets",
            lambda: [
                (b, self._packing(b), self._assembly(b)) for b in self.refresher._buckets(self.placed, self.config)
            ],
        )

    def send(self, item: _GatherItem) -> _InFlight:
        """Every piece into its padded slot, class by class (one list copy and cast), then one all-gather."""
        placed, (bucket, (size, dtype, slots), _) = self.placed, item
        comm = bucket[0]
        send = placed[slots[0][0] if slots else bucket[1][0]][0].update.new_zeros(size, dtype=dtype)
        if slots:  # one list copy (and cast to the payload dtype) of every piece into its padded slot
            torch._foreach_copy_(
                [send[a:b] for _, a, b in slots], [placed[i][0].update.reshape(-1) for i, _, _ in slots]
            )
        recv = send.new_empty(comm.world * send.numel())
        return _InFlight(recv, comm.all_gather(recv, send, async_op=True))

    def _packing(self, bucket: _GatherBucket) -> tuple[int, torch.dtype, list[tuple[int, int, int]]]:
        """A bucket's send buffer: its size, its payload dtype, and where each held piece goes (class by class,
        each in a slot of its class's largest piece)."""
        placed = self.placed
        idx = [i for members in self.refresher._classes(placed, bucket[1]) for i in members]
        slots, offset = [], 0
        for i in idx:
            numel = placed[i][0].update.numel()
            if numel:
                slots.append((i, offset, offset + numel))
            offset += placed[i][1].pad
        return offset, self.refresher._payload_dtype(placed[idx[0]][0], self.config), slots

    def assemble(self, item: _GatherItem, arrived: _InFlight) -> _GatherBatch:
        """Per class kept here, the regions this rank keeps of its matrices, for the whole class at once: its whole
        matrices (the pieces' own layout, or one gather through the class's index), or the regions shape by shape,
        each by one gather through an index made once (not a cut per matrix and region)."""
        bucket, _, classes = item
        comm = bucket[0]
        table = arrived.recv.view(comm.world, -1)
        batch, offset = _GatherBatch(), 0
        for size, cls in classes:
            offset += size
            if cls is None:  # nothing of this class here
                continue
            n = len(cls.members)
            # [rank, matrix, slot] -> [matrix, rank, slot]: one copy per class, after which each matrix's pieces
            # are contiguous (row-major layouts: the matrix itself) and the class's matrices evenly spaced, so
            # Newton-Schulz takes them as one batch without a stack.
            by_matrix = _by_matrix(table[:, offset - size : offset], n, size // n)
            batch.classes.append((cls, len(batch.pieces)))
            if cls.sources is None:  # mapped whole, in the payload's dtype
                batch.pieces += self.refresher._fulls(*self.placed[cls.members[0]], by_matrix).unbind(0)
                continue
            flat = by_matrix.view(n, -1)
            for source, (count, rows, cols) in zip(cls.sources, cls.groups):
                batch.pieces += _columns(flat, source).view(n * count, rows, cols).unbind(0)
        return batch

    def _assembly(self, bucket: _GatherBucket) -> list[tuple[int, _GatherClass | None]]:
        """Per class of the bucket (the order :meth:`send` packed them in): its elements in the gathered table
        of every rank's pieces, and how it is assembled and cut (None: no region of it here)."""
        out = []
        for members in self.refresher._classes(self.placed, bucket[1]):
            job, plc = self.placed[members[0]]
            size = len(members) * plc.pad
            kept = tuple(
                (a, b, c, e) for a, b, c, e in job.regions() if plc.mine.rows_in(a, b) and plc.mine.cols_in(c, e)
            )
            if not kept:
                out.append((size, None))
                continue
            device, wide = job.update.device, _wide(job.update)
            if kept == ((0, job.rows, 0, job.cols),):  # one logical matrix: mapped whole
                rows = _view_rows(plc.mine, job.cols)
                piece = None if rows is not None else self.refresher._piece_index(job, plc, device)
                cls = _GatherClass(
                    members, ((1, job.rows, job.cols),), None, piece, rows, plc.mine.shape, wide, len(members)
                )
            else:
                groups, sources, piece = self.refresher._regions_index(job, plc, kept, device)
                count = len(members) * len(kept)
                cls = _GatherClass(members, groups, sources, piece, None, plc.mine.shape, wide, count)
            out.append((size, cls))
        return out

    def send_back(self, item: _GatherItem, batch: _GatherBatch, directions: list[Tensor]) -> None:
        """Nothing travels back: this rank keeps its piece of every direction, class by class (a view where it is
        one block of rows, else cut out of the class's directions by one gather)."""
        outs = self.outs
        for cls, start in batch.classes:
            mine = directions[start : start + cls.count]
            if cls.rows is not None and mine[0].dtype == cls.wide:
                a, b = cls.rows
                for i, d in zip(cls.members, mine):
                    outs[i] = d[a:b]  # this rank's rows of the direction, as they are: nothing written
                continue
            for i, piece in zip(cls.members, self._cut(cls, mine)):
                outs[i] = piece

    def _cut(self, cls: _GatherClass, directions: Sequence[Tensor]) -> Tensor:
        """This rank's pieces of a class's directions ``(n, *piece shape)`` in its wide dtype: the directions as one
        batch per region shape (they come from one batched Newton-Schulz), then one gather through the class's
        index of this rank's piece."""
        n, parts, at = len(cls.members), [], 0
        for count, _, _ in cls.groups:
            chunk = directions[at : at + n * count]
            at += n * count
            batch = batch_view(chunk)
            parts.append((batch if batch is not None else torch.stack(chunk)).reshape(n, -1))
        flat = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        index = cls.piece
        if index is None:  # a whole matrix held as one block of rows, its directions not in the wide dtype
            job, plc = self.placed[cls.members[0]]
            index = self.refresher._piece_index(job, plc, flat.device)
        taken = _columns(flat, index)
        return (taken if taken.dtype == cls.wide else taken.to(cls.wide)).view(n, *cls.shape)


class _OwnerExchange(_Exchange[_OwnerItem, _OwnerBatch]):
    """``refresh="owner"``: each matrix's pieces to its owner by one all-to-all per bucket, its direction back."""

    def plan(self) -> list[_OwnerItem]:
        """The buckets, each with its static parts (:meth:`_counts`; kept with a plan's memo)."""
        return self.kept(
            "buckets", lambda: [(b, self._counts(b)) for b in self.refresher._owner_plan(self.placed, self.config)]
        )

    def _counts(self, bucket: _OwnerBucket) -> tuple[list[int], bool, list[int], tuple, list]:
        """A bucket's static parts: matrices per owner (group rank order), whether every piece fills its slot, the
        matrices this rank owns, the return dtype with the receivers' lr scales, and each owned matrix's regions."""
        counts = [0] * bucket.comm.world  # a pass over the bucket's matrices, none over the group's ranks
        for owner in bucket.owners:
            counts[owner] += 1
        full_slots = all([self.placed[i][0].update.numel() == bucket.pad for i in bucket.jobs])
        owned = [i for i, o in zip(bucket.jobs, bucket.owners) if o == bucket.comm.rank]
        back = self.refresher._return_dtype(self.placed, bucket.jobs, self.config)
        return counts, full_slots, owned, back, self.refresher._regions([self.placed[i][0] for i in owned])

    def send(self, item: _OwnerItem) -> _InFlight:
        """Every piece into its slot of the class's largest piece (one list copy and cast), then one all-to-all."""
        bucket, (counts, full_slots, *_) = item
        comm, pad = bucket.comm, bucket.pad
        pieces = [self.placed[i][0].update.reshape(-1) for i in bucket.jobs]
        send = (torch.empty if full_slots else torch.zeros)(
            len(pieces) * pad, dtype=bucket.dtype, device=pieces[0].device
        )
        filled = [(send[t * pad : t * pad + p.numel()], p) for t, p in enumerate(pieces) if p.numel()]
        if filled:  # one list copy (and cast to the payload dtype) of every piece into its slot
            torch._foreach_copy_([slot for slot, _ in filled], [p for _, p in filled])
        recv = send.new_empty(comm.world * counts[comm.rank] * pad)
        work = comm.all_to_all(
            recv, send, [counts[comm.rank] * pad] * comm.world, [c * pad for c in counts], async_op=True
        )
        return _InFlight(recv, work)

    def assemble(self, item: _OwnerItem, arrived: _InFlight) -> _OwnerBatch:
        """The owned matrices whole, each region to Newton-Schulz; the directions are written straight into the
        (matrices, W * pad) buffer they travel back in (row-major layouts), unscaled where the receivers scale."""
        bucket, (_, _, owned, (back_dtype, scales), regions) = item
        placed, comm, pad = self.placed, bucket.comm, bucket.pad
        back = torch.empty((len(owned), comm.world * pad), device=arrived.recv.device, dtype=back_dtype)
        # [source rank, owned matrix, slot] -> [owned matrix, source rank, slot]: one copy per bucket, after
        # which each owned matrix's pieces are contiguous (row-major layouts: the matrix itself) and the
        # matrices lie evenly spaced, so Newton-Schulz takes them as one batch without a stack.
        table = arrived.recv.view(comm.world, len(owned), pad).transpose(0, 1).contiguous()
        batch = _OwnerBatch(scaled=scales is None, back=back, owned=owned, scales=scales)
        fulls = self.refresher._fulls(*placed[owned[0]], table) if owned else table  # one class per bucket
        for t, (i, job_regions) in enumerate(zip(owned, regions)):
            job, plc = placed[i]
            batch.dirs[i] = (
                back[t, : job.rows * job.cols].view(job.rows, job.cols)
                if plc.row_major
                else torch.empty((job.rows, job.cols), dtype=back.dtype, device=back.device)
            )
            for a, bnd, c, e in job_regions:
                batch.pieces.append(fulls[t][a:bnd, c:e])
                batch.where.append((i, a, bnd, c, e))
        return batch

    def send_back(self, item: _OwnerItem, batch: _OwnerBatch, directions: list[Tensor]) -> tuple:
        """The directions into the return buffer, then one all-to-all back to the ranks holding the pieces."""
        bucket, (counts, *_) = item
        comm, pad, back, dirs = bucket.comm, bucket.pad, batch.back, batch.dirs
        if directions:  # one list copy into the return buffer (and cast where it is narrower)
            torch._foreach_copy_([dirs[i][a:bnd, c:e] for i, a, bnd, c, e in batch.where], directions)
        if batch.owned and not self.placed[batch.owned[0]][1].row_major:  # one class a bucket: every member's
            # piece of every owned direction to its slot, in one scatter through the class's index
            job, plc = self.placed[batch.owned[0]]
            index = self.refresher._assembly_index(job, plc, back.device)
            back[:, index] = torch.stack([dirs[i].reshape(-1) for i in batch.owned])
        # (owned matrix, destination, slot) -> (destination, owned matrix, slot): each destination's part whole
        send_back = back.view(len(batch.owned), comm.world, pad).transpose(0, 1).reshape(-1)
        recv_back = send_back.new_empty(len(bucket.jobs) * pad)
        work_back = comm.all_to_all(
            recv_back, send_back, [c * pad for c in counts], [len(batch.owned) * pad] * comm.world, async_op=True
        )
        return bucket, recv_back, work_back, batch.scales

    def receive(self, returning: list[tuple]) -> None:
        """Sources in rank order, each its matrices in bucket order: the bucket's order, one slot each. Every
        piece of a bucket has one shape here, so the cast and the lr scale are one op each per bucket."""
        for bucket, recv_back, work, scales in returning:
            work.wait()
            scale = None
            if scales is not None:  # a bucket is one shape of one group (one split): its matrices share the scale
                (scale,) = {scales[i] for i in bucket.jobs}
            update = self.placed[bucket.jobs[0]][0].update
            for i, d in zip(bucket.jobs, _returned(recv_back, len(bucket.jobs), bucket.pad, update, scale)):
                self.outs[i] = d


def _returned(recv: Tensor, count: int, pad: int, like: Tensor, scale: float | None) -> list[Tensor]:
    """An owner bucket's directions as they came back, ``count`` slots of ``pad``: each shaped as ``like`` in its
    fp32-or-wider dtype, times ``scale`` where the owner left it to the receiver (a function of its own, so that a
    compiled step keeps it in a graph: the loop around the wait runs as Python)."""
    wide = recv.view(count, pad)[:, : like.numel()].to(_wide(like))
    if scale is not None:
        wide.mul_(scale)
    return [wide[t].view(like.shape) for t in range(count)]


def _widest_direction(jobs: Sequence[MatrixJob]) -> torch.dtype:
    """The widest direction dtype of ``jobs`` (their momenta's, fp32 or wider), from their distinct dtypes."""
    return functools.reduce(torch.promote_types, {job.update.dtype for job in jobs}, torch.float32)


def _columns(flat: Tensor, index: Tensor) -> Tensor:
    """The columns ``index`` of a ``(matrices, n)`` table, one gather (a function of its own, so that a compiled step
    keeps it in a graph: the methods around it meet a new bucket's shapes at every call and run as Python)."""
    return flat.index_select(1, index)


def _by_matrix(table: Tensor, count: int, pad: int) -> Tensor:
    """A ``(W, count * pad)`` table of gathered pieces as ``(count, W, pad)``: one copy (a function of its own, so
    that a compiled step keeps it in a graph: the bucket loop around it runs as Python)."""
    return table.view(table.shape[0], count, pad).transpose(0, 1).contiguous()


def _view_rows(mine: Any, cols: int) -> tuple[int, int] | None:
    """The rows of a whole ``(rows, cols)`` direction that are this rank's piece, where the piece is one block of
    consecutive rows with every column (a view of them); None otherwise (the piece is written out)."""
    if len(mine.rows) != 1 or len(mine.cols) != 1:
        return None
    r, c = mine.rows[0], mine.cols[0]
    if c.start != 0 or c.size != cols or r.local != 0 or c.local != 0:
        return None
    return r.start, r.stop


_MISSING = object()


def kept(memo: dict, key: Hashable, make: Callable[[], Any]) -> Any:
    """``memo[key]``, made by ``make()`` the first time: what a plan's jobs keep between steps."""
    found = memo.get(key, _MISSING)
    if found is _MISSING:
        found = memo[key] = make()
    return found


def _positions(count: int, device: torch.device) -> Tensor:
    """``0 .. count-1`` as a gather index: int32 where it fits (half the index bytes), else int64."""
    return torch.arange(count, dtype=torch.int32 if count < 2**31 else torch.int64, device=device)
