"""A rank's piece of stacked experts ``(E, m, n)`` as its piece of the ``(E_local * m, n)`` matrix of its own experts
(``dimuon.optim.distributed.experts``), held to a brute-force cut of index tensors."""

import torch

from dimuon.optim.distributed.engine import MatrixJob
from dimuon.optim.distributed.experts import expert_rows_in, local_experts_job, local_experts_piece
from dimuon.optim.distributed.layout import Piece, Span

E, M, N = 3, 6, 4


def _piece(experts: tuple[int, int], rows: tuple[int, int]) -> Piece:
    """Experts ``[e0, e1)`` and rows ``[r0, r1)`` of each, in the ``(E, m*n)`` view (columns ``n`` per row)."""
    (e0, e1), (r0, r1) = experts, rows
    return Piece((Span(e0, e1, 0),), (Span(r0 * N, r1 * N, 0),))


def test_a_ranks_experts_are_one_row_sharded_matrix():
    full = torch.arange(E * M * N).view(E, M, N)
    piece = _piece((1, 3), (3, 6))  # experts 1 and 2, rows 3..5 of each
    local = full[1:3, 3:6].reshape(-1, N)  # what the rank holds, as the core views it: (E_local * m_local, n)
    mine = local_experts_piece(piece, M, N)
    assert mine.shape == (2 * 3, N)
    assembled = torch.zeros(2 * M, N, dtype=full.dtype)  # the rank's experts, whole, as one stacked matrix
    mine.place(assembled, local)
    expect = full[1:3].reshape(-1, N)
    held = torch.zeros(2 * M, dtype=torch.bool)
    held[3:6], held[M + 3 : M + 6] = True, True
    assert torch.equal(assembled[held], expect[held]) and not assembled[~held].any()
    assert torch.equal(mine.take(expect), local)


def test_logical_rows_map_to_the_local_rows_holding_them():
    piece = _piece((1, 3), (3, 6))
    experts = local_experts_piece(piece, M, N)
    assert expert_rows_in(piece, experts, M, 0, M) is None  # expert 0: not here
    assert expert_rows_in(piece, experts, M, M, 2 * M) == (0, 3)  # expert 1: its rows 3..5, locally first
    assert expert_rows_in(piece, experts, M, 2 * M + 4, 3 * M) == (4, 6)  # rows 4..5 of expert 2
    assert expert_rows_in(piece, experts, M, 2 * M, 2 * M + 3) is None  # rows 0..2 of expert 2: another rank's


def test_the_local_job_has_each_expert_and_its_splits_as_logical_matrices():
    update = torch.zeros(2 * 3, N)
    job = MatrixJob("w", update, E * M, N, splits=((0, 3), (3, 6), (6, 9), (9, 12), (12, 15), (15, 18)), matrix_rows=M)
    local = local_experts_job(job, _piece((1, 3), (3, 6)))
    assert (local.rows, local.cols, local.matrix_rows) == (2 * M, N, None)
    assert local.logical_ranges() == ((0, 3), (3, 6), (6, 9), (9, 12))
    assert local_experts_job(job, _piece((0, 0), (0, 0))).rows == 0  # no expert here: nothing to run
