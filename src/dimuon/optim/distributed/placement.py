"""One parameter's placement as the sharded maps read it, and the small helpers they share.

:class:`~dimuon.optim.distributed.sharded.ShardedEngine` derives a :class:`_Placement` once per parameter (where its
piece sits, which process groups its maps talk over); the spectral refreshes
(:mod:`dimuon.optim.distributed.refresh`) read it. Kept in a module of its own so that neither imports the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dimuon.optim.distributed.collectives import Collectives
from dimuon.optim.distributed.engine import MatrixJob
from dimuon.optim.distributed.layout import Layout, Piece


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


def _by_comm(indices: Sequence[int], comms: Sequence[Collectives | None]) -> list[tuple[Collectives, list[int]]]:
    """``indices`` grouped by their communicator (``comms``: each index's, in the same order), groups in the order
    of first appearance (None left out)."""
    groups: dict[int, tuple[Collectives, list[int]]] = {}
    for i, comm in zip(indices, comms):
        if comm is not None:
            groups.setdefault(id(comm), (comm, []))[1].append(i)
    return list(groups.values())


def _wide(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _empty_direction(job: MatrixJob) -> Tensor:
    """A zero direction shaped like the job's local piece, in fp32 or wider."""
    return torch.zeros(job.update.shape, dtype=_wide(job.update), device=job.update.device)
