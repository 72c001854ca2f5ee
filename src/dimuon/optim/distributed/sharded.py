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
  issued as one group launch where the backend groups (NCCL) (:mod:`dimuon.optim.distributed.owners`).
- Stacked parameters (``stacked=True``, ``(E, m, n)``) sharded by their leading dimension (FSDP's ``Shard(0)``,
  expert parallelism over ``ep``, or both): every rank holds whole matrices, so every map runs on the local ones as
  in one process, with no communication. Where a mesh dimension also splits each expert's rows (``Shard(1)``, as
  torchtitan lays out experts over its remaining data dimension), a rank's experts are one matrix of ``E_local``
  row-sharded experts (:mod:`dimuon.optim.distributed.experts`), refreshed, row-normalized and blocked in the
  group splitting their rows as any row-sharded matrix; the expert dimension's ranks exchange nothing.
- Column splits (``col_split_sizes``): every region of rows x columns is its own matrix; gather and owner
  refreshes cut the assembled matrix, RowNorm and block steps cut the local rows (the core allows them only
  where each rank holds whole rows, i.e. no mesh dimension splits the columns).

This module derives the placements (:class:`~dimuon.optim.distributed.placement._Placement`: a parameter's piece and
the process groups its maps talk over, made once per parameter) and makes those groups, dispatches each step's jobs,
and runs the RowNorm and block maps. The spectral refreshes live in :mod:`dimuon.optim.distributed.refresh`
(:class:`~dimuon.optim.distributed.refresh.SpectralRefresh`, which :meth:`ShardedEngine._spectral` calls): the
gather and owner refreshes run one skeleton there, each supplying only its exchange, and the whole matrices and the
replicas' split share one exchange of every owner's directions (:mod:`dimuon.optim.distributed.owners`).

Every decision uses global shapes and the placements only, and the collectives of each process group
are issued in the order the parameters come, so every rank of every group (shard, replicate, reduction,
flattened) issues the same sequence, empty pieces included.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dimuon.optim.distributed import piece_classes
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
    materialize,
    row_factors_batched,
)
from dimuon.optim.distributed.experts import (
    expert_rows_in,
    holds_whole_matrices,
    local_experts_job,
    local_experts_piece,
    splits_expert_rows,
    whole_experts_job,
)
from dimuon.optim.distributed.layout import Layout, Piece, Span, derive_layout, is_dtensor
from dimuon.optim.distributed.placement import Placed, _by_comm, _empty_direction, _Placement
from dimuon.optim.distributed.refresh import SpectralRefresh
from dimuon.optim.linalg import square_sums
from dimuon.optim.schedules import StepKind


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
        self._scale_vectors: dict[tuple, Tensor] = {}  # RowNorm's split rows: scales per oriented row, per entry set
        self._logical_rows: dict[tuple, tuple] = {}  # per layout: the local rows of each logical matrix
        self._local = LocalEngine()
        self._refresher = SpectralRefresh(refresh, replica_refresh, self.bucket_bytes, comm_dtype)
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

    placement = _placement  # what the class plans read

    # ----------------------------------------------------------------- the class path (piece_classes)
    def class_plan(
        self, group: dict[str, Any], bufs: Sequence[Tensor], names: Sequence[str], keys: Sequence[str], fixed: bool
    ) -> Any:
        """A Muon group's plan by class of local pieces (None: the group takes the per-job path)."""
        return piece_classes.make_piece_plan(self, group, bufs, names, keys, fixed)

    def class_row_factors(self, classes: Sequence[Any], batches: Sequence[Tensor]) -> list[Tensor]:
        """RowNorm of a plan's classes: :func:`piece_classes.row_factors_sharded`."""
        return piece_classes.row_factors_sharded(classes, batches, self._scale_vectors)

    def class_refresh(self, plan: Any, batches: Sequence[Tensor], config: MapConfig) -> list[list[Tensor]]:
        """The spectral refresh of a plan's matrices, per class: :func:`piece_classes.refreshed`."""
        return piece_classes.refreshed(self, plan, batches, config)

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

    experts_placement = _experts_placement  # what the class plans read

    def _placed(self, jobs: Sequence[MatrixJob]) -> tuple[list[Placed], list[int]]:
        """Each job with its placement as the maps run it, and the jobs with nothing to run here: stacked experts
        whose rows a mesh dimension splits become this rank's experts as one row-sharded matrix (none held: idle,
        and so on every rank of the group splitting their rows, which holds the same experts)."""
        placed, idle = [], []
        for i, job in enumerate(jobs):
            plc = self._placement(job)
            if splits_expert_rows(job, plc):
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
        local = [i for i, (job, plc) in enumerate(placed) if holds_whole_matrices(job, plc)]
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
        local = [i for i, (job, plc) in enumerate(placed) if holds_whole_matrices(job, plc)]
        if local:
            out.update(zip(local, self._local.row_directions([_local_stacked_job(*placed[i]) for i in local], config)))
        rest = [i for i in range(len(placed)) if i not in out]
        if rest:
            out.update(zip(rest, self._rownorm([placed[i] for i in rest], config)))
        return [out[i] for i in range(len(placed))]

    def refresh_placed(self, placed: Sequence[Placed], config: MapConfig, memo: dict) -> list[Tensor]:
        """The spectral refresh of jobs already placed, what is static about them kept in ``memo`` (a plan's)."""
        return self._refresher.directions(placed, config, memo)

    def _spectral(self, placed: Sequence[Placed], config: MapConfig) -> list[Tensor]:
        """The spectral refresh (:mod:`dimuon.optim.distributed.refresh`): gather or owner within the shard groups,
        the replicas' split, the owners' share of matrices held whole."""
        return self._refresher.directions(placed, config)

    def matrix_sums(self, jobs: Sequence[MatrixJob], partial_sums: PartialSums) -> list[Tensor]:
        """Per job, its partial sums over the rows this rank holds added over the ranks holding distinct pieces
        of its matrix (the shard group; replicas hold the same sums and are left out): one flat all-reduce
        (kind ``all_reduce[signal]``) per shard group, all issued before any wait. Matrices split by columns
        are refused at construction (their per-row sums would be partial)."""
        placed = [(job, self._placement(job)) for job in jobs]
        parts = partial_sums(jobs, [self._local_rows(job, plc) for job, plc in placed])
        pending = []
        for comm, members in _by_comm(range(len(placed)), [plc.shard for _, plc in placed]):
            flat = torch.cat([parts[i].reshape(-1) for i in members])
            pending.append((members, flat, comm.all_reduce(flat, kind="all_reduce[signal]", async_op=True)))
        for members, flat, work in pending:
            work.wait()
            for i, total in zip(members, flat.split([parts[i].numel() for i in members])):
                parts[i] = total.view(parts[i].shape)
        return parts

    def _local_rows(self, job: MatrixJob, plc: _Placement) -> tuple[RowRange | None, ...]:
        """:func:`_local_logical_rows`, worked out once per layout (a stacked parameter's are one per expert of the
        whole parameter, which a signal step asks of every class)."""
        key = (job.rows, job.cols, job.splits, job.matrix_rows, plc.mine if plc.shard is not None else None)
        found = self._logical_rows.get(key)
        if found is None:
            found = self._logical_rows[key] = tuple(_local_logical_rows(job, plc))
        return found

    # ----------------------------------------------------------------- local maps
    def _block(self, placed: Sequence[Placed], config: MapConfig) -> list[Tensor]:
        """MuonBP block step: each logical matrix cut by this rank's piece (or, for a matrix held whole, by
        the ``blocks`` grid as in one process), orthogonalized locally."""
        pieces, where = [], []
        for i, (job, plc) in enumerate(placed):
            regions = piece_classes.block_regions(job, plc, job.update.shape[1])
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
            for e in piece_classes._row_entries(job, plc, u.shape[1], config.lr_scale):  # the class plans' too
                block = None if e.region is None else u[e.region[0] : e.region[1], e.region[2] : e.region[3]]
                if e.comm is None:  # whole oriented rows here: a wide matrix's rows, a tall one's columns
                    whole.append((i, e.region, block, e.scale))  # type: ignore[arg-type]
                    continue
                entry = _SplitRows(i, e.region, e.scale, e.wide, block, e.length, u.device)
                pending.setdefault(id(e.comm), (e.comm, []))[1].append(entry)
        for (i, region, _, _), f in zip(whole, row_factors_batched([w[2] for w in whole], [w[3] for w in whole])):
            parts[i].append((region, f))
        reduced = []
        for comm, entries in pending.values():
            flat = _square_sums_flat(entries)
            reduced.append((entries, flat, comm.all_reduce(flat, async_op=True)))
        for entries, flat, work in reduced:
            work.wait()
            scales = piece_classes.scale_vector([(e.scale, e.length) for e in entries], flat, self._scale_vectors)
            for e, f in zip(entries, _split_row_factors(entries, flat, scales)):
                if e.region is not None:
                    parts[e.job].append((e.region, f))
        for p in parts:
            p.sort(key=_region_order)
        return [compose_row_direction(job.update, p) for (job, _), p in zip(placed, parts)]


def _local_stacked_job(job: MatrixJob, plc: _Placement) -> MatrixJob:
    """The job of the stacked matrices this rank holds, as one process would see a parameter of that many."""
    return whole_experts_job(job, job.update.shape[0] // job.matrix_rows)  # type: ignore[operator]


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
