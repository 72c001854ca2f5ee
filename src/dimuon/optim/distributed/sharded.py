"""Sharded execution of the direction maps for DTensor parameters: FSDP2, HSDP, tensor parallel, FSDP x TP.

Each parameter's placements give its layout (:mod:`dimuon.optim.distributed.layout`): which rows and
columns every rank holds, which mesh dimensions shard rows, which shard columns, which replicate.
docs/algorithms.md, "Sharded execution", states the maps and their communication:

- RowNorm: an oriented row split across ranks needs its sum of squares from every rank holding part
  of it: wide logical matrices (``m <= n``, rows of ``W``) reduce over the dimensions sharding the
  columns, tall ones (columns of ``W``) over the dimensions sharding the rows. One flat all-reduce
  per process group and step gathers all such sums; an unsplit oriented row is local (so ``m <= n``
  on ``Shard(0)`` moves nothing).
- Block (MuonBP): Newton-Schulz on the local piece of each logical matrix (a row block, a column
  block or a sub-block), no communication.
- Spectral, ``refresh="gather"``: within the shard group (the ranks holding distinct pieces),
  bucketed async all-gather of the pieces, overlapped with Newton-Schulz of the previous bucket;
  every rank orthogonalizes and keeps its piece.
- Spectral, ``refresh="owner"``: one owner per matrix in the shard group (balanced by Newton-Schulz
  FLOPs); pieces travel to the owner and back by all-to-all.
- Replicas (mesh dimensions that replicate, e.g. HSDP's replicate dimension):
  ``replica_refresh="repeat"`` lets every replica repeat the refresh (no bytes across replicas);
  ``"split"`` gives each matrix to one replica (balanced by FLOPs), whose shard group refreshes it,
  and the replicas exchange the refreshed pieces over the replicate dimension.
- Parameters held whole (``Replicate()`` everywhere, or plain tensors under DDP with
  ``process_group=``): owners orthogonalize their share and exchange it; RowNorm and block steps are local.
- Both exchanges send every owner's segment to every rank: one all-gather of the segments padded to the largest,
  or, where that would move more than twice their bytes (more ranks than matrices), one broadcast per owner,
  issued as one group launch where the backend groups (NCCL).
- Stacked parameters (``stacked=True``, ``(E, m, n)``) sharded by their leading dimension (FSDP's ``Shard(0)``,
  expert parallelism over ``ep``, or both): every rank holds whole matrices, so every map runs on the local ones as
  in one process, with no communication. Where a mesh dimension also splits each expert's rows (``Shard(1)``, as
  torchtitan lays out experts over its remaining data dimension), a rank's experts are one matrix of ``E_local``
  row-sharded experts (:mod:`dimuon.optim.distributed.experts`), refreshed, row-normalized and blocked in the
  group splitting their rows as any row-sharded matrix; the expert dimension's ranks exchange nothing.
- Column splits (``col_split_sizes``): every region of rows x columns is its own matrix; gather and owner
  refreshes cut the assembled matrix, RowNorm and block steps cut the local rows (the core allows them only
  where each rank holds whole rows, i.e. no mesh dimension splits the columns).

The gather and owner refreshes run one skeleton (:meth:`ShardedEngine._refresh`: plan the buckets, pack and send
one while the previous is assembled and orthogonalized, map, send the directions back, keep this rank's pieces),
each supplying only its exchange (:class:`_GatherExchange`, :class:`_OwnerExchange`); the whole matrices and the
replicas' split share one exchange of every owner's directions (:func:`_share_owned`).

Every decision uses global shapes and the placements only, and the collectives of each process group
are issued in the order the parameters come, so every rank of every group (shard, replicate, reduction,
flattened) issues the same sequence, empty pieces included.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dimuon.optim.distributed.collectives import Collectives, CommCounter
from dimuon.optim.distributed.engine import (
    DEFAULT_BUCKET_MB,
    DEFAULT_REFRESH,
    REFRESH_STRATEGIES,
    REPLICA_REFRESH_STRATEGIES,
    LocalEngine,
    MapConfig,
    MatrixJob,
    PartialSums,
    Region,
    RegionFactor,
    RowDirection,
    RowRange,
    apply_map_batched,
    batch_view,
    compose_row_direction,
    map_regions,
    materialize,
    row_factors_batched,
    stacked_ranges,
)
from dimuon.optim.distributed.experts import expert_rows_in, local_experts_job, local_experts_piece
from dimuon.optim.distributed.layout import Layout, Piece, Span, derive_layout, is_dtensor
from dimuon.optim.linalg import default_ns_dtype, lr_scale_factor, oriented_shape, square_sums
from dimuon.optim.schedules import StepKind


@dataclass(frozen=True)
class _Placement:
    """Where one parameter's piece sits and which groups its maps talk over (fixed for the parameter)."""

    mine: Piece
    shard: Collectives | None  # ranks holding distinct pieces (None: the whole matrix is here)
    members: tuple[Piece, ...]  # every shard-group rank's piece, in group-rank order
    rows_comm: Collectives | None  # ranks splitting the rows (column sums of tall matrices)
    cols_comm: Collectives | None  # ranks splitting the columns (row sums of wide matrices)
    replicas: Collectives | None  # ranks holding this same piece (replicated copies)
    pad: int  # the largest piece's element count: what each shard-group rank contributes to a gather
    row_major: bool  # members hold consecutive row blocks of ``pad // cols`` rows and every column
    layout: Layout | None = None  # the DTensor's layout (None: a plain tensor)


Placed = tuple[MatrixJob, _Placement]


@dataclass(frozen=True)
class _OwnerBucket:
    """One exchange each way of the owner refresh: matrices of one class, owner by owner."""

    comm: Collectives  # the shard group
    jobs: tuple[int, ...]  # the matrices (indices of the placed jobs), grouped by owner in group-rank order
    owners: tuple[int, ...]  # each matrix's owner (group rank)
    pad: int  # the slot of every piece: the class's largest piece
    dtype: torch.dtype  # the payload dtype


def mesh_dim_label(mesh, dims: Sequence[int]) -> str:
    """A mesh dimension's name (``mesh_dim<i>`` when unnamed); names joined by ``+`` for several."""
    names = mesh.mesh_dim_names
    return "+".join(names[d] if names else f"mesh_dim{d}" for d in dims)


def vote_groups(
    params: Sequence[Tensor], process_group: dist.ProcessGroup | None
) -> list[tuple[dist.ProcessGroup, str]]:
    """The process groups the non-finite vote runs over, with their labels, in the same order on every rank.

    Where the ranks of the parameters' meshes (and of ``process_group``) are together the whole default group,
    one all-reduce over that group: every rank of the world steps this optimizer, so its one vote is the
    AND of them all. Otherwise (the parameters live on some of the world's ranks, e.g. one pipeline stage's),
    the world's other ranks never call the vote: then every mesh dimension of each DTensor's mesh and
    ``process_group``, one after the other, whose chain covers every rank of every mesh.
    """
    groups: dict[int, tuple[dist.ProcessGroup, str]] = {}
    ranks: set[int] = set()
    meshes: set[int] = set()
    for p in params:
        if is_dtensor(p) and id(p.device_mesh) not in meshes:  # each mesh once: a model has one or two
            mesh = p.device_mesh
            meshes.add(id(mesh))
            ranks.update(int(r) for r in mesh.mesh.flatten().tolist())
            for dim in range(mesh.ndim):
                group = mesh.get_group(dim)
                groups.setdefault(id(group), (group, mesh_dim_label(mesh, (dim,))))
    if process_group is not None:
        ranks.update(dist.get_process_group_ranks(process_group))
        groups.setdefault(id(process_group), (process_group, "process_group"))
    world = dist.group.WORLD
    if groups and world is not None and ranks == set(range(dist.get_world_size())):
        # The world's own label where it is one of the groups (a 1-D mesh over every rank), else "world".
        return [groups.get(id(world), (world, "world"))]
    return list(groups.values())


# The flattened process groups made so far, per enumeration of every group of one flattening (the same on every
# rank): the default group they were made under, and the groups in that order. Shared by every engine of the
# process, so that FSDP2's per-parameter meshes and a rebuilt engine take the groups made once.
_FLAT_GROUPS: dict[tuple[tuple[int, ...], ...], tuple[dist.ProcessGroup, list[dist.ProcessGroup]]] = {}


def flattened_group(mesh, dims: Sequence[int]) -> dist.ProcessGroup:
    """The process group over dimensions ``dims`` of ``mesh`` taken together, made without touching the mesh.

    ``DeviceMesh._flatten`` would register the flattened mesh on the user's root mesh, and torch 2.13 then routes
    its own redistributions through it: ``full_tensor()`` of an uneven ``(Shard(d), Shard(d))`` DTensor comes back
    with rows misplaced and zeros. So the groups are made here as torch would make them, without the mesh: the
    same enumeration of every flattened group of the root mesh (every rank computes the same list), each made by
    ``dist.new_group`` on every rank in that order (a collective call of the default group, as the mesh's own
    groups were), the one holding this rank returned. Where one flattened group spans the world, it is the default
    group (torch's choice too), and nothing is made. Group ranks are in ascending global rank order."""
    from torch.distributed._mesh_layout import _MeshLayout

    root = mesh._get_root_mesh()
    layout = _MeshLayout([mesh._layout[d] for d in dims]).collapse()
    rows = _MeshLayout([layout]).remap_to_tensor(root._rank_map).tolist()
    enumeration = tuple(tuple(sorted(int(r) for r in row)) for row in rows)
    world = dist.group.WORLD
    if len(enumeration[0]) == dist.get_world_size():
        return world
    made = _FLAT_GROUPS.get(enumeration)
    if made is None or made[0] is not world:  # none yet, or made under a default group since destroyed
        label = "+".join(mesh.mesh_dim_names[d] for d in dims) if mesh.mesh_dim_names else "flattened"
        groups = [dist.new_group(list(ranks), group_desc=f"dimuon_{label}") for ranks in enumeration]
        made = _FLAT_GROUPS[enumeration] = (world, groups)
    rank = dist.get_rank()
    return next(group for ranks, group in zip(enumeration, made[1]) if rank in ranks)


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
    return [[job for _, job in sorted(bucket, key=lambda oj: oj[0])] for bucket in buckets]


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


def _by_comm(indices: Sequence[int], comm_of) -> list[tuple[Collectives, list[int]]]:
    """``indices`` grouped by their communicator, groups in the order of first appearance (None left out)."""
    groups: dict[int, tuple[Collectives, list[int]]] = {}
    for i in indices:
        comm = comm_of(i)
        if comm is not None:
            groups.setdefault(id(comm), (comm, []))[1].append(i)
    return list(groups.values())


class ShardedEngine:
    """Direction engine for DTensor parameters; counts the logical bytes of every collective it issues.

    ``params`` are all the optimizer's parameters: the process groups they span are known from the
    start, so every rank votes on the non-finite check before any other collective, first step included.
    """

    def __init__(
        self,
        refresh: str = DEFAULT_REFRESH,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        comm_dtype: torch.dtype | None = None,
        process_group: dist.ProcessGroup | None = None,
        replica_refresh: str = "repeat",
        params: Sequence[Tensor] = (),
    ):
        if refresh not in REFRESH_STRATEGIES:
            raise ValueError(f"refresh must be one of {REFRESH_STRATEGIES}, got {refresh!r}")
        if replica_refresh not in REPLICA_REFRESH_STRATEGIES:
            raise ValueError(f"replica_refresh must be one of {REPLICA_REFRESH_STRATEGIES}, got {replica_refresh!r}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
        self.refresh = refresh
        self.replica_refresh = replica_refresh
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.comm_dtype = comm_dtype
        self.process_group = process_group  # for plain (replicated, e.g. DDP) parameters
        self.counter = CommCounter()
        self._comms: dict[int, Collectives] = {}
        self._flat_groups: dict[tuple[int, tuple[int, ...]], dist.ProcessGroup] = {}  # per mesh object and dims
        self._placements: dict[int, tuple[Tensor, _Placement]] = {}
        self._expert_placements: dict[int, tuple[Tensor | None, _Placement]] = {}  # row-split experts' own
        self._assembly: dict[tuple, Tensor] = {}  # per layout and shape: the index assembling, or cutting, pieces
        self._owner_plans: dict[tuple, list[_OwnerBucket]] = {}  # the jobs' signature -> owner buckets
        self._scale_vectors: dict[tuple, Tensor] = {}  # RowNorm's split rows: scales per oriented row, per entry set
        self._local = LocalEngine()
        # The vote's own counted collectives: where it runs over the world, the world group may also be a flattened
        # mesh's (FSDP x TP over every rank), whose collectives keep their mesh label.
        self._voters = [Collectives(g, self.counter, label) for g, label in vote_groups(params, process_group)]

    # ----------------------------------------------------------------- bookkeeping
    def comm_stats(self, by_mesh_dim: bool = False) -> dict:
        return self.counter.stats_by_mesh_dim() if by_mesh_dim else self.counter.stats()

    def reset_comm_stats(self) -> None:
        self.counter.reset()

    def _collectives(self, group: dist.ProcessGroup, label: str) -> Collectives:
        key = id(group)
        if key not in self._comms:
            self._comms[key] = Collectives(group, self.counter, label)
        return self._comms[key]

    def _mesh_comm(self, mesh, dims: tuple[int, ...]) -> Collectives | None:
        """Counted collectives over the given dimensions of ``mesh`` (a flattened group for two: made by every rank
        for the same meshes in the same order, at construction, without registering it on the mesh)."""
        if not dims:
            return None
        if len(dims) == 1:
            return self._collectives(mesh.get_group(dims[0]), mesh_dim_label(mesh, dims))
        key = (id(mesh), tuple(dims))
        flat = self._flat_groups.get(key)
        if flat is None:
            flat = self._flat_groups[key] = flattened_group(mesh, dims)
        return self._collectives(flat, mesh_dim_label(mesh, dims))

    def agree_max(self, values: Tensor) -> Tensor:
        for comm in self._voters:  # the vote's groups: one all-reduce where the world is covered
            values = comm.all_max(values)
        return values

    def all_true(self, flag: Tensor) -> Tensor:
        """``flag`` (0-d, or 1-D: several flags, AND-ed elementwise) AND-ed over every rank that votes."""
        for comm in self._voters:  # one all-reduce (4 bytes for the vote) where the world is covered (vote_groups)
            flag = comm.all_true(flag)
        return flag

    # ----------------------------------------------------------------- placements
    def prepare(self, matrices: Sequence[tuple[Tensor, str, int, int]]) -> None:
        """Derive every Muon parameter's placement and make the process groups it talks over, given ``(parameter,
        name, rows, cols)`` of its matrix: at the optimizer's construction, where the meshes' host reads and the
        communicators every rank makes together belong (at W = 256 they are not a step's cost)."""
        for param, name, rows, cols in matrices:
            self._placement_of(param, name, rows, cols)

    def _placement(self, job: MatrixJob) -> _Placement:
        """The placement of the job's parameter, derived once per parameter object."""
        return self._placement_of(job.meta.get("param"), job.name, job.rows, job.cols)

    def _placement_of(self, param: Tensor | None, name: str, rows: int, cols: int) -> _Placement:
        cached = self._placements.get(id(param))
        if cached is not None and cached[0] is param:
            return cached[1]
        if param is not None and is_dtensor(param):
            placement = self._dtensor_placement(derive_layout(param, name))
        elif self.process_group is not None:
            whole = Piece((Span(0, rows, 0),), (Span(0, cols, 0),))
            comm = self._collectives(self.process_group, "process_group")
            placement = _Placement(whole, None, (), None, None, comm, whole.numel, False)
        else:
            raise TypeError(
                f"parameter {name!r} is a plain tensor in a group with sharded (DTensor) parameters; "
                "shard every Muon parameter the same way (e.g. fully_shard the whole model), or pass "
                "process_group= for replicated (DDP) parameters"
            )
        self._placements[id(param)] = (param, placement)
        return placement

    def _dtensor_placement(self, layout: Layout) -> _Placement:
        mesh = layout.mesh
        shard = self._mesh_comm(mesh, layout.shard_dims)
        members: tuple[Piece, ...] = ()
        if shard is not None:
            coords = mesh_coordinates(mesh.mesh)
            members = tuple(layout.piece_at(coords[r]) for r in dist.get_process_group_ranks(shard.group))
        pad = max((m.numel for m in members), default=layout.mine.numel)
        return _Placement(
            mine=layout.mine,
            shard=shard,
            members=members,
            rows_comm=self._mesh_comm(mesh, layout.row_dims),
            cols_comm=self._mesh_comm(mesh, layout.col_dims),
            replicas=self._mesh_comm(mesh, layout.rep_dims),
            pad=pad,
            row_major=_row_major(members, layout.cols, pad),
            layout=layout,
        )

    def _experts_placement(self, job: MatrixJob, plc: _Placement) -> _Placement:
        """The placement of this rank's experts as one ``(E_local * m, n)`` matrix whose experts the dimensions
        sharding the parameter's dimension 1 split by rows (their group holds the same experts): made once per
        parameter, from the parameter's layout."""
        param = job.meta.get("param")
        cached = self._expert_placements.get(id(param))
        if cached is not None and cached[0] is param:
            return cached[1]
        layout, comm, m, n = plc.layout, plc.cols_comm, job.matrix_rows, job.cols
        assert layout is not None and comm is not None and m is not None
        coords = mesh_coordinates(layout.mesh.mesh)
        members = tuple(
            local_experts_piece(layout.piece_at(coords[r]), m, n) for r in dist.get_process_group_ranks(comm.group)
        )
        pad = max(member.numel for member in members)
        experts = _Placement(
            mine=local_experts_piece(plc.mine, m, n),
            shard=comm,
            members=members,
            rows_comm=comm,
            cols_comm=None,
            replicas=plc.replicas,
            pad=pad,
            row_major=_row_major(members, n, pad),
        )
        self._expert_placements[id(param)] = (param, experts)
        return experts

    def _placed(self, jobs: Sequence[MatrixJob]) -> tuple[list[Placed], list[int]]:
        """Each job with its placement as the maps run it, and the jobs with nothing to run here: stacked experts
        whose rows a mesh dimension splits become this rank's experts as one row-sharded matrix (none held: idle,
        and so on every rank of the group splitting their rows, which holds the same experts)."""
        placed, idle = [], []
        for i, job in enumerate(jobs):
            plc = self._placement(job)
            if _splits_expert_rows(job, plc):
                job = local_experts_job(job, plc.mine)
                plc = self._experts_placement(jobs[i], plc)
                if job.rows == 0:
                    idle.append(i)
            placed.append((job, plc))
        return placed, idle

    # ----------------------------------------------------------------- dispatch
    def directions(self, jobs: Sequence[MatrixJob], kind: StepKind, config: MapConfig) -> list[Tensor]:
        placed, idle = self._placed(jobs)
        out: dict[int, Tensor] = {i: _empty_direction(jobs[i]) for i in idle}
        local = [i for i, (job, plc) in enumerate(placed) if _holds_whole_matrices(job, plc)]
        if local:  # stacked matrices held whole: the single-process maps on the local ones, no communication
            out.update(
                zip(local, self._local.directions([_local_stacked_job(*placed[i]) for i in local], kind, config))
            )
        rest = [i for i in range(len(placed)) if i not in out]
        if rest:
            run = [placed[i] for i in rest]
            if kind is StepKind.ROWNORM:
                found = [materialize(d) for d in self._rownorm(run, config)]
            elif kind is StepKind.BLOCK:
                found = self._block(run, config)
            else:
                found = self._spectral(run, config)
            out.update(zip(rest, found))
        return [out[i] for i in range(len(placed))]

    def row_directions(self, jobs: Sequence[MatrixJob], config: MapConfig) -> list[RowDirection]:
        placed, idle = self._placed(jobs)
        out: dict[int, RowDirection] = {i: _empty_direction(jobs[i]) for i in idle}
        local = [i for i, (job, plc) in enumerate(placed) if _holds_whole_matrices(job, plc)]
        if local:
            out.update(zip(local, self._local.row_directions([_local_stacked_job(*placed[i]) for i in local], config)))
        rest = [i for i in range(len(placed)) if i not in out]
        if rest:
            out.update(zip(rest, self._rownorm([placed[i] for i in rest], config)))
        return [out[i] for i in range(len(placed))]

    def _spectral(self, placed: Sequence[Placed], config: MapConfig) -> list[Tensor]:
        out: dict[int, Tensor] = {}
        sharded = [i for i, (_, plc) in enumerate(placed) if plc.shard is not None]
        whole = [i for i, (_, plc) in enumerate(placed) if plc.shard is None]
        if sharded:
            mine, exchanges = self._replica_shares(placed, sharded)
            run = self._gather_refresh if self.refresh == "gather" else self._owner_refresh
            out.update(zip(mine, run([placed[i] for i in mine], config)))
            self._exchange_over_replicas(placed, exchanges, out)
        if whole:
            out.update(zip(whole, self._whole_refresh([placed[i] for i in whole], config)))
        return [out[i] for i in range(len(placed))]

    def matrix_sums(self, jobs: Sequence[MatrixJob], partial_sums: PartialSums) -> list[Tensor]:
        """Per job, its partial sums over the rows this rank holds added over the ranks holding distinct pieces
        of its matrix (the shard group; replicas hold the same sums and are left out): one flat all-reduce
        (kind ``all_reduce[signal]``) per shard group, all issued before any wait. Matrices split by columns
        are refused at construction (their per-row sums would be partial)."""
        placed = [(job, self._placement(job)) for job in jobs]
        parts = partial_sums(jobs, [_local_logical_rows(job, plc) for job, plc in placed])
        pending = []
        for comm, members in _by_comm(range(len(placed)), lambda i: placed[i][1].shard):
            flat = torch.cat([parts[i].reshape(-1) for i in members])
            pending.append((members, flat, comm.all_reduce(flat, kind="all_reduce[signal]", async_op=True)))
        for members, flat, work in pending:
            work.wait()
            for i, total in zip(members, flat.split([parts[i].numel() for i in members])):
                parts[i] = total.view(parts[i].shape)
        return parts

    # ----------------------------------------------------------------- local maps
    def _block(self, placed: Sequence[Placed], config: MapConfig) -> list[Tensor]:
        """MuonBP block step: each logical matrix cut by this rank's piece (or, for a matrix held whole, by
        the ``blocks`` grid as in one process), orthogonalized locally."""
        pieces, where = [], []
        for i, (job, plc) in enumerate(placed):
            if plc.shard is None:
                regions = map_regions(job, StepKind.BLOCK)
            else:
                # Column ranges are global ones only with col_split_sizes, allowed where columns are whole here.
                cols = job.col_ranges() if job.col_splits else ((0, job.update.shape[1]),)
                regions = [
                    (r[0], r[1], c, d)
                    for a, b in job.logical_ranges()
                    if (r := plc.mine.local_rows_in(a, b)) is not None
                    for c, d in cols
                ]
            for r0, r1, c0, c1 in regions:
                pieces.append(job.update[r0:r1, c0:c1])
                where.append((i, r0, r1, c0, c1))
        results = apply_map_batched(pieces, StepKind.BLOCK, config)
        count = Counter(i for i, *_ in where)
        outs: list[Tensor | None] = [None] * len(placed)
        for (i, r0, r1, c0, c1), d in zip(where, results):  # a block that is the whole piece is its direction
            if count[i] == 1 and (r0, r1, c0, c1) == (
                0,
                *placed[i][0].update.shape[:1],
                0,
                placed[i][0].update.shape[1],
            ):
                outs[i] = d
        for (i, r0, r1, c0, c1), d in zip(where, results):
            if outs[i] is None:
                outs[i] = _empty_direction(placed[i][0])
            if outs[i] is not d:
                outs[i][r0:r1, c0:c1] = d  # type: ignore[index]
        return [out if out is not None else _empty_direction(job) for out, (job, _) in zip(outs, placed)]

    def _rownorm(self, placed: Sequence[Placed], config: MapConfig) -> list[RowDirection]:
        """RowNorm factors: local where oriented rows are whole; where ranks split them, one flat all-reduce of
        the partial sums of squares per process group (issued in first-appearance order, all before any wait).
        Both batched by shape over the Nesterov batch: a few ops per shape, not per matrix."""
        parts: list[list[RegionFactor]] = [[] for _ in placed]
        whole: list[tuple[int, Region, Tensor, float]] = []  # (job, local region, block, scale)
        pending: dict[int, tuple[Collectives, list[_SplitRows]]] = {}
        for i, (job, plc) in enumerate(placed):
            u = job.update
            # Column ranges are global ones only with col_split_sizes, allowed where columns are whole here.
            col_ranges = job.col_ranges() if job.col_splits else ((0, u.shape[1]),)
            for a, b in job.logical_ranges():
                for c, d in col_ranges:
                    cols = d - c if job.col_splits else job.cols  # the logical matrix's global columns
                    scale = lr_scale_factor(config.lr_scale, b - a, cols)
                    wide = b - a <= cols
                    local = (a, b) if plc.shard is None else plc.mine.local_rows_in(a, b)
                    comm = (plc.cols_comm if wide else plc.rows_comm) if plc.shard is not None else None
                    block = u[local[0] : local[1], c:d] if local is not None else None
                    if comm is None or (wide and block is None):  # whole oriented rows here (or none at all)
                        if block is not None:  # oriented as its matrix: a wide one's rows, a tall one's columns
                            whole.append((i, (local[0], local[1], c, d), block, scale))
                        continue
                    entry = _SplitRows(
                        i,
                        None if local is None else (local[0], local[1], c, d),
                        scale,
                        wide,
                        block,
                        (local[1] - local[0]) if wide else d - c,
                        u.device,
                    )
                    pending.setdefault(id(comm), (comm, []))[1].append(entry)
        for (i, region, _, _), f in zip(whole, row_factors_batched([w[2] for w in whole], [w[3] for w in whole])):
            parts[i].append((region, f))
        reduced = []
        for comm, entries in pending.values():
            flat = _square_sums_flat(entries)
            reduced.append((entries, flat, comm.all_reduce(flat, async_op=True)))
        for entries, flat, work in reduced:
            work.wait()
            for e, f in zip(entries, _split_row_factors(entries, flat, self._scale_vector(entries, flat))):
                if e.region is not None:
                    parts[e.job].append((e.region, f))
        for p in parts:
            p.sort(key=_region_order)
        return [compose_row_direction(job.update, p) for (job, _), p in zip(placed, parts)]

    def _scale_vector(self, entries: Sequence[_SplitRows], like: Tensor) -> Tensor:
        """Each entry's shape scale repeated over its oriented rows, as ``like``'s dtype and device: made once per
        set of entries (a host-to-device copy at the first step only)."""
        key = (tuple((e.scale, e.length) for e in entries), like.dtype, like.device)
        vector = self._scale_vectors.get(key)
        if vector is None:
            values = [e.scale for e in entries for _ in range(e.length)]
            vector = self._scale_vectors[key] = torch.tensor(values, dtype=like.dtype, device=like.device)
        return vector

    # ----------------------------------------------------------------- spectral refreshes
    def _payload_dtype(self, job: MatrixJob, config: MapConfig) -> torch.dtype:
        """What a spectral refresh sends of ``job``'s momentum: ``comm_dtype`` where set, else the Newton-Schulz
        compute dtype where it is narrower than the momentum (bf16 on CUDA): Newton-Schulz rounds the assembled
        matrix to it before anything else, so sending it rounded gives the same directions for half the bytes."""
        if self.comm_dtype is not None:
            return self.comm_dtype
        ns = config.ns_dtype or default_ns_dtype(job.update.device)
        return ns if ns.itemsize < job.update.dtype.itemsize else job.update.dtype

    def _buckets(self, placed: Sequence[Placed], config: MapConfig) -> list[tuple[Collectives, list[int]]]:
        """Per shard group and payload dtype (each in first-appearance order), buckets sized by the full (padded)
        matrices they materialize on a rank, not by the pieces, so memory and overlap do not depend on the world
        size. A bucket travels as one buffer, so its jobs share one payload dtype (as the owner refresh's classes
        do): an fp64 momentum next to an fp32 one is not sent rounded to fp32."""
        out = []
        for comm, idx in _by_comm(range(len(placed)), lambda i: placed[i][1].shard):
            payloads = {i: self._payload_dtype(placed[i][0], config) for i in idx}
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i in idx:
                by_dtype.setdefault(payloads[i], []).append(i)
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
        return flat.index_select(1, index).view(n, job.rows, job.cols)

    def _assembly_index(self, job: MatrixJob, plc: _Placement, device: torch.device) -> Tensor:
        """For every element of the ``(rows, cols)`` matrix, its position in a ``(W, pad)`` table of the shard
        group's pieces; built once per layout and shape (matrices of one shape and placement share it), int32
        where it fits."""
        key = (job.rows, job.cols, plc.pad, plc.members, device)
        index = self._assembly.get(key)
        if index is None:
            positions = _positions(len(plc.members) * plc.pad, device).view(len(plc.members), plc.pad)
            full = torch.empty((job.rows, job.cols), dtype=positions.dtype, device=device)
            for g, member in enumerate(plc.members):
                member.place(full, positions[g, : member.numel].view(member.shape))
            index = self._assembly[key] = full.reshape(-1)
        return index

    def _cut_pieces(
        self, placed: Sequence[Placed], members: Sequence[int], directions: Sequence[Tensor], outs: list
    ) -> None:
        """This rank's piece of each whole direction of one class (one shape, placement and dtype), ``outs[i]``:
        one gather through an index precomputed per layout for the whole class where the directions lie as one
        batch (they come from one batched Newton-Schulz), not a copy per span of every matrix."""
        job, plc = placed[members[0]]
        batch = batch_view(directions)
        wide = _wide(job.update)
        if batch is None or batch.dtype != wide:  # not one batch: each written out as the general path does
            for i, d in zip(members, directions):
                outs[i] = _empty_direction(placed[i][0])
                plc.mine.write(outs[i], d, 0, job.rows, 0, job.cols)
            return
        index = self._piece_index(job, plc, batch.device)
        taken = batch.reshape(len(members), -1).index_select(1, index)  # (n, piece elements), this rank's order
        for i, piece in zip(members, taken):
            outs[i] = piece.view(plc.mine.shape)

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
    def _refresh(self, exchange: _Exchange) -> list[Tensor]:
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
        return self._refresh(_GatherExchange(self, placed, config))

    def _owner_plan(self, placed: Sequence[Placed], config: MapConfig) -> list[_OwnerBucket]:
        """The owner refresh's buckets for these jobs, made once per set of jobs and payload dtypes (the same
        on every rank: shapes, placements and the group ranks decide)."""
        key = tuple(
            (
                id(job.meta.get("param")),
                job.rows,
                job.cols,
                job.splits,
                job.col_splits,
                self._payload_dtype(job, config),
            )
            for job, _ in placed
        )
        plan = self._owner_plans.get(key)
        if plan is None:
            plan = self._owner_plans[key] = self._make_owner_plan(placed, config)
        return plan

    def _make_owner_plan(self, placed: Sequence[Placed], config: MapConfig) -> list[_OwnerBucket]:
        """Per shard group: owners by Newton-Schulz FLOPs over all its matrices, then the matrices of each class
        (one shape, layout and payload dtype) cut into buckets holding at most ``per_owner`` matrices of each
        owner, ``per_owner`` as many full matrices as fit the bucket size on the owner (at least one)."""
        plan = []
        for comm, idx in _by_comm(range(len(placed)), lambda i: placed[i][1].shard):
            keys = {}
            for i in idx:
                job, plc = placed[i]
                keys[i] = (
                    job.rows,
                    job.cols,
                    plc.members,
                    plc.pad,
                    job.update.dtype,
                    self._payload_dtype(job, config),
                    job.update.device,
                )
            shapes = [(placed[i][0].rows, placed[i][0].cols) for i in idx]
            owners = dict(zip(idx, assign_owners(shapes, comm.world, [keys[i] for i in idx])))
            classes: dict[tuple, list[int]] = {}
            for i in idx:
                classes.setdefault(keys[i], []).append(i)
            for key, members in classes.items():
                pad, itemsize = key[3], key[5].itemsize
                per_owner = max(1, self.bucket_bytes // max(1, comm.world * pad * itemsize))
                for bucket in owner_buckets(members, [owners[i] for i in members], per_owner):
                    plan.append(_OwnerBucket(comm, tuple(bucket), tuple(owners[i] for i in bucket), pad, key[5]))
        return plan

    def _owner_refresh(self, placed: Sequence[Placed], config: MapConfig) -> list[Tensor]:
        """Each matrix to its owner and back: per bucket one all-to-all there (every rank's pieces of the
        bucket's matrices, each in a slot of the class's largest piece) and one back, the forward exchange of
        bucket ``b+1`` in flight while Newton-Schulz runs on bucket ``b``'s matrices, every owner orthogonalizing
        its matrices of the bucket in one batch."""
        return self._refresh(_OwnerExchange(self, placed, config))

    def _return_dtype(
        self, placed: Sequence[Placed], idx: Sequence[int], config: MapConfig
    ) -> tuple[torch.dtype, dict[int, float] | None]:
        """The dtype an owner sends a bucket's directions back in, and per job the lr scale the receiver then
        applies: Newton-Schulz's own dtype, unscaled, where it is narrower than the directions and every job of
        the bucket has a single scale over its matrices (else the scaled directions, ``comm_dtype`` or the widest
        of the jobs' direction dtypes: one buffer carries them all, and an fp64 direction is not rounded to fp32)."""
        wide = functools.reduce(torch.promote_types, (_wide(placed[i][0].update) for i in idx))
        narrows = {self._payload_dtype(placed[i][0], config) for i in idx}
        narrow = narrows.pop() if len(narrows) == 1 else wide
        if self.comm_dtype is None and narrow.itemsize < wide.itemsize:
            scales = {}
            for i in idx:
                job = placed[i][0]
                found = {lr_scale_factor(config.lr_scale, b - a, e - c) for a, b, c, e in job.regions()}
                if len(found) != 1:
                    break
                scales[i] = found.pop()
            else:
                return narrow, scales
        return self.comm_dtype or wide, None

    def _replica_shares(
        self, placed: Sequence[Placed], sharded: Sequence[int]
    ) -> tuple[list[int], list[tuple[Collectives, list[int], list[int]]]]:
        """The sharded jobs this rank's replica refreshes, and per replicate group the owner replica of each
        job (``replica_refresh="split"``); with ``"repeat"`` every replica refreshes every job."""
        if self.replica_refresh == "repeat":
            return list(sharded), []
        mine = [i for i in sharded if placed[i][1].replicas is None]
        exchanges = []
        for comm, idx in _by_comm(sharded, lambda i: placed[i][1].replicas):
            owners = assign_owners([(placed[i][0].rows, placed[i][0].cols) for i in idx], comm.world)
            mine += [i for i, o in zip(idx, owners) if o == comm.rank]
            exchanges.append((comm, idx, owners))
        return sorted(mine), exchanges

    def _exchange_over_replicas(self, placed: Sequence[Placed], exchanges, out: dict[int, Tensor]) -> None:
        """The replicas swap the pieces they refreshed (same piece, same shape): per replicate group one
        all-gather of every replica's pieces, padded to the largest replica's, all issued before any wait."""

        def share(comm: Collectives, idx: list[int], mine: list[int]) -> tuple[list[Tensor], torch.dtype, None]:
            # The widest direction dtype of the group's jobs: one buffer carries them all, none rounded.
            dtype = self.comm_dtype or functools.reduce(torch.promote_types, (_wide(placed[i][0].update) for i in idx))
            return [out[i].reshape(-1) for i in mine], dtype, None

        out.update(_share_owned(placed, exchanges, share))

    def _whole_owners(self, placed: Sequence[Placed]) -> list[tuple[Collectives, list[int], list[int]]]:
        """Per replica group of the whole matrices, its jobs and each one's owner (group rank), balanced by
        Newton-Schulz FLOPs: the same on every rank of the group."""
        return [
            (comm, idx, assign_owners([(placed[i][0].rows, placed[i][0].cols) for i in idx], comm.world))
            for comm, idx in _by_comm(range(len(placed)), lambda i: placed[i][1].replicas)
        ]

    def _whole_refresh(self, placed: Sequence[Placed], config: MapConfig) -> list[Tensor]:
        """Whole matrices on every rank: each owner orthogonalizes its share, then per replica group one
        all-gather of every owner's directions, padded to the largest share (in Newton-Schulz's dtype, unscaled,
        where every matrix of the group has one lr scale: the receivers apply it, as the owner would have)."""
        outs: list[Tensor] = [_empty_direction(job) for job, _ in placed]

        def share(comm: Collectives, idx: list[int], mine: list[int]) -> tuple[list[Tensor], torch.dtype, Any]:
            dtype, scales = self._return_dtype(placed, idx, config)
            return self._whole_directions(placed, mine, config, dtype, scales), dtype, scales

        for i, d in _share_owned(placed, self._whole_owners(placed), share).items():
            outs[i] = d
        return outs

    def _whole_directions(
        self,
        placed: Sequence[Placed],
        mine: Sequence[int],
        config: MapConfig,
        dtype: torch.dtype,
        scales: dict[int, float] | None,
    ) -> list[Tensor]:
        """The flat directions of the whole matrices this rank owns: Newton-Schulz's output as it is, region by
        region, where the receivers apply the lr scale; else the single-process map's scaled directions."""
        if scales is None:
            return [
                d.reshape(-1) for d in self._local.directions([placed[i][0] for i in mine], StepKind.SPECTRAL, config)
            ]
        pieces, where = [], []
        for i in mine:
            for a, b, c, e in placed[i][0].regions():
                pieces.append(placed[i][0].update[a:b, c:e])
                where.append((i, a, b, c, e))
        dirs = {i: torch.empty(placed[i][0].update.shape, dtype=dtype, device=placed[i][0].update.device) for i in mine}
        for (i, a, b, c, e), d in zip(where, apply_map_batched(pieces, StepKind.SPECTRAL, config, scaled=False)):
            dirs[i][a:b, c:e] = d
        return [dirs[i].reshape(-1) for i in mine]


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

    pieces: list[Tensor]
    where: list[Any]
    scaled: bool = True  # False: Newton-Schulz's output as it is, the receivers apply the lr scale
    cut: list[tuple[list[int], int]] = field(default_factory=list)  # gather: classes cut out by one index
    back: Tensor | None = None  # owner: the (owned matrices, W * pad) buffer the directions travel back in
    dirs: dict[int, Tensor] = field(default_factory=dict)  # owner: each owned matrix's whole direction
    owned: list[int] = field(default_factory=list)  # owner: this rank's matrices of the bucket
    scales: dict[int, float] | None = None  # owner: per job the lr scale the receiver applies (unscaled)


class _Exchange:
    """What a refresh supplies to :meth:`ShardedEngine._refresh`: its buckets and how pieces travel."""

    def __init__(self, engine: ShardedEngine, placed: Sequence[Placed], config: MapConfig) -> None:
        self.engine, self.placed, self.config = engine, placed, config
        self.outs: list[Tensor | None] = [None] * len(placed)

    def plan(self) -> list[Any]:
        """The buckets, the same on every rank of a group."""
        raise NotImplementedError

    def send(self, bucket: Any) -> _InFlight:
        """Pack the bucket's pieces into one buffer and launch its exchange (async)."""
        raise NotImplementedError

    def assemble(self, bucket: Any, arrived: _InFlight) -> _Batch:
        """The arrived pieces as whole matrices, cut into the regions Newton-Schulz maps here."""
        raise NotImplementedError

    def send_back(self, bucket: Any, batch: _Batch, directions: list[Tensor]) -> Any:
        """Place the bucket's directions: kept here, or launched back to the ranks holding the pieces."""
        return None

    def receive(self, returning: list[Any]) -> None:
        """Wait for what :meth:`send_back` launched and write each rank's pieces into ``outs``."""


class _GatherExchange(_Exchange):
    """``refresh="gather"``: every rank gathers every piece of a bucket, orthogonalizes and keeps its own piece."""

    def plan(self) -> list[tuple[Collectives, list[int]]]:
        return self.engine._buckets(self.placed, self.config)

    def send(self, bucket: tuple[Collectives, list[int]]) -> _InFlight:
        """Every piece into its padded slot, class by class (one list copy and cast), then one all-gather."""
        placed = self.placed
        comm, idx = bucket[0], [i for members in _classes(placed, bucket[1]) for i in members]
        dtype = self.engine._payload_dtype(placed[idx[0]][0], self.config)
        pads = [placed[i][1].pad for i in idx]
        send = placed[idx[0]][0].update.new_zeros(sum(pads), dtype=dtype)
        slots, pieces, offset = [], [], 0
        for i, pad in zip(idx, pads):
            piece = placed[i][0].update.reshape(-1)
            if piece.numel():
                slots.append(send[offset : offset + piece.numel()])
                pieces.append(piece)
            offset += pad
        if pieces:  # one list copy (and cast to the payload dtype) of every piece into its padded slot
            torch._foreach_copy_(slots, pieces)
        recv = send.new_empty(comm.world * send.numel())
        return _InFlight(recv, comm.all_gather(recv, send, async_op=True))

    def assemble(self, bucket: tuple[Collectives, list[int]], arrived: _InFlight) -> _Batch:
        """Each class's whole matrices; only the regions this rank keeps go to Newton-Schulz, except classes cut
        by one index (mapped whole, their pieces cut out by :meth:`ShardedEngine._cut_pieces`)."""
        comm, idx = bucket
        table = arrived.recv.view(comm.world, -1)
        batch, offset = _Batch([], []), 0
        for members in _classes(self.placed, idx):  # the order send() packed them in
            n, pad = len(members), self.placed[members[0]][1].pad
            # [rank, matrix, slot] -> [matrix, rank, slot]: one copy per class, after which each matrix's pieces
            # are contiguous (row-major layouts: the matrix itself) and the class's matrices evenly spaced, so
            # Newton-Schulz takes them as one batch without a stack.
            by_matrix = _by_matrix(table[:, offset : offset + n * pad], n, pad)
            offset += n * pad
            fulls = self.engine._fulls(*self.placed[members[0]], by_matrix)  # in the payload's dtype
            if _cut_by_index(*self.placed[members[0]]):
                batch.cut.append((members, len(batch.pieces)))
                batch.pieces += list(fulls)
                batch.where += [None] * n
                continue
            for full, i in zip(fulls, members):
                job, plc = self.placed[i]
                for a, bnd, c, e in job.regions():
                    if plc.mine.rows_in(a, bnd) and plc.mine.cols_in(c, e):  # Newton-Schulz only where kept
                        batch.pieces.append(full[a:bnd, c:e])
                        batch.where.append((i, a, bnd, c, e))
        return batch

    def send_back(self, bucket: tuple[Collectives, list[int]], batch: _Batch, directions: list[Tensor]) -> None:
        """Nothing travels back: this rank keeps its piece of every direction (a view where it is one block)."""
        outs = self.outs
        for members, start in batch.cut:
            self.engine._cut_pieces(self.placed, members, directions[start : start + len(members)], outs)
        for entry, d in zip(batch.where, directions):
            if entry is None:  # cut with its class
                continue
            i, a, bnd, c, e = entry
            job, plc = self.placed[i]
            whole = (a, bnd, c, e) == (0, job.rows, 0, job.cols) and d.dtype == _wide(job.update)
            if whole and (view := _rows_view(plc.mine, d)) is not None:
                outs[i] = view  # this rank's rows of the direction, as they are: nothing written
                continue
            if outs[i] is None:
                outs[i] = _empty_direction(job)
            plc.mine.write(outs[i], d, a, bnd, c, e)


def _by_matrix(table: Tensor, count: int, pad: int) -> Tensor:
    """A ``(W, count * pad)`` table of gathered pieces as ``(count, W, pad)``: one copy (a function of its own, so
    that a compiled step keeps it in a graph: the bucket loop around it runs as Python)."""
    return table.view(table.shape[0], count, pad).transpose(0, 1).contiguous()


class _OwnerExchange(_Exchange):
    """``refresh="owner"``: each matrix's pieces to its owner by one all-to-all per bucket, its direction back."""

    def plan(self) -> list[_OwnerBucket]:
        return self.engine._owner_plan(self.placed, self.config)

    def send(self, bucket: _OwnerBucket) -> _InFlight:
        """Every piece into its slot of the class's largest piece (one list copy and cast), then one all-to-all."""
        comm, pad = bucket.comm, bucket.pad
        pieces = [self.placed[i][0].update.reshape(-1) for i in bucket.jobs]
        full_slots = all(p.numel() == pad for p in pieces)
        send = (torch.empty if full_slots else torch.zeros)(
            len(pieces) * pad, dtype=bucket.dtype, device=pieces[0].device
        )
        filled = [(send[t * pad : t * pad + p.numel()], p) for t, p in enumerate(pieces) if p.numel()]
        if filled:  # one list copy (and cast to the payload dtype) of every piece into its slot
            torch._foreach_copy_([slot for slot, _ in filled], [p for _, p in filled])
        counts = [bucket.owners.count(r) for r in range(comm.world)]
        recv = send.new_empty(comm.world * counts[comm.rank] * pad)
        work = comm.all_to_all(
            recv, send, [counts[comm.rank] * pad] * comm.world, [c * pad for c in counts], async_op=True
        )
        return _InFlight(recv, work)

    def assemble(self, bucket: _OwnerBucket, arrived: _InFlight) -> _Batch:
        """The owned matrices whole, each region to Newton-Schulz; the directions are written straight into the
        (matrices, W * pad) buffer they travel back in (row-major layouts), unscaled where the receivers scale."""
        placed, comm, pad = self.placed, bucket.comm, bucket.pad
        owned = [i for i, o in zip(bucket.jobs, bucket.owners) if o == comm.rank]
        back_dtype, scales = self.engine._return_dtype(placed, bucket.jobs, self.config)
        back = torch.empty((len(owned), comm.world * pad), device=arrived.recv.device, dtype=back_dtype)
        # [source rank, owned matrix, slot] -> [owned matrix, source rank, slot]: one copy per bucket, after
        # which each owned matrix's pieces are contiguous (row-major layouts: the matrix itself) and the
        # matrices lie evenly spaced, so Newton-Schulz takes them as one batch without a stack.
        table = arrived.recv.view(comm.world, len(owned), pad).transpose(0, 1).contiguous()
        batch = _Batch([], [], scaled=scales is None, back=back, owned=owned, scales=scales)
        fulls = self.engine._fulls(*placed[owned[0]], table) if owned else table  # one class per bucket
        for t, i in enumerate(owned):
            job, plc = placed[i]
            batch.dirs[i] = (
                back[t, : job.rows * job.cols].view(job.rows, job.cols)
                if plc.row_major
                else torch.empty((job.rows, job.cols), dtype=back.dtype, device=back.device)
            )
            for a, bnd, c, e in job.regions():
                batch.pieces.append(fulls[t][a:bnd, c:e])
                batch.where.append((i, a, bnd, c, e))
        return batch

    def send_back(self, bucket: _OwnerBucket, batch: _Batch, directions: list[Tensor]) -> tuple:
        """The directions into the return buffer, then one all-to-all back to the ranks holding the pieces."""
        comm, pad, back, dirs = bucket.comm, bucket.pad, batch.back, batch.dirs
        if directions:  # one list copy into the return buffer (and cast where it is narrower)
            torch._foreach_copy_([dirs[i][a:bnd, c:e] for i, a, bnd, c, e in batch.where], directions)
        for t, i in enumerate(batch.owned):  # other layouts: every member's piece to its slot, one scatter
            if not self.placed[i][1].row_major:
                index = self.engine._assembly_index(self.placed[i][0], self.placed[i][1], back.device)
                back[t].index_put_((index,), dirs[i].reshape(-1))
        # (owned matrix, destination, slot) -> (destination, owned matrix, slot): each destination's part whole
        send_back = back.view(len(batch.owned), comm.world, pad).transpose(0, 1).reshape(-1)
        recv_back = send_back.new_empty(len(bucket.jobs) * pad)
        counts = [bucket.owners.count(r) for r in range(comm.world)]
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


def _class_key(placed: Sequence[Placed], i: int) -> tuple:
    """Matrices a gather bucket assembles alike: one shape, placement and dtype."""
    job, plc = placed[i]
    return (job.rows, job.cols, plc.pad, plc.members, plc.row_major, job.update.dtype)


def _classes(placed: Sequence[Placed], idx: Sequence[int]) -> list[list[int]]:
    """A bucket's jobs by class, in order of first appearance (the same order on every rank)."""
    classes: dict[tuple, list[int]] = {}
    for i in idx:
        classes.setdefault(_class_key(placed, i), []).append(i)
    return list(classes.values())


def _rows_view(mine: Any, direction: Tensor) -> Tensor | None:
    """This rank's piece of a whole ``(rows, cols)`` direction as a view, where the piece is one block of
    consecutive rows with every column (None otherwise: it is written out)."""
    if len(mine.rows) != 1 or len(mine.cols) != 1:
        return None
    r, c = mine.rows[0], mine.cols[0]
    if c.start != 0 or c.size != direction.shape[1] or r.local != 0 or c.local != 0:
        return None
    return direction[r.start : r.stop]


def _positions(count: int, device: torch.device) -> Tensor:
    """``0 .. count-1`` as a gather index: int32 where it fits (half the index bytes), else int64."""
    return torch.arange(count, dtype=torch.int32 if count < 2**31 else torch.int64, device=device)


def _cut_by_index(job: MatrixJob, plc: _Placement) -> bool:
    """Whether the gather refresh cuts this class's pieces out of its directions with one index: one logical
    matrix each (no fused splits), a piece here that is not one block of whole rows (those are views)."""
    whole = job.regions() == [(0, job.rows, 0, job.cols)]
    rows_block = len(plc.mine.rows) == 1 and len(plc.mine.cols) == 1 and plc.mine.cols[0].size == job.cols
    return whole and plc.mine.numel > 0 and not rows_block


def _holds_whole_matrices(job: MatrixJob, plc: _Placement) -> bool:
    """A stacked parameter sharded by its leading dimension alone (dimension 1 split over no rank but this one, e.g.
    torchtitan's ``Shard(1)`` over an ``efsdp`` of size 1): each rank holds whole stacked matrices."""
    return job.matrix_rows is not None and plc.shard is not None and not _splits_expert_rows(job, plc)


def _splits_expert_rows(job: MatrixJob, plc: _Placement) -> bool:
    """A stacked parameter whose dimension 1 (each matrix's rows) mesh dimensions of several ranks split."""
    return job.matrix_rows is not None and plc.cols_comm is not None and plc.cols_comm.world > 1


def _local_stacked_job(job: MatrixJob, plc: _Placement) -> MatrixJob:
    """The job of the stacked matrices this rank holds, as one process would see a parameter of that many."""
    m = job.matrix_rows
    count = job.update.shape[0] // m
    own = tuple((a, b) for a, b in job.splits if b <= m)  # the row ranges of one stacked matrix
    return MatrixJob(
        name=job.name,
        update=job.update,
        rows=count * m,
        cols=job.cols,
        splits=stacked_ranges(count, m, own) if job.splits else (),
        blocks=job.blocks,
        meta=job.meta,
        col_splits=job.col_splits,
        matrix_rows=m,
    )


def _local_logical_rows(job: MatrixJob, plc: _Placement) -> list[RowRange | None]:
    """Per logical row range of the job, the local rows holding it here (None: none of them)."""
    if plc.shard is None:
        return list(job.logical_ranges())
    if job.matrix_rows is None:
        return [plc.mine.local_rows_in(a, b) for a, b in job.logical_ranges()]
    m, n = job.matrix_rows, job.cols  # the layout counts stacked matrices: rows of the (E, m*n) view
    experts = local_experts_piece(plc.mine, m, n)
    return [expert_rows_in(plc.mine, experts, m, a, b) for a, b in job.logical_ranges()]


def mesh_coordinates(ranks: Tensor) -> dict[int, tuple[int, ...]]:
    """The coordinate of every global rank in a mesh's rank tensor (``DeviceMesh.mesh``)."""
    return {int(ranks[c]): c for c in itertools.product(*(range(s) for s in ranks.shape))}


def _row_major(members: Sequence[Piece], cols: int, pad: int) -> bool:
    """Whether group rank ``g`` holds rows ``[g*c, g*c + n_g)`` and every column (``c = pad / cols``): the
    gathered, padded buffer is then the matrix itself (FSDP's ``Shard(0)``, torch.chunk layout)."""
    if not members or cols == 0 or pad % cols:
        return False
    chunk = pad // cols
    for g, m in enumerate(members):
        if m.cols and m.cols != (Span(0, cols, 0),):
            return False
        if len(m.rows) > 1 or (m.rows and m.rows[0].start != g * chunk):
            return False
    return True


@dataclass(frozen=True)
class _SplitRows:
    """A RowNorm region whose oriented rows the ranks split: its partial sums of squares travel in an all-reduce."""

    job: int
    region: Region | None  # the local rows x columns, None where none of the matrix's rows are here
    scale: float
    wide: bool
    block: Tensor | None
    length: int  # oriented rows: the block's rows (wide) or the columns (tall)
    device: torch.device


def _partial_square_sums(entries: Sequence[_SplitRows]) -> list[Tensor]:
    """Each entry's sums of squares over its local block along its oriented rows (zeros without a block), batched
    by shape and orientation where the blocks lie back to back in one buffer."""
    out: list[Tensor | None] = [None] * len(entries)
    groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for k, e in enumerate(entries):
        if e.block is None:  # a tall matrix none of whose rows are here: zeros to the column sums
            out[k] = torch.zeros(e.length, dtype=torch.float32, device=e.device)
        else:
            groups[(tuple(e.block.shape), e.block.dtype, e.wide)].append(k)
    for (_, dtype, wide), idx in groups.items():
        blocks = [entries[k].block for k in idx]
        batch = batch_view(blocks)  # type: ignore[arg-type]
        dim = -1 if wide else -2
        wide_dtype = torch.promote_types(dtype, torch.float32)
        sums = (
            square_sums(batch.to(wide_dtype), dim).unbind(0)
            if batch is not None
            else [square_sums(b.to(wide_dtype), dim) for b in blocks]
        )  # type: ignore[union-attr]
        for k, total in zip(idx, sums):
            out[k] = total.reshape(-1)
    return out  # type: ignore[return-value]


def _region_order(part: RegionFactor) -> int:
    """A part's place among its job's regions as one int: its region's ``(r0, r1, c0)``, which decide it (regions do
    not overlap) and are plain ints, where ``c1`` may be a compiled step's symbolic size, which it cannot sort by."""
    r0, r1, c0, _ = part[0]
    return (r0 * _SPAN + r1) * _SPAN + c0


_SPAN = 1 << 40  # above any row or column index


def _square_sums_flat(entries: Sequence[_SplitRows]) -> Tensor:
    """The entries' partial sums of squares end to end, the buffer their all-reduce sums (a function of its own, so
    that a compiled step keeps it in a graph: the loop around the all-reduce runs as Python)."""
    return torch.cat(_partial_square_sums(entries))


def _split_row_factors(entries: Sequence[_SplitRows], sums: Tensor, scales: Tensor) -> list[Tensor]:
    """Each entry's RowNorm factors from the all-reduced ``sums`` (each whole oriented row's squared norm) and the
    ``scales`` vector: the same factor as linalg.row_factors, one division for all, shaped ``(n, 1)`` for a wide
    matrix's rows and ``(1, n)`` for a tall one's columns (kept in a graph by a compiled step, as above)."""
    factors = scales / sums.sqrt().clamp(min=1e-7)
    return [f[:, None] if e.wide else f[None, :] for e, f in zip(entries, factors.split([e.length for e in entries]))]


def _wide(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _empty_direction(job: MatrixJob) -> Tensor:
    """A zero direction shaped like the job's local piece, in fp32 or wider."""
    return torch.zeros(job.update.shape, dtype=_wide(job.update), device=job.update.device)
