"""The interface between the optimizer and its execution: "give me the directions for these momenta".

The optimizer core hands a list of :class:`MatrixJob` (one per parameter, holding the rows of the
Nesterov momentum this process owns) and a step kind; an engine returns, for each job, the
direction for exactly those rows, already multiplied by the shape scale of the matrix the map was
applied to (docs/algorithms.md, "Step size"). :class:`LocalEngine` is the single-process engine; the
sharded engine implements the same call with collectives. Tests hold the two against each other.
"""

from __future__ import annotations

import numbers
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Literal, Protocol, get_args

import torch
from torch import Tensor

from dimuon.optim.common import StepKind
from dimuon.optim.linalg import (
    compiled_newton_schulz,
    lr_scale_factor,
    newton_schulz,
    row_factors,
    row_normalize,
)
from dimuon.optim.workspace import Workspace

RowRange = tuple[int, int]
Region = tuple[int, int, int, int]  # rows [r0, r1) x columns [c0, c1) of a matrix
BlockGrid = tuple[int, int]  # (row blocks, column blocks) of a single-process block step
# Per job, its per-logical-matrix sums over the rows this process holds, given per job and logical matrix the
# local row range holding that matrix's rows here (None: none of them).
PartialSums = Callable[[Sequence["MatrixJob"], Sequence[Sequence["RowRange | None"]]], list[Tensor]]

# Spectral-step strategies of the sharded engine (docs/algorithms.md, "Sharded execution").
Refresh = Literal["gather", "owner"]
REFRESH_STRATEGIES: tuple[str, ...] = get_args(Refresh)
DEFAULT_REFRESH: Refresh = "owner"  # 2/W of gather's bytes and no repeated Newton-Schulz at every W >= 2

# How the replicas of a sharded matrix (mesh dimensions that replicate it, e.g. HSDP's) share its refresh:
# every replica repeats it, or each matrix goes to one replica and the refreshed pieces are broadcast.
ReplicaRefresh = Literal["repeat", "split"]
REPLICA_REFRESH_STRATEGIES: tuple[str, ...] = get_args(ReplicaRefresh)

# Size of the communication buckets that overlap with Newton-Schulz, in MiB (the one default).
DEFAULT_BUCKET_MB: float = 16.0


@dataclass(frozen=True)
class MapConfig:
    """Options of the direction maps (shared by every matrix of one parameter group)."""

    ns_steps: int = 5
    ns_coefficients: str = "quintic"
    ns_algorithm: str = "standard"
    ns_dtype: torch.dtype | None = None
    lr_scale: str = "match_rms_adamw"
    ns_compile: bool = False  # run Newton-Schulz through torch.compile
    # Where the maps take their large temporaries (the CPU form of the step, dimuon.optim.workspace); not an option
    workspace: Workspace | None = field(default=None, compare=False, repr=False)


@dataclass
class MatrixJob:
    """One Muon parameter as the engine sees it.

    ``update`` holds this process's piece of the ``(rows, cols)`` Nesterov momentum (all of it in a
    single process; a sharded engine reads where the piece sits from the parameter's placements).
    ``splits`` are the global row ranges and ``col_splits`` the global column ranges of the logical
    matrices the parameter is made of: every row range times every column range is one matrix (one range
    each unless fused matrices are split, by ``split_sizes`` and ``col_split_sizes``). ``blocks`` is the
    ``(row blocks, column blocks)`` grid a single-process block step cuts each stacked matrix into
    (``torch.chunk`` on each side; an int: row blocks). ``matrix_rows`` is set for a stacked parameter
    (``stacked=True``, shape ``(E, m, n)``): the matrix is then the ``(E*m, n)`` view, the ``m`` rows of each
    stacked matrix are apart (``splits`` holds each stacked matrix's row ranges), and a sharded engine
    finds each rank's whole stacked matrices by the leading dimension.
    """

    name: str
    update: Tensor
    rows: int
    cols: int
    splits: tuple[RowRange, ...] = ()
    blocks: int | BlockGrid = (1, 1)
    meta: dict = field(default_factory=dict)
    col_splits: tuple[RowRange, ...] = ()
    matrix_rows: int | None = None

    def logical_ranges(self) -> tuple[RowRange, ...]:
        """The row ranges of the logical matrices (for a stacked parameter, of every stacked matrix)."""
        return self.splits or ((0, self.rows),)

    def col_ranges(self) -> tuple[RowRange, ...]:
        """The column ranges of the logical matrices."""
        return self.col_splits or ((0, self.cols),)

    def regions(self) -> list[Region]:
        """Every logical matrix as rows ``[r0, r1)`` x columns ``[c0, c1)``, row ranges first."""
        return [(a, b, c, d) for a, b in self.logical_ranges() for c, d in self.col_ranges()]

    def stacked_ranges(self) -> tuple[RowRange, ...]:
        """The row range of each stacked matrix (one range, all rows, unless stacked)."""
        m = self.matrix_rows
        return ((0, self.rows),) if not m else tuple((e, e + m) for e in range(0, self.rows, m))


@dataclass(frozen=True)
class RowScaled:
    """A RowNorm direction left as ``update * factor``: ``factor`` (fp32 or wider, the shape scale folded in)
    broadcasts against ``update`` as ``(rows, 1)`` (row norms) or ``(1, cols)`` (column norms). The core folds it
    into the weight update (one ``addcmul`` reading the momentum once), so the direction is never written."""

    update: Tensor
    factor: Tensor

    def materialize(self) -> Tensor:
        return self.update * self.factor


RowDirection = Tensor | RowScaled
# A region of a job's local update and the RowNorm factor of its oriented rows there.
RegionFactor = tuple[Region, Tensor]


class DirectionEngine(Protocol):
    """Computes directions for a group's jobs at one step kind."""

    def directions(self, jobs: Sequence[MatrixJob], kind: StepKind, config: MapConfig) -> list[Tensor]: ...

    def row_directions(self, jobs: Sequence[MatrixJob], config: MapConfig) -> list[RowDirection]:
        """RowNorm directions of ``jobs`` as :class:`RowScaled` where one factor covers the job's update (else the
        direction itself): ``directions(jobs, ROWNORM, config)`` without writing them."""
        ...

    def matrix_sums(self, jobs: Sequence[MatrixJob], partial_sums: PartialSums) -> list[Tensor]:
        """Per job, ``partial_sums(job)`` (this process's share, e.g. a ``(matrices, k)`` tensor of sums over the
        rows it holds) added over the processes that hold distinct rows of the job's matrix, each counted
        once; the same result on every process, with one collective at most (every process must call it)."""
        ...

    def agree_max(self, values: Tensor) -> Tensor:
        """``values`` (a 1-D tensor) replaced by their elementwise maximum over every process that votes, so every
        process holds the same numbers (replicas whose sums differ in the last bits decide alike; every process
        must call it)."""
        ...

    def all_true(self, flag: Tensor) -> Tensor:
        """``flag`` (a 0-d bool tensor, or a 1-D one of several flags) AND-ed over every process, elementwise, as a
        bool tensor of its shape on ``flag``'s device: no host read (every process must call it)."""
        ...

    def comm_stats(self, by_mesh_dim: bool = False) -> dict[str, dict[str, Any]]:
        """Logical bytes and calls per collective kind (or per mesh dimension, then kind) since the last reset."""
        ...

    def reset_comm_stats(self) -> None: ...


def read_flag(flag: Tensor) -> bool:
    """The host reads a 0-d flag (one device-to-host copy, which waits for the device's queue): with
    ``nonfinite="raise"`` the vote's, the step's only read of it."""
    return bool(flag)


def chunk_ranges(start: int, stop: int, chunks: int) -> list[RowRange]:
    """Row ranges that ``torch.chunk`` makes of rows ``[start, stop)`` (it may make fewer than asked)."""
    n = stop - start
    if n <= 0:
        return []
    size = -(-n // chunks)
    return [(start + i, min(start + i + size, stop)) for i in range(0, n, size)]


def intersect(a: RowRange, b: RowRange) -> RowRange | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def intersections(ranges: Sequence[RowRange], chunks: Sequence[RowRange]) -> list[RowRange]:
    """Every non-empty intersection of a range with a chunk, range after range (loops, not a comprehension with an
    assignment in it: dynamo cannot read the cell that makes, and a compiled step may make a plan)."""
    out = []
    for a in ranges:
        for b in chunks:
            cut = intersect(a, b)
            if cut is not None:
                out.append(cut)
    return out


def split_sizes_to_ranges(
    rows: int, split_sizes: int | Sequence[int] | None, name: str, option: str = "split_sizes", side: str = "rows"
) -> tuple[RowRange, ...]:
    """Global row ranges of the fused matrices given ``split_sizes`` (a chunk count or row counts); with
    ``option="col_split_sizes", side="columns"`` the same for column chunks."""
    if split_sizes is None or split_sizes == 1:
        return ()
    if isinstance(split_sizes, numbers.Integral) and not isinstance(split_sizes, bool):
        split_sizes = int(split_sizes)
        if split_sizes < 1 or rows % split_sizes:
            raise ValueError(f"{option}={split_sizes} for parameter {name!r} must divide its {rows} {side} evenly")
        sizes = [rows // split_sizes] * split_sizes
    else:
        sizes = [int(s) for s in split_sizes]
        if sum(sizes) != rows or min(sizes, default=0) < 1:
            raise ValueError(
                f"{option}={tuple(sizes)} for parameter {name!r} must be positive and sum to its {rows} {side}"
            )
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return tuple(out)


def col_split_sizes_to_ranges(
    cols: int, col_split_sizes: int | Sequence[int] | None, name: str
) -> tuple[RowRange, ...]:
    """Global column ranges of the matrices given ``col_split_sizes`` (a chunk count or column counts)."""
    return split_sizes_to_ranges(cols, col_split_sizes, name, option="col_split_sizes", side="columns")


def stacked_ranges(count: int, matrix_rows: int, ranges: Sequence[RowRange]) -> tuple[RowRange, ...]:
    """The row ranges of ``count`` stacked matrices of ``matrix_rows`` rows each in their ``(count*m, n)`` view:
    each matrix's ``ranges`` (its split rows; all its rows when empty), matrix after matrix."""
    ranges = tuple(ranges) or ((0, matrix_rows),)
    return tuple((e * matrix_rows + a, e * matrix_rows + b) for e in range(count) for a, b in ranges)


def batch_view(matrices: Sequence[Tensor]) -> Tensor | None:
    """``matrices`` as one ``(B, r, c)`` view where each is contiguous and they lie evenly spaced in one buffer
    without overlapping (the core writes same-shape updates back to back into one such buffer, so the same row
    chunk of each lies evenly spaced there), else None."""
    first = matrices[0]
    if not first.is_contiguous():
        return None
    if len(matrices) == 1:
        return first.unsqueeze(0)
    if torch.compiler.is_compiling():  # storage offsets and pointers are not traced: the callers stack (same values)
        return None
    step = matrices[1].storage_offset() - first.storage_offset()
    storage = first.untyped_storage().data_ptr()
    evenly = step >= first.numel() and all(
        [  # a list, not a generator: one Python call, not one per matrix
            m.is_contiguous()
            and m.untyped_storage().data_ptr() == storage
            and m.storage_offset() == first.storage_offset() + k * step
            for k, m in enumerate(matrices)
        ]
    )
    if evenly:
        return first.as_strided((len(matrices), *first.shape), (step, *first.stride()), first.storage_offset())
    return None


def as_batch(matrices: Sequence[Tensor], workspace: Workspace | None = None) -> Tensor:
    """``torch.stack(matrices)``, without the copy when they already lie back to back in one buffer
    (:func:`batch_view`): the usual case costs nothing here. A stack goes into a ``workspace`` buffer where one is
    given (the caller gives it back)."""
    view = batch_view(matrices)
    if view is not None:
        return view
    if workspace is None:
        return torch.stack(list(matrices))
    first = matrices[0]
    out = workspace.empty((len(matrices), *first.shape), first.dtype, first.device)
    return torch.stack(list(matrices), out=out)


def shape_classes(
    firsts: Sequence[Tensor], seconds: Sequence[Tensor], include: Sequence[bool] | None = None
) -> list[list[int]]:
    """The indices of the pairs ``(firsts[i], seconds[i])`` (those with ``include[i]``), grouped by the first's
    shape, dtype and device and the second's dtype, in first-seen order: the pairs one batched op can take."""
    classes: dict[tuple[Any, ...], list[int]] = {}
    for i, (a, b) in enumerate(zip(firsts, seconds)):
        if include is None or include[i]:
            classes.setdefault((tuple(a.shape), a.dtype, b.dtype, a.device), []).append(i)
    return list(classes.values())


def orthogonalize_batch(batch: Tensor, config: MapConfig, scale: float | None) -> Tensor:
    """Newton-Schulz of a ``(B, rows, cols)`` batch, as ``config`` says; with a ``scale``, the lr-scaled direction
    in fp32 or wider (a copy where Newton-Schulz ran narrower), without one its output as it is."""
    ws = None if config.ns_compile else config.workspace  # a compiled graph allocates its own
    orthogonalize = compiled_newton_schulz() if config.ns_compile else newton_schulz
    extra = {"buffers": ws} if ws is not None else {}
    result = orthogonalize(
        batch,
        steps=config.ns_steps,
        coefficients=config.ns_coefficients,
        algorithm=config.ns_algorithm,
        dtype=config.ns_dtype,
        **extra,
    )
    if scale is None:
        return result
    wide = torch.promote_types(result.dtype, torch.float32)
    if result.dtype == wide:
        return result.mul_(scale)
    if ws is None:  # the direction in fp32: a copy, then the scale in place
        return result.to(wide).mul_(scale)
    narrow, result = result, ws.empty(result.shape, wide, result.device)
    result.copy_(narrow).mul_(scale)
    ws.give_back(narrow)
    return result


def apply_map_batched(pieces: Sequence[Tensor], kind: StepKind, config: MapConfig, scaled: bool = True) -> list[Tensor]:
    """Apply the spectral map (``kind`` SPECTRAL or BLOCK) or RowNorm to each piece, batching by shape.

    Matrices of one exact shape and dtype share a batched call (tall ones are handled tall, never copied
    transposed; an fp64 piece is never stacked into an fp32 batch). Returns, in order, the scaled direction of
    each piece (fp32 or wider); with
    ``scaled=False`` (spectral maps only) Newton-Schulz's output as it is, in its compute dtype, for a caller
    that applies the lr scale later (an owner sending directions back in bf16).
    """
    out: list[Tensor | None] = [None] * len(pieces)
    by_shape: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for i, piece in enumerate(pieces):
        by_shape[(*piece.shape, piece.dtype)].append(i)
    ws = None if config.ns_compile else config.workspace  # a compiled graph allocates its own
    for (rows, cols, _), idx in by_shape.items():
        view = batch_view([pieces[i] for i in idx])
        batch = view if view is not None else as_batch([pieces[i] for i in idx], ws)
        scale = lr_scale_factor(config.lr_scale, rows, cols)
        if kind is StepKind.ROWNORM:
            result = row_normalize(batch, scale=scale)
        else:
            result = orthogonalize_batch(batch, config, scale if scaled else None)
        if ws is not None and view is None:
            ws.give_back(batch)  # the stack of this call's own
        for i, res in zip(idx, result.unbind(0)):
            out[i] = res
    return out  # type: ignore[return-value]


def row_factors_batched(pieces: Sequence[Tensor], scales: Sequence[float]) -> list[Tensor]:
    """:func:`~dimuon.optim.linalg.row_factors` of each piece with its scale, one call per shape and scale where the
    pieces lie back to back in one buffer (the core's Nesterov batch), else one call per piece (a stack would copy
    them)."""
    out: list[Tensor | None] = [None] * len(pieces)
    groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for i, piece in enumerate(pieces):
        groups[(tuple(piece.shape), scales[i])].append(i)
    for (_, scale), idx in groups.items():
        batch = batch_view([pieces[i] for i in idx])
        results = (
            row_factors(batch, scale=scale).unbind(0)
            if batch is not None
            else [row_factors(pieces[i], scale=scale) for i in idx]
        )
        for i, res in zip(idx, results):
            out[i] = res
    return out  # type: ignore[return-value]


def compose_row_direction(update: Tensor, parts: Sequence[RegionFactor]) -> RowDirection:
    """A job's RowNorm direction from its regions' factors: one :class:`RowScaled` where the regions tile the
    update by whole rows with row factors (or by whole columns with column factors), else the direction written
    region by region (zeros where no region is)."""
    rows, cols = update.shape
    if parts:
        # A factor is told by its shape against its region's: a (1, 1) factor of an (r, 1) region is a column one.
        row_tiled = all(f.shape[-2:] == (r1 - r0, 1) and (c0, c1) == (0, cols) for (r0, r1, c0, c1), f in parts)
        col_tiled = all(f.shape[-2:] == (1, c1 - c0) and (r0, r1) == (0, rows) for (r0, r1, c0, c1), f in parts)
        edges = [(r0, r1) if row_tiled else (c0, c1) for (r0, r1, c0, c1), _ in parts]
        tiles = (
            all(a == b for (_, a), (b, _) in pairwise(edges))
            and edges[0][0] == 0
            and (edges[-1][1] == (rows if row_tiled else cols))
        )
        if (row_tiled or col_tiled) and tiles:
            factors = [f for _, f in parts]
            factor = factors[0] if len(factors) == 1 else torch.cat(factors, dim=0 if row_tiled else 1)
            return RowScaled(update, factor)
    wide = parts[0][1].dtype if parts else torch.promote_types(update.dtype, torch.float32)
    out = torch.zeros(update.shape, dtype=wide, device=update.device)
    for (r0, r1, c0, c1), f in parts:
        torch.mul(update[r0:r1, c0:c1], f, out=out[r0:r1, c0:c1])
    return out


def materialize(direction: RowDirection) -> Tensor:
    """The direction a :class:`RowScaled` stands for (a Tensor as it is)."""
    return direction.materialize() if isinstance(direction, RowScaled) else direction


def block_grid(blocks: int | Sequence[int]) -> BlockGrid:
    """``blocks`` as a ``(row blocks, column blocks)`` pair: an int means row blocks only."""
    if isinstance(blocks, int):
        return (blocks, 1)
    rows, cols = (*blocks, 1)[:2]  # a 1-tuple is row blocks
    return (int(rows), int(cols))


def map_regions(job: MatrixJob, kind: StepKind) -> list[Region]:
    """The regions of an unsharded job's matrix that the map acts on at this step kind: each logical matrix,
    or on block steps each logical matrix cut by the ``blocks`` grid (row chunks of the whole matrix, or of
    each stacked matrix, intersected with the logical row ranges, times column chunks intersected with the
    logical column ranges)."""
    row_blocks, col_blocks = block_grid(job.blocks)
    if kind is not StepKind.BLOCK or (row_blocks, col_blocks) == (1, 1):
        return job.regions()
    row_chunks = [b for a, z in job.stacked_ranges() for b in chunk_ranges(a, z, row_blocks)]
    col_chunks = chunk_ranges(0, job.cols, col_blocks)
    rows, cols = intersections(job.logical_ranges(), row_chunks), intersections(job.col_ranges(), col_chunks)
    return [(a, b, c, d) for a, b in rows for c, d in cols]


class LocalEngine:
    """Single-process engine: every job holds its whole matrix; no communication."""

    def all_true(self, flag: Tensor) -> Tensor:
        return flag

    def agree_max(self, values: Tensor) -> Tensor:
        return values

    def comm_stats(self, by_mesh_dim: bool = False) -> dict[str, dict[str, Any]]:
        return {}

    def reset_comm_stats(self) -> None:
        pass

    def matrix_sums(self, jobs: Sequence[MatrixJob], partial_sums: PartialSums) -> list[Tensor]:
        return partial_sums(jobs, [job.logical_ranges() for job in jobs])  # every job holds its whole matrix

    def row_directions(self, jobs: Sequence[MatrixJob], config: MapConfig) -> list[RowDirection]:
        regions = [(j, region) for j, job in enumerate(jobs) for region in job.regions()]
        factors = row_factors_batched(
            [jobs[j].update[r0:r1, c0:c1] for j, (r0, r1, c0, c1) in regions],
            [lr_scale_factor(config.lr_scale, r1 - r0, c1 - c0) for _, (r0, r1, c0, c1) in regions],
        )
        parts: list[list[RegionFactor]] = [[] for _ in jobs]
        for (j, region), f in zip(regions, factors):
            parts[j].append((region, f))
        return [compose_row_direction(job.update, p) for job, p in zip(jobs, parts)]

    def directions(self, jobs: Sequence[MatrixJob], kind: StepKind, config: MapConfig) -> list[Tensor]:
        if kind is StepKind.ROWNORM:
            return [materialize(d) for d in self.row_directions(jobs, config)]
        pieces: list[Tensor] = []
        owners: list[tuple[int, Region]] = []
        for j, job in enumerate(jobs):
            for region in map_regions(job, kind):
                r0, r1, c0, c1 = region
                pieces.append(job.update[r0:r1, c0:c1])
                owners.append((j, region))
        results = apply_map_batched(pieces, kind, config)
        outs: list[Tensor | None] = [None] * len(jobs)
        cut: dict[tuple[Any, ...], list[int]] = defaultdict(list)  # jobs assembled from regions, by shape and dtype
        copies: list[tuple[int, Region, Tensor]] = []
        for (j, region), res in zip(owners, results):
            job = jobs[j]
            if region == (0, job.rows, 0, job.cols):
                outs[j] = res
                continue
            if not copies or copies[-1][0] != j:  # a job's regions come one after another
                cut[(tuple(job.update.shape), res.dtype, res.device)].append(j)
            copies.append((j, region, res))
        for (shape, dtype, device), js in cut.items():  # one buffer per shape
            for j, whole in zip(js, torch.empty((len(js), *shape), dtype=dtype, device=device).unbind(0)):
                outs[j] = whole
        if copies:  # one list copy for every region
            torch._foreach_copy_(
                [outs[j][r0:r1, c0:c1] for j, (r0, r1, c0, c1), _ in copies],  # type: ignore[index]
                [res for *_, res in copies],
            )
        for j, job in enumerate(jobs):  # a matrix without regions (a rank's empty share of stacked matrices)
            if outs[j] is None:
                wide = torch.promote_types(job.update.dtype, torch.float32)
                outs[j] = torch.zeros(job.update.shape, dtype=wide, device=job.update.device)
        return outs  # type: ignore[return-value]
