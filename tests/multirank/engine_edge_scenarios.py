"""Rank-side programs of the engine's edge tests: Muon gradients missing on some ranks only, the flattened process
group of two mesh dimensions that shard one tensor dimension (made without touching the user's mesh), and buckets of
fp32 and fp64 momenta (every payload in its own dtype).

Parameters are seeded full tensors that every rank cuts by its placements, gradients likewise, so one process with
the same tensors is the oracle (:func:`reference`)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from dimuon.optim import build

LR = 0.05
SHAPES = {"w0": (8, 6), "w1": (6, 8), "w2": (10, 4)}  # square-ish, wide, tall (RowNorm reduces its column sums)
STEPS = 4

# Which Muon gradients each rank drops at which step: {step: {rank: names}} (``"*"``: every rank).
DROPS = {
    "one_rank": {1: {1: ("w0",)}},  # rank 1 alone: the sets of gradients differ
    "every_rank": {1: {"*": ("w0",)}},  # every rank: w0 simply has no gradient at step 1 (torch skips it)
    "each_its_own": {1: {0: ("w0",), 1: ("w1",)}},  # every rank's set changed, and they differ
    "back_on_one_rank": {1: {"*": ("w0",)}, 2: {0: ("w0",)}},  # at step 2 rank 1 alone has w0's gradient again
    # rank 1 alone at step 1, then w0 frozen on every rank (FROZEN): from then on the ranks agree, and step
    "frozen_after_one_rank": {1: {1: ("w0",)}, 2: {"*": ("w0",)}, 3: {"*": ("w0",)}},
}
# The step from which a case's w0 no longer requires a gradient, on every rank.
FROZEN = {"frozen_after_one_rank": 2}
# Steps at which the ranks' sets differ (raised with "raise", skipped with "skip"); at the others they agree.
MISMATCHED = {
    "one_rank": {1},
    "every_rank": set(),
    "each_its_own": {1},
    "back_on_one_rank": {2},
    "frozen_after_one_rank": {1},
}
OPTIMIZERS = {
    "muon_owner": ("muon", {"refresh": "owner"}),
    "muon_gather": ("muon", {"refresh": "gather"}),
    "prm": ("periodic_row_muon", {"k": 2}),  # RowNorm at odd steps: the tall matrix's column sums are reduced
    "adaptive": ("adaptive_row_muon", {"k_min": 1, "k_max": 3, "threshold": 0.0}),  # the vote read with signals
}
GRADIENT_CASES = [
    (f"{opt}_{policy}_{drops}", opt, policy, drops)
    for opt in OPTIMIZERS
    for policy in ("raise", "skip")
    for drops in DROPS
]


def _full(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.1).to(dtype)


def _grad(name: str, shape: tuple[int, ...], step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _full(shape, 1000 * (step + 1) + sum(map(ord, name)), dtype) * 10


def _dropped(drops: str, step: int, rank: int | None) -> set[str]:
    at = DROPS[drops].get(step, {})
    return set(at.get("*", ())) | (set(at.get(rank, ())) if rank is not None else set())


def _whole(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def gradients(rank: int, world: int, cases: list[tuple[str, str, str, str]]) -> dict:
    """Per case, each step's outcome on this rank (stepped, or the error's message), the warnings it gave, the
    skip count, the step counter and the full parameters at the end."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for key, opt_name, policy, drops in cases:
        params = {
            n: nn.Parameter(distribute_tensor(_full(s, i), mesh, [Shard(0)], src_data_rank=None))
            for i, (n, s) in enumerate(SHAPES.items())
        }
        name, options = OPTIMIZERS[opt_name]
        opt = build(name, list(params.items()), lr=LR, ns_dtype=torch.float32, nonfinite=policy, **options)
        outcomes, caught = [], []
        for t in range(STEPS):
            if t == FROZEN.get(drops):
                params["w0"].requires_grad_(False)
            dropped = _dropped(drops, t, rank)
            for n, p in params.items():
                full = _grad(n, SHAPES[n], t)
                p.grad = None if n in dropped else distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                try:
                    opt.step()
                    outcomes.append("stepped")
                except RuntimeError as e:
                    outcomes.append(f"raised: {e}")
            caught.append(
                [
                    str(w.message)
                    for w in seen
                    if "None on some ranks" in str(w.message) or "other ranks have" in str(w.message)
                ]
            )
        out[key] = {
            "outcomes": outcomes,
            "warnings": caught,
            "skipped": opt.skipped_steps,
            "phase": opt.param_groups[0]["step"],
            "params": {n: _whole(p) for n, p in params.items()},
        }
    dist.barrier()
    return out


def gradients_reference(opt_name: str, policy: str, drops: str) -> dict[str, torch.Tensor]:
    """The same run in one process: a step the ranks disagree on is not taken (raise: no slot; skip: the slot taken
    without a step, which a NaN gradient gives), and a gradient every rank dropped is None here too."""
    params = {n: nn.Parameter(_full(s, i)) for i, (n, s) in enumerate(SHAPES.items())}
    name, options = OPTIMIZERS[opt_name]
    options = {k: v for k, v in options.items() if k != "refresh"}
    opt = build(name, list(params.items()), lr=LR, ns_dtype=torch.float32, nonfinite="skip", **options)
    for t in range(STEPS):
        if t in MISMATCHED[drops] and policy == "raise":
            continue
        dropped = _dropped(drops, t, None)
        for n, p in params.items():
            p.grad = None if n in dropped else _grad(n, SHAPES[n], t)
        if t in MISMATCHED[drops]:  # a NaN makes this process skip the step as the ranks do
            next(p for p in params.values() if p.grad is not None).grad.view(-1)[0] = float("nan")
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


# ---------------------------------------------------------------------------------------------- flattened groups

# Uneven shapes laid out (Shard(d), Shard(d)) over a 2 x 2 mesh: the layouts whose full_tensor() torch 2.13 gets
# wrong once a flattened mesh is registered on the mesh.
FLAT_CASES = {"s0s0_5x5": ((5, 5), 0), "s0s0_13x6": ((13, 6), 0), "s1s1_6x7": ((6, 7), 1), "s1s1_5x5": ((5, 5), 1)}


def _flat_step_grads(params: dict, step: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    for n, p in params.items():
        full = _grad(n, tuple(p.shape), step)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)


def flattened(rank: int, world: int, refresh: str) -> dict:
    """On a 2 x 2 mesh (every rank): full_tensor() of each parameter before and after the optimizer is built, the
    flattened meshes registered on the mesh, and the parameters after 2 steps. On a (pp 2, dp 2, tp 1) mesh, each
    stage's optimizer over its own (dp, tp) submesh: the group its refresh talks over and the parameter after 2
    steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dimuon.optim.distributed.sharded import ShardedEngine

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    fulls = {n: _full(shape, i) for i, (n, (shape, _)) in enumerate(FLAT_CASES.items())}
    params = {
        n: nn.Parameter(distribute_tensor(fulls[n], mesh, [Shard(d), Shard(d)], src_data_rank=None))
        for n, (_, d) in FLAT_CASES.items()
    }
    before = {n: torch.equal(p.full_tensor(), fulls[n]) for n, p in params.items()}
    opt = build("muon", list(params.items()), lr=LR, ns_dtype=torch.float32, refresh=refresh)
    after = {n: torch.equal(p.full_tensor(), fulls[n]) for n, p in params.items()}
    registered = len(mesh._get_root_mesh()._flatten_mapping)
    for t in range(2):
        _flat_step_grads(params, t)
        opt.step()
    whole = {n: _whole(p) for n, p in params.items()}

    root = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    stage = root["dp", "tp"]
    w = nn.Parameter(distribute_tensor(_full((7, 5), 9), stage, [Shard(0), Shard(0)], src_data_rank=None))
    stage_opt = build("muon", [("w", w)], lr=LR, ns_dtype=torch.float32, refresh=refresh)
    engine = stage_opt._engine
    assert isinstance(engine, ShardedEngine)
    shard = engine._placements[id(w)][1].shard
    for t in range(2):
        _flat_step_grads({"w": w}, t)
        stage_opt.step()
    local = w.to_local().detach().clone()
    dist.barrier()
    return {
        "before": before,
        "after": after,
        "registered": registered,
        "params": whole,
        "stage": {
            "group_ranks": dist.get_process_group_ranks(shard.group),
            "registered": len(root._flatten_mapping),
            "local": local,
            "rows": _stage_rows(rank),
        },
    }


def _stage_rows(rank: int) -> tuple[int, int]:
    """The rows of the (7, 5) stage parameter rank ``rank`` holds: its stage's two ranks split them 4 + 3."""
    return (0, 4) if rank % 2 == 0 else (4, 7)


def flattened_reference(steps: int = 2) -> dict[str, torch.Tensor]:
    """The 2 x 2 mesh's parameters, and the stage parameter ``w``, trained in one process."""
    params = {n: nn.Parameter(_full(shape, i)) for i, (n, (shape, _)) in enumerate(FLAT_CASES.items())}
    params["w"] = nn.Parameter(_full((7, 5), 9))
    opt = build("muon", list(params.items()), lr=LR, ns_dtype=torch.float32)
    for t in range(steps):
        for n, p in params.items():
            p.grad = _grad(n, tuple(p.shape), t)
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


# ---------------------------------------------------------------------------------------------- mixed dtypes

MIXED = {"w32": torch.float32, "w64": torch.float64}  # one shape: fp32 first, the fp64 momentum after it
MIXED_SHAPE = (8, 6)
MIXED_CASES = {
    "gather": {"refresh": "gather"},
    "owner": {"refresh": "owner"},
    "gather_split_replicas": {"refresh": "gather", "replica_refresh": "split"},
    "owner_split_replicas": {"refresh": "owner", "replica_refresh": "split"},
    "whole": {"process_group": "world"},
}


def mixed_dtypes(rank: int, world: int) -> dict:
    """Per case, an fp32 and an fp64 parameter of one shape in one Muon group with fp64 Newton-Schulz, two steps:
    the full parameters. ``*_split_replicas`` lay them out (Replicate(), Shard(0)) over a (replicate, shard) mesh
    of (world, 1), so each refresh is one replica's and the pieces cross the replicas; ``whole`` holds them whole
    on every rank (``process_group``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    flat = init_device_mesh("cpu", (world,))
    hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    out = {}
    for key, options in MIXED_CASES.items():
        options = dict(options)
        if options.get("process_group") == "world":
            options["process_group"] = dist.group.WORLD
            params = {n: nn.Parameter(_full(MIXED_SHAPE, i, dt)) for i, (n, dt) in enumerate(MIXED.items())}
        else:
            mesh, placements = (hsdp, [Replicate(), Shard(0)]) if "replicas" in key else (flat, [Shard(0)])
            params = {
                n: nn.Parameter(distribute_tensor(_full(MIXED_SHAPE, i, dt), mesh, placements, src_data_rank=None))
                for i, (n, dt) in enumerate(MIXED.items())
            }
        opt = build("muon", list(params.items()), lr=LR, ns_dtype=torch.float64, **options)
        for t in range(2):
            for n, p in params.items():
                full = _grad(n, MIXED_SHAPE, t, MIXED[n])
                p.grad = (
                    distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                    if hasattr(p, "device_mesh")
                    else full
                )
            opt.step()
        out[key] = {n: _whole(p) for n, p in params.items()}
    dist.barrier()
    return out


def mixed_reference() -> dict[str, torch.Tensor]:
    params = {n: nn.Parameter(_full(MIXED_SHAPE, i, dt)) for i, (n, dt) in enumerate(MIXED.items())}
    opt = build("muon", list(params.items()), lr=LR, ns_dtype=torch.float64)
    for t in range(2):
        for n, p in params.items():
            p.grad = _grad(n, MIXED_SHAPE, t, MIXED[n])
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


def two_ranks(rank: int, world: int, cases: list[tuple[str, str, str, str]]) -> dict:
    """One spawn for the 2-rank programs (a gloo spawn costs seconds)."""
    return {"gradients": gradients(rank, world, cases), "mixed": mixed_dtypes(rank, world)}
