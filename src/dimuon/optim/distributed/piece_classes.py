"""The sharded step by class: a Muon group's DTensor pieces planned once, then one batch per class each step.

A rank's pieces of the parameters alike in global shape, dtype and placement are one class (a
:class:`~dimuon.optim.classes.ShapeClass` of local shape): their Nesterov momenta lie in one ``(B, rows, cols)``
buffer, as in one process. What the sharded engine works out per matrix at every step of the per-job path (the
placement, the local rows of each logical matrix, which oriented rows the ranks split and over which group, the
block regions) is worked out here once, when the plan is made, so a RowNorm or block step's Python grows with
classes and step kinds, not with matrices:

- RowNorm: per class, the factors of the oriented rows held whole here from the class batch; the partial sums of
  squares of split ones, every class's in one flat all-reduce per process group (all issued before any wait), the
  same sums :meth:`ShardedEngine._rownorm` reduces, in another order;
- block: the local regions of every class, batched by shape (:func:`dimuon.optim.classes.spectral_directions`);
- spectral: the engine's refresh on the plan's jobs, their updates views of the class batches.

Stacked parameters (experts) are planned as the per-job path runs them, decided per class once: a class's local
matrix is the ``(E_local * rows, cols)`` view of its experts (``lead`` 2); experts whole here are mapped as one
process maps them (their refresh too, with no communication), experts whose rows a mesh dimension splits are the
rank's experts as one row-sharded matrix (:mod:`dimuon.optim.distributed.experts`), their refresh the engine's.
Under AdaptiveRowMuon a stacked class's staleness sums are its parameters' (``PieceClass.signal_job``: every expert's
logical matrices, added over the parameter's shard group), as on the per-job path.

A schedule that decides per matrix (AdaptiveRowMuon) takes each kind's share of a class as one batch, as in one
process (:meth:`~dimuon.optim.classes.ClassStep._by_kind`): RowNorm as above on the share (the entries are per
class; every rank decides the same kinds, from agreed signals, so they issue the same collectives); the refresh of
the chosen matrices, what is static about it kept per subset for the few subsets refreshed last
(:func:`subset_memo`); its staleness signal per class of local pieces (``dimuon.optim.adaptive``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
from torch import Tensor

from dimuon.optim import devices
from dimuon.optim.classes import (
    MASK_BATCH_NUMEL,
    GroupPlan,
    ShapeClass,
    matrix_job,
    ordered_plan,
    spectral_directions,
)
from dimuon.optim.common import StepKind, local_tensors
from dimuon.optim.distributed.collectives import Collectives
from dimuon.optim.distributed.engine import MapConfig, MatrixJob, Region, map_regions
from dimuon.optim.distributed.experts import (
    holds_whole_matrices,
    local_experts_job,
    splits_expert_rows,
    whole_experts_job,
)
from dimuon.optim.distributed.layout import Piece, Span
from dimuon.optim.distributed.placement import _Placement
from dimuon.optim.distributed.refresh import kept
from dimuon.optim.linalg import lr_scale_factor, row_factors, square_sums


@dataclass(frozen=True)
class RowEntry:
    """One logical matrix's RowNorm on a class's local pieces: where its rows lie here and who shares them."""

    region: Region | None  # local rows x columns (None: none of its rows are here)
    scale: float
    wide: bool  # oriented by rows (the logical matrix is wide or square), else by columns
    comm: Collectives | None  # the ranks splitting its oriented rows (None: whole here)
    length: int  # oriented rows of one matrix: its local rows (wide) or its columns (tall)


@dataclass
class PieceClass(ShapeClass):
    """A :class:`ShapeClass` of local pieces: the RowNorm entries its matrices share."""

    entries: tuple[RowEntry, ...] = ()
    placed: tuple[Any, ...] = ()  # stacked: each member's placement as its maps run (else the engine's, per job)
    refresh: bool = True  # its spectral step is the engine's refresh (else mapped here, as one process maps it)
    signal_job: MatrixJob | None = None  # stacked: a member's parameter job, whose sums the staleness signal adds


def _row_entries(job: MatrixJob, plc: Any, local_cols: int, lr_scale: str) -> tuple[RowEntry, ...]:
    """The RowNorm entries of one matrix of the class: :meth:`ShardedEngine._rownorm`'s regions, decided once."""
    entries = []
    col_ranges = job.col_ranges() if job.col_splits else ((0, local_cols),)
    for a, b in job.logical_ranges():
        for c, d in col_ranges:
            cols = d - c if job.col_splits else job.cols  # the logical matrix's global columns
            wide = b - a <= cols
            local = (a, b) if plc.shard is None else plc.mine.local_rows_in(a, b)
            comm = (plc.cols_comm if wide else plc.rows_comm) if plc.shard is not None else None
            if comm is None and local is None:
                continue
            if comm is not None and wide and local is None:  # no rows of a wide matrix here: nothing to add
                continue
            region = None if local is None else (local[0], local[1], c, d)
            length = (local[1] - local[0]) if wide and local is not None else d - c
            entries.append(RowEntry(region, lr_scale_factor(lr_scale, b - a, cols), wide, comm, length))
    return tuple(entries)


def block_regions(job: MatrixJob, plc: Any, local_cols: int) -> list[Region]:
    """The regions a block step maps on one matrix (both paths': the per-job :meth:`ShardedEngine._block` and a
    class's): each logical matrix cut by this rank's piece, or by the ``blocks`` grid where it is held whole. Column
    ranges are global ones only with col_split_sizes, allowed where columns are whole here."""
    if plc.shard is None:
        return map_regions(job, StepKind.BLOCK)
    cols = job.col_ranges() if job.col_splits else ((0, local_cols),)
    rows = [plc.mine.local_rows_in(a, b) for a, b in job.logical_ranges()]  # no assignment in a comprehension
    return [(r[0], r[1], c, d) for r in rows if r is not None for c, d in cols]


def _tiling(entries: Sequence[RowEntry], rows: int, cols: int) -> str | None:
    """How the entries' factors tile the local matrix: ``"rows"`` (row factors over whole local rows, back to
    back), ``"cols"``, or None (the direction is written region by region)."""
    held = [e for e in entries if e.region is not None]
    if not held:
        return None
    if all(e.wide and e.region[2:] == (0, cols) for e in held):  # type: ignore[index]
        edges, size, kind = [e.region[:2] for e in held], rows, "rows"  # type: ignore[index]
    elif all(not e.wide and e.region[:2] == (0, rows) for e in held):  # type: ignore[index]
        edges, size, kind = [e.region[2:] for e in held], cols, "cols"  # type: ignore[index]
    else:
        return None
    tiles = edges[0][0] == 0 and edges[-1][1] == size and all(a[1] == b[0] for a, b in pairwise(edges))
    return kind if tiles else None


def make_piece_plan(
    engine: Any,
    group: dict[str, Any],
    bufs: Sequence[Tensor],
    names: Sequence[str],
    keys: Sequence[str],
    fixed: bool,
) -> GroupPlan:
    """The plan of a Muon group of sharded parameters with momentum buffers ``bufs`` (stacked parameters:
    :func:`_stacked_plan`); ``fixed``: the schedule decides one kind for the group. Classes are told apart by what
    every rank of a group sees alike (global shape, dtypes, every member's piece, the process groups), so all ranks
    issue the same collectives."""
    if group["stacked"]:  # experts: each parameter as the per-job path runs it
        return _stacked_plan(engine, group, bufs, names, keys, fixed)
    params = list(group["params"])
    jobs = [matrix_job(p, group, name) for p, name in zip(params, names)]
    placements = [engine.placement(job) for job in jobs]
    locals_, local_bufs = local_tensors(params), local_tensors(bufs)
    classes, order = [], []
    for (dtype, device, *_), idx in _alike(params, local_bufs, placements).items():
        job, plc, local = jobs[idx[0]], placements[idx[0]], locals_[idx[0]]
        cols = math.prod(local.shape[1:])
        entries = _row_entries(job, plc, cols, group["lr_scale"])
        row_regions = [e.region for e in entries if e.region is not None]
        regions = {StepKind.BLOCK: block_regions(job, plc, cols), StepKind.ROWNORM: row_regions}
        classes.append(_piece_class([params[i] for i in idx], local, 1, dtype, device, regions, entries))
        order += idx
    return ordered_plan(group, classes, order, params, local_bufs, jobs, keys, fixed, sharded=True)


def _alike(
    params: Sequence[Tensor],
    bufs: Sequence[Tensor],
    placements: Sequence[Any],
    extras: Sequence[tuple[Any, ...]] | None = None,
) -> dict[tuple[Any, ...], list[int]]:
    """The parameters' indices by class, in order of first appearance: alike in what every rank of a group sees
    alike (the momentum's dtype and device first, then global shape, dtype, every member's piece and the process
    groups) and in ``extras`` (a stacked parameter's local shape and form)."""
    members: dict[tuple[Any, ...], list[int]] = {}
    for i, (p, b, plc) in enumerate(zip(params, bufs, placements)):
        comms = (id(plc.shard), id(plc.rows_comm), id(plc.cols_comm), id(plc.replicas))
        key = (b.dtype, b.device, tuple(p.shape), p.dtype, plc.members, plc.mine, comms, *(extras[i] if extras else ()))
        members.setdefault(key, []).append(i)
    return members


# How the per-job path runs a stacked parameter (ShardedEngine._placed and its dispatch), decided once per class:
# "rows": a mesh dimension splits each expert's rows, the rank's experts one row-sharded matrix in that group;
# "whole": experts sharded alone, whole matrices here, mapped as one process maps them (no communication);
# "replicated": the whole parameter on every rank, as any matrix held whole; "idle": no rows here, nothing to map.
_REFRESHED = ("rows", "replicated")


def _stacked_form(engine: Any, job: MatrixJob, experts: int) -> tuple[MatrixJob, Any, str]:
    """A stacked parameter's job and placement as the per-job path maps it, and its form (above), given the experts
    its local piece holds."""
    plc = engine.placement(job)
    if splits_expert_rows(job, plc):
        run = local_experts_job(job, plc.mine)
        return run, engine.experts_placement(job, plc), "rows" if run.rows else "idle"
    if not holds_whole_matrices(job, plc):  # no mesh dimension shards it
        return job, plc, "replicated"
    run = whole_experts_job(job, experts)
    whole = Piece((Span(0, run.rows, 0),), (Span(0, run.cols, 0),))
    return run, _Placement(whole, None, (), None, None, None, whole.numel, False), "whole" if run.rows else "idle"


def _stacked_class(
    params: list[Tensor],
    forms: list[tuple[MatrixJob, Any, str]],
    local: Tensor,
    group: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    signal_job: MatrixJob,
) -> PieceClass:
    """The class of stacked parameters alike in form, local and global pieces: its local matrix the ``(E_local *
    rows, cols)`` view of its experts, the maps' regions those of the jobs the per-job path runs; ``signal_job``
    a member's parameter job (the staleness signal's sums are the parameter's, over all its experts)."""
    job, plc, form = forms[0]
    cols = math.prod(local.shape[2:])
    entries = _row_entries(job, plc, cols, group["lr_scale"]) if form != "idle" else ()
    regions = {
        StepKind.BLOCK: block_regions(job, plc, cols) if form != "idle" else [],
        StepKind.ROWNORM: [e.region for e in entries if e.region is not None],
        StepKind.SPECTRAL: map_regions(job, StepKind.SPECTRAL) if form == "whole" else [],
    }
    placed = tuple(plc for _, plc, _ in forms)
    return _piece_class(params, local, 2, dtype, device, regions, entries, placed, form in _REFRESHED, signal_job)


def _piece_class(
    params: list[Tensor],
    local: Tensor,
    lead: int,
    dtype: torch.dtype,
    device: torch.device,
    regions: dict[StepKind, list[Region]],
    entries: tuple[RowEntry, ...],
    placed: tuple[Any, ...] = (),
    refresh: bool = True,
    signal_job: MatrixJob | None = None,
) -> PieceClass:
    """A class of local pieces shaped as ``local``, whose first ``lead`` dimensions make its matrix's rows."""
    rows, cols = math.prod(local.shape[:lead]), math.prod(local.shape[lead:])
    return PieceClass(
        params=params,
        shape=tuple(local.shape),
        rows=rows,
        cols=cols,
        lead=lead,
        dtype=dtype,
        device=device,
        regions=regions,
        tiled=_tiling(entries, rows, cols),
        alone=devices.cpu_path(device) or math.prod(local.shape) > MASK_BATCH_NUMEL,
        entries=entries,
        placed=placed,
        refresh=refresh,
        signal_job=signal_job,
    )


def _stacked_plan(
    engine: Any, group: dict[str, Any], bufs: Sequence[Tensor], names: Sequence[str], keys: Sequence[str], fixed: bool
) -> GroupPlan:
    """The plan of a group of stacked parameters (experts): classes told apart as :func:`make_piece_plan`'s are, and
    by form; the plan's jobs those the per-job path maps (a rank's experts)."""
    params = list(group["params"])
    locals_, local_bufs = local_tensors(params), local_tensors(bufs)
    whole = [matrix_job(p, group, name) for p, name in zip(params, names)]
    forms = [_stacked_form(engine, job, local.shape[0]) for job, local in zip(whole, locals_)]
    placements = [plc for _, plc, _ in forms]
    extras = [(tuple(local.shape), form) for local, (_, _, form) in zip(locals_, forms)]
    classes, order = [], []
    for (dtype, device, *_), idx in _alike(params, local_bufs, placements, extras).items():
        members = [forms[i] for i in idx]
        classes.append(
            _stacked_class([params[i] for i in idx], members, locals_[idx[0]], group, dtype, device, whole[idx[0]])
        )
        order += idx
    jobs = [job for job, _, _ in forms]
    return ordered_plan(group, classes, order, params, local_bufs, jobs, keys, fixed, sharded=True)


def row_factors_sharded(classes: Sequence[PieceClass], batches: Sequence[Tensor], cache: dict) -> list[Tensor]:
    """Per class, its RowNorm factors ``(B, rows, 1)`` or ``(B, 1, cols)`` where they tile the local matrix, else
    its direction: whole oriented rows from the batch, split ones from one flat all-reduce of partial sums of
    squares per process group (launched for every group before any wait), each group's scales kept in ``cache``
    (:func:`scale_vector`). The math before and after the collectives is in functions of its own, so that a
    compiled step keeps it in graphs."""
    parts, groups = _local_row_factors(classes, batches)
    launched = [(items, flat, comm.all_reduce(flat, async_op=True)) for comm, items, flat in groups]
    for _, _, work in launched:
        work.wait()
    reduced = [
        (items, flat, scale_vector([(classes[ci].entries[k].scale, s.numel()) for ci, k, s in items], flat, cache))
        for items, flat, _ in launched
    ]
    return _row_directions(classes, batches, parts, reduced)


def scale_vector(scales: Sequence[tuple[float, int]], like: Tensor, cache: dict) -> Tensor:
    """Each ``(scale, count)``'s scale repeated over its count of split oriented rows, as ``like``'s dtype and device
    (RowNorm's shape scales over the all-reduced sums, both paths'): made once per set of scales and kept in
    ``cache`` (a host-to-device copy at the first step only)."""
    key = (tuple(scales), like.dtype, like.device)
    vector = cache.get(key)
    if vector is None:
        values = [scale for scale, count in scales for _ in range(count)]
        vector = cache[key] = torch.tensor(values, dtype=like.dtype, device=like.device)
    return vector


_Items = list[tuple[int, int, Tensor]]  # (class, entry, its partial sums) of one process group's all-reduce


def _local_row_factors(
    classes: Sequence[PieceClass], batches: Sequence[Tensor]
) -> tuple[list[list[Tensor | None]], list[tuple[Collectives, _Items, Tensor]]]:
    """Per class and entry the factors of the oriented rows whole here (None for split ones); per process group
    (in first-appearance order, the same on its every rank) the split rows' partial sums, and them end to end."""
    parts: list[list[Tensor | None]] = [[None] * len(cls.entries) for cls in classes]
    comms: list[Collectives] = []
    members: list[_Items] = []
    for ci, (cls, batch) in enumerate(zip(classes, batches)):
        for k, e in enumerate(cls.entries):
            block = None if e.region is None else batch[:, e.region[0] : e.region[1], e.region[2] : e.region[3]]
            if e.comm is None:
                parts[ci][k] = row_factors(block, scale=e.scale)  # type: ignore[arg-type]
                continue
            if block is None:  # a tall matrix none of whose rows are here: zeros to the column sums
                sums = torch.zeros(batch.shape[0] * e.length, dtype=torch.float32, device=batch.device)
            else:
                wide_dtype = torch.promote_types(block.dtype, torch.float32)
                sums = square_sums(block.to(wide_dtype), -1 if e.wide else -2).reshape(-1)
            found = [j for j, comm in enumerate(comms) if comm is e.comm]
            if not found:
                comms.append(e.comm)
                members.append([])
            members[found[0] if found else -1].append((ci, k, sums))
    return parts, [(comm, items, torch.cat([s for _, _, s in items])) for comm, items in zip(comms, members)]


def _row_directions(
    classes: Sequence[PieceClass],
    batches: Sequence[Tensor],
    parts: list[list[Tensor | None]],
    reduced: Sequence[tuple[_Items, Tensor, Tensor]],
) -> list[Tensor]:
    """The split rows' factors from their all-reduced sums (each whole oriented row's squared norm: the factor of
    linalg.row_factors, one division per group, over the group's scale vector), then every class's factors or
    direction."""
    for items, flat, scales in reduced:
        factors = scales / flat.sqrt().clamp(min=1e-7)
        for (ci, k, _), f in zip(items, factors.split([s.numel() for _, _, s in items])):
            e = classes[ci].entries[k]
            if e.region is not None:
                f = f.view(-1, e.length)
                parts[ci][k] = f[:, :, None] if e.wide else f[:, None, :]
    return [_compose(cls, batch, p) for cls, batch, p in zip(classes, batches, parts)]


def _compose(cls: PieceClass, batch: Tensor, factors: list[Tensor | None]) -> Tensor:
    """A class's factors (where they tile the local matrix) or its direction, from its entries' factors."""
    held = [(e.region, f) for e, f in zip(cls.entries, factors) if e.region is not None]
    if cls.tiled is not None:
        fs = [f for _, f in held]
        return fs[0] if len(fs) == 1 else torch.cat(fs, dim=1 if cls.tiled == "rows" else 2)  # type: ignore[return-value,arg-type]
    wide = held[0][1].dtype if held else torch.promote_types(batch.dtype, torch.float32)  # type: ignore[union-attr]
    out = torch.zeros(batch.shape, dtype=wide, device=batch.device)
    for (r0, r1, c0, c1), f in held:  # type: ignore[misc]
        out[:, r0:r1, c0:c1] = batch[:, r0:r1, c0:c1] * f
    return out


def refreshed(engine: Any, plan: GroupPlan, batches: Sequence[Tensor], config: MapConfig) -> list[Any]:
    """Per class, each matrix's local direction from the engine's spectral refresh, the jobs' updates set to the
    rows of the class batches; a class of stacked matrices held whole here (or of none) mapped as one process maps
    them, with no communication (as the per-job path's local maps), one batch per shape."""
    updates = [u for batch in batches for u in batch.unbind(0)]
    for job, u in zip(plan.jobs, updates):
        job.update = u
    # A plan of one kind per group hands the same jobs at every step: their placements and everything static about
    # the refresh (split, buckets, classes, regions, exchange counts) are kept in its memo.
    memo = plan.memo if plan.fixed else subset_memo(plan)
    placed = kept(memo, "placed", lambda: _refresh_jobs(engine, plan))
    made = engine.refresh_placed(placed, config, memo) if placed else []
    local = [ci for ci, cls in enumerate(plan.classes) if not cls.refresh]  # type: ignore[attr-defined]
    mapped = (
        spectral_directions([plan.classes[i] for i in local], [batches[i] for i in local], StepKind.SPECTRAL, config)
        if local
        else []
    )
    out: list[Any] = []
    start = 0
    for ci, cls in enumerate(plan.classes):
        if ci in local:
            out.append(mapped[local.index(ci)])
            continue
        out.append(made[start : start + len(cls.params)])
        start += len(cls.params)
    return out


def _refresh_jobs(engine: Any, plan: GroupPlan) -> list[tuple[MatrixJob, Any]]:
    """The plan's jobs the engine refreshes, class after class, each with its placement (a stacked class's, or the
    engine's of the job's parameter, worked out once per job and kept in the plan's memo, which the parts of a step
    that mixes kinds share: a subset refreshed for the first time finds its placements there)."""
    known: dict[int, Any] = plan.memo.setdefault("placements", {})
    placed: list[tuple[MatrixJob, Any]] = []
    start = 0
    for cls in plan.classes:
        jobs, start = plan.jobs[start : start + len(cls.params)], start + len(cls.params)
        if cls.refresh:  # type: ignore[attr-defined]
            plcs = cls.placed or [  # type: ignore[attr-defined]
                known[id(job)] if id(job) in known else known.setdefault(id(job), engine.placement(job)) for job in jobs
            ]
            placed += zip(jobs, plcs)
    return placed


# The refreshed subsets of a plan whose schedule decides per matrix, whose refresh's static parts are kept: matrices
# refreshed together (first all, then those forced at the same age) tend to be so again, so a few subsets recur.
SUBSET_MEMOS = 8


def subset_memo(part: GroupPlan) -> dict:
    """The memo of the refresh of ``part``'s jobs (a plan's share of one step kind), kept in the whole plan's memo
    for the :data:`SUBSET_MEMOS` subsets refreshed last: a subset met again refreshes as a plan of one kind does; a
    new one is planned at that step, from what the refresh keeps per shape and layout (no Python call per matrix)."""
    memos = part.memo.setdefault("subsets", {})  # a plan's parts share its memo (dataclasses.replace)
    key = tuple(map(id, part.jobs))  # the plan's jobs, alive as long as its memo
    memo = memos.pop(key, None)
    if memo is None:
        memo = {}
        if len(memos) >= SUBSET_MEMOS:
            memos.pop(next(iter(memos)))  # the one used longest ago
    memos[key] = memo  # the most recent last
    return memo
