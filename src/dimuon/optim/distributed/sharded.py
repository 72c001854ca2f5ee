"""Sharded execution of the direction maps for DTensor parameters (FSDP2 ``Shard(0)`` on a 1-D mesh).

Each rank holds rows ``[r0, r1)`` of every matrix (as ``torch.chunk`` cuts them; shards may be
uneven or empty). docs/algorithms.md, "Sharded execution":

- RowNorm, ``m <= n`` (oriented rows are rows of ``W``): purely local.
- RowNorm, ``m > n``: one bucketed all-reduce of the local column sums of squares, then local.
- Block (MuonBP): Newton-Schulz on the local shard alone, no communication.
- Spectral, ``refresh="gather"``: bucketed async all-gather of the momentum shards, overlapped with
  Newton-Schulz of the previous bucket; every rank orthogonalizes and keeps its rows.
- Spectral, ``refresh="owner"``: one owner rank per matrix (balanced by Newton-Schulz FLOPs); the
  shards travel to the owner and the results back by all-to-all; no duplicated work.

Replicated parameters (``Replicate()`` DTensors, or plain tensors under DDP when the optimizer is
given ``process_group``) hold the whole matrix on every rank: their spectral steps are split
across ranks by the same owner assignment and the results broadcast; RowNorm and block steps are
computed locally.

Every rank walks the same buckets in the same order (all decisions use global shapes only), so
no collective is ever issued by only some ranks, and empty shards take part with empty payloads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dimuon.optim.distributed.collectives import Collectives, CommCounter
from dimuon.optim.distributed.engine import (
    DEFAULT_BUCKET_MB,
    REFRESH_STRATEGIES,
    LocalEngine,
    MapConfig,
    MatrixJob,
    RowRange,
    apply_map_batched,
    intersect,
    map_ranges,
    read_flag,
)
from dimuon.optim.linalg import lr_scale_factor, oriented_shape, row_normalize
from dimuon.optim.schedules import StepKind


@dataclass
class _Shard:
    """Where one job's local rows sit in the global matrix, and every rank's row count."""

    job: MatrixJob
    chunk: int  # rows per rank as torch.chunk cuts them (the padded shard height)
    replicated: bool

    def rows_of(self, rank: int) -> int:
        if self.replicated:
            return self.job.rows
        return max(0, min(self.chunk, self.job.rows - rank * self.chunk))

    def offset_of(self, rank: int) -> int:
        return 0 if self.replicated else min(rank * self.chunk, self.job.rows)


def _process_group(param: Tensor) -> tuple[dist.ProcessGroup, bool]:
    """The 1-D mesh group of a DTensor parameter and whether it is replicated (else ``Shard(0)``)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = param.device_mesh, param.placements
    if mesh.ndim != 1 or len(placements) != 1:
        raise NotImplementedError(
            f"sharded Muon supports DTensors on a 1-D device mesh; got a {mesh.ndim}-D mesh with placements "
            f"{placements} (use fully_shard on a 1-D mesh, or HSDP with the optimizer on the shard dimension)"
        )
    (placement,) = placements
    if isinstance(placement, Shard) and placement.dim == 0:
        return mesh.get_group(0), False
    if isinstance(placement, Replicate):
        return mesh.get_group(0), True
    raise NotImplementedError(f"sharded Muon supports Shard(0) and Replicate() placements, got {placement}")


def vote_groups(params: Sequence[Tensor], process_group: dist.ProcessGroup | None) -> list[dist.ProcessGroup]:
    """Every process group the ranks sharing these parameters span: each mesh dimension of each DTensor's
    mesh, and ``process_group``; the non-finite vote runs over all of them (in this order on every rank)."""
    groups: dict[int, dist.ProcessGroup] = {}
    for p in params:
        if type(p).__name__ == "DTensor":
            for dim in range(p.device_mesh.ndim):
                group = p.device_mesh.get_group(dim)
                groups.setdefault(id(group), group)
    if process_group is not None:
        groups.setdefault(id(process_group), process_group)
    return list(groups.values())


def _ns_cost(rows: int, cols: int) -> float:
    """Relative Newton-Schulz FLOPs of one matrix (oriented ``r <= c``): 5 x (2 r^2 c + r^3)."""
    r, c = oriented_shape(rows, cols)
    return 5.0 * (2.0 * r * r * c + r**3)


def assign_owners(shapes: Sequence[tuple[int, int]], world: int) -> list[int]:
    """Owner rank per matrix, greedy longest-processing-time by FLOPs (deterministic on all ranks)."""
    load = [0.0] * world
    owners = [0] * len(shapes)
    order = sorted(range(len(shapes)), key=lambda i: (-_ns_cost(*shapes[i]), i))
    for i in order:
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += _ns_cost(*shapes[i])
    return owners


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


class ShardedEngine:
    """Direction engine for DTensor parameters; counts the logical bytes of every collective it issues.

    ``params`` are all the optimizer's parameters: the process groups they span are known from the
    start, so every rank votes on the non-finite check before any other collective, first step included.
    """

    def __init__(
        self,
        refresh: str = "gather",
        bucket_mb: float = DEFAULT_BUCKET_MB,
        comm_dtype: torch.dtype | None = None,
        process_group: dist.ProcessGroup | None = None,
        params: Sequence[Tensor] = (),
    ):
        if refresh not in REFRESH_STRATEGIES:
            raise ValueError(f"refresh must be one of {REFRESH_STRATEGIES}, got {refresh!r}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
        self.refresh = refresh
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.comm_dtype = comm_dtype
        self.process_group = process_group  # for plain (replicated, e.g. DDP) parameters
        self.counter = CommCounter()
        self._comms: dict[int, Collectives] = {}
        self._local = LocalEngine()
        self._voters = [self._collectives(g) for g in vote_groups(params, process_group)]

    # ----------------------------------------------------------------- bookkeeping
    def comm_stats(self) -> dict[str, dict[str, int]]:
        return self.counter.stats()

    def reset_comm_stats(self) -> None:
        self.counter.reset()

    def _collectives(self, group: dist.ProcessGroup) -> Collectives:
        key = id(group)
        if key not in self._comms:
            self._comms[key] = Collectives(group, self.counter)
        return self._comms[key]

    def all_true(self, flag: Tensor) -> bool:
        for comm in self._voters:
            flag = comm.all_true(flag)
        return read_flag(flag)

    def _prepare(self, jobs: Sequence[MatrixJob]) -> tuple[Collectives | None, list[_Shard]]:
        """Shard layout of each job; plain-tensor jobs (none sharded) fall back to the local engine."""
        comm: Collectives | None = None
        shards: list[_Shard] = []
        for job in jobs:
            param = job.meta.get("param")
            if param is not None and type(param).__name__ == "DTensor":
                group, replicated = _process_group(param)
            elif self.process_group is not None:
                group, replicated = self.process_group, True
            else:
                raise TypeError(
                    f"parameter {job.name!r} is a plain tensor in a group with sharded (DTensor) parameters; "
                    "shard every Muon parameter the same way (e.g. fully_shard the whole model), or pass "
                    "process_group= for replicated (DDP) parameters"
                )
            c = self._collectives(group)
            if comm is not None and c.group is not comm.group:
                raise NotImplementedError("all sharded Muon parameters must live on the same device mesh")
            comm = c
            chunk = -(-job.rows // c.world)
            shard = _Shard(job, chunk, replicated)
            job.row_offset = shard.offset_of(c.rank)
            shards.append(shard)
        return comm, shards

    # ----------------------------------------------------------------- dispatch
    def directions(self, jobs: Sequence[MatrixJob], kind: StepKind, config: MapConfig) -> list[Tensor]:
        comm, shards = self._prepare(jobs)
        if comm is None:
            return []
        if kind is StepKind.ROWNORM:
            return self._rownorm(comm, shards, config)
        if kind is StepKind.BLOCK:
            return self._block(shards, config)
        replicated = [s for s in shards if s.replicated]
        sharded = [s for s in shards if not s.replicated]
        out: dict[int, Tensor] = {}
        if sharded:
            run = self._gather_refresh if self.refresh == "gather" else self._owner_refresh
            out.update(zip((id(s) for s in sharded), run(comm, sharded, config)))
        if replicated:
            out.update(zip((id(s) for s in replicated), self._replicated_refresh(comm, replicated, config)))
        return [out[id(s)] for s in shards]

    # ----------------------------------------------------------------- local maps
    def _block(self, shards: Sequence[_Shard], config: MapConfig) -> list[Tensor]:
        """MuonBP block step: each logical matrix cut by this rank's shard, orthogonalized locally."""
        pieces, where = [], []
        for j, s in enumerate(shards):
            job = s.job
            if s.replicated:  # the whole matrix is local: block as in one process
                pieces_j = [(lo, hi) for lo, hi in _unsharded_block_ranges(job)]
            else:
                pieces_j = [r for lr in job.logical_ranges() if (r := intersect(lr, job.local_range)) is not None]
            for lo, hi in pieces_j:
                pieces.append(job.update[lo - job.row_offset : hi - job.row_offset])
                where.append((j, lo, hi))
        return _assemble(shards, where, apply_map_batched(pieces, StepKind.BLOCK, config))

    def _rownorm(self, comm: Collectives, shards: Sequence[_Shard], config: MapConfig) -> list[Tensor]:
        """RowNorm: local where oriented rows are whole; one all-reduce of column norms where they are split."""
        outs = [torch.empty(s.job.update.shape, dtype=_wide(s.job.update), device=s.job.update.device) for s in shards]
        split_pieces = []  # (shard index, global range, local slice) of tall logical matrices
        for j, s in enumerate(shards):
            job = s.job
            for a, b in job.logical_ranges():
                rows, cols = b - a, job.cols
                scale = lr_scale_factor(config.lr_scale, rows, cols)
                local = intersect((a, b), job.local_range)
                if rows > cols and not s.replicated:
                    split_pieces.append((j, local, scale))
                elif local is not None:
                    lo, hi = local[0] - job.row_offset, local[1] - job.row_offset
                    outs[j][lo:hi] = row_normalize(job.update[lo:hi], scale=scale)
        if split_pieces:
            sums = []
            for j, local, _ in split_pieces:
                job = shards[j].job
                if local is None:
                    sums.append(torch.zeros(job.cols, dtype=outs[j].dtype, device=outs[j].device))
                else:
                    block = job.update[local[0] - job.row_offset : local[1] - job.row_offset].to(outs[j].dtype)
                    sums.append(block.square().sum(dim=0))
            flat = torch.cat(sums)
            comm.all_reduce(flat)
            for (j, local, scale), norms in zip(split_pieces, flat.split([len(s) for s in sums])):
                if local is None:
                    continue
                job = shards[j].job
                lo, hi = local[0] - job.row_offset, local[1] - job.row_offset
                # The same division as linalg.row_normalize, with the norm of each full column.
                factor = scale / norms.sqrt().clamp(min=1e-7)
                outs[j][lo:hi] = job.update[lo:hi].to(outs[j].dtype).mul(factor)
        return outs

    # ----------------------------------------------------------------- spectral refreshes
    def _buckets(self, shards: Sequence[_Shard], world: int) -> list[list[int]]:
        """Buckets sized by the full (padded) matrices they materialize on a rank, not by the shards,
        so the memory and the overlap granularity do not depend on the world size."""
        sizes = [s.chunk * world * s.job.cols * self._payload_dtype(s).itemsize for s in shards]
        return make_buckets(sizes, self.bucket_bytes)

    def _payload_dtype(self, s: _Shard) -> torch.dtype:
        return self.comm_dtype or s.job.update.dtype

    def _gather_refresh(self, comm: Collectives, shards: Sequence[_Shard], config: MapConfig) -> list[Tensor]:
        """All-gather bucket ``i+1`` while Newton-Schulz runs on bucket ``i``; keep this rank's rows."""
        buckets = self._buckets(shards, comm.world)
        outs: list[Tensor | None] = [None] * len(shards)

        def launch(bucket: list[int]):
            dtype = self._payload_dtype(shards[bucket[0]])
            parts = []
            for j in bucket:
                s = shards[j]
                padded = s.job.update.new_zeros((s.chunk, s.job.cols), dtype=dtype)
                padded[: s.job.update.shape[0]] = s.job.update
                parts.append(padded.reshape(-1))
            send = torch.cat(parts)
            recv = send.new_empty(comm.world * send.numel())
            return recv, comm.all_gather(recv, send, async_op=True)

        pending = launch(buckets[0])
        for b, bucket in enumerate(buckets):
            recv, work = pending
            if b + 1 < len(buckets):
                pending = launch(buckets[b + 1])
            work.wait()
            table = recv.view(comm.world, -1)
            pieces, where, offset = [], [], 0
            for j in bucket:
                s = shards[j]
                job = s.job
                size = s.chunk * job.cols
                full = table[:, offset : offset + size].reshape(comm.world * s.chunk, job.cols)[: job.rows]
                offset += size
                for a, bnd in job.logical_ranges():
                    local = intersect((a, bnd), job.local_range)
                    if local is None:
                        continue
                    pieces.append(full[a:bnd].to(job.update.dtype))
                    where.append((j, a, local))
            results = apply_map_batched(pieces, StepKind.SPECTRAL, config)
            for (j, a, (lo, hi)), d in zip(where, results):
                outs[j] = _place(outs[j], shards[j].job, lo, hi, d[lo - a : hi - a])
        return [o if o is not None else _empty_like_update(s.job) for o, s in zip(outs, shards)]

    def _owner_refresh(self, comm: Collectives, shards: Sequence[_Shard], config: MapConfig) -> list[Tensor]:
        """Shards go to each matrix's owner (all-to-all), the owner orthogonalizes, rows come back."""
        owners = assign_owners([(s.job.rows, s.job.cols) for s in shards], comm.world)
        buckets = self._buckets(shards, comm.world)
        outs: list[Tensor | None] = [None] * len(shards)
        me, world = comm.rank, comm.world

        def launch(bucket: list[int]):
            parts = [[shards[j].job.update.reshape(-1) for j in bucket if owners[j] == dst] for dst in range(world)]
            out_splits = [sum(shards[j].rows_of(src) * shards[j].job.cols for j in bucket if owners[j] == me)
                          for src in range(world)]
            return _exchange(comm, parts, out_splits, self._payload_dtype(shards[bucket[0]]),
                             shards[bucket[0]].job.update.device)

        returns = []
        pending = launch(buckets[0])
        for b, bucket in enumerate(buckets):
            recv, out_splits, work = pending
            if b + 1 < len(buckets):
                pending = launch(buckets[b + 1])
            work.wait()
            # Reassemble each owned matrix: source rank order, then job order within a source.
            owned = [j for j in bucket if owners[j] == me]
            segments = recv.split(out_splits)
            rows_by_job: dict[int, list[Tensor]] = {j: [] for j in owned}
            for src in range(world):
                cursor = 0
                for j in owned:
                    n = shards[j].rows_of(src) * shards[j].job.cols
                    rows_by_job[j].append(segments[src][cursor : cursor + n].view(-1, shards[j].job.cols))
                    cursor += n
            pieces, where = [], []
            for j in owned:
                job = shards[j].job
                full = torch.cat(rows_by_job[j]).to(job.update.dtype)
                for a, bnd in job.logical_ranges():
                    pieces.append(full[a:bnd])
                    where.append((j, a, bnd))
            results = apply_map_batched(pieces, StepKind.SPECTRAL, config)
            full_dirs = {j: torch.empty(shards[j].job.rows, shards[j].job.cols, dtype=_wide(shards[j].job.update),
                                        device=shards[j].job.update.device) for j in owned}
            for (j, a, bnd), d in zip(where, results):
                full_dirs[j][a:bnd] = d
            # Send each rank its rows of the owned results.
            parts = [[full_dirs[j][shards[j].offset_of(dst) : shards[j].offset_of(dst) + shards[j].rows_of(dst)]
                      .reshape(-1) for j in owned] for dst in range(world)]
            back_splits = [sum(shards[j].rows_of(me) * shards[j].job.cols for j in bucket if owners[j] == src)
                           for src in range(world)]
            recv_back, _, work_back = _exchange(comm, parts, back_splits, self._payload_dtype(shards[bucket[0]]),
                                                shards[bucket[0]].job.update.device)
            returns.append((bucket, recv_back, back_splits, work_back))
        for bucket, recv_back, back_splits, work in returns:
            work.wait()
            segments = recv_back.split(back_splits)
            for src in range(world):
                cursor = 0
                for j in bucket:
                    if owners[j] != src:
                        continue
                    job = shards[j].job
                    n = job.update.numel()
                    outs[j] = segments[src][cursor : cursor + n].view(job.update.shape).to(_wide(job.update))
                    cursor += n
        return [o if o is not None else _empty_like_update(s.job) for o, s in zip(outs, shards)]

    def _replicated_refresh(self, comm: Collectives, shards: Sequence[_Shard], config: MapConfig) -> list[Tensor]:
        """Whole matrices on every rank: each owner orthogonalizes its share, then broadcasts it."""
        owners = assign_owners([(s.job.rows, s.job.cols) for s in shards], comm.world)
        mine = [j for j in range(len(shards)) if owners[j] == comm.rank]
        local = self._local.directions([shards[j].job for j in mine], StepKind.SPECTRAL, config)
        outs: list[Tensor] = [torch.empty(s.job.update.shape, dtype=_wide(s.job.update), device=s.job.update.device)
                              for s in shards]
        for j, d in zip(mine, local):
            outs[j] = d.contiguous()
        works = []
        for src in range(comm.world):
            owned = [j for j in range(len(shards)) if owners[j] == src]
            if not owned:
                continue
            flat = torch.cat([outs[j].reshape(-1) for j in owned]) if src == comm.rank else torch.empty(
                sum(outs[j].numel() for j in owned), dtype=outs[owned[0]].dtype, device=outs[owned[0]].device)
            works.append((owned, flat, comm.broadcast(flat, src, async_op=True)))
        for owned, flat, work in works:
            work.wait()
            for j, part in zip(owned, flat.split([outs[j].numel() for j in owned])):
                outs[j] = part.view(outs[j].shape)
        return outs


def _exchange(
    comm: Collectives, parts_by_dst: Sequence[Sequence[Tensor]], out_splits: list[int], dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor, list[int], object]:
    """Async flat all-to-all of per-destination tensor lists; ``out_splits`` counts what each source sends."""
    in_splits = [sum(t.numel() for t in parts) for parts in parts_by_dst]
    flat = [t for parts in parts_by_dst for t in parts]
    send = torch.cat(flat).to(dtype) if flat else torch.empty(0, dtype=dtype, device=device)
    recv = send.new_empty(sum(out_splits))
    return recv, out_splits, comm.all_to_all(recv, send, out_splits, in_splits, async_op=True)


def _wide(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _empty_like_update(job: MatrixJob) -> Tensor:
    return torch.zeros(job.update.shape, dtype=_wide(job.update), device=job.update.device)


def _place(out: Tensor | None, job: MatrixJob, lo: int, hi: int, rows: Tensor) -> Tensor:
    """Write global rows ``[lo, hi)`` of a direction into this rank's output for ``job``."""
    if out is None:
        out = torch.empty(job.update.shape, dtype=rows.dtype, device=rows.device)
    out[lo - job.row_offset : hi - job.row_offset] = rows
    return out


def _assemble(shards: Sequence[_Shard], where: Sequence[tuple[int, int, int]], results: Sequence[Tensor]) -> list[Tensor]:
    outs: list[Tensor | None] = [None] * len(shards)
    for (j, lo, hi), d in zip(where, results):
        outs[j] = _place(outs[j], shards[j].job, lo, hi, d)
    return [o if o is not None else _empty_like_update(s.job) for o, s in zip(outs, shards)]


def _unsharded_block_ranges(job: MatrixJob) -> list[RowRange]:
    return map_ranges(job, StepKind.BLOCK)
