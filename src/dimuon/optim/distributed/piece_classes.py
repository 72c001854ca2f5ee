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

A schedule that decides per matrix (AdaptiveRowMuon) takes each kind's share of a class as one batch, as in one
process (:meth:`~dimuon.optim.classes.ClassStep._by_kind`): RowNorm as above on the share (the entries are per
class; every rank decides the same kinds, from agreed signals, so they issue the same collectives); the refresh of
the chosen matrices, what is static about it kept per subset for the few subsets refreshed last
(:func:`subset_memo`); its staleness signal per class of local pieces (``dimuon.optim.adaptive``). Stacked
parameters (experts) and other layouts the plan does not take keep the per-job path.
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
from dimuon.optim.classes import MASK_BATCH_NUMEL, GroupPlan, ShapeClass, matrix_job, ordered_plan
from dimuon.optim.common import StepKind, local_tensors
from dimuon.optim.distributed.collectives import Collectives
from dimuon.optim.distributed.engine import MapConfig, MatrixJob, Region, map_regions
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
    return [
        (r[0], r[1], c, d)
        for a, b in job.logical_ranges()
        if (r := plc.mine.local_rows_in(a, b)) is not None
        for c, d in cols
    ]


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
) -> GroupPlan | None:
    """The plan of a Muon group of sharded parameters with momentum buffers ``bufs`` (None for stacked parameters,
    which keep the per-job path); ``fixed``: the schedule decides one kind for the group. Classes are told apart by
    what every rank of a group sees alike (global shape, dtypes, every member's piece, the process groups), so all
    ranks issue the same collectives."""
    params = list(group["params"])
    if group["stacked"]:  # experts: the per-job path
        return None
    jobs = [matrix_job(p, group, name) for p, name in zip(params, names)]
    placements = [engine.placement(job) for job in jobs]
    locals_, local_bufs = local_tensors(params), local_tensors(bufs)
    members: dict[tuple[Any, ...], list[int]] = {}
    for i, (p, b, plc) in enumerate(zip(params, local_bufs, placements)):
        comms = (id(plc.shard), id(plc.rows_comm), id(plc.cols_comm), id(plc.replicas))
        key = (tuple(p.shape), p.dtype, b.dtype, b.device, plc.members, plc.mine, comms)
        members.setdefault(key, []).append(i)
    classes, order = [], []
    for (_, _, dtype, device, *_), idx in members.items():
        job, plc, local = jobs[idx[0]], placements[idx[0]], locals_[idx[0]]
        rows, cols = local.shape[0], math.prod(local.shape[1:])
        entries = _row_entries(job, plc, cols, group["lr_scale"])
        row_regions = [e.region for e in entries if e.region is not None]
        classes.append(
            PieceClass(
                params=[params[i] for i in idx],
                shape=tuple(local.shape),
                rows=rows,
                cols=cols,
                lead=1,
                dtype=dtype,
                device=device,
                regions={StepKind.BLOCK: block_regions(job, plc, cols), StepKind.ROWNORM: row_regions},
                tiled=_tiling(entries, rows, cols),
                alone=devices.cpu_path(device) or math.prod(local.shape) > MASK_BATCH_NUMEL,
                entries=entries,
            )
        )
        order += idx
    return ordered_plan(group, classes, order, params, local_bufs, jobs, keys, fixed, sharded=True)


def row_factors_sharded(classes: Sequence[PieceClass], batches: Sequence[Tensor]) -> list[Tensor]:
    """Per class, its RowNorm factors ``(B, rows, 1)`` or ``(B, 1, cols)`` where they tile the local matrix, else
    its direction: whole oriented rows from the batch, split ones from one flat all-reduce of partial sums of
    squares per process group (launched for every group before any wait). The math before and after the
    collectives is in functions of its own, so that a compiled step keeps it in graphs."""
    parts, groups = _local_row_factors(classes, batches)
    launched = [(items, flat, comm.all_reduce(flat, async_op=True)) for comm, items, flat in groups]
    for _, _, work in launched:
        work.wait()
    return _row_directions(classes, batches, parts, [(items, flat) for items, flat, _ in launched])


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
    reduced: Sequence[tuple[_Items, Tensor]],
) -> list[Tensor]:
    """The split rows' factors from their all-reduced sums (each whole oriented row's squared norm: the factor of
    linalg.row_factors, one division per group), then every class's factors or direction."""
    for items, flat in reduced:
        factors = _scales(classes, items, flat) / flat.sqrt().clamp(min=1e-7)
        for (ci, k, _), f in zip(items, factors.split([s.numel() for _, _, s in items])):
            e = classes[ci].entries[k]
            if e.region is not None:
                f = f.view(-1, e.length)
                parts[ci][k] = f[:, :, None] if e.wide else f[:, None, :]
    return [_compose(cls, batch, p) for cls, batch, p in zip(classes, batches, parts)]


def _scales(classes: Sequence[PieceClass], items: Sequence[tuple[int, int, Tensor]], like: Tensor) -> Tensor:
    """Each entry's shape scale over its sums: one op where every entry has the same (the usual case)."""
    scales = [classes[ci].entries[k].scale for ci, k, _ in items]
    if len(set(scales)) == 1:
        return torch.full_like(like, scales[0])
    return torch.cat([torch.full_like(s, scale) for (_, _, s), scale in zip(items, scales)])


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


def refreshed(engine: Any, plan: GroupPlan, batches: Sequence[Tensor], config: MapConfig) -> list[list[Tensor]]:
    """Per class, each matrix's local direction from the engine's spectral refresh, the jobs' updates set to the
    rows of the class batches."""
    updates = [u for batch in batches for u in batch.unbind(0)]
    for job, u in zip(plan.jobs, updates):
        job.update = u
    # A plan of one kind per group hands the same jobs at every step: their placements and everything static about
    # the refresh (split, buckets, classes, regions, exchange counts) are kept in its memo.
    memo = plan.memo if plan.fixed else subset_memo(plan)
    placed = kept(memo, "placed", lambda: [(job, engine.placement(job)) for job in plan.jobs])
    made = engine.refresh_placed(placed, config, memo)
    out, start = [], 0
    for cls in plan.classes:
        out.append(made[start : start + len(cls.params)])
        start += len(cls.params)
    return out


# The refreshed subsets of a plan whose schedule decides per matrix, whose refresh's static parts are kept: matrices
# refreshed together (first all, then those forced at the same age) tend to be so again, so a few subsets recur.
SUBSET_MEMOS = 8


def subset_memo(part: GroupPlan) -> dict:
    """The memo of the refresh of ``part``'s jobs (a plan's share of one step kind), kept in the whole plan's memo
    for the :data:`SUBSET_MEMOS` subsets refreshed last: a subset met again refreshes as a plan of one kind does
    (no Python per matrix); a new one is worked out once, as the per-job path would at every step."""
    memos = part.memo.setdefault("subsets", {})  # a plan's parts share its memo (dataclasses.replace)
    key = tuple(map(id, part.jobs))  # the plan's jobs, alive as long as its memo
    memo = memos.pop(key, None)
    if memo is None:
        memo = {}
        if len(memos) >= SUBSET_MEMOS:
            memos.pop(next(iter(memos)))  # the one used longest ago
    memos[key] = memo  # the most recent last
    return memo
