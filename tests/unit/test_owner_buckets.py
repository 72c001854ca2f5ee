"""The owner refresh's plan on its own: owners balanced by Newton-Schulz FLOPs, buckets of one class holding at most
``per_owner`` matrices of each owner, so every rank orthogonalizes at once and a spectral step issues a few
exchanges per matrix shape, not two per matrix."""

from __future__ import annotations

import math

import pytest

from dimuon.optim.distributed.owners import _ns_cost, assign_owners
from dimuon.optim.distributed.refresh import owner_buckets


def dit_shapes(depth: int, hidden: int) -> list[tuple[int, int]]:
    """A DiT's Muon matrices in parameter order: qkv, proj, fc1, fc2, adaLN per block."""
    block = [(3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden), (6 * hidden, hidden)]
    return block * depth


def plan(shapes: list[tuple[int, int]], world: int, per_owner: int) -> tuple[list[int], list[list[int]]]:
    owners = assign_owners(shapes, world)
    classes: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(shapes):
        classes.setdefault(shape, []).append(i)
    buckets = [b for idx in classes.values() for b in owner_buckets(idx, [owners[i] for i in idx], per_owner)]
    return owners, buckets


@pytest.mark.parametrize(("depth", "hidden", "world"), [(12, 384, 8), (28, 1152, 8), (12, 384, 4), (28, 1152, 64)])
def test_owners_are_balanced_by_flops(depth, hidden, world):
    shapes = dit_shapes(depth, hidden)
    owners = assign_owners(shapes, world)
    load = [0.0] * world
    for shape, o in zip(shapes, owners):
        load[o] += _ns_cost(*shape)
    mean = sum(load) / world
    biggest = max(_ns_cost(*s) for s in shapes)
    # LPT's bound: no rank above the mean by more than one matrix; with many matrices per rank, close to even.
    assert max(load) <= mean + biggest
    if len(shapes) >= 4 * world:
        assert max(load) / mean <= 1.15, max(load) / mean


@pytest.mark.parametrize("per_owner", [1, 2, 5])
@pytest.mark.parametrize(("depth", "world"), [(12, 8), (28, 8), (28, 256), (3, 4)])
def test_buckets_hold_one_class_at_most_per_owner_matrices_of_each_owner(depth, world, per_owner):
    shapes = dit_shapes(depth, 64)
    owners, buckets = plan(shapes, world, per_owner)
    assert sorted(i for b in buckets for i in b) == list(range(len(shapes)))  # every matrix exactly once
    for b in buckets:
        assert len({shapes[i] for i in b}) == 1
        counts = [sum(owners[i] == r for i in b) for r in range(world)]
        assert max(counts) <= per_owner
        assert [owners[i] for i in b] == sorted(owners[i] for i in b)  # owner by owner: the exchange's order
    # The fewest buckets a class can have: its largest count on one owner, over per_owner.
    for shape in set(shapes):
        idx = [i for i, s in enumerate(shapes) if s == shape]
        most = max(sum(owners[i] == r for i in idx) for r in range(world))
        assert sum(shapes[b[0]] == shape for b in buckets) == math.ceil(most / per_owner)


def test_a_spectral_step_issues_a_few_exchanges_per_shape_not_two_per_matrix():
    # DiT-XL/2 at 8 ranks, one matrix per owner and bucket (bf16 at 16 MiB): 140 matrices, 5 shapes.
    shapes = dit_shapes(28, 1152)
    _, buckets = plan(shapes, 8, 1)
    assert len(buckets) == 5 * math.ceil(28 / 8)  # 20 exchanges each way, not 140
    # Every bucket but a class's last keeps all 8 ranks busy.
    assert [len(b) for b in buckets] == [8, 8, 8, 4] * 5


def test_a_bucket_orders_its_matrices_by_owner_and_keeps_their_order_within_one():
    assert owner_buckets([10, 11, 12, 13, 14], [1, 0, 1, 0, 2], 1) == [[11, 10, 14], [13, 12]]
    assert owner_buckets([10, 11, 12, 13, 14], [1, 0, 1, 0, 2], 2) == [[11, 13, 10, 12, 14]]
    assert owner_buckets([], [], 1) == []


def test_owner_plans_are_kept_for_the_recent_sets_of_jobs_only(monkeypatch):
    """A schedule deciding per matrix refreshes a new set of matrices at many steps: the refresh keeps the owner plans
    of the :data:`OWNER_PLANS` sets met last (a set met again reuses its plan), not one per set ever met."""
    from types import SimpleNamespace

    import torch

    from dimuon.optim.distributed.refresh import OWNER_PLANS, SpectralRefresh

    made: list[int] = []
    monkeypatch.setattr(SpectralRefresh, "_make_owner_plan", lambda self, placed, config: made.append(1) or [])
    refresh = SpectralRefresh("owner", "none", 1 << 20, None)
    config = SimpleNamespace(ns_dtype=torch.float32)
    jobs = [
        SimpleNamespace(meta={"param": object()}, rows=4, cols=4, splits=(), col_splits=(), update=torch.zeros(4, 4))
        for _ in range(40)
    ]
    sets = [[(jobs[i], None), (jobs[i + 1], None)] for i in range(39)]
    for placed in sets:
        refresh._owner_plan(placed, config)  # type: ignore[arg-type]
    assert len(made) == 39 and len(refresh._owner_plans) == OWNER_PLANS
    refresh._owner_plan(sets[-1], config)  # type: ignore[arg-type]  # met last: kept
    refresh._owner_plan(sets[0], config)  # type: ignore[arg-type]  # met longest ago: made again
    assert len(made) == 40 and len(refresh._owner_plans) == OWNER_PLANS
