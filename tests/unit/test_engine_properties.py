"""Property tests of the batched local engine against the per-matrix reference, over random shapes."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dimuon.optim.distributed.engine import (
    LocalEngine,
    MapConfig,
    MatrixJob,
    RowScaled,
    chunk_ranges,
    col_split_sizes_to_ranges,
    materialize,
    shape_classes,
    split_sizes_to_ranges,
)
from dimuon.optim.reference import reference_direction
from dimuon.optim.schedules import StepKind

dims = st.integers(min_value=1, max_value=24)


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(st.tuples(dims, dims), min_size=1, max_size=5),
    kind=st.sampled_from([StepKind.SPECTRAL, StepKind.ROWNORM, StepKind.BLOCK]),
    blocks=st.integers(min_value=1, max_value=5),
    lr_scale=st.sampled_from(["match_rms_adamw", "original", "none"]),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_local_engine_matches_reference(shapes, kind, blocks, lr_scale, seed):
    g = torch.Generator().manual_seed(seed)
    updates = [torch.randn(*s, generator=g) for s in shapes]
    jobs = [
        MatrixJob(name=f"w{i}", update=u, rows=u.shape[0], cols=u.shape[1], blocks=blocks)
        for i, u in enumerate(updates)
    ]
    config = MapConfig(ns_dtype=torch.float32, lr_scale=lr_scale)
    got = LocalEngine().directions(jobs, kind, config)
    for u, d in zip(updates, got):
        expect = reference_direction(u, kind, lr_scale, blocks=blocks)
        assert d.shape == u.shape
        torch.testing.assert_close(d, expect, rtol=1e-4, atol=1e-5)


@given(start=st.integers(0, 50), length=st.integers(0, 60), chunks=st.integers(1, 9))
def test_chunk_ranges_are_torch_chunk(start, length, chunks):
    rows = torch.arange(start, start + length)
    expect = [(int(c[0]), int(c[-1]) + 1) for c in torch.chunk(rows, chunks)] if length else []
    assert chunk_ranges(start, start + length, chunks) == expect


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(min_value=2, max_value=24),
    cols=st.integers(min_value=2, max_value=24),
    row_chunks=st.integers(min_value=1, max_value=3),
    col_chunks=st.integers(min_value=1, max_value=3),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_row_directions_fold_the_factor_where_one_covers_the_matrix(rows, cols, row_chunks, col_chunks, seed):
    """Every chunk is RowNormed as its own matrix (with its own shape scale); the direction stays ``U * f`` with one
    factor exactly where the chunks tile by whole oriented rows, and is written out (the same values) otherwise."""
    rows, cols = rows * row_chunks, cols * col_chunks  # chunks that divide the sides
    u = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    splits = split_sizes_to_ranges(rows, row_chunks, "w")
    col_splits = col_split_sizes_to_ranges(cols, col_chunks, "w")
    job = MatrixJob(name="w", update=u, rows=rows, cols=cols, splits=splits, col_splits=col_splits)
    config = MapConfig(lr_scale="match_rms_adamw")
    (got,) = LocalEngine().row_directions([job], config)
    expect = torch.empty_like(u)
    for r0, r1, c0, c1 in job.regions():
        expect[r0:r1, c0:c1] = reference_direction(u[r0:r1, c0:c1], StepKind.ROWNORM, "match_rms_adamw")
    orientations = {r1 - r0 <= c1 - c0 for r0, r1, c0, c1 in job.regions()}
    folds = (orientations == {True} and col_chunks == 1) or (orientations == {False} and row_chunks == 1)
    assert isinstance(got, RowScaled) == folds
    if folds:
        assert got.update is u and got.factor.shape in ((rows, 1), (1, cols))
    torch.testing.assert_close(materialize(got), expect, rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(st.sampled_from([(2, 3), (3, 2), (6,)]), st.sampled_from([torch.float32, torch.bfloat16])),
        max_size=8,
    ),
    include=st.lists(st.booleans(), min_size=8, max_size=8),
)
def test_shape_classes_partition_the_included_pairs_by_shape_and_dtypes(pairs, include):
    """Every included pair in exactly one class, in first-seen order; one class holds one shape and dtype pair."""
    firsts = [torch.zeros(shape) for shape, _ in pairs]
    seconds = [torch.zeros(1, dtype=dtype) for _, dtype in pairs]
    got = shape_classes(firsts, seconds, include[: len(pairs)])
    assert sorted(i for c in got for i in c) == [i for i in range(len(pairs)) if include[i]]
    assert [c[0] for c in got] == sorted(c[0] for c in got) and all(c == sorted(c) for c in got)
    for c in got:
        assert len({(firsts[i].shape, seconds[i].dtype) for i in c}) == 1
    keys = [(firsts[c[0]].shape, seconds[c[0]].dtype) for c in got]
    assert len(set(keys)) == len(keys)
