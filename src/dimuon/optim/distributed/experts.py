"""Stacked experts ``(E, m, n)`` as the sharded engine sees them: each rank's experts as one stacked matrix.

Placements on dimension 0 decide which experts a rank holds (expert parallelism, or FSDP's ``Shard(0)``);
placements on dimension 1 split every expert's ``m`` rows (FSDP's ``Shard(1)``, as torchtitan shards experts over
its remaining data dimension). The ranks that hold one expert's rows hold the same experts, so a rank's experts
form an ``(E_local * m, n)`` matrix of ``E_local`` row-sharded matrices, shared by those ranks alone: its refresh
runs in their group, and the expert dimension's ranks exchange nothing.
"""

from __future__ import annotations

import math
from typing import Any

from dimuon.optim.distributed.engine import MatrixJob, RowRange, stacked_ranges
from dimuon.optim.distributed.layout import Layout, Piece, Span, placement_words

__all__ = [
    "check_stacked_layout",
    "expert_rows_in",
    "holds_whole_matrices",
    "local_experts",
    "local_experts_job",
    "local_experts_piece",
    "splits_expert_rows",
    "whole_experts_job",
]

SUPPORTED = (
    "stacked parameters may be sharded by experts (Shard(0) over any mesh dimensions: FSDP, expert parallelism) "
    "and by each expert's rows (Shard(1), FSDP over the remaining data dimension), or replicated"
)


def check_stacked_layout(param: Any, name: str, layout: Layout, optimizer: str, whole_rows: str | None) -> None:
    """Refuse, at construction, a stacked parameter's layout the engine cannot run: each expert's rows in more than
    one block on a rank (a ``_StridedShard`` of dimension 1), and for an optimizer keeping per-row state laid out by
    the parameter's placements (``whole_rows``), rows of an expert split unevenly (that state would not split alike)."""
    from torch.distributed.tensor import Shard

    splitting = [(d, p) for d, p in enumerate(layout.placements) if d in layout.col_dims]
    if any(type(p) is not Shard for _, p in splitting):
        raise ValueError(
            f"stacked=True: parameter {name!r} has {placement_words(param)}, whose _StridedShard of dimension 1 "
            f"gives a rank an expert's rows in several blocks; {SUPPORTED}"
        )
    ways = math.prod(layout.mesh.size(d) for d, _ in splitting)
    m = param.shape[1]
    if whole_rows and m % ways:
        raise ValueError(
            f"{optimizer} {whole_rows}, laid out as the parameter is: stacked=True parameter {name!r} has "
            f"{placement_words(param)}, which split each expert's {m} rows {ways} ways unevenly; shard its "
            f"experts' rows over a number of ranks dividing {m}, shard only its experts (Shard(0)), or use "
            "periodic_row_muon for it"
        )


def local_experts(piece: Piece) -> int:
    """How many experts a piece of the ``(E, m*n)`` view holds (whole or in part)."""
    return sum(s.size for s in piece.rows)


def local_experts_piece(piece: Piece, m: int, n: int) -> Piece:
    """A rank's piece of the ``(E, m*n)`` view as its piece of the ``(E_local * m, n)`` matrix of its experts:
    expert ``k`` (local order) is rows ``[k*m, (k+1)*m)``, of which the rank holds the rows its columns give
    (columns come ``n`` per row of an expert), locally at ``k * m_local`` on."""
    held = tuple(Span(s.start // n, s.stop // n, s.local // n) for s in piece.cols) if n else ()
    m_local = sum(s.size for s in held)
    rows = tuple(
        Span(k * m + s.start, k * m + s.stop, k * m_local + s.local) for k in range(local_experts(piece)) for s in held
    )
    return Piece(rows, (Span(0, n, 0),) if rows else ())


def local_experts_job(job: MatrixJob, piece: Piece) -> MatrixJob:
    """The job of this rank's experts as one stacked matrix of ``E_local * m`` rows (``piece`` in the ``(E, m*n)``
    view), each expert a logical matrix (its split ranges where ``split_sizes`` cut it): as one process would see a
    parameter of that many experts, with the rows the rank holds of each."""
    m = job.matrix_rows
    assert m is not None
    own = tuple((a, b) for a, b in job.splits if b <= m)  # the row ranges of one stacked matrix
    count = local_experts(piece)
    return MatrixJob(
        name=job.name,
        update=job.update,
        rows=count * m,
        cols=job.cols,
        splits=stacked_ranges(count, m, own),
        blocks=job.blocks,
        meta=job.meta,
        col_splits=job.col_splits,
    )


def expert_rows_in(piece: Piece, experts: Piece, m: int, start: int, stop: int) -> RowRange | None:
    """The local rows holding global rows ``[start, stop)`` of the ``(E*m, n)`` view (one expert's, or part of
    them), given the rank's piece of the ``(E, m*n)`` view and its :func:`local_experts_piece` (None: none here)."""
    expert, offset = divmod(start, m)
    held = piece.local_rows_in(expert, expert + 1)
    if held is None:
        return None
    k = held[0]  # the expert's local index
    return experts.local_rows_in(k * m + offset, k * m + offset + stop - start)


def holds_whole_matrices(job: MatrixJob, plc: Any) -> bool:
    """A stacked parameter sharded by its leading dimension alone (dimension 1 split over no rank but this one, e.g.
    torchtitan's ``Shard(1)`` over an ``efsdp`` of size 1): each rank holds whole stacked matrices."""
    return job.matrix_rows is not None and plc.shard is not None and not splits_expert_rows(job, plc)


def splits_expert_rows(job: MatrixJob, plc: Any) -> bool:
    """A stacked parameter whose dimension 1 (each matrix's rows) mesh dimensions of several ranks split."""
    return job.matrix_rows is not None and plc.cols_comm is not None and plc.cols_comm.world > 1


def whole_experts_job(job: MatrixJob, count: int) -> MatrixJob:
    """The job of the ``count`` stacked matrices this rank holds whole, as one process would see a parameter of that
    many."""
    m = job.matrix_rows
    assert m is not None
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
