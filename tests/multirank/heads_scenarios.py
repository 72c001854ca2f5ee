"""Rank-side programs of the column-split (per-head) and stacked-matrix (experts) tests on 2 gloo ranks.

The parameters cover what the sharded paths must get right for logical matrices that are row ranges x column
ranges: tall column chunks (RowNorm reduces their column sums over the ranks holding rows), wide ones (local),
row and column splits together, column-split matrices of so few rows that a rank holds one row or none, and
stacked experts sharded by their leading dimension under FSDP2 (uneven: 3
experts over 2 ranks; a single expert, so one rank holds none). Gradients are seeded full tensors every rank cuts
by its parameter's placements, so one process with the same gradients is the oracle.
"""

from __future__ import annotations

import torch
from torch import nn

from dimuon.optim import build

STEPS = 6
LR = 0.02
BLOCKS = 2  # MuonBP's single-process row blocks that reproduce the 2 ranks' row shards


class HeadsAndExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(24, 16)  # (16, 24): 3 heads of 8 columns, tall (16, 8) chunks
        self.wide = nn.Linear(40, 6)  # (6, 40): 2 column chunks, wide (6, 20)
        self.qkv = nn.Linear(16, 18)  # (18, 16): 3 row chunks x 2 column chunks of (6, 8)
        self.experts = nn.Parameter(torch.randn(3, 8, 12))  # 3 experts over 2 ranks: 2 and 1
        self.lonely = nn.Parameter(torch.randn(1, 6, 10))  # 1 expert: the second rank holds none
        self.split_experts = nn.Parameter(torch.randn(4, 12, 8))  # each expert: 2 row chunks x 2 column chunks
        self.few = nn.Linear(32, 3)  # (3, 32) in 2 column chunks over 2 ranks: rows 2 and 1 (one-row regions)
        self.single = nn.Linear(32, 1)  # (1, 32) in 2 column chunks: one rank holds its row, the other none


def _model() -> HeadsAndExperts:
    torch.manual_seed(0)
    return HeadsAndExperts()


def groups(model: HeadsAndExperts, optimizer: str, only_stacked: bool = False) -> list[dict]:
    """The split groups; with ``only_stacked`` the unstacked matrices go to AdamW (a run of experts alone)."""
    unstacked = [
        {"params": [("proj.weight", model.proj.weight)], "col_split_sizes": 3},
        {"params": [("wide.weight", model.wide.weight)], "col_split_sizes": 2},
        {"params": [("qkv.weight", model.qkv.weight)], "split_sizes": 3, "col_split_sizes": 2},
        {"params": [("few.weight", model.few.weight), ("single.weight", model.single.weight)], "col_split_sizes": 2},
    ]
    stacked = [
        {"params": [("experts", model.experts), ("lonely", model.lonely)], "stacked": True},
        {"params": [("split_experts", model.split_experts)], "stacked": True, "split_sizes": 2, "col_split_sizes": 2},
    ]
    if optimizer == "muon_bp":
        for g in unstacked:
            g["blocks"] = BLOCKS  # sharded: the row shards; one process: the same row blocks
        for g in stacked:
            g["blocks"] = (1, 2)  # every rank holds whole experts: the grid cuts each, here and in one process
    if only_stacked:
        unstacked = [{"params": [p for g in unstacked for p in g["params"]], "algorithm": "adamw"}]
    biases = [(f"{n}.bias", getattr(model, n).bias) for n in ("proj", "wide", "qkv", "few", "single")]
    return [*unstacked, *stacked, {"params": biases, "algorithm": "adamw"}]


def set_grads(model: nn.Module, step: int) -> None:
    """Seeded full gradients, each rank keeping its piece as the parameter's placements cut it: a fixed direction
    per parameter plus noise, so the momenta settle and the adaptive schedule takes both kinds."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    base, gen = torch.Generator().manual_seed(7), torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=base) + 0.5 * torch.randn(p.shape, generator=gen)
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        else:
            p.grad = full


def make(optimizer: str, opts: dict, mesh=None, only_stacked: bool = False):
    """Seeded model and optimizer; FSDP2 over ``mesh`` (every parameter ``Shard(0)``) when given."""
    model = _model()
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    return model, build(
        optimizer, groups(model, optimizer, only_stacked), lr=LR, weight_decay=0.05, ns_dtype=torch.float32, **opts
    )


def train(model, opt) -> tuple[list[dict], list[dict]]:
    stats, refreshes = [], []
    for t in range(STEPS):
        set_grads(model, t)
        opt.reset_comm_stats()
        opt.reset_refresh_stats()
        opt.step()
        stats.append(opt.comm_stats())
        refreshes.append({k: m["spectral"] for k, m in opt.refresh_stats()["matrices"].items()})
    return stats, refreshes


def full_params(model) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def reference(optimizer: str, opts: dict, only_stacked: bool = False) -> tuple[dict, list[dict]]:
    local = {k: v for k, v in opts.items() if k != "refresh"}
    model, opt = make(optimizer, local, None, only_stacked)
    _, refreshes = train(model, opt)
    return full_params(model), refreshes


def _column_sharded(rank: int, world: int, mesh, optimizer: str, opts: dict):
    """The proj-like matrix and a stacked one distributed by columns (``Shard(1)``, ``Shard(2)`` of the stacked one,
    as row-wise tensor parallelism lays them out): a head of 8 columns straddles the two ranks' 12 columns."""
    from torch.distributed.tensor import Shard, distribute_tensor

    model = _model()
    model.proj.weight = nn.Parameter(distribute_tensor(model.proj.weight.detach(), mesh, [Shard(1)]))
    stacked = {
        "params": [("experts", nn.Parameter(distribute_tensor(model.experts.detach(), mesh, [Shard(2)])))],
        "stacked": True,
    }
    return model, [{"params": [("proj.weight", model.proj.weight)], "col_split_sizes": 3}], stacked


def column_sharded_muon(rank: int, world: int, mesh, opts: dict) -> dict:
    """Muon with column splits on a column-sharded matrix: its spectral steps assemble whole matrices."""
    from torch.distributed.tensor import distribute_tensor

    model, group, _ = _column_sharded(rank, world, mesh, "muon", opts)
    opt = build("muon", group, lr=LR, weight_decay=0.05, ns_dtype=torch.float32, **opts)
    stats = []
    for t in range(STEPS):
        gen = torch.Generator().manual_seed(1000 + t)
        w = model.proj.weight
        w.grad = distribute_tensor(torch.randn(w.shape, generator=gen), w.device_mesh, w.placements, src_data_rank=None)
        opt.reset_comm_stats()
        opt.step()
        stats.append(opt.comm_stats())
    return {"proj": model.proj.weight.full_tensor().clone(), "stats": stats}


def column_sharded_reference(opts: dict) -> torch.Tensor:
    model = _model()
    w = model.proj.weight
    opt = build(
        "muon",
        [{"params": [w], "col_split_sizes": 3}],
        lr=LR,
        weight_decay=0.05,
        ns_dtype=torch.float32,
        **{k: v for k, v in opts.items() if k != "refresh"},
    )
    for t in range(STEPS):
        gen = torch.Generator().manual_seed(1000 + t)
        w.grad = torch.randn(w.shape, generator=gen)
        opt.step()
    return w.detach().clone()


def refusals(rank: int, world: int, mesh) -> dict[str, str]:
    """The construction errors for the layouts these options cannot run on yet."""
    out = {}
    _, group, stacked = _column_sharded(rank, world, mesh, "periodic_row_muon", {})
    for key, optimizer, groups_ in (
        ("prm_col_split", "periodic_row_muon", group),
        ("bp_col_split", "muon_bp", group),
        ("stacked_shard2", "muon", [stacked]),
    ):
        # Each optimizer its own copies of the groups: building one fills the dicts with its own options.
        own = [
            {k: v for k, v in g.items() if k in ("params", "algorithm", "split_sizes", "col_split_sizes", "stacked")}
            for g in groups_
        ]
        try:
            build(optimizer, own, lr=LR)
            out[key] = "built"
        except ValueError as e:
            out[key] = str(e)
    return out


CASES = [
    ("muon_gather", "muon", {"refresh": "gather"}),
    ("muon_owner", "muon", {"refresh": "owner"}),
    ("prm", "periodic_row_muon", {"k": 2, "gamma": 0.5, "refresh": "gather"}),
    ("prm_owner", "periodic_row_muon", {"k": 3, "refresh": "owner"}),
    ("bp", "muon_bp", {"period": 2, "block_lr_ratio": 0.8}),
    ("arm", "adaptive_row_muon", {"threshold": 0.3, "k_min": 1, "k_max": 3}),
]
STACKED_ONLY = [
    ("stacked_muon", "muon", {}),
    ("stacked_prm", "periodic_row_muon", {"k": 2}),
    ("stacked_bp", "muon_bp", {"period": 2}),
]
COLUMN_SHARDED = [("tp_gather", {"refresh": "gather"}), ("tp_owner", {"refresh": "owner"})]


def everything(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    for key, optimizer, opts in CASES:
        model, opt = make(optimizer, opts, mesh)
        placements = {n: str(tuple(p.placements)) for n, p in model.named_parameters()}
        stats, refreshes = train(model, opt)
        out[key] = {"params": full_params(model), "stats": stats, "refreshes": refreshes, "placements": placements}
    for key, optimizer, opts in STACKED_ONLY:
        model, opt = make(optimizer, opts, mesh, only_stacked=True)
        stats, _ = train(model, opt)
        out[key] = {"params": full_params(model), "stats": stats}
    for key, opts in COLUMN_SHARDED:
        out[key] = column_sharded_muon(rank, world, mesh, opts)
    out["refusals"] = refusals(rank, world, mesh)
    return out
