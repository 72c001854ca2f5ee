"""Layouts from placements: every rank's rows and columns, as DTensor's own splitting gives them."""

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dimuon.optim.distributed.engine import MatrixJob, map_regions
from dimuon.optim.distributed.layout import Layout, Piece, Span
from dimuon.optim.reference import reference_direction
from dimuon.optim.schedules import StepKind


class _Mesh:
    """The two things a layout asks of a device mesh: its shape and names."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape, self.ndim, self.mesh_dim_names = shape, len(shape), None

    def size(self, dim: int) -> int:
        return self.shape[dim]


def _torch_indices(length: int, placements, mesh: _Mesh, coord, dim: int) -> list[int]:
    """The global indices of tensor dimension ``dim`` that DTensor's own splitting gives ``coord``."""
    idx = torch.arange(length)
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, Replicate) and p.dim == dim:  # the same split, on a 1-D index tensor
            on_index = _StridedShard(0, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(0)
            shards, _ = on_index._split_tensor(idx, mesh.size(mesh_dim), with_padding=False)
            idx = shards[coord[mesh_dim]]
    return idx.tolist()


def _expand(spans: tuple[Span, ...]) -> list[int]:
    return [i for s in sorted(spans, key=lambda s: s.local) for i in range(s.start, s.stop)]


PLACEMENTS = {
    "fsdp": (Shard(0),),
    "tp_row": (Shard(1),),
    "hsdp": (Replicate(), Shard(0)),
    "fsdp_over_tp_col": (_StridedShard(0, split_factor=2), Shard(0)),
    "fsdp_over_tp_row": (Shard(0), Shard(1)),
    "dp_cols_tp_heads": (Shard(1), _StridedShard(0, split_factor=3)),
    "both_rows": (Shard(0), Shard(0)),
}


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    sizes=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    key=st.sampled_from(sorted(PLACEMENTS)),
)
def test_pieces_match_dtensor_splitting(rows, cols, sizes, key):
    placements = PLACEMENTS[key]
    mesh = _Mesh(sizes[: len(placements)])
    layout = Layout("w", rows, cols, mesh, placements, (), (), (), 1, Piece((), ()))
    for coord in itertools.product(*(range(s) for s in mesh.shape)):
        piece = layout.piece_at(coord)
        assert _expand(piece.rows) == _torch_indices(rows, placements, mesh, coord, 0), (key, coord)
        assert _expand(piece.cols) == _torch_indices(cols, placements, mesh, coord, 1), (key, coord)
        full = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)
        local = piece.take(full)
        back = torch.full_like(full, -1.0)
        piece.place(back, local)
        held = back >= 0
        assert torch.equal(back[held], full[held]) and int(held.sum()) == piece.numel


def test_conv_weight_columns_scale_by_the_kernel():
    # A (out, in, 3, 3) weight with Shard(1) on 2 ranks: input channels [0, 2) and [2, 3) -> columns of 9 each.
    layout = Layout("conv", 4, 27, _Mesh((2,)), (Shard(1),), (), (0,), (), 9, Piece((), ()))
    assert layout.piece_at((0,)).cols == (Span(0, 18, 0),)
    assert layout.piece_at((1,)).cols == (Span(18, 27, 0),)


def test_blocks_pair_cuts_rows_and_columns_as_torch_chunk():
    u = torch.randn(7, 10, dtype=torch.float64)
    job = MatrixJob("w", u, 7, 10, blocks=(2, 3))
    assert map_regions(job, StepKind.BLOCK) == [
        (r0, r1, c0, c1) for r0, r1 in ((0, 4), (4, 7)) for c0, c1 in ((0, 4), (4, 8), (8, 10))
    ]
    assert map_regions(MatrixJob("w", u, 7, 10, blocks=3), StepKind.BLOCK) == [
        (0, 3, 0, 10),
        (3, 6, 0, 10),
        (6, 7, 0, 10),
    ]
    assert map_regions(job, StepKind.SPECTRAL) == [(0, 7, 0, 10)]
    expect = reference_direction(u.float(), StepKind.BLOCK, "none", blocks=(2, 3))
    top_left = reference_direction(u[:4, :4].float(), StepKind.SPECTRAL, "none")
    assert torch.allclose(expect[:4, :4], top_left)
