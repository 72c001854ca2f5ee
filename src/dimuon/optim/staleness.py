"""The staleness signal of the adaptive schedule: how much of the momentum's alignment with a matrix's last
spectral direction has been lost since that direction was computed.

With ``O_s`` the spectral direction of the matrix's last spectral step ``s`` and ``U`` the Nesterov momentum,

    staleness_t = 1 - cos(U_t, O_s) / cos(U_s, O_s)

(Frobenius cosines; docs/algorithms.md, "Adaptive refresh"): 0 at step ``s``, growing as the momentum turns away
from the direction last computed for it. It needs the reference ``O_s`` (kept in bf16) and, per row, the two
sums ``U_s . O_s`` and ``|U_s|^2`` taken at step ``s`` (per row and column range when the parameter's columns
are split, ``col_split_sizes``); at step ``t`` each process adds four sums per logical matrix over the rows it
holds, so a sharded matrix needs one all-reduce of four scalars. Pure tensor math: the core keeps the
references, the engine adds the sums over the ranks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from dimuon.optim.distributed.engine import as_batch, shape_classes

RowRange = tuple[int, int]

# The reference direction is kept in bf16: half the memory of an fp32 copy. The row sums are taken against
# the stored (rounded) reference, so the rounding largely cancels: the signal stays within 2e-5 of the fp32
# one on DiT-shaped momenta (tests/unit/test_optim_adaptive.py), far below any useful threshold.
REFERENCE_DTYPE = torch.bfloat16
ROW_SUMS = 2  # per row of the reference step: U_s . O_s and |U_s|^2
SIGNAL_SUMS = 4  # per logical matrix: U_t . O_s, |U_t|^2, U_s . O_s, |U_s|^2


def reference_row_sums(update: Tensor, direction: Tensor, col_ranges: Sequence[RowRange] = ()) -> Tensor:
    """``(rows, 2)`` fp32: per row, ``U_s . O_s`` and ``|U_s|^2`` (``direction`` as stored, e.g. bf16); with column
    ranges ``(rows, 2 * len(col_ranges))``, the two sums over each range's columns, range after range."""
    return reference_row_sums_many([update], [direction], [col_ranges])[0]


def reference_row_sums_many(
    updates: Sequence[Tensor], directions: Sequence[Tensor], col_ranges: Sequence[Sequence[RowRange]] | None = None
) -> list[Tensor]:
    """:func:`reference_row_sums` of many matrices: those of one shape without column ranges batched (two row dot
    products per shape, not per matrix)."""
    col_ranges = col_ranges if col_ranges is not None else [()] * len(updates)
    out: list[Tensor | None] = [None] * len(updates)
    for idx in _shape_classes(updates, directions, col_ranges, out):
        u, o = as_batch([updates[i] for i in idx]).float(), torch.stack([directions[i] for i in idx]).float()
        sums = torch.stack((torch.linalg.vecdot(u, o), torch.linalg.vecdot(u, u)), dim=2)  # (B, m, 2)
        for i, one in zip(idx, sums.unbind(0)):
            out[i] = one
    for i, cols in enumerate(col_ranges):
        if out[i] is None:  # per column range
            u, o = updates[i].float(), directions[i].float()
            out[i] = torch.stack(
                [
                    torch.stack(
                        (torch.linalg.vecdot(u[:, c:d], o[:, c:d]), torch.linalg.vecdot(u[:, c:d], u[:, c:d])), 1
                    )
                    for c, d in cols
                ],
                dim=1,
            ).reshape(u.shape[0], ROW_SUMS * len(cols))
    return out  # type: ignore[return-value]


def _shape_classes(
    updates: Sequence[Tensor],
    directions: Sequence[Tensor],
    col_ranges: Sequence[Sequence[RowRange]],
    out: Sequence[Tensor | None],
) -> list[list[int]]:
    """The indices of the 2-D matrices without column ranges, by shape, dtypes and device (each batched as one)."""
    include = [not cols and u.dim() == 2 and o is None for u, cols, o in zip(updates, col_ranges, out)]
    return shape_classes(updates, directions, include)


def staleness_partial_sums(
    update: Tensor,
    direction: Tensor,
    row_sums: Tensor,
    local_ranges: Sequence[RowRange | None],
    col_ranges: Sequence[RowRange] = (),
) -> Tensor:
    """``(len(local_ranges), 4)`` fp32: per logical matrix, this process's part of ``U_t . O_s``, ``|U_t|^2``,
    ``U_s . O_s`` and ``|U_s|^2`` over the rows it holds: local rows ``local_ranges[i]`` of ``update``,
    ``direction`` and ``row_sums`` (None: none of matrix ``i``'s rows are here). With column ranges (the
    ``row_sums`` of :func:`reference_row_sums` over the same ranges) ``(len(local_ranges) * len(col_ranges), 4)``:
    every row range times every column range, row ranges first."""
    return staleness_partial_sums_many([update], [direction], [row_sums], [local_ranges], [col_ranges])[0]


def staleness_partial_sums_many(
    updates: Sequence[Tensor],
    directions: Sequence[Tensor],
    row_sums: Sequence[Tensor],
    local_ranges: Sequence[Sequence[RowRange | None]],
    col_ranges: Sequence[Sequence[RowRange]] | None = None,
) -> list[Tensor]:
    """:func:`staleness_partial_sums` of many matrices: those of one shape without column ranges batched (two row
    dot products and one segmented sum over all their logical matrices per shape, not per matrix; the updates
    read in place where they lie in one buffer), the others a few kernels each."""
    col_ranges = col_ranges if col_ranges is not None else [()] * len(updates)
    out: list[Tensor | None] = [None] * len(updates)
    for idx in _shape_classes(updates, directions, col_ranges, out):
        u, o = as_batch([updates[i] for i in idx]).float(), torch.stack([directions[i] for i in idx]).float()
        then = torch.stack([row_sums[i] for i in idx]).float()  # (B, m, 2)
        rows = torch.cat(
            (torch.linalg.vecdot(u, o).unsqueeze(2), torch.linalg.vecdot(u, u).unsqueeze(2), then), dim=2
        )  # (B, m, 4)
        ranges = [tuple(local_ranges[i]) for i in idx]
        seg, starts = _segments_many(u.shape[1], ranges, u.device)
        sums = rows.new_zeros(starts[-1] + 1, SIGNAL_SUMS).index_add_(0, seg, rows.reshape(-1, SIGNAL_SUMS))
        for i, start, held in zip(idx, starts, ranges):
            out[i] = sums[start : start + len(held)]
    for i, (u, o, rs, ranges, cols) in enumerate(zip(updates, directions, row_sums, local_ranges, col_ranges)):
        if out[i] is not None:
            continue
        u, o = u.float(), o.float()
        # per row and column range: (m, C, 4), flattened so one segmented sum takes every range (m may be 0)
        now = torch.stack([torch.linalg.vecdot(u[:, c:d], o[:, c:d]) for c, d in cols], dim=1)
        norm = torch.stack([torch.linalg.vecdot(u[:, c:d], u[:, c:d]) for c, d in cols], dim=1)
        then = rs.float().view(u.shape[0], len(cols), ROW_SUMS)
        rows = torch.cat((now.unsqueeze(2), norm.unsqueeze(2), then), dim=2).reshape(
            u.shape[0], len(cols) * SIGNAL_SUMS
        )
        ranges = tuple(ranges)
        sums = rows.new_zeros(len(ranges) + 1, rows.shape[1])  # the last slot takes rows in no range
        total = sums.index_add_(0, _segments(u.shape[0], ranges, u.device), rows)[: len(ranges)]
        out[i] = total.reshape(-1, SIGNAL_SUMS)
    return out  # type: ignore[return-value]


_SEGMENTS: dict[tuple, Tensor] = {}
_SEGMENTS_MANY: dict[tuple, tuple[Tensor, list[int]]] = {}


def _segments(rows: int, ranges: tuple[RowRange | None, ...], device: torch.device) -> Tensor:
    """Per local row, the index of the range holding it (``len(ranges)`` for none); cached per layout (not from
    inside a compiled step: a tensor a graph made and returned is overwritten by the graph's next replay)."""
    key = (rows, ranges, device)
    seg = _SEGMENTS.get(key)
    if seg is None:
        seg = torch.full((rows,), len(ranges), dtype=torch.long, device=device)
        for i, held in enumerate(ranges):
            if held is not None:
                seg[held[0] : held[1]] = i
        if not torch.compiler.is_compiling():  # a graph's output is overwritten by its next replay (CUDA graphs)
            _SEGMENTS[key] = seg
    return seg


def _segments_many(
    rows: int, ranges: Sequence[tuple[RowRange | None, ...]], device: torch.device
) -> tuple[Tensor, list[int]]:
    """:func:`_segments` of ``len(ranges)`` matrices of ``rows`` rows one after another: matrix ``j``'s ranges at
    slots ``starts[j]..``, back to back, and one slot after them all (``starts[-1]``) for the rows in none, so the
    sums of every matrix are one contiguous block; and ``starts``. Built on the host once per layout and copied to
    the device once."""
    key = (rows, tuple(ranges), device)
    hit = _SEGMENTS_MANY.get(key)
    if hit is None:
        starts = list(itertools.accumulate((len(held) for held in ranges), initial=0))
        seg = []
        for base, held in zip(starts, ranges):
            per_row = [starts[-1]] * rows
            for r, span in enumerate(held):
                if span is not None:
                    per_row[span[0] : span[1]] = [base + r] * (span[1] - span[0])
            seg += per_row
        hit = (torch.tensor(seg, dtype=torch.long, device=device), starts)
        if not torch.compiler.is_compiling():  # as in _segments: a graph keeps its own, a constant of the graph
            _SEGMENTS_MANY[key] = hit
    return hit


def row_sums_batch(updates: Tensor, directions: Tensor, col_ranges: Sequence[RowRange]) -> Tensor:
    """``(B, rows, C, 2)`` fp32 of a ``(B, rows, cols)`` batch: per row and column range ``U . O`` and ``|U|^2``
    (:func:`reference_row_sums` of every matrix at once, ranges in the same order)."""
    u, o = updates.float(), directions.float()
    if len(col_ranges) == 1 and col_ranges[0] == (0, u.shape[2]):  # the whole row, as the per-matrix form takes it
        return torch.stack((torch.linalg.vecdot(u, o), torch.linalg.vecdot(u, u)), dim=2).unsqueeze(2)
    pairs = [
        torch.stack((torch.linalg.vecdot(u[..., c:d], o[..., c:d]), torch.linalg.vecdot(u[..., c:d], u[..., c:d])), 2)
        for c, d in col_ranges
    ]
    return torch.stack(pairs, dim=2)


def staleness_batch(
    updates: Tensor, directions: Tensor, row_sums: Tensor, ranges: tuple[RowRange, ...], col_ranges: Sequence[RowRange]
) -> Tensor:
    """``(B,)``: the stalest logical matrix (every row range ``ranges`` times column range) of each matrix of a
    ``(B, rows, cols)`` batch held whole, ``row_sums`` its ``(B, rows, 2 C)`` reference sums."""
    return staleness_from_sums(partial_sums_batch(updates, directions, row_sums, ranges, col_ranges)).amax(dim=1)


def partial_sums_batch(
    updates: Tensor,
    directions: Tensor,
    row_sums: Tensor,
    ranges: Sequence[RowRange | None],
    col_ranges: Sequence[RowRange],
) -> Tensor:
    """``(B, len(ranges) * C, 4)`` fp32: :func:`staleness_partial_sums_many` of every matrix of a ``(B, rows,
    cols)`` batch whose matrices hold the same local rows ``ranges`` of their logical matrices (None: none here),
    ``row_sums`` their ``(B, rows, 2 C)`` reference sums over the column ranges; the sums added row after row as
    that function adds them (one segmented sum for the batch), row ranges first."""
    count, rows = updates.shape[0], updates.shape[1]
    now = row_sums_batch(updates, directions, col_ranges)  # (B, rows, C, 2)
    then = row_sums.float().view(count, rows, len(col_ranges), ROW_SUMS)
    per_row = torch.cat((now, then), dim=3).reshape(count * rows, len(col_ranges) * SIGNAL_SUMS)
    seg, starts = _segments_many(rows, (tuple(ranges),) * count, updates.device)
    sums = per_row.new_zeros(starts[-1] + 1, per_row.shape[1]).index_add_(0, seg, per_row)
    return sums[: starts[-1]].view(count, -1, SIGNAL_SUMS)  # the last slot: the rows in no range


def staleness_from_sums(sums: Tensor) -> Tensor:
    """``1 - cos(U_t, O_s) / cos(U_s, O_s)`` per row of ``sums`` (``|O_s|`` cancels); ``inf`` where the reference
    cannot say (a zero momentum at step ``s``, or a zero one now): such a matrix counts as stale."""
    now, norm_now, then, norm_then = sums.unbind(dim=-1)
    valid = (then > 0) & (norm_now > 0) & (norm_then > 0)
    tiny = torch.finfo(sums.dtype).tiny
    ratio = (now * norm_then.clamp(min=tiny).sqrt()) / (then.clamp(min=tiny) * norm_now.clamp(min=tiny).sqrt())
    return torch.where(valid, 1.0 - ratio, torch.full_like(ratio, float("inf")))
